// The Redis tier on a three-node Redis Cluster the test builds itself (three redis-server
// --cluster-enabled yes, then redis-cli --cluster create): slots computed as the cluster computes
// them (CLUSTER KEYSLOT), users spread over the nodes, MOVED redirections followed from any seed
// node, replicas seeded at different nodes serving each other's writes and erasures.

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

TEST_CASE("redis cluster: three nodes, keys spread by slot, MOVED followed", "[redis]")
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
