// The Redis tier on a three-node Redis Cluster the test builds itself (three redis-server
// --cluster-enabled yes, then redis-cli --cluster create): slots computed as the cluster computes
// them (CLUSTER KEYSLOT), users spread over the nodes, MOVED redirections followed from any seed
// node, replicas seeded at different nodes serving each other's writes and erasures; a user's slot
// migrated to another node by hand (CLUSTER SETSLOT, MIGRATE) while facts are read and written:
// ASK followed, TRYAGAIN waited out, never half the facts.

#include "redis_common.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::redis;
using inferscale_test::redis_server;

namespace {

/// Three redis-server --cluster-enabled yes joined by redis-cli --cluster create, each reporting
/// cluster_state:ok.
std::vector<std::unique_ptr<redis_server>> make_cluster()
{
  std::string const cli = inferscale_test::find_on_path("redis-cli");
  if (cli.empty()) {
    FAIL(
      "redis-cli is not on PATH: the cluster test builds its cluster with redis-cli --cluster "
      "create (Debian's redis-tools; .ci/setup installs it)");
  }
  std::vector<std::unique_ptr<redis_server>> nodes;
  std::string command = cli + " --cluster create";
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(std::make_unique<redis_server>(redis_server::options{false, true}));
    command += " 127.0.0.1:" + std::to_string(nodes.back()->port());
  }
  command += " --cluster-replicas 0 --cluster-yes > " + nodes[0]->directory() + "/create.log 2>&1";
  int const created = std::system(command.c_str());
  INFO("redis-cli --cluster create: " << nodes[0]->tail_of("create.log"));
  REQUIRE(created == 0);
  auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (auto const& n : nodes) {
    for (;;) {
      auto const info = raw_command(n->port(), {"CLUSTER", "INFO"});
      if (std::string{info->str, info->len}.find("cluster_state:ok") != std::string::npos) {
        break;
      }
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  return nodes;
}

/// The reply of one command as a string (status, bulk string or error).
std::string text_of(int port, std::vector<std::string> const& args)
{
  auto const r = raw_command(port, args);
  return r->str != nullptr ? std::string{r->str, r->len} : std::string{};
}

}  // namespace

TEST_CASE("redis cluster: three nodes, keys spread by slot, MOVED followed", "[redis]")
{
  auto const nodes = make_cluster();
  kv_store reference{store_config(256)};
  constexpr std::uint64_t users = 24;
  for (std::uint64_t ns = 1; ns <= users; ++ns) {
    add(reference, ns * 10 + 1, ns, 3);
    add(reference, ns * 10 + 2, ns, 6);
  }
  redis_fact_store writer{options_for(nodes[0]->port()), reference.config()};
  for (std::uint64_t ns = 1; ns <= users; ++ns) {
    CAPTURE(ns);
    // the slot as the cluster computes it
    std::string const key = writer.fact_key_name(ns, ns * 10 + 1);
    auto const slot       = raw_command(nodes[0]->port(), {"CLUSTER", "KEYSLOT", key});
    CHECK(slot->integer == detail::redis::hash_slot(key));
    CHECK(writer.put(reference, ns * 10 + 1, embedding_of(ns * 10 + 1)));
    CHECK(writer.put(reference, ns * 10 + 2));
  }
  int nodes_with_keys = 0;
  for (auto const& n : nodes) {
    nodes_with_keys += raw_command(n->port(), {"DBSIZE"})->integer > 0 ? 1 : 0;
  }
  CHECK(nodes_with_keys == 3);  // 24 users over three nodes' slots

  // Replicas seeded at the other nodes: each key is redirected to its owner (MOVED).
  redis_fact_store source_b{options_for(nodes[1]->port()), reference.config()};
  redis_fact_store source_c{options_for(nodes[2]->port()), reference.config()};
  tiered_store replica_b{tiers_config(128, 128)};
  tiered_store replica_c{tiers_config(128, 128)};
  for (std::uint64_t ns = 1; ns <= users; ++ns) {
    CAPTURE(ns);
    tier_request r = replica_b.admit({{ns, ns * 10 + 1}, {ns, ns * 10 + 2}}, source_b);
    CHECK(r.fetched.size() == 2);
    replica_b.stage_host(r);
    for (std::uint64_t id : {ns * 10 + 1, ns * 10 + 2}) {
      CHECK(fact_bytes(replica_b.device_tier(), id) == fact_bytes(reference, id));
    }
  }
  CHECK(source_c.fetch(5, {51}).facts.at(0).embedding == embedding_of(51));
  replica_c.admit({{5, 51}}, source_c);

  // An erasure through one node reaches both replicas.
  CHECK(writer.erase(5, 52));
  tier_request const r = replica_b.admit({{5, 51}}, source_b);
  CHECK(r.forgotten.size() == 2);
  CHECK(r.fetched == std::vector<std::uint64_t>{51});
  CHECK_THROWS_WITH(replica_c.admit({{5, 52}}, source_c), Catch::Contains("is not stored"));
  CHECK(writer.erase_namespace(7) == 2);
  CHECK(source_c.namespace_fact_ids(7).empty());
}

TEST_CASE("redis cluster: a user's slot migrating: ASK followed, split keys never served",
          "[redis]")
{
  auto const nodes = make_cluster();
  kv_store reference{store_config(64)};
  for (std::uint64_t ns : {3, 4}) {
    for (std::uint64_t j = 1; j <= 3; ++j) {
      add(reference, ns * 10 + j, ns, static_cast<std::int32_t>(2 + j));
    }
  }
  redis_fact_store writer{options_for(nodes[0]->port()), reference.config()};
  for (std::uint64_t ns : {3, 4}) {
    CHECK(writer.put(reference, ns * 10 + 1));
    CHECK(writer.put(reference, ns * 10 + 2));
  }

  // The node that owns a user's slot, and another one to move it to.
  auto const migrate_begin = [&](std::uint64_t ns, std::size_t& from, std::size_t& to) {
    int const slot = detail::redis::hash_slot(writer.catalogue_key(ns));
    for (from = 0; from < nodes.size(); ++from) {
      std::string const n = std::to_string(slot);
      if (raw_command(nodes[from]->port(), {"CLUSTER", "COUNTKEYSINSLOT", n})->integer > 0) {
        break;
      }
    }
    REQUIRE(from < nodes.size());
    to                        = (from + 1) % nodes.size();
    std::string const id_from = text_of(nodes[from]->port(), {"CLUSTER", "MYID"});
    std::string const id_to   = text_of(nodes[to]->port(), {"CLUSTER", "MYID"});
    std::string const n       = std::to_string(slot);
    REQUIRE(text_of(nodes[to]->port(), {"CLUSTER", "SETSLOT", n, "IMPORTING", id_from}) == "OK");
    REQUIRE(text_of(nodes[from]->port(), {"CLUSTER", "SETSLOT", n, "MIGRATING", id_to}) == "OK");
    return slot;
  };
  // MIGRATE of the named keys (or every key of the slot) from `from` to `to`.
  auto const move_keys = [&](int slot, std::size_t from, std::size_t to, std::size_t count) {
    auto const keys =
      raw_command(nodes[from]->port(), {"CLUSTER", "GETKEYSINSLOT", std::to_string(slot), "100"});
    REQUIRE(keys->type == REDIS_REPLY_ARRAY);
    std::vector<std::string> args{
      "MIGRATE", "127.0.0.1", std::to_string(nodes[to]->port()), "", "0", "5000", "KEYS"};
    for (std::size_t i = 0; i < keys->elements && i < count; ++i) {
      args.emplace_back(keys->element[i]->str, keys->element[i]->len);
    }
    REQUIRE(args.size() > 7);
    REQUIRE(text_of(nodes[from]->port(), args) == "OK");
  };
  auto const migrate_end = [&](int slot, std::size_t to) {
    std::string const id_to = text_of(nodes[to]->port(), {"CLUSTER", "MYID"});
    for (auto const& n : nodes) {
      REQUIRE(text_of(n->port(), {"CLUSTER", "SETSLOT", std::to_string(slot), "NODE", id_to}) ==
              "OK");
    }
  };
  auto const keys_in = [&](std::size_t node, int slot) {
    return raw_command(nodes[node]->port(), {"CLUSTER", "COUNTKEYSINSLOT", std::to_string(slot)})
      ->integer;
  };

  // User 3: every key moved, the slot still migrating. A store that knows the old owner is
  // sent on by ASK (the importing node asked after ASKING).
  redis_fact_store reader{options_for(nodes[0]->port()), reference.config()};
  CHECK(reader.fetch(3, {31}).facts.at(0).pages == fact_bytes(reference, 31));  // learns the owner
  std::size_t from = 0, to = 0;
  int const slot3 = migrate_begin(3, from, to);
  move_keys(slot3, from, to, 100);
  CHECK(keys_in(from, slot3) == 0);
  CHECK(keys_in(to, slot3) > 0);
  fetched_namespace got = reader.fetch(3, {32, 31});
  REQUIRE(got.facts.size() == 2);
  CHECK(got.facts[0].pages == fact_bytes(reference, 32));
  CHECK(got.facts[1].pages == fact_bytes(reference, 31));
  CHECK(got.generation == writer.generation(3));
  CHECK(reader.namespace_fact_ids(3) == std::vector<std::uint64_t>{31, 32});
  // A new fact's transaction creates a key while the slot migrates: Redis refuses it
  // (TRYAGAIN, "multiple keys request during rehashing") for as long as the migration lasts, so
  // the write is source_unavailable and nothing of it is written.
  CHECK_THROWS_AS(reader.put(reference, 33), source_unavailable);
  CHECK(reader.namespace_fact_ids(3) == std::vector<std::uint64_t>{31, 32});
  migrate_end(slot3, to);
  CHECK(reader.put(reference, 33));  // the slot's new owner (MOVED)
  CHECK(reader.fetch(3, {33, 31}).facts.at(0).pages == fact_bytes(reference, 33));
  CHECK(keys_in(to, slot3) == 5);  // catalogue, generation and three facts

  // User 4: only some of its keys moved. A transaction over both halves is refused by the
  // importing node (TRYAGAIN) and retried; while the split lasts the fetch is unavailable, never
  // answered with half the facts or a missing generation; once the rest moves it is served.
  std::size_t from4 = 0, to4 = 0;
  int const slot4 = migrate_begin(4, from4, to4);
  move_keys(slot4, from4, to4, 1);
  REQUIRE(keys_in(from4, slot4) > 0);
  REQUIRE(keys_in(to4, slot4) > 0);
  CHECK_THROWS_AS(reader.fetch(4, {41, 42}), source_unavailable);
  try {
    (void)reader.fetch(4, {41, 42});
  } catch (source_unavailable const& e) {
    CHECK(std::string{e.what()}.find("TRYAGAIN") != std::string::npos);
  }
  move_keys(slot4, from4, to4, 100);
  got = reader.fetch(4, {41, 42});
  REQUIRE(got.facts.size() == 2);
  CHECK(got.facts[0].pages == fact_bytes(reference, 41));
  CHECK(got.facts[1].pages == fact_bytes(reference, 42));
  migrate_end(slot4, to4);
  CHECK(writer.namespace_fact_ids(4) == std::vector<std::uint64_t>{41, 42});
}
