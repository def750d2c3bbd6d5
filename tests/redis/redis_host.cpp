// The Redis tier (redis_source.hpp) on a redis-server the test starts: the key scheme, facts that
// round-trip byte for byte against a directly inserted store, replicas (each a tiered_store with
// its own connection) fetching what they lack, a fact committed by one replica served by another
// on its next request, erasures reaching every replica before it serves that user again, and
// refusals that change nothing.

#include "redis_common.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::redis;
using inferscale_test::redis_server;

TEST_CASE("redis: keys name the model and the layout and hash-tag the namespace", "[redis]")
{
  // CRC-16/XMODEM check value, and the cluster's slot of a hash tag (written out: the tag only).
  CHECK(detail::redis::crc16("123456789", 9) == 0x31C3);
  CHECK(detail::redis::hash_slot("{user1000}.following") ==
        detail::redis::hash_slot("{user1000}.followers"));
  CHECK(detail::redis::hash_slot("a{}b") == (detail::redis::crc16("a{}b", 4) & 16383));

  redis_fact_store store{options_for(1), store_config(0)};
  std::string const prefix = "inferscale:v1:test/Fake-135M@r1:3x2x8:l0+3:h0+2:bfloat16:p4:{u42}:";
  CHECK(store.fact_key_name(42, 7) == prefix + "f:7");
  CHECK(store.catalogue_key(42) == prefix + "catalogue");
  CHECK(store.generation_key(42) == prefix + "generation");
  int const slot = detail::redis::hash_slot(store.fact_key_name(42, 7));
  CHECK(detail::redis::hash_slot(store.catalogue_key(42)) == slot);
  CHECK(detail::redis::hash_slot(store.generation_key(42)) == slot);
  CHECK(slot == (detail::redis::crc16("u42", 3) & 16383));

  CHECK_THROWS_WITH((redis_fact_store{options_for(1, "bad{model}"), store_config(0)}),
                    Catch::Contains("letters, digits"));
  CHECK_THROWS_WITH((redis_fact_store{options_for(1, ""), store_config(0)}),
                    Catch::Contains("name the model"));
}

TEST_CASE("redis: facts round-trip byte for byte and replicas fetch what they lack", "[redis]")
{
  redis_server server;
  kv_store reference{store_config(64)};
  for (std::uint64_t id = 1; id <= 6; ++id) {
    add(reference, id, id <= 4 ? 7 : 8, static_cast<std::int32_t>(id * 2 + 1));
  }
  redis_fact_store writer{options_for(server.port()), reference.config()};
  for (std::uint64_t id = 1; id <= 6; ++id) {
    CHECK(writer.put(reference, id, embedding_of(id)));
  }
  CHECK_FALSE(writer.put(reference, 3, embedding_of(3)));  // the same value again: left as it is
  CHECK(writer.namespace_fact_ids(7) == std::vector<std::uint64_t>{1, 2, 3, 4});
  std::uint64_t const generation = writer.generation(7);
  CHECK(generation != 0);  // random at the namespace's first write

  SECTION("fetch returns the store's bytes, tokens and embedding")
  {
    fetched_namespace const got = writer.fetch(7, {4, 1});
    CHECK(got.generation == generation);
    REQUIRE(got.facts.size() == 2);
    for (fetched_fact const& f : got.facts) {
      CAPTURE(f.fact_id);
      CHECK(f.pages == fact_bytes(reference, f.fact_id));
      CHECK(f.token_ids == reference.at(f.fact_id).token_ids);
      CHECK(f.embedding == embedding_of(f.fact_id));
    }
    // The stored value as the format defines it: its last 8 bytes are the CRC-64 of the rest.
    auto const raw = raw_command(server.port(), {"GET", writer.fact_key_name(7, 1)});
    REQUIRE(raw->type == REDIS_REPLY_STRING);
    std::vector<unsigned char> const v(raw->str, raw->str + raw->len);
    std::uint64_t stored = 0;
    for (int b = 7; b >= 0; --b) {
      stored = (stored << 8) | v[v.size() - 8 + static_cast<std::size_t>(b)];
    }
    // bit-at-a-time CRC-64/XZ, written here
    std::uint64_t crc = ~std::uint64_t{0};
    for (std::size_t i = 0; i + 8 < v.size(); ++i) {
      crc ^= v[i];
      for (int b = 0; b < 8; ++b) {
        crc = (crc & 1u) != 0 ? (crc >> 1) ^ 0xC96C5795D7870F42ull : crc >> 1;
      }
    }
    CHECK(stored == ~crc);
    CHECK(v.size() == 88 + 4 * 3 + 4 * 4 + reference.page_bytes() + 8);  // fact 1: 3 tokens
  }

  SECTION("two replicas, each with its own local LRU, serve each other's writes")
  {
    redis_fact_store source_a{options_for(server.port()), reference.config()};
    redis_fact_store source_b{options_for(server.port()), reference.config()};
    tiered_store replica_a{tiers_config(16, 16)};
    tiered_store replica_b{tiers_config(16, 16)};
    tier_request r = replica_a.admit({{7, 1}, {7, 2}, {8, 5}}, source_a);
    CHECK(r.fetched == std::vector<std::uint64_t>{1, 2, 5});
    replica_a.stage_host(r);
    for (std::uint64_t id : {1, 2, 5}) {
      CHECK(fact_bytes(replica_a.device_tier(), id) == fact_bytes(reference, id));
    }
    // Replica B commits a fact; replica A serves it on its next request.
    kv_store b_store{store_config(8)};
    add(b_store, 20, 7, 5);
    CHECK(source_b.put(b_store, 20));
    r = replica_a.admit({{7, 20}, {7, 1}}, source_a);
    CHECK(r.fetched == std::vector<std::uint64_t>{20});
    replica_a.stage_host(r);
    CHECK(fact_bytes(replica_a.device_tier(), 20) == fact_bytes(b_store, 20));

    // An erasure reaches both replicas before they serve namespace 7 again.
    r = replica_b.admit({{7, 3}, {7, 20}}, source_b);
    CHECK(r.fetched == std::vector<std::uint64_t>{3, 20});
    CHECK(writer.erase(7, 2));
    CHECK_FALSE(writer.erase(7, 2));  // already gone (the generation still moves)
    CHECK(writer.generation(7) == generation + 2);
    r = replica_a.admit({{7, 1}}, source_a);  // held, but the generation changed
    std::vector<std::uint64_t> forgotten = r.forgotten;
    std::sort(forgotten.begin(), forgotten.end());
    CHECK(forgotten == std::vector<std::uint64_t>{1, 2, 20});
    CHECK(r.fetched == std::vector<std::uint64_t>{1});
    CHECK(replica_a.contains(5));  // namespace 8 untouched
    CHECK_THROWS_WITH(replica_b.admit({{7, 2}}, source_b), Catch::Contains("is not stored"));
    r         = replica_b.admit({{7, 3}}, source_b);  // its copies of namespace 7 are dropped first
    forgotten = r.forgotten;
    std::sort(forgotten.begin(), forgotten.end());
    CHECK(forgotten == std::vector<std::uint64_t>{3, 20});
    CHECK(r.fetched == std::vector<std::uint64_t>{3});

    // erase_namespace: everything of namespace 8 goes, on every replica's next request.
    CHECK(writer.erase_namespace(8) == 2);
    CHECK(writer.namespace_fact_ids(8).empty());
    CHECK_THROWS_WITH(replica_a.admit({{8, 5}}, source_a), Catch::Contains("is not stored"));
    CHECK_FALSE(replica_a.contains(5));
  }

  SECTION("refusals change nothing")
  {
    tiered_store replica{tiers_config(16, 16)};
    redis_fact_store source{options_for(server.port()), reference.config()};
    replica.admit({{7, 1}}, source);
    std::vector<unsigned char> const host_pool = replica.host_tier().pool_to_host();
    std::uint64_t const version                = replica.device_tier().version();
    CHECK_THROWS_WITH(
      replica.admit({{7, 4}, {7, 99}}, source),
      Catch::Contains("fact 99 is not stored") && Catch::Contains(writer.fact_key_name(7, 99)));
    CHECK_THROWS_WITH(replica.admit({{8, 4}}, source), Catch::Contains("is not stored"));
    // another model's keys are other keys
    redis_fact_store other_model{options_for(server.port(), "test/Other@r1"), reference.config()};
    CHECK_THROWS_WITH(other_model.fetch(7, {1}), Catch::Contains("Other@r1"));
    // a replica of another page layout
    tiered_store_config wide = tiers_config(16, 16);
    wide.device.page_size    = 8;
    tiered_store wide_replica{wide};
    CHECK_THROWS_WITH(wide_replica.admit({{7, 1}}, source), Catch::Contains("pages of 8 tokens"));
    CHECK(replica.host_tier().pool_to_host() == host_pool);
    CHECK(replica.device_tier().version() == version);
    CHECK_FALSE(replica.contains(4));
    // a writer of another layout; the same id with other contents
    kv_store wide_store{store_config(8, 8)};
    add(wide_store, 30, 7, 3);
    CHECK_THROWS_WITH(writer.put(wide_store, 30), Catch::Contains("pages of 8 tokens"));
    kv_store changed{store_config(8)};
    add(changed, 1, 7, 3, /*salt*/ 5);
    CHECK_THROWS_WITH(writer.put(changed, 1), Catch::Contains("with other contents"));
    CHECK(writer.fetch(7, {1}).facts.at(0).pages == fact_bytes(reference, 1));
  }
}
