// The two tiers (tier.hpp) with both tiers in host memory: the residency catalogue, the LRU policy
// (checked against a small model of the policy written out here), capacity accounting, refusals
// that change nothing, and tiered injection, whose cache bytes must equal the plain host run from
// one store holding every fact.

#include "../snapshot/snapshot_common.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/tier.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

using namespace inferscale;

namespace {

constexpr std::int32_t layers    = 3;
constexpr std::int32_t heads     = 2;
constexpr std::int32_t head_dim  = 8;
constexpr std::int32_t page_size = 4;

tiered_store_config make_config(std::int64_t device_pages,
                                std::int64_t host_pages,
                                std::int64_t quota = 0)
{
  tiered_store_config c;
  c.device.model           = kv_geometry{layers, heads, head_dim};
  c.device.store_dtype     = dtype::bfloat16;
  c.device.page_size       = page_size;
  c.device.num_pages       = device_pages;
  c.device.space           = memory_space::host;
  c.host_pages             = host_pages;
  c.namespace_device_pages = quota;
  return c;
}

/// K and V of fact `id` with `tokens` tokens: distinct bf16-exact values per element.
struct fact_kv {
  std::vector<float> k, v;
  fact_kv(std::uint64_t id, std::int32_t tokens)
  {
    std::size_t const n = static_cast<std::size_t>(layers) * tokens * heads * head_dim;
    k.resize(n);
    v.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      // Multiples of 1/64 below 4: exact in bf16.
      k[i] = static_cast<float>(static_cast<std::int64_t>((id * 131 + i * 7) % 256) - 128) / 64.0f;
      v[i] = static_cast<float>(static_cast<std::int64_t>((id * 17 + i * 13) % 256) - 128) / 64.0f;
    }
  }
  fact_kv_view<float const> keys(std::int32_t tokens) const
  {
    return make_fact_kv_view<float const>(k.data(), layers, tokens, heads, head_dim);
  }
  fact_kv_view<float const> values(std::int32_t tokens) const
  {
    return make_fact_kv_view<float const>(v.data(), layers, tokens, heads, head_dim);
  }
};

std::vector<std::int32_t> tokens_of(std::uint64_t id, std::int32_t n)
{
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (std::int32_t j = 0; j < n; ++j) {
    t[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(id * 100 + j);
  }
  return t;
}

void add(tiered_store& s, std::uint64_t id, std::uint64_t ns, std::int32_t n, fact_residency where)
{
  fact_kv const kv{id, n};
  s.insert<float>(id, ns, tokens_of(id, n), kv.keys(n), kv.values(n), where);
}

void add(kv_store& s, std::uint64_t id, std::uint64_t ns, std::int32_t n)
{
  fact_kv const kv{id, n};
  s.insert<float>(id, ns, tokens_of(id, n), kv.keys(n), kv.values(n));
}

/// Everything observable of a tiered store, to compare before and after a refused call.
struct snapshot {
  std::vector<unsigned char> device_pool, host_pool;
  std::uint64_t device_version{}, host_version{};
  std::int64_t device_free{}, host_free{};
  std::map<std::uint64_t, std::pair<int, bool>> residency;
  std::map<std::uint64_t, std::vector<std::uint64_t>> lru;

  static snapshot of(tiered_store const& s,
                     std::vector<std::uint64_t> const& ids,
                     std::vector<std::uint64_t> const& namespaces)
  {
    snapshot o;
    o.device_pool    = s.device_tier().pool_to_host();
    o.host_pool      = s.host_tier().pool_to_host();
    o.device_version = s.device_tier().version();
    o.host_version   = s.host_tier().version();
    o.device_free    = s.device_tier().free_pages();
    o.host_free      = s.host_tier().free_pages();
    for (std::uint64_t id : ids) {
      if (s.contains(id)) {
        o.residency[id] = {static_cast<int>(s.residency(id)), s.is_pinned(id)};
      }
    }
    for (std::uint64_t ns : namespaces) {
      o.lru[ns] = s.lru_order(ns);
    }
    return o;
  }
  bool operator==(snapshot const& o) const
  {
    return device_pool == o.device_pool && host_pool == o.host_pool &&
           device_version == o.device_version && host_version == o.host_version &&
           device_free == o.device_free && host_free == o.host_free && residency == o.residency &&
           lru == o.lru;
  }
};

/// A contiguous bf16 host cache `(layers, 2, slots, heads, head_dim)`.
struct host_cache {
  static constexpr std::int64_t slots = 256;
  std::vector<bfloat16_t> data;
  paged_kv_cache desc;
  host_cache() : data(static_cast<std::size_t>(layers) * 2 * slots * heads * head_dim)
  {
    std::fill(data.begin(), data.end(), from_float<bfloat16_t>(-7.0f));
    desc = make_contiguous_cache(
      dtype::bfloat16,
      data.data(),
      {layers, 2, slots, heads, head_dim},
      {2 * slots * heads * head_dim, slots * heads * head_dim, heads * head_dim, head_dim, 1});
  }
  std::vector<unsigned char> bytes() const
  {
    std::vector<unsigned char> b(data.size() * sizeof(bfloat16_t));
    std::memcpy(b.data(), data.data(), b.size());
    return b;
  }
};

rope_params rotation()
{
  rope_spec spec;
  spec.head_dim = head_dim;
  spec.theta    = 10000.0;
  return make_rope_params(spec);
}

std::vector<std::int64_t> slots_for(std::int64_t first, std::int64_t n)
{
  std::vector<std::int64_t> s(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    s[static_cast<std::size_t>(j)] = first + j;
  }
  return s;
}

}  // namespace

TEST_CASE("tier: the one-layer views address exactly the layer's rows", "[tier]")
{
  kv_store_ref ref{};
  ref.pool               = reinterpret_cast<void*>(std::uintptr_t{1} << 20);
  ref.store_dtype        = dtype::bfloat16;
  ref.num_layers         = 5;
  ref.num_heads          = 3;
  ref.head_dim           = 16;
  ref.page_size          = 8;
  ref.num_pages          = 11;
  std::int64_t const row = 3 * 16;
  for (std::int32_t l = 0; l < ref.num_layers; ++l) {
    kv_store_ref const v = tier_layer_view(ref, l);
    CHECK(v.num_layers == 1);
    CHECK(v.num_pages == 55);
    for (std::int64_t t = 0; t < ref.num_pages * ref.page_size; t += 3) {
      for (std::int32_t kv = 0; kv < 2; ++kv) {
        std::int64_t const vt = tier_layer_token(ref, t);
        REQUIRE(vt < v.num_pages * v.page_size);
        // Written out: element offset of (page, layer, kv, slot) in [page][layer][2][ps][row].
        std::int64_t const page = t / 8, slot = t % 8;
        std::int64_t const want = (((page * 5 + l) * 2 + kv) * 8 + slot) * row;
        std::int64_t const got =
          (static_cast<unsigned char*>(v.pool) - static_cast<unsigned char*>(ref.pool)) / 2 +
          v.row_offset(vt, 0, kv);
        CHECK(got == want);
      }
    }
  }
}

TEST_CASE("tier: placement, accounting and erasure", "[tier]")
{
  tiered_store s{make_config(8, 20)};
  add(s, 1, 10, 5, fact_residency::host);    // 2 pages
  add(s, 2, 10, 4, fact_residency::device);  // 1 page
  add(s, 3, 20, 9, fact_residency::both);    // 3 pages
  CHECK(s.residency(1) == fact_residency::host);
  CHECK(s.residency(2) == fact_residency::device);
  CHECK(s.residency(3) == fact_residency::both);
  // 2·L·c·h·d·b bytes per fact, b = 2 (bf16).
  auto const bytes   = [](std::int64_t c) { return 2 * layers * c * heads * head_dim * 2; };
  tier_usage const u = s.usage();
  CHECK(u.device_pages == 1 + 3);
  CHECK(u.device_free == 8 - 4);
  CHECK(u.host_pages == 2 + 3);
  CHECK(u.host_free == 20 - 5);
  CHECK(u.evictable_pages == 3);  // only fact 3 is in both tiers
  CHECK(u.device_bytes == bytes(4) + bytes(9));
  CHECK(u.host_bytes == bytes(5) + bytes(9));
  CHECK(s.namespace_device_pages(10) == 1);
  CHECK(s.namespace_host_pages(10) == 2);

  // Both tiers hold identical rows for fact 3.
  auto const& d                = s.device_tier().at(3);
  auto const& h                = s.host_tier().at(3);
  auto const dp                = s.device_tier().pool_to_host();
  auto const hp                = s.host_tier().pool_to_host();
  std::size_t const page_bytes = s.device_tier().pool_bytes() / 8;
  for (std::size_t i = 0; i < d.pages.size(); ++i) {
    CHECK(std::memcmp(dp.data() + d.pages[i] * page_bytes,
                      hp.data() + h.pages[i] * page_bytes,
                      page_bytes) == 0);
  }

  CHECK(s.erase_namespace(10) == 2);
  CHECK_FALSE(s.contains(1));
  CHECK_FALSE(s.contains(2));
  s.erase(3);
  tier_usage const e = s.usage();
  CHECK(e.device_pages == 0);
  CHECK(e.host_pages == 0);
  CHECK(e.device_free == 8);
  CHECK(e.host_free == 20);
  CHECK(e.device_bytes == 0);
  CHECK(e.host_bytes == 0);
  CHECK(s.device_tier().num_facts() == 0);
  CHECK(s.host_tier().num_facts() == 0);
  // Nothing of the erased facts is left in either pool.
  auto const zero = [](std::vector<unsigned char> const& b) {
    return std::all_of(b.begin(), b.end(), [](unsigned char x) { return x == 0; });
  };
  CHECK(zero(s.device_tier().pool_to_host()));
  CHECK(zero(s.host_tier().pool_to_host()));
}

TEST_CASE("tier: admission evicts by namespace recency, then LRU order, never what must stay",
          "[tier]")
{
  // 6 device pages; every fact 4 tokens = 1 page.
  tiered_store s{make_config(6, 64)};
  // Namespace 1: facts 11, 12, 13 in both tiers; namespace 2: 21, 22 in both, 23 device only.
  for (std::uint64_t id : {11, 12, 13}) {
    add(s, id, 1, 4, fact_residency::both);
  }
  for (std::uint64_t id : {21, 22}) {
    add(s, id, 2, 4, fact_residency::both);
  }
  add(s, 23, 2, 4, fact_residency::device);
  // Host-only facts to admit later.
  for (std::uint64_t id : {14, 15, 16}) {
    add(s, id, 1, 4, fact_residency::host);
  }
  add(s, 24, 2, 4, fact_residency::host);
  CHECK(s.usage().device_free == 0);
  CHECK(s.lru_order(1) == std::vector<std::uint64_t>{13, 12, 11});
  CHECK(s.lru_order(2) == std::vector<std::uint64_t>{22, 21});

  // Touch 11 (namespace 1 becomes the most recent, 11 its most recent fact).
  tier_request r0 = s.admit({11});
  CHECK(r0.staged.empty());
  CHECK(r0.evicted.empty());
  CHECK(s.lru_order(1) == std::vector<std::uint64_t>{11, 13, 12});

  s.pin(12);  // pinned: leaves the LRU
  CHECK(s.is_pinned(12));
  CHECK(s.lru_order(1) == std::vector<std::uint64_t>{11, 13});

  // Namespace 1 asks for 14 and 15 (2 pages). Namespace 2 was used least recently: its LRU tail
  // 21, then 22, go; 23 (device only) stays.
  tier_request r1 = s.admit({14, 15});
  CHECK(r1.evicted == std::vector<std::uint64_t>{21, 22});
  CHECK(r1.staged == std::vector<std::uint64_t>{14, 15});
  CHECK(r1.staged_pages == 2);
  CHECK(s.residency(21) == fact_residency::host);
  CHECK(s.residency(22) == fact_residency::host);
  CHECK(s.residency(23) == fact_residency::device);
  CHECK(s.residency(14) == fact_residency::both);
  CHECK(s.lru_order(1) == std::vector<std::uint64_t>{15, 14, 11, 13});
  CHECK(s.lru_order(2).empty());

  // Namespace 2 asks for 24 (1 page): namespace 2 is now the least recent but has nothing
  // evictable, so namespace 1's LRU tail (13) goes; 12 is pinned.
  tier_request r2 = s.admit({24});
  CHECK(r2.evicted == std::vector<std::uint64_t>{13});
  CHECK(s.residency(13) == fact_residency::host);
  CHECK(s.residency(12) == fact_residency::both);

  // A request listing 11 and 16: 11 is protected although it is namespace 1's LRU tail now.
  CHECK(s.lru_order(1) == std::vector<std::uint64_t>{15, 14, 11});
  tier_request r3 = s.admit({11, 16});
  // Namespace 1 (last used by r1) is now less recent than namespace 2 (r2): its LRU tail 11 is
  // requested, so 14 goes.
  CHECK(r3.evicted == std::vector<std::uint64_t>{14});
  CHECK(s.residency(11) == fact_residency::both);

  // Unpin 12: it joins as the most recent of its namespace.
  s.unpin(12);
  CHECK(s.lru_order(1).front() == 12);
}

TEST_CASE("tier: the LRU policy matches a brute-force model over random requests", "[tier]")
{
  // Model: per fact {ns, on_device, on_host(always), pinned=false}; namespace last-use clock; per
  // namespace a recency list. Admission evicts from namespaces in increasing last use, each from
  // its least recent fact, skipping requested facts, until the request fits.
  constexpr int facts = 24, namespaces = 4, device_pages = 7;
  tiered_store s{make_config(device_pages, 64)};
  for (int f = 0; f < facts; ++f) {
    add(s, static_cast<std::uint64_t>(f), f % namespaces, 4, fact_residency::host);
  }
  std::vector<bool> on_device(facts, false);
  std::vector<std::uint64_t> ns_use(namespaces, 0);
  std::vector<std::vector<int>> recency(namespaces);  // most recent first
  std::uint64_t clock = 0;
  std::mt19937 rng{1234};
  for (int step = 0; step < 300; ++step) {
    int const n = 1 + static_cast<int>(rng() % 3);
    std::vector<std::uint64_t> ids;
    while (static_cast<int>(ids.size()) < n) {
      std::uint64_t const id = rng() % facts;
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) { ids.push_back(id); }
    }
    // Model's expected victims.
    int need = 0, free_pages = device_pages;
    for (int f = 0; f < facts; ++f) {
      free_pages -= on_device[f] ? 1 : 0;
    }
    for (auto id : ids) {
      need += on_device[id] ? 0 : 1;
    }
    std::vector<std::uint64_t> want_victims;
    std::vector<int> order(namespaces);
    for (int i = 0; i < namespaces; ++i) {
      order[i] = i;
    }
    std::stable_sort(
      order.begin(), order.end(), [&](int a, int b) { return ns_use[a] < ns_use[b]; });
    int freed = 0;
    for (int ns : order) {
      for (auto it = recency[ns].rbegin(); it != recency[ns].rend() && need > free_pages + freed;
           ++it) {
        if (std::find(ids.begin(), ids.end(), static_cast<std::uint64_t>(*it)) != ids.end()) {
          continue;
        }
        want_victims.push_back(static_cast<std::uint64_t>(*it));
        ++freed;
      }
    }
    tier_request const r = s.admit(ids);
    REQUIRE(r.evicted == want_victims);
    // Apply to the model.
    for (auto v : want_victims) {
      on_device[v] = false;
      auto& rec    = recency[v % namespaces];
      rec.erase(std::find(rec.begin(), rec.end(), static_cast<int>(v)));
    }
    for (auto id : ids) {
      int const ns  = static_cast<int>(id % namespaces);
      ns_use[ns]    = ++clock;
      auto& rec     = recency[ns];
      auto const it = std::find(rec.begin(), rec.end(), static_cast<int>(id));
      if (it != rec.end()) { rec.erase(it); }
      rec.insert(rec.begin(), static_cast<int>(id));
      on_device[id] = true;
    }
    for (int ns = 0; ns < namespaces; ++ns) {
      std::vector<std::uint64_t> want(recency[ns].begin(), recency[ns].end());
      REQUIRE(s.lru_order(static_cast<std::uint64_t>(ns)) == want);
    }
  }
}

TEST_CASE("tier: a namespace over its quota evicts its own facts first", "[tier]")
{
  tiered_store s{make_config(10, 64, /*quota=*/3)};
  for (std::uint64_t id : {1, 2, 3}) {
    add(s, id, 1, 4, fact_residency::host);
  }
  for (std::uint64_t id : {4}) {
    add(s, id, 1, 4, fact_residency::host);
  }
  tier_request a = s.admit({1, 2, 3});
  CHECK(a.evicted.empty());
  CHECK(s.namespace_device_pages(1) == 3);
  // The device tier has 7 free pages, but namespace 1 is at its quota: its LRU tail (1) goes.
  tier_request b = s.admit({4});
  CHECK(b.evicted == std::vector<std::uint64_t>{1});
  CHECK(s.namespace_device_pages(1) == 3);
  CHECK(s.usage().device_free == 7);
}

TEST_CASE("tier: refused calls change nothing", "[tier]")
{
  tiered_store s{make_config(3, 6)};
  add(s, 1, 1, 4, fact_residency::both);
  add(s, 2, 1, 4, fact_residency::device);
  add(s, 3, 2, 8, fact_residency::host);  // 2 pages
  add(s, 4, 2, 4, fact_residency::host);
  s.pin(1);
  std::vector<std::uint64_t> const ids{1, 2, 3, 4, 5};
  std::vector<std::uint64_t> const nss{1, 2};
  snapshot const before = snapshot::of(s, ids, nss);

  // Unknown id, repeated id.
  CHECK_THROWS_WITH(s.admit({3, 99}), Catch::Contains("unknown fact id 99"));
  CHECK(snapshot::of(s, ids, nss) == before);
  CHECK_THROWS_WITH(s.admit({4, 4}), Catch::Contains("listed twice"));
  CHECK(snapshot::of(s, ids, nss) == before);
  // 3 + 4 need 3 pages: 1 free, nothing evictable (1 pinned, 2 device-only).
  CHECK_THROWS_WITH(s.admit({3, 4}), Catch::Contains("needs 3 device pages; 1 are free"));
  CHECK(snapshot::of(s, ids, nss) == before);
  // Evicting what must stay.
  CHECK_THROWS_WITH(s.evict(1), Catch::Contains("pinned"));
  CHECK_THROWS_WITH(s.evict(2), Catch::Contains("device only"));
  CHECK_THROWS_WITH(s.evict(3), Catch::Contains("no device copy"));
  CHECK(snapshot::of(s, ids, nss) == before);
  // Duplicate insert; a fact that does not fit the host tier (6 pages, 4 used... needs 3).
  fact_kv const kv{9, 12};
  CHECK_THROWS_WITH(
    s.insert<float>(1, 1, tokens_of(1, 4), fact_kv{1, 4}.keys(4), fact_kv{1, 4}.values(4)),
    Catch::Contains("already stored"));
  CHECK_THROWS_WITH(s.insert<float>(9, 1, tokens_of(9, 12), kv.keys(12), kv.values(12)),
                    Catch::Contains("host pages"));
  CHECK_THROWS_WITH(
    s.insert<float>(9, 1, tokens_of(9, 12), kv.keys(12), kv.values(12), fact_residency::device),
    Catch::Contains("device pages"));
  // Views the store refuses (token count differs): neither tier keeps anything.
  CHECK_THROWS(
    s.insert<float>(9, 1, tokens_of(9, 3), kv.keys(4), kv.values(4), fact_residency::both));
  CHECK(snapshot::of(s, ids, nss) == before);
  CHECK_FALSE(s.contains(9));
  // Demote of a fact already in the host tier.
  CHECK_THROWS_WITH(s.demote(1), Catch::Contains("already in the host tier"));
  CHECK(snapshot::of(s, ids, nss) == before);
  // Bad configurations.
  CHECK_THROWS(tiered_store{make_config(3, -1)});
  auto c          = make_config(3, 6);
  c.device.pinned = true;
  CHECK_THROWS_WITH(tiered_store{c}, Catch::Contains("cannot be pinned"));
}

TEST_CASE("tier: demote makes a device-only fact evictable; evict keeps the host copy", "[tier]")
{
  tiered_store s{make_config(4, 8)};
  add(s, 1, 1, 6, fact_residency::device);
  auto const device_rows = [&] {
    auto const& f        = s.device_tier().at(1);
    auto const pool      = s.device_tier().pool_to_host();
    std::size_t const pb = s.device_tier().pool_bytes() / 4;
    std::vector<unsigned char> out;
    for (auto p : f.pages) {
      out.insert(out.end(), pool.begin() + p * pb, pool.begin() + (p + 1) * pb);
    }
    return out;
  };
  auto const want = device_rows();
  s.demote(1);
  CHECK(s.residency(1) == fact_residency::both);
  CHECK(s.lru_order(1) == std::vector<std::uint64_t>{1});
  s.evict(1);
  CHECK(s.residency(1) == fact_residency::host);
  CHECK(s.usage().device_free == 4);
  s.pin(1);  // copied back
  CHECK(s.residency(1) == fact_residency::both);
  CHECK(device_rows() == want);
}

TEST_CASE("tier: tiered host injection equals injection from one store holding every fact",
          "[tier]")
{
  // Device tier: 9 pages; host tier: 64. 12 facts of 3..9 tokens in 3 namespaces, a third in
  // both tiers, one device-only, the rest host-only; requests of 4 facts, random, with evictions.
  tiered_store s{make_config(9, 64)};
  kv_store_config rc = make_config(64, 0).device;
  kv_store reference{rc};
  std::vector<std::int32_t> lengths;
  for (std::uint64_t id = 0; id < 12; ++id) {
    std::int32_t const n = 3 + static_cast<std::int32_t>(id % 7);
    lengths.push_back(n);
    fact_residency const where = id == 5       ? fact_residency::device
                                 : id % 3 == 0 ? fact_residency::both
                                               : fact_residency::host;
    if (where != fact_residency::host && s.device_tier().pages_for(n) > s.usage().device_free) {
      add(s, id, id % 3, n, fact_residency::host);
    } else {
      add(s, id, id % 3, n, where);
    }
    add(reference, id, id % 3, n);
  }
  rope_params const rot = rotation();
  std::mt19937 rng{7};
  int staged_requests = 0, evictions = 0;
  for (int step = 0; step < 40; ++step) {
    std::vector<std::uint64_t> ids;
    while (ids.size() < 3) {
      std::uint64_t const id = rng() % 12;
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) { ids.push_back(id); }
    }
    tier_request r;
    try {
      r = s.admit(ids);
    } catch (logic_error const&) {
      continue;  // too big for the 9 device pages with what must stay: refused, state unchanged
    }
    staged_requests += r.staged.empty() ? 0 : 1;
    evictions += static_cast<int>(r.evicted.size());
    compose_options o;
    o.first_position            = 11 + step;
    composition const plan      = compose(s.device_tier(), ids, o);
    composition const want_plan = compose(reference, ids, o);
    REQUIRE(plan.token_ids == want_plan.token_ids);
    std::int64_t const first_slot = static_cast<std::int64_t>(rng() % 100);
    auto const slots              = slots_for(first_slot, plan.length());
    injection_batch batch{s.device_tier()};
    batch.add(plan, slots);
    injection_batch want_batch{reference};
    want_batch.add(want_plan, slots);
    host_cache got, want;
    tier_host_order const order =
      step % 2 == 0 ? tier_host_order::per_layer : tier_host_order::whole;
    s.run(r, batch, got.desc, rot, order);
    want_batch.run(want.desc, rot);
    REQUIRE(got.bytes() == want.bytes());
    // Something was written (the cache started at -7 everywhere).
    REQUIRE(got.bytes() != host_cache{}.bytes());
  }
  CHECK(staged_requests > 5);
  CHECK(evictions > 5);
}

TEST_CASE("tier: a request admitted before another is stale", "[tier]")
{
  tiered_store s{make_config(4, 8)};
  add(s, 1, 1, 4, fact_residency::host);
  add(s, 2, 1, 4, fact_residency::host);
  tier_request r1        = s.admit({1});
  composition const plan = compose(s.device_tier(), {1});
  injection_batch batch{s.device_tier()};
  batch.add(plan, slots_for(0, plan.length()));
  tier_request r2 = s.admit({2});
  host_cache c;
  auto const before = c.bytes();
  CHECK_THROWS_WITH(s.run(r1, batch, c.desc, rotation()), Catch::Contains("changed since"));
  CHECK(c.bytes() == before);
  (void)r2;
}

TEST_CASE("tier: a snapshot restores both tiers, residency, pins and the LRU state", "[tier]")
{
  using inferscale_test::snapshot::read_bytes;
  using inferscale_test::snapshot::scratch_dir;
  using inferscale_test::snapshot::write_bytes;
  tiered_store_config const config = make_config(6, 32);
  tiered_store s{config};
  for (std::uint64_t id : {11, 12, 13}) {
    add(s, id, 1, 4, fact_residency::both);
  }
  add(s, 21, 2, 7, fact_residency::device);
  for (std::uint64_t id : {14, 15, 22, 23}) {
    add(s, id, id / 10, 5, fact_residency::host);
  }
  s.pin(12);
  (void)s.admit({13, 11});
  s.erase(15);
  std::vector<std::uint64_t> const ids{11, 12, 13, 14, 15, 21, 22, 23};
  std::vector<std::uint64_t> const nss{1, 2};
  scratch_dir dir;
  save_tiers(s, dir.path());
  tiered_store r = load_tiers(dir.path(), config);
  CHECK(snapshot::of(r, ids, nss).residency == snapshot::of(s, ids, nss).residency);
  CHECK(r.device_tier().pool_to_host() == s.device_tier().pool_to_host());
  CHECK(r.host_tier().pool_to_host() == s.host_tier().pool_to_host());
  for (std::uint64_t ns : nss) {
    CHECK(r.lru_order(ns) == s.lru_order(ns));
  }
  tier_usage const a = s.usage(), b = r.usage();
  CHECK(a.device_pages == b.device_pages);
  CHECK(a.host_pages == b.host_pages);
  CHECK(a.evictable_pages == b.evictable_pages);
  CHECK(a.device_bytes == b.device_bytes);
  // The policy continues identically: the same requests evict the same facts.
  for (auto const& request : std::vector<std::vector<std::uint64_t>>{{14}, {22}, {23}, {11, 13}}) {
    CAPTURE(request);
    tier_request const x = s.admit(request);
    tier_request const y = r.admit(request);
    CHECK(x.evicted == y.evicted);
    CHECK(x.staged == y.staged);
    CHECK_FALSE(x.evicted.empty());
  }
  // Saving again over it keeps exactly one snapshot's files (the member wraps save_tiers).
  r.save(dir.path());
  std::size_t files = 0;
  for (auto const& f : std::filesystem::directory_iterator(dir.path())) {
    (void)f;
    ++files;
  }
  CHECK(files == 3);

  // every single-byte corruption and every truncation of the manifest is refused
  std::string const manifest             = dir.file("tiers.istr");
  std::vector<unsigned char> const bytes = read_bytes(manifest);
  for (std::size_t at = 0; at < bytes.size(); ++at) {
    std::vector<unsigned char> bad = bytes;
    bad[at] ^= 0x10;
    write_bytes(manifest, bad);
    CAPTURE(at);
    CHECK_THROWS_AS(load_tiers(dir.path(), config), logic_error);
  }
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    write_bytes(manifest, {bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n)});
    CAPTURE(n);
    CHECK_THROWS_AS(load_tiers(dir.path(), config), logic_error);
  }
  write_bytes(manifest, bytes);
  CHECK_NOTHROW(tiered_store::load(dir.path(), config));
  // another capacity is refused by the tier file
  CHECK_THROWS_WITH(load_tiers(dir.path(), make_config(7, 32)), Catch::Contains("capacity"));

  // an interrupted save (the host tier cannot be written): the previous snapshot's files stay as
  // they were, no file of the failed save is left, and the previous state loads
  auto const listing = [&] {
    std::map<std::string, std::vector<unsigned char>> files;
    for (auto const& f : std::filesystem::directory_iterator(dir.path())) {
      files[f.path().filename().string()] = read_bytes(f.path().string());
    }
    return files;
  };
  auto const before = listing();
  REQUIRE(before.size() == 3);
  add(r, 31, 3, 4, fact_residency::host);  // a changed state: new tier files
  std::filesystem::create_directory(dir.file("host.pending.iskv.tmp"));
  CHECK_THROWS_WITH(save_tiers(r, dir.path()),
                    Catch::Contains("cannot create") && Catch::Contains("host.pending.iskv.tmp"));
  std::filesystem::remove(dir.file("host.pending.iskv.tmp"));
  CHECK(listing() == before);
  tiered_store const back = load_tiers(dir.path(), config);
  CHECK_FALSE(back.host_tier().contains(31));
  CHECK(back.host_tier().contains(14));
}
