// Facts paged from disk (directory_source.hpp) as the level below the host tier
// (tiered_store::admit(keys, source)): pages read only for the facts asked, byte for byte what a
// directly inserted store holds, each fact checked by the snapshot's fact table (the damaged fact
// refused, its neighbours served), the host tier an LRU cache of the source that never drops a
// fact inserted here, generations (a changed one drops the namespace's fetched copies), the
// unreachable-source policy, and refusals that change nothing.

#include "../snapshot/snapshot_common.hpp"

#include <inferscale/directory_source.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/tier.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

using namespace inferscale;
namespace snap = inferscale_test::snapshot;

namespace {

constexpr std::int32_t layers    = 3;
constexpr std::int32_t heads     = 2;
constexpr std::int32_t head_dim  = 8;
constexpr std::int32_t page_size = 4;

kv_store_config store_config(std::int64_t pages, std::int32_t page = page_size)
{
  kv_store_config c;
  c.model       = kv_geometry{layers, heads, head_dim};
  c.store_dtype = dtype::bfloat16;
  c.page_size   = page;
  c.num_pages   = pages;
  c.space       = memory_space::host;
  return c;
}

tiered_store_config tiers_config(std::int64_t device_pages, std::int64_t host_pages)
{
  tiered_store_config c;
  c.device     = store_config(device_pages);
  c.host_pages = host_pages;
  return c;
}

/// K and V of fact `id`: distinct bf16-exact values per element.
struct fact_kv {
  std::vector<float> k, v;
  fact_kv(std::uint64_t id, std::int32_t tokens)
  {
    std::size_t const n = static_cast<std::size_t>(layers) * tokens * heads * head_dim;
    for (std::size_t i = 0; i < n; ++i) {
      k.push_back(static_cast<float>(static_cast<std::int64_t>((id * 131 + i * 7) % 256) - 128) /
                  64.0f);
      v.push_back(static_cast<float>(static_cast<std::int64_t>((id * 17 + i * 13) % 256) - 128) /
                  64.0f);
    }
  }
};

std::vector<std::int32_t> tokens_of(std::uint64_t id, std::int32_t n)
{
  std::vector<std::int32_t> t;
  for (std::int32_t j = 0; j < n; ++j) {
    t.push_back(static_cast<std::int32_t>(id * 100 + j));
  }
  return t;
}

template <class Store>
void add(Store& s, std::uint64_t id, std::uint64_t ns, std::int32_t n)
{
  fact_kv const kv{id, n};
  s.template insert<float>(id,
                           ns,
                           tokens_of(id, n),
                           make_fact_kv_view<float const>(kv.k.data(), layers, n, heads, head_dim),
                           make_fact_kv_view<float const>(kv.v.data(), layers, n, heads, head_dim));
}

/// The bytes a store's pool holds for fact `id`, its pages in token order.
std::vector<unsigned char> fact_bytes(kv_store const& s, std::uint64_t id)
{
  std::vector<unsigned char> const pool = s.pool_to_host();
  std::vector<unsigned char> out;
  for (std::int64_t p : s.at(id).pages) {
    auto const from = pool.begin() + static_cast<std::ptrdiff_t>(p * s.page_bytes());
    out.insert(out.end(), from, from + static_cast<std::ptrdiff_t>(s.page_bytes()));
  }
  return out;
}

/// The facts of the tests: id -> (namespace, tokens).
std::map<std::uint64_t, std::pair<std::uint64_t, std::int32_t>> const facts = {
  {1, {7, 3}}, {2, {7, 9}}, {3, {7, 4}}, {4, {8, 1}}, {5, {8, 6}}, {6, {7, 5}}};

/// A directly inserted store of every fact (the reference), saved to `path`.
kv_store saved_reference(std::string const& path, std::int64_t pages = 32)
{
  kv_store s{store_config(pages)};
  for (auto const& [id, f] : facts) {
    add(s, id, f.first, f.second);
  }
  save_store(s, path);
  return s;
}

/// Everything observable of a tiered store.
struct observed {
  std::vector<unsigned char> device_pool, host_pool;
  std::uint64_t device_version{}, host_version{};
  std::vector<std::uint64_t> held, fetched_order;
  bool operator==(observed const& o) const
  {
    return device_pool == o.device_pool && host_pool == o.host_pool &&
           device_version == o.device_version && host_version == o.host_version && held == o.held &&
           fetched_order == o.fetched_order;
  }
  static observed of(tiered_store const& t)
  {
    observed o;
    o.device_pool    = t.device_tier().pool_to_host();
    o.host_pool      = t.host_tier().pool_to_host();
    o.device_version = t.device_tier().version();
    o.host_version   = t.host_tier().version();
    for (std::uint64_t id = 0; id < 100; ++id) {
      if (t.contains(id)) { o.held.push_back(id); }
    }
    o.fetched_order = t.fetched_order();
    return o;
  }
};

std::vector<fact_key> keys(std::vector<std::uint64_t> const& ids)
{
  std::vector<fact_key> out;
  for (std::uint64_t id : ids) {
    out.push_back({facts.count(id) != 0 ? facts.at(id).first : 7, id});
  }
  return out;
}

/// A source over a directory source whose generations and reachability the test sets, counting
/// what it is asked.
class scripted_source final : public fact_source {
 public:
  explicit scripted_source(std::string const& path) : disk_{path} {}
  fact_layout const& layout() const override { return disk_.layout(); }
  std::string name() const override { return "scripted " + disk_.name(); }
  fetched_namespace fetch(std::uint64_t ns, std::vector<std::uint64_t> const& ids) override
  {
    if (unreachable) { throw source_unavailable{"scripted source: unreachable"}; }
    asked.push_back(ids);
    fetched_namespace got = disk_.fetch(ns, ids);
    got.generation        = generation[ns];
    return got;
  }
  bool unreachable{false};
  std::map<std::uint64_t, std::uint64_t> generation;
  std::vector<std::vector<std::uint64_t>> asked;

 private:
  directory_fact_source disk_;
};

}  // namespace

TEST_CASE("tier source: a directory serves pages byte for byte, read only when asked", "[tier]")
{
  snap::scratch_dir dir;
  kv_store const reference = saved_reference(dir.file("facts.iskv"));
  directory_fact_source source{dir.path()};
  CHECK(source.num_facts() == static_cast<std::int64_t>(facts.size()));
  CHECK(source.files() == std::vector<std::string>{dir.file("facts.iskv")});
  CHECK(source.layout() == fact_layout::of(reference));
  CHECK(source.namespace_fact_ids(8) == std::vector<std::uint64_t>{4, 5});

  SECTION("fetch returns the store's bytes and its tokens")
  {
    fetched_namespace const got = source.fetch(7, {2, 6, 1});
    REQUIRE(got.facts.size() == 3);
    CHECK(got.generation == 0);
    for (fetched_fact const& f : got.facts) {
      CAPTURE(f.fact_id);
      CHECK(f.namespace_id == 7);
      CHECK(f.token_ids == reference.at(f.fact_id).token_ids);
      CHECK(f.embedding.empty());
      CHECK(f.pages == fact_bytes(reference, f.fact_id));
    }
  }

  SECTION("matches tells a copy of a fact from anything else, reading nothing")
  {
    fetched_namespace const got = source.fetch(7, {2, 3});
    for (fetched_fact const& f : got.facts) {
      CAPTURE(f.fact_id);
      CHECK(source.matches(f) == std::optional<bool>{true});
      fetched_fact changed = f;  // one bit of its last page
      changed.pages.back() = static_cast<unsigned char>(changed.pages.back() ^ 1u);
      CHECK(source.matches(changed) == std::optional<bool>{false});
      changed = f;
      changed.token_ids.back() += 1;
      CHECK(source.matches(changed) == std::optional<bool>{false});
      changed              = f;
      changed.namespace_id = 8;
      CHECK(source.matches(changed) == std::optional<bool>{false});
      changed = f;
      changed.pages.resize(changed.pages.size() + source.layout().page_bytes);
      CHECK(source.matches(changed) == std::optional<bool>{false});
      changed         = f;
      changed.fact_id = 99;  // a fact the directory does not hold
      CHECK(source.matches(changed) == std::optional<bool>{false});
    }
    // facts 2 and 3 swapped: each the other's bytes under its id
    fetched_fact swapped = got.facts[0];
    swapped.pages        = got.facts[1].pages;
    CHECK(source.matches(swapped) == std::optional<bool>{false});
  }

  SECTION("admit pulls the missing facts through the host tier into the device tier")
  {
    tiered_store tiers{tiers_config(16, 16)};
    add(tiers, 50, 7, 2);  // inserted here: never asked of the source
    tier_request r = tiers.admit(keys({2, 50, 4}), source);
    CHECK(r.fetched == std::vector<std::uint64_t>{2, 4});
    CHECK(r.forgotten.empty());
    CHECK(r.staged == std::vector<std::uint64_t>{2, 50, 4});
    CHECK(r.staged_pages == 3 + 1 + 1);
    tiers.stage_host(r);
    for (std::uint64_t id : {2, 4}) {
      CAPTURE(id);
      CHECK(tiers.residency(id) == fact_residency::both);
      CHECK(tiers.is_fetched(id));
      CHECK(tiers.host_tier().at(id).token_ids == reference.at(id).token_ids);
      CHECK(fact_bytes(tiers.host_tier(), id) == fact_bytes(reference, id));
      CHECK(fact_bytes(tiers.device_tier(), id) == fact_bytes(reference, id));
    }
    CHECK_FALSE(tiers.is_fetched(50));
    // Held now: nothing more is read.
    tier_request const again = tiers.admit(keys({4, 2}), source);
    CHECK(again.fetched.empty());
    CHECK(again.staged.empty());
  }

  SECTION("a fact of another namespace, an unknown fact, a repeated id are refused")
  {
    CHECK_THROWS_WITH(source.fetch(8, {1}), Catch::Contains("is in namespace 7"));
    CHECK_THROWS_WITH(source.fetch(7, {99}), Catch::Contains("fact 99 is not in directory"));
    CHECK_THROWS_WITH(source.fetch(7, {1, 1}), Catch::Contains("asked for twice"));
  }
}

TEST_CASE("tier source: a damaged fact is refused by its checksum, the others still served",
          "[tier]")
{
  snap::scratch_dir dir;
  std::string const path          = dir.file("facts.iskv");
  kv_store const reference        = saved_reference(path);
  std::vector<unsigned char> file = snap::read_bytes(path);
  snap::layout const l            = snap::layout_of(file);
  // The fact table as the format defines it, recomputed here: every fact's CRC holds.
  std::vector<std::uint64_t> const table = snap::reference_fact_table(file);
  REQUIRE(table.size() == facts.size());
  // Fact 2's second page: the pool stores used pages ascending; the reference took pages in order.
  std::int64_t const page = reference.at(2).pages.at(1);
  std::size_t const at =
    l.pool_begin() + static_cast<std::size_t>(page) * reference.page_bytes() + 5;
  file[at] ^= 0x10;
  snap::write_bytes(path, file);

  directory_fact_source source{path};  // the catalogue is intact: opening reads no page
  CHECK(source.name() == "snapshot file '" + path + "'");
  CHECK(source.fetch(7, {1, 3, 6}).facts.size() == 3);
  CHECK_THROWS_WITH(source.fetch(7, {2}),
                    Catch::Contains("fact 2: checksum mismatch") && Catch::Contains(path));

  tiered_store tiers{tiers_config(16, 16)};
  add(tiers, 50, 7, 2);
  observed const before = observed::of(tiers);
  CHECK_THROWS_WITH(tiers.admit(keys({1, 2}), source), Catch::Contains("checksum mismatch"));
  CHECK(observed::of(tiers) == before);  // fact 1 was read but not kept
  CHECK(tiers.admit(keys({1, 3}), source).fetched == std::vector<std::uint64_t>{1, 3});

  SECTION("a damaged catalogue or a truncated file is refused when opened")
  {
    std::vector<unsigned char> bad = snap::read_bytes(path);
    bad[l.catalogue_begin + 3] ^= 1;
    snap::write_bytes(dir.file("bad.iskv"), bad);
    CHECK_THROWS_WITH(directory_fact_source{dir.file("bad.iskv")},
                      Catch::Contains("catalogue checksum mismatch"));
    std::vector<unsigned char> cut = snap::read_bytes(path);
    cut.resize(cut.size() - 9);
    snap::write_bytes(dir.file("cut.iskv"), cut);
    CHECK_THROWS_WITH(directory_fact_source{dir.file("cut.iskv")}, Catch::Contains("truncated"));
  }
}

TEST_CASE("tier source: the host tier is an LRU cache of the source", "[tier]")
{
  snap::scratch_dir dir;
  // Facts of one page each (4 tokens), namespace 7.
  kv_store s{store_config(16)};
  for (std::uint64_t id = 11; id <= 16; ++id) {
    add(s, id, 7, 4);
  }
  save_store(s, dir.file("one-page.iskv"));
  directory_fact_source source{dir.path()};
  auto const k = [](std::vector<std::uint64_t> ids) {
    std::vector<fact_key> out;
    for (std::uint64_t id : ids) {
      out.push_back({7, id});
    }
    return out;
  };

  // Device 2 pages, host 3 pages; fact 90 (inserted here) holds one host page for good.
  tiered_store tiers{tiers_config(2, 3)};
  add(tiers, 90, 7, 4);
  tier_request r = tiers.admit(k({11}), source);
  CHECK(r.fetched == std::vector<std::uint64_t>{11});
  r = tiers.admit(k({12}), source);
  CHECK(tiers.fetched_order() == std::vector<std::uint64_t>{12, 11});
  // The host tier is full: 11, least recently used, is dropped from both tiers for 13.
  r = tiers.admit(k({13}), source);
  CHECK(r.fetched == std::vector<std::uint64_t>{13});
  CHECK(r.forgotten == std::vector<std::uint64_t>{11});
  CHECK_FALSE(tiers.contains(11));
  CHECK(tiers.fetched_order() == std::vector<std::uint64_t>{13, 12});
  // 12 held: used again, nothing fetched; 13 becomes the oldest.
  r = tiers.admit(k({12}), source);
  CHECK(r.fetched.empty());
  CHECK(tiers.fetched_order() == std::vector<std::uint64_t>{12, 13});
  r = tiers.admit(k({11}), source);
  CHECK(r.forgotten == std::vector<std::uint64_t>{13});
  tiers.stage_host(r);
  CHECK(fact_bytes(tiers.host_tier(), 11) == fact_bytes(s, 11));
  CHECK(fact_bytes(tiers.device_tier(), 11) == fact_bytes(s, 11));
  // Pinned and requested facts stay: 12 pinned, 11 in the request, so nothing can make room.
  tiers.pin(12);
  observed const before = observed::of(tiers);
  CHECK_THROWS_WITH(tiers.admit(k({11, 14}), source), Catch::Contains("0 host pages are free"));
  CHECK(observed::of(tiers) == before);
  tiers.unpin(12);
  r = tiers.admit(k({14}), source);
  CHECK(r.forgotten == std::vector<std::uint64_t>{12});
  CHECK(tiers.contains(90));
  CHECK_FALSE(tiers.is_fetched(90));
  // A request larger than the host tier's room for fetched facts is refused, nothing changed.
  observed const full = observed::of(tiers);
  CHECK_THROWS_WITH(tiers.admit(k({15, 16, 12}), source), Catch::Contains("host pages"));
  CHECK(observed::of(tiers) == full);
}

TEST_CASE("tier source: generations and an unreachable source", "[tier]")
{
  snap::scratch_dir dir;
  kv_store const reference = saved_reference(dir.file("facts.iskv"));
  scripted_source source{dir.path()};
  tiered_store tiers{tiers_config(32, 32)};
  add(tiers, 60, 7, 3);  // inserted here: never forgotten

  tier_request r = tiers.admit(keys({1, 4, 60}), source);
  CHECK(r.fetched == std::vector<std::uint64_t>{1, 4});
  CHECK(source.asked == std::vector<std::vector<std::uint64_t>>{{1}, {4}});
  source.asked.clear();
  r = tiers.admit(keys({1}), source);  // held: the generation is still asked for
  CHECK(source.asked == std::vector<std::vector<std::uint64_t>>{{}});
  CHECK(r.fetched.empty());

  SECTION("a changed generation drops the namespace's fetched copies and reads them again")
  {
    tiers.admit(keys({2}), source);
    source.generation[7] = 5;
    source.asked.clear();
    r                                    = tiers.admit(keys({1, 60}), source);
    std::vector<std::uint64_t> forgotten = r.forgotten;
    std::sort(forgotten.begin(), forgotten.end());
    CHECK(forgotten == std::vector<std::uint64_t>{1, 2});
    CHECK(r.fetched == std::vector<std::uint64_t>{1});
    CHECK(source.asked == std::vector<std::vector<std::uint64_t>>{{}, {1}});
    CHECK(tiers.contains(60));
    CHECK(tiers.contains(4));  // namespace 8 is untouched
    CHECK_FALSE(tiers.contains(2));
    tiers.stage_host(r);
    CHECK(fact_bytes(tiers.device_tier(), 1) == fact_bytes(reference, 1));
  }

  SECTION("unreachable: refused, or answered without memory, and nothing changes")
  {
    source.unreachable    = true;
    observed const before = observed::of(tiers);
    CHECK_THROWS_AS(tiers.admit(keys({1, 2}), source), source_unavailable);
    CHECK(observed::of(tiers) == before);
    r = tiers.admit(keys({1, 2}), source, source_policy::without_memory);
    CHECK(r.without_memory);
    CHECK(r.staged.empty());
    CHECK(r.fetched.empty());
    CHECK(observed::of(tiers) == before);
  }
}

TEST_CASE("tier source: refusals change nothing", "[tier]")
{
  snap::scratch_dir dir;
  saved_reference(dir.file("facts.iskv"));
  directory_fact_source source{dir.path()};
  tiered_store tiers{tiers_config(4, 32)};
  add(tiers, 70, 8, 2);
  tiers.admit(keys({1}), source);
  observed const before = observed::of(tiers);

  // another page layout
  tiered_store_config other = tiers_config(4, 32);
  other.device.page_size    = 8;
  tiered_store wide{other};
  CHECK_THROWS_WITH(wide.admit(keys({1}), source),
                    Catch::Contains("pages of 4 tokens") && Catch::Contains("pages of 8 tokens"));
  // an unknown fact, a fact asked in the wrong namespace, a held fact in another namespace
  CHECK_THROWS_WITH(tiers.admit(keys({3, 99}), source), Catch::Contains("fact 99 is not in"));
  CHECK_THROWS_WITH(tiers.admit({{8, 3}}, source), Catch::Contains("is in namespace 7"));
  CHECK_THROWS_WITH(tiers.admit({{7, 70}}, source),
                    Catch::Contains("fact 70 is held in namespace 8, requested in namespace 7"));
  CHECK_THROWS_WITH(tiers.admit(keys({3, 3}), source), Catch::Contains("listed twice"));
  // more than the device tier holds: 9 + 4 tokens = 3 + 1 pages beside fact 1's
  CHECK_THROWS_WITH(tiers.admit(keys({1, 2, 3}), source), Catch::Contains("device pages"));
  CHECK(observed::of(tiers) == before);
}

TEST_CASE("tier source: a directory of several snapshot files", "[tier]")
{
  snap::scratch_dir dir;
  kv_store a{store_config(8)}, b{store_config(8)};
  add(a, 1, 7, 3);
  add(a, 2, 7, 5);
  add(b, 4, 8, 2);
  save_store(a, dir.file("a.iskv"));
  save_store(b, dir.file("b.iskv"));
  snap::write_bytes(dir.file("notes.txt"), {1, 2, 3});  // not a snapshot: not read

  SECTION("facts of every file are served")
  {
    directory_fact_source source{dir.path()};
    CHECK(source.files() == std::vector<std::string>{dir.file("a.iskv"), dir.file("b.iskv")});
    CHECK(source.num_facts() == 3);
    CHECK(source.fetch(8, {4}).facts.at(0).pages == fact_bytes(b, 4));
    CHECK(source.fetch(7, {2}).facts.at(0).pages == fact_bytes(a, 2));
  }

  SECTION("the tier files of save_tiers: a fact in both is served once")
  {
    snap::scratch_dir saved;
    tiered_store tiers{tiers_config(8, 8)};
    add(tiers, 1, 7, 3);
    tier_request r = tiers.admit({1});  // both tiers hold fact 1
    tiers.stage_host(r);
    save_tiers(tiers, saved.path());
    directory_fact_source source{saved.path()};
    CHECK(source.files().size() == 2);
    CHECK(source.num_facts() == 1);
    CHECK(source.fetch(7, {1}).facts.at(0).pages == fact_bytes(tiers.host_tier(), 1));
  }

  SECTION("one id with other contents in two files is refused")
  {
    kv_store c{store_config(8)};
    add(c, 4, 8, 3);  // fact 4 again, 3 tokens instead of 2
    save_store(c, dir.file("c.iskv"));
    CHECK_THROWS_WITH(directory_fact_source{dir.path()},
                      Catch::Contains("fact 4 is also in") && Catch::Contains("b.iskv"));
  }

  SECTION("files of other page layouts, or no file at all, are refused")
  {
    kv_store d{store_config(8, 8)};
    add(d, 9, 7, 3);
    save_store(d, dir.file("d.iskv"));
    CHECK_THROWS_WITH(directory_fact_source{dir.path()}, Catch::Contains("page layout"));
    snap::scratch_dir empty;
    CHECK_THROWS_WITH(directory_fact_source{empty.path()},
                      Catch::Contains("holds no store snapshot"));
  }
}

TEST_CASE("tier source: compressed pages (fp8, int4) travel unchanged, other layouts refused",
          "[tier][compression]")
{
  for (kv_compression c : {kv_compression::fp8_e4m3, kv_compression::int4}) {
    CAPTURE(to_string(c));
    snap::scratch_dir dir;
    kv_store_config sc = store_config(32);
    sc.compression     = c;
    kv_store reference{sc};
    for (auto const& [id, f] : facts) {
      add(reference, id, f.first, f.second);
    }
    save_store(reference, dir.file("facts.iskv"));
    directory_fact_source source{dir.path()};
    CHECK(source.layout() == fact_layout::of(reference));
    CHECK(source.layout().compression == c);
    CHECK_THAT(source.layout().describe(), Catch::Contains(to_string(c)));

    tiered_store_config tc = tiers_config(16, 16);
    tc.device.compression  = c;
    tiered_store tiers{tc};
    tier_request r = tiers.admit(keys({2, 5}), source);
    tiers.stage_host(r);
    for (std::uint64_t id : {2, 5}) {
      CAPTURE(id);
      CHECK(fact_bytes(tiers.host_tier(), id) == fact_bytes(reference, id));
      CHECK(fact_bytes(tiers.device_tier(), id) == fact_bytes(reference, id));
    }
    // Tiers of plain bfloat16 pages do not take compressed ones (nor the other way round).
    tiered_store plain{tiers_config(16, 16)};
    auto const before = observed::of(plain);
    CHECK_THROWS_WITH(plain.admit(keys({2}), source), Catch::Contains("the tiers hold pages of"));
    CHECK(observed::of(plain) == before);
  }
}
