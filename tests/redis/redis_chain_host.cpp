// read_through_source (read_through_source.hpp): a Redis tier in front of a snapshot directory on
// disk. A redis-server the test starts on 127.0.0.1 and a directory_fact_source over a
// save_store file; the bytes every fetch returns are compared with the store that was saved,
// and what the source behind was asked for is recorded by a wrapper around it.
#include "redis_common.hpp"

#include <inferscale/directory_source.hpp>
#include <inferscale/read_through_source.hpp>
#include <inferscale/snapshot.hpp>

#include <catch2/catch.hpp>

#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace inferscale;
using namespace inferscale_test::redis;
using inferscale_test::redis_server;

/// The source behind, recording the ids of every fetch it is asked for.
class recording_source final : public fact_source {
 public:
  explicit recording_source(fact_source& inner) : inner_{inner} {}
  fact_layout const& layout() const override { return inner_.layout(); }
  std::string name() const override { return inner_.name(); }
  fetched_namespace fetch(std::uint64_t ns, std::vector<std::uint64_t> const& ids) override
  {
    asked.push_back(ids);
    return inner_.fetch(ns, ids);
  }
  std::optional<bool> matches(fetched_fact const& f) const override { return inner_.matches(f); }
  std::vector<std::vector<std::uint64_t>> asked;

 private:
  fact_source& inner_;
};

/// A snapshot file of six facts (namespace 7: facts 1-4, namespace 8: 5 and 6) in a temporary
/// directory, and the store it was saved from.
struct saved_memory {
  saved_memory() : store{store_config(64)}
  {
    std::random_device seed;
    dir = std::filesystem::temp_directory_path() /
          ("inferscale-chain-" + std::to_string(seed()) + std::to_string(seed()));
    std::filesystem::create_directories(dir);
    for (std::uint64_t id = 1; id <= 6; ++id) {
      add(store, id, id <= 4 ? 7 : 8, static_cast<std::int32_t>(id * 2 + 3));
    }
    save_store(store, (dir / "memory.iskv").string());
  }
  ~saved_memory()
  {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
  std::filesystem::path dir;
  kv_store store;
};

void require_facts(fetched_namespace const& got,
                   kv_store const& reference,
                   std::vector<std::uint64_t> const& ids)
{
  REQUIRE(got.facts.size() == ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    CAPTURE(ids[i]);
    REQUIRE(got.facts[i].fact_id == ids[i]);
    REQUIRE(got.facts[i].namespace_id == reference.at(ids[i]).namespace_id);
    REQUIRE(got.facts[i].token_ids == reference.at(ids[i]).token_ids);
    REQUIRE(got.facts[i].pages == fact_bytes(reference, ids[i]));
  }
}

using asked_list = std::vector<std::vector<std::uint64_t>>;

}  // namespace

TEST_CASE("redis in front of disk: disk read once, then Redis for every replica", "[redis]")
{
  saved_memory memory;
  redis_server server;
  directory_fact_source disk{memory.dir.string()};
  recording_source back{disk};
  redis_fact_store front{options_for(server.port(), "test/Fake-135M@snapshot-1"),
                         memory.store.config()};
  read_through_source chain{front, back};
  CHECK(chain.name() == front.name() + " in front of " + disk.name());
  CHECK(chain.layout() == disk.layout());

  // Cold: both facts from disk, in the order asked, then in Redis.
  fetched_namespace got = chain.fetch(7, {3, 1});
  require_facts(got, memory.store, {3, 1});
  CHECK(got.generation == 0);  // the directory's: one save
  CHECK(back.asked == asked_list{{3, 1}});
  CHECK(chain.stats().back_reads == 2);
  CHECK(chain.stats().backfilled == 2);
  CHECK(chain.stats().front_hits == 0);
  CHECK(front.namespace_fact_ids(7) == std::vector<std::uint64_t>{1, 3});
  require_facts(front.fetch(7, {1, 3}), memory.store, {1, 3});

  // Warm: only the fact Redis lacks is read from disk.
  got = chain.fetch(7, {1, 2, 3});
  require_facts(got, memory.store, {1, 2, 3});
  CHECK(back.asked == asked_list{{3, 1}, {2}});
  CHECK(chain.stats().front_hits == 2);
  CHECK(chain.stats().backfilled == 3);

  // Another replica (its own connection and disk reader): every fact from Redis, disk asked for
  // none (only the directory's generation).
  directory_fact_source disk_b{memory.dir.string()};
  recording_source back_b{disk_b};
  redis_fact_store front_b{options_for(server.port(), "test/Fake-135M@snapshot-1"),
                           memory.store.config()};
  read_through_source replica_b{front_b, back_b};
  require_facts(replica_b.fetch(7, {2, 1, 3}), memory.store, {2, 1, 3});
  CHECK(back_b.asked == asked_list{{}});
  CHECK(replica_b.stats().front_hits == 3);
  CHECK(replica_b.stats().back_reads == 0);

  // The tiers admit through it as through any source.
  tiered_store tiers{tiers_config(16, 16)};
  std::size_t const asked_before = back.asked.size();
  tier_request r                 = tiers.admit({{8, 5}, {7, 2}}, chain);
  CHECK(r.fetched == std::vector<std::uint64_t>{5, 2});
  tiers.stage_host(r);
  CHECK(fact_bytes(tiers.device_tier(), 5) == fact_bytes(memory.store, 5));
  CHECK(fact_bytes(tiers.device_tier(), 2) == fact_bytes(memory.store, 2));
  std::vector<std::uint64_t> read_from_disk;  // one fetch per namespace
  for (std::size_t i = asked_before; i < back.asked.size(); ++i) {
    read_from_disk.insert(read_from_disk.end(), back.asked[i].begin(), back.asked[i].end());
  }
  CHECK(read_from_disk == std::vector<std::uint64_t>{5});  // fact 2 came from Redis
}

TEST_CASE("redis in front of disk: damaged or foreign values are read from disk and replaced",
          "[redis]")
{
  saved_memory memory;
  redis_server server;
  directory_fact_source disk{memory.dir.string()};
  recording_source back{disk};
  redis_fact_store front{options_for(server.port()), memory.store.config()};
  read_through_source chain{front, back};
  require_facts(chain.fetch(7, {1, 2, 4}), memory.store, {1, 2, 4});

  SECTION("a value refused by its checksum")
  {
    auto const value = raw_command(server.port(), {"GET", front.fact_key_name(7, 2)});
    REQUIRE(value->type == REDIS_REPLY_STRING);
    std::string damaged{value->str, value->len};
    damaged[damaged.size() / 2] = static_cast<char>(damaged[damaged.size() / 2] ^ 0x10);
    (void)raw_command(server.port(), {"SET", front.fact_key_name(7, 2), damaged});
    CHECK_THROWS_AS(front.fetch(7, {2}), logic_error);
  }
  SECTION("another fact's value under the key (another save's, say)")
  {
    kv_store other{store_config(8)};
    add(other, 2, 7, 9, /*salt=*/5);  // fact 2 of namespace 7 with other bytes
    REQUIRE(fact_bytes(other, 2) != fact_bytes(memory.store, 2));
    CHECK_THROWS_AS(front.put(other, 2), logic_error);  // create-only: Redis keeps its value
    (void)front.erase(7, 2);
    CHECK(front.put(other, 2));
  }
  fetched_namespace const got = chain.fetch(7, {4, 2, 1});
  require_facts(got, memory.store, {4, 2, 1});
  CHECK(back.asked.back() == std::vector<std::uint64_t>{2});  // 4 and 1 from Redis
  CHECK(chain.stats().replaced >= 1);
  // Redis holds the disk's fact 2 again
  require_facts(front.fetch(7, {2}), memory.store, {2});
}

TEST_CASE("redis in front of disk: Redis unreachable, every fact from disk; failures behind",
          "[redis]")
{
  saved_memory memory;
  redis_server server;
  directory_fact_source disk{memory.dir.string()};
  recording_source back{disk};
  redis_options o = options_for(server.port());
  o.timeout_ms    = 500;
  redis_fact_store front{o, memory.store.config()};
  read_through_source chain{front, back};
  require_facts(chain.fetch(7, {1}), memory.store, {1});

  server.stop();
  fetched_namespace got = chain.fetch(7, {1, 3});
  require_facts(got, memory.store, {1, 3});
  CHECK(back.asked.back() == std::vector<std::uint64_t>{1, 3});
  CHECK(chain.stats().front_unavailable >= 1);
  CHECK_FALSE(chain.stats().last_front_error.empty());

  server.start();  // no persistence: an empty Redis, filled again by the next fetch
  require_facts(chain.fetch(7, {3}), memory.store, {3});
  CHECK(front.namespace_fact_ids(7) == std::vector<std::uint64_t>{3});

  // A fact the disk lacks: the fetch fails as the disk's does, and Redis is left as it was.
  CHECK_THROWS_AS(chain.fetch(7, {3, 2, 99}), logic_error);
  CHECK(front.namespace_fact_ids(7) == std::vector<std::uint64_t>{3});
  CHECK_THROWS_WITH(chain.fetch(7, {2, 2}), Catch::Contains("fact 2 is asked for twice"));
  // Redis holding a fact the disk does not (erased before this save, say): not served from Redis
  kv_store extra{store_config(8)};
  add(extra, 50, 7, 3);
  CHECK(front.put(extra, 50));
  CHECK_THROWS_WITH(chain.fetch(7, {50}), Catch::Contains("fact 50 is not in"));

  // Two sources of different page layouts are refused.
  redis_fact_store other_layout{options_for(server.port()), store_config(8, page_size * 2)};
  CHECK_THROWS_WITH((read_through_source{other_layout, disk}), Catch::Contains("holds pages of"));
}
