// The faults of issue 52 (item 4), each against a redis-server the test starts: a writer killed
// mid-write (between the parts of a transaction, in the middle of a value, and at a random point
// of a burst of writes), Redis killed and restarted with its append-only file (no committed fact
// lost), Redis unreachable (stopped, hung, restarted empty: refused or answered without memory,
// never a stale or partial fact), corrupt values (refused by their checksum or their fields), and
// two replicas writing the same user at once (no fact lost or duplicated).

#include "redis_common.hpp"

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::redis;
using inferscale_test::redis_server;

namespace {

/// The f:<id> keys of namespace `ns` (SCAN over the server), as ids.
std::set<std::uint64_t> value_ids(int port, redis_fact_store const& s, std::uint64_t ns)
{
  std::string const prefix = s.fact_key_name(ns, 0).substr(0, s.fact_key_name(ns, 0).size() - 1);
  std::set<std::uint64_t> ids;
  std::string cursor = "0";
  do {
    auto const r = raw_command(port, {"SCAN", cursor, "MATCH", prefix + "*", "COUNT", "1000"});
    cursor       = std::string{r->element[0]->str, r->element[0]->len};
    for (std::size_t i = 0; i < r->element[1]->elements; ++i) {
      std::string const key{r->element[1]->element[i]->str, r->element[1]->element[i]->len};
      ids.insert(std::stoull(key.substr(prefix.size())));
    }
  } while (cursor != "0");
  return ids;
}

/// Every catalogue entry has its value and every value its catalogue entry; every value checks.
void check_consistent(int port, redis_fact_store& s, std::uint64_t ns, kv_store const& reference)
{
  std::vector<std::uint64_t> const catalogue = s.namespace_fact_ids(ns);
  std::set<std::uint64_t> const values       = value_ids(port, s, ns);
  CHECK(std::set<std::uint64_t>(catalogue.begin(), catalogue.end()) == values);
  if (catalogue.empty()) { return; }
  fetched_namespace const got = s.fetch(ns, catalogue);
  for (fetched_fact const& f : got.facts) {
    CAPTURE(f.fact_id);
    CHECK(f.pages == fact_bytes(reference, f.fact_id));
  }
}

/// Sends raw bytes to 127.0.0.1:port on a new socket (returns it open).
int send_raw(int port, std::string const& bytes)
{
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family      = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port        = htons(static_cast<std::uint16_t>(port));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) { ::_exit(3); }
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    ssize_t const n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) { ::_exit(4); }
    sent += static_cast<std::size_t>(n);
  }
  return fd;
}

std::string resp(std::vector<std::string> const& args)
{
  std::string out = "*" + std::to_string(args.size()) + "\r\n";
  for (std::string const& a : args) {
    out += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
  }
  return out;
}

bool killed_by_sigkill(pid_t child)
{
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

}  // namespace

TEST_CASE("redis faults: a writer killed mid-write leaves the fact absent, never partial",
          "[redis]")
{
  redis_server server;
  kv_store reference{store_config(512)};
  for (std::uint64_t id = 1; id <= 300; ++id) {
    add(reference, id, 9, static_cast<std::int32_t>(1 + id % 7));
  }
  redis_fact_store writer{options_for(server.port()), reference.config()};
  CHECK(writer.put(reference, 1));  // the namespace exists before the faults

  SECTION("killed between the parts of its transaction (MULTI, SET, HSET sent; no EXEC)")
  {
    std::string const key = writer.fact_key_name(9, 2);
    pid_t const child     = ::fork();
    if (child == 0) {
      std::string const queued = resp({"MULTI"}) + resp({"SET", key, "whole value, never run"}) +
                                 resp({"HSET", writer.catalogue_key(9), "2", "0"});
      int const fd = send_raw(server.port(), queued);
      char reply[64];
      std::size_t got = 0;  // +OK, +QUEUED, +QUEUED: the server holds the transaction
      while (got < 5 + 9 + 9) {
        ssize_t const n = ::recv(fd, reply, sizeof reply, 0);
        if (n <= 0) { ::_exit(5); }
        got += static_cast<std::size_t>(n);
      }
      ::raise(SIGKILL);
    }
    REQUIRE(killed_by_sigkill(child));
    CHECK(raw_command(server.port(), {"EXISTS", key})->integer == 0);
    CHECK(writer.namespace_fact_ids(9) == std::vector<std::uint64_t>{1});
    CHECK_THROWS_WITH(writer.fetch(9, {2}), Catch::Contains("is not stored"));
    CHECK(writer.put(reference, 2));  // the id is free: written whole now
    CHECK(writer.fetch(9, {2}).facts.at(0).pages == fact_bytes(reference, 2));
  }

  SECTION("killed in the middle of sending a value")
  {
    std::string const key = writer.fact_key_name(9, 3);
    pid_t const child     = ::fork();
    if (child == 0) {
      std::string const head = "*3\r\n$3\r\nSET\r\n$" + std::to_string(key.size()) + "\r\n" + key +
                               "\r\n$100000\r\n" + std::string(50000, 'x');
      (void)send_raw(server.port(), head);
      ::usleep(100000);  // the server has read the half value
      ::raise(SIGKILL);
    }
    REQUIRE(killed_by_sigkill(child));
    CHECK(raw_command(server.port(), {"EXISTS", key})->integer == 0);
    CHECK_THROWS_WITH(writer.fetch(9, {3}), Catch::Contains("is not stored"));
  }

  SECTION("the library's writer killed at a random point of a burst of writes")
  {
    for (int round = 0; round < 3; ++round) {
      pid_t const child = ::fork();
      if (child == 0) {
        redis_fact_store burst{options_for(server.port()), reference.config()};
        for (std::uint64_t id = 2; id <= 300; ++id) {
          burst.put(reference, id, embedding_of(id));
        }
        ::_exit(0);
      }
      ::usleep(static_cast<useconds_t>(20000 + 15000 * round));
      ::kill(child, SIGKILL);
      int status = 0;
      ::waitpid(child, &status, 0);
      CAPTURE(round);
      check_consistent(server.port(), writer, 9, reference);
    }
  }
}

TEST_CASE("redis faults: killed and restarted with its append-only file, no committed fact lost",
          "[redis]")
{
  redis_server server{{/*append_only*/ true, /*cluster*/ false}};
  kv_store reference{store_config(64)};
  for (std::uint64_t id = 1; id <= 20; ++id) {
    add(reference, id, 5, static_cast<std::int32_t>(id));
  }
  redis_fact_store writer{options_for(server.port()), reference.config()};
  for (std::uint64_t id = 1; id <= 20; ++id) {
    REQUIRE(writer.put(reference, id, embedding_of(id)));
  }
  CHECK(writer.erase(5, 20));
  std::uint64_t const generation = writer.generation(5);
  redis_fact_store replica_source{options_for(server.port()), reference.config()};
  tiered_store replica{tiers_config(64, 64)};
  replica.admit({{5, 1}, {5, 2}}, replica_source);

  server.kill();  // SIGKILL: no shutdown, only what appendfsync always wrote
  server.start();

  std::vector<std::uint64_t> ids;
  for (std::uint64_t id = 1; id <= 19; ++id) {
    ids.push_back(id);
  }
  fetched_namespace const got = until_available([&] { return writer.fetch(5, ids); });
  CHECK(got.generation == generation);
  for (fetched_fact const& f : got.facts) {
    CAPTURE(f.fact_id);
    CHECK(f.pages == fact_bytes(reference, f.fact_id));
    CHECK(f.embedding == embedding_of(f.fact_id));
  }
  CHECK_THROWS_WITH(writer.fetch(5, {20}), Catch::Contains("is not stored"));  // erased stays so
  // The replica's copies are still of the current generation: kept, and 3 fetched.
  tier_request const r = until_available([&] {
    return replica.admit({{5, 1}, {5, 3}}, replica_source);
  });
  CHECK(r.forgotten.empty());
  CHECK(r.fetched == std::vector<std::uint64_t>{3});
}

TEST_CASE("redis faults: an unreachable Redis refuses or answers without memory, never stale",
          "[redis]")
{
  redis_server server;
  kv_store reference{store_config(64)};
  for (std::uint64_t id = 1; id <= 4; ++id) {
    add(reference, id, 3, 5);
  }
  redis_options fast = options_for(server.port());
  fast.timeout_ms    = 300;
  redis_fact_store writer{fast, reference.config()};
  for (std::uint64_t id = 1; id <= 4; ++id) {
    REQUIRE(writer.put(reference, id));
  }
  redis_fact_store source{fast, reference.config()};
  tiered_store replica{tiers_config(16, 16)};
  replica.admit({{3, 1}, {3, 2}}, source);
  std::vector<unsigned char> const host_pool = replica.host_tier().pool_to_host();
  std::uint64_t const device_version         = replica.device_tier().version();
  auto const unchanged                       = [&] {
    return replica.host_tier().pool_to_host() == host_pool &&
           replica.device_tier().version() == device_version && replica.contains(1) &&
           replica.contains(2) && !replica.contains(3);
  };
  std::string const endpoint = "127.0.0.1:" + std::to_string(server.port());

  SECTION("stopped: refused with the endpoint named, or answered without memory")
  {
    server.stop();
    // Even facts held here are not served: their generation cannot be checked.
    CHECK_THROWS_AS(replica.admit({{3, 1}}, source), source_unavailable);
    CHECK_THROWS_WITH(replica.admit({{3, 1}, {3, 3}}, source), Catch::Contains(endpoint));
    CHECK(unchanged());
    tier_request const r = replica.admit({{3, 1}, {3, 3}}, source, source_policy::without_memory);
    CHECK(r.without_memory);
    CHECK(r.staged.empty());
    CHECK(unchanged());
    CHECK_THROWS_AS(writer.put(reference, 3), source_unavailable);

    // Back, but empty (no persistence): generation 0 was never seen, so the copies are dropped
    // and the facts, gone from Redis, are refused.
    server.start();
    CHECK_THROWS_WITH(until_available([&] {
                        return replica.admit({{3, 1}}, source);
                      }),
                      Catch::Contains("is not stored"));
    CHECK_FALSE(replica.contains(1));
    CHECK_FALSE(replica.contains(2));
  }

  SECTION("hung (SIGSTOP): the timeout refuses, then it answers again")
  {
    server.pause();
    CHECK_THROWS_WITH(replica.admit({{3, 1}, {3, 3}}, source),
                      Catch::Contains(endpoint) && Catch::Contains("no reply"));
    CHECK(unchanged());
    server.resume();
    tier_request const r = until_available([&] { return replica.admit({{3, 3}}, source); });
    CHECK(r.fetched == std::vector<std::uint64_t>{3});
  }
}

TEST_CASE("redis faults: a corrupt value is refused by its checksum, the replica unchanged",
          "[redis]")
{
  redis_server server;
  kv_store reference{store_config(64)};
  for (std::uint64_t id = 1; id <= 4; ++id) {
    add(reference, id, 6, 6);
  }
  redis_fact_store writer{options_for(server.port()), reference.config()};
  for (std::uint64_t id = 1; id <= 4; ++id) {
    REQUIRE(writer.put(reference, id));
  }
  redis_fact_store source{options_for(server.port()), reference.config()};
  tiered_store replica{tiers_config(16, 16)};
  replica.admit({{6, 1}}, source);
  std::vector<unsigned char> const host_pool = replica.host_tier().pool_to_host();
  std::string const key                      = writer.fact_key_name(6, 2);
  auto const value                           = [&](std::string const& k) {
    auto const r = raw_command(server.port(), {"GET", k});
    return std::string{r->str, r->len};
  };
  std::string const good = value(key);

  SECTION("one flipped bit in the pages")
  {
    std::string bad = good;
    bad[good.size() / 2] ^= 0x04;
    raw_command(server.port(), {"SET", key, bad});
    CHECK_THROWS_WITH(replica.admit({{6, 1}, {6, 2}}, source),
                      Catch::Contains("checksum mismatch") && Catch::Contains(key));
  }
  SECTION("a truncated value")
  {
    raw_command(server.port(), {"SET", key, good.substr(0, good.size() - 100)});
    CHECK_THROWS_WITH(replica.admit({{6, 2}}, source), Catch::Contains("checksum mismatch"));
  }
  SECTION("another fact's valid value under this key")
  {
    raw_command(server.port(), {"SET", key, value(writer.fact_key_name(6, 3))});
    CHECK_THROWS_WITH(replica.admit({{6, 2}}, source),
                      Catch::Contains("the value is fact 3 of namespace 6"));
  }
  SECTION("a value of another page layout (checksum recomputed)")
  {
    std::string bad   = good;
    bad[44]           = 8;  // page_size field: 8 tokens instead of 4
    std::uint64_t crc = ~std::uint64_t{0};
    for (std::size_t i = 0; i + 8 < bad.size(); ++i) {
      crc ^= static_cast<unsigned char>(bad[i]);
      for (int b = 0; b < 8; ++b) {
        crc = (crc & 1u) != 0 ? (crc >> 1) ^ 0xC96C5795D7870F42ull : crc >> 1;
      }
    }
    crc = ~crc;
    for (int b = 0; b < 8; ++b) {
      bad[bad.size() - 8 + static_cast<std::size_t>(b)] = static_cast<char>(crc >> (8 * b));
    }
    raw_command(server.port(), {"SET", key, bad});
    CHECK_THROWS_WITH(replica.admit({{6, 2}}, source), Catch::Contains("another layout"));
  }
  CHECK(replica.host_tier().pool_to_host() == host_pool);
  CHECK_FALSE(replica.contains(2));
  CHECK(replica.admit({{6, 4}}, source).fetched == std::vector<std::uint64_t>{4});
}

TEST_CASE("redis faults: two replicas writing the same user at once lose and duplicate nothing",
          "[redis]")
{
  redis_server server;
  constexpr std::uint64_t ns = 11;
  kv_store a_store{store_config(1024)}, b_store{store_config(1024)};
  for (std::uint64_t id = 1000; id < 1150; ++id) {
    add(a_store, id, ns, 3);
  }
  for (std::uint64_t id = 2000; id < 2150; ++id) {
    add(b_store, id, ns, 3);
  }
  for (std::uint64_t id = 3000; id < 3040; ++id) {  // both write these, the same contents
    add(a_store, id, ns, 2);
    add(b_store, id, ns, 2);
  }
  add(a_store, 4000, ns, 3);
  add(b_store, 4000, ns, 3, /*salt*/ 9);  // both write 4000, other contents
  std::atomic<int> shared_written{0}, conflict_written{0}, conflict_refused{0};
  auto const write = [&](kv_store const& store, std::uint64_t own_first) {
    redis_fact_store w{options_for(server.port()), store.config()};
    for (std::uint64_t i = 0; i < 150; ++i) {
      w.put(store, own_first + i);
      if (i < 40 && w.put(store, 3000 + i)) { ++shared_written; }
      if (i == 75) {
        try {
          if (w.put(store, 4000)) { ++conflict_written; }
        } catch (logic_error const&) {
          ++conflict_refused;
        }
      }
    }
  };
  std::thread a{write, std::cref(a_store), 1000};
  std::thread b{write, std::cref(b_store), 2000};
  a.join();
  b.join();

  CHECK(shared_written == 40);  // each shared id written once, by one of them
  CHECK(conflict_written == 1);
  CHECK(conflict_refused == 1);
  redis_fact_store reader{options_for(server.port()), a_store.config()};
  std::vector<std::uint64_t> expected;
  for (std::uint64_t id = 1000; id < 1150; ++id) {
    expected.push_back(id);
  }
  for (std::uint64_t id = 2000; id < 2150; ++id) {
    expected.push_back(id);
  }
  for (std::uint64_t id = 3000; id < 3040; ++id) {
    expected.push_back(id);
  }
  expected.push_back(4000);
  CHECK(reader.namespace_fact_ids(ns) == expected);
  CHECK(value_ids(server.port(), reader, ns) ==
        std::set<std::uint64_t>(expected.begin(), expected.end()));
  fetched_namespace const got = reader.fetch(ns, expected);
  for (fetched_fact const& f : got.facts) {
    CAPTURE(f.fact_id);
    if (f.fact_id == 4000) {
      CHECK((f.pages == fact_bytes(a_store, 4000) || f.pages == fact_bytes(b_store, 4000)));
    } else {
      CHECK(f.pages ==
            fact_bytes(f.fact_id < 2000 || f.fact_id >= 3000 ? a_store : b_store, f.fact_id));
    }
  }

  SECTION("an erasure racing writers leaves every fact whole or absent")
  {
    kv_store c_store{store_config(512)};
    for (std::uint64_t id = 1; id <= 200; ++id) {
      add(c_store, id, 12, 3);
    }
    std::thread writer_thread{[&] {
      redis_fact_store w{options_for(server.port()), c_store.config()};
      for (std::uint64_t id = 1; id <= 200; ++id) {
        w.put(c_store, id);
      }
    }};
    std::int64_t erased = 0;
    {
      redis_fact_store e{options_for(server.port()), c_store.config()};
      for (int round = 0; round < 20; ++round) {
        erased += e.erase_namespace(12);
      }
    }
    writer_thread.join();
    std::vector<std::uint64_t> const left = reader.namespace_fact_ids(12);
    CHECK(erased + static_cast<std::int64_t>(left.size()) == 200);
    check_consistent(server.port(), reader, 12, c_store);
  }
}
