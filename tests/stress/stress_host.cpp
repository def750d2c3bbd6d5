// The memory facade's concurrency contract (memory.hpp, "Concurrency") under load: 8 serving
// threads (serve, serve_step and the catalogue's reads) and 2 mutating threads (add_facts,
// update_fact in place and superseding, erase_fact, compact_index, save_memory) run together for a
// bounded time. Built twice, under ThreadSanitizer and under AddressSanitizer (CMakeLists.txt):
// the sanitizers report any race or memory error; the test checks every served composition:
//  - no half-written fact: the V rows injected for a fact are the fake model's V for the tokens
//    the plan carries for it (recomputed here from the formula; V is not rotated), and those
//    tokens are one whole version of that fact;
//  - no fact returned after its erase (or its superseding update) returned, none from another
//    namespace, and no version older than one whose update had returned;
//  - no lost add: in a namespace searched exactly, every fact whose add returned before the
//    request began (and whose erase had not begun) is served.
// At the end the memory holds exactly what the mutators' own records say, and the last save
// loads to the same state.

#include "fake_model.hpp"
#include "memory_fixtures.hpp"

#include <inferscale/memory.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>  // getpid

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::fake;
using namespace inferscale_test::memory_fixtures;

namespace {

constexpr std::uint64_t small_namespaces = 6;    // namespaces 1..6, searched exactly
constexpr std::uint64_t big_namespace    = 100;  // searched by the graph
constexpr std::uint32_t small_capacity   = 24;   // live facts at most in a small namespace
constexpr std::uint32_t k_all            = 32;   // >= small_capacity: a request gets them all
constexpr std::int64_t big_facts         = 300;
constexpr std::uint64_t max_ids          = 1 << 15;
std::vector<std::int32_t> const context  = {1, 2};  // every fact's context, at positions 0, 1

// Fact `id` version `v`: tokens {100 + id % 97, 300 + v, 800 + id % 89}; the first and last name
// the fact, the middle one its version.
std::vector<std::int32_t> tokens_of(std::uint64_t id, std::int32_t version)
{
  return {static_cast<std::int32_t>(100 + id % 97),
          300 + version,
          static_cast<std::int32_t>(800 + id % 89)};
}
std::string text_of(std::uint64_t id, std::uint64_t ns, std::int32_t version)
{
  return "ns" + std::to_string(ns) + " w" + std::to_string(id % 40) + " v" +
         std::to_string(version % 5) + " f" + std::to_string(id);
}

/// What the readers may know of a fact, written by its one mutator after each call returns.
struct fact_record {
  std::atomic<std::uint64_t> ns{0};
  std::atomic<std::uint64_t> added{0};           ///< global sequence when its add returned
  std::atomic<bool> retiring{false};             ///< an erase or superseding update has begun
  std::atomic<std::uint64_t> retired{0};         ///< sequence when that call returned
  std::atomic<std::int32_t> version_started{0};  ///< the newest version an update has begun
  std::atomic<std::int32_t> version_done{0};     ///< the newest version whose update returned
};

struct shared_state {
  memory* mem{};
  std::array<fact_record, max_ids> facts{};
  std::atomic<std::uint64_t> sequence{1};
  /// Ids are handed out from two ranges, one per mutator: [1, high[0]) and [max_ids/2, high[1]).
  std::array<std::atomic<std::uint64_t>, 2> high{};
  std::atomic<bool> stop{false};
  /// The kinds of mutation that have run (the `ran_*` bits): the load lasts until each has.
  std::atomic<unsigned> ran{0};
  std::mutex failures_guard;
  std::vector<std::string> failures;
  void fail(std::string const& what)
  {
    std::lock_guard<std::mutex> g{failures_guard};
    if (failures.size() < 20) { failures.push_back(what); }
  }
};

memory_config make_config()
{
  memory_config c;
  c.store.model                  = tiny;
  c.store.store_dtype            = dtype::float32;
  c.store.page_size              = 4;
  c.store.num_pages              = 8192;
  c.store.space                  = memory_space::host;
  c.index.dim                    = 32;
  c.index.metric                 = distance_metric::cosine;
  c.index.exact_search_threshold = small_capacity;
  return c;
}

// ---- the readers' checks -------------------------------------------------------------------

/// What a reader knew before its call: the sequence, and every fact's finished version.
struct before_call {
  std::uint64_t start{};
  std::map<std::uint64_t, std::int32_t> done;
};

/// One request's share of a step's cache: slots `offset ..` of a shared host_cache.
struct cache_slice {
  host_cache* shared{};
  std::int64_t offset{0};
  std::vector<std::int64_t> allocate(std::int64_t, std::int64_t n)
  {
    std::vector<std::int64_t> slots;
    for (std::int64_t j = 0; j < n; ++j) {
      slots.push_back(offset + j);
    }
    return slots;
  }
  paged_kv_cache const& cache() const { return shared->cache(); }
  // Its slots are a fixed slice of the shared cache: nothing to adopt or give back.
  void commit(std::int64_t) {}
  void release(std::int64_t) noexcept {}
};

/// Checks one served request, injected at slots `offset ..` of `cache` (`before`: what held
/// before the call; null for a memory nobody mutates).
void check_request(shared_state& s,
                   memory_request const& r,
                   host_cache const& cache,
                   std::int64_t offset,
                   std::uint64_t ns,
                   before_call const* before)
{
  std::string const where = "namespace " + std::to_string(ns) + ": ";
  if (r.plan.segments.size() != r.fact_ids.size()) {
    s.fail(where + "the plan has " + std::to_string(r.plan.segments.size()) + " segments for " +
           std::to_string(r.fact_ids.size()) + " facts");
    return;
  }
  for (composed_segment const& seg : r.plan.segments) {
    std::uint64_t const id = seg.fact_id;
    std::string const fact = where + "fact " + std::to_string(id) + ": ";
    if (id >= max_ids || s.facts[id].ns.load() != ns) {
      s.fail(fact + "not a fact of this namespace");
      continue;
    }
    fact_record const& rec      = s.facts[id];
    std::uint64_t const retired = rec.retired.load();
    if (before != nullptr && retired != 0 && retired <= before->start) {
      s.fail(fact + "served after its erase (or superseding update) returned");
    }
    if (seg.length != 3) {
      s.fail(fact + "segment of " + std::to_string(seg.length) + " tokens");
      continue;
    }
    std::vector<std::int32_t> const got(r.plan.token_ids.begin() + seg.begin,
                                        r.plan.token_ids.begin() + seg.begin + 3);
    std::int32_t const version = got[1] - 300;
    if (got != tokens_of(id, version)) {
      s.fail(fact + "tokens are not one version of this fact");
      continue;
    }
    if (before != nullptr) {
      auto const it          = before->done.find(id);
      std::int32_t const low = it == before->done.end() ? 0 : it->second;
      if (version < low || version > rec.version_started.load()) {
        s.fail(fact + "version " + std::to_string(version) + " outside [" + std::to_string(low) +
               ", " + std::to_string(rec.version_started.load()) + "]");
      }
    }
    // The V rows: the fake model's formula over the context and the version's tokens.
    std::vector<std::int32_t> seen = context;
    for (std::int64_t j = 0; j < 3; ++j) {
      seen.push_back(got[static_cast<std::size_t>(j)]);
      for (std::int32_t l = 0; l < 2; ++l) {
        float k[4], v[4];
        fake_row(seen, 2 + j, l, k, v);
        for (int d = 0; d < 4; ++d) {
          if (cache.value(l, offset + seg.begin + j, d) != v[d]) {
            s.fail(fact + "V of token " + std::to_string(j) + " is not its version's");
            return;
          }
        }
      }
    }
  }
}

struct reader_counts {
  std::int64_t requests{0};
  std::int64_t facts_checked{0};
  std::int64_t presence_checked{0};
  std::int64_t reads{0};
};

/// Serves requests until told to stop: thread `t` of 8; threads 6 and 7 serve steps of two.
reader_counts serve_loop(shared_state& s, int t)
{
  reader_counts n;
  word_embedder embedder;
  plain_model const model;
  rope_params const rotation = model.rotation();
  std::mt19937_64 rng{1000u + static_cast<unsigned>(t)};
  bool const steps = t >= 6;
  while (!s.stop.load()) {
    std::size_t const batch = steps ? 2 : 1;
    host_cache cache;  // a step's requests share it: slots 0.. and 128..
    std::vector<std::uint64_t> spaces(batch);
    std::vector<std::string> queries(batch);
    std::vector<std::uint32_t> ks(batch);
    for (std::size_t b = 0; b < batch; ++b) {
      bool const big = rng() % 4 == 0;
      spaces[b]      = big ? big_namespace : 1 + rng() % small_namespaces;
      queries[b]     = "ns" + std::to_string(spaces[b]) + " w" + std::to_string(rng() % 40);
    }
    std::uint32_t const k = spaces[0] == big_namespace && !steps ? 4 : k_all;
    // What must hold before the call: the sequence, each fact's finished version, and the facts
    // of the small namespaces that must be served (added, no erase begun).
    before_call before;
    before.start = s.sequence.load();
    std::vector<std::vector<std::uint64_t>> must(batch);
    std::array<std::uint64_t, 2> const first{1, max_ids / 2};
    for (std::size_t range = 0; range < 2; ++range) {
      std::uint64_t const end = s.high[range].load();
      for (std::uint64_t id = first[range]; id < end; ++id) {
        fact_record const& rec = s.facts[id];
        std::uint64_t const ns = rec.ns.load();
        if (std::find(spaces.begin(), spaces.end(), ns) == spaces.end()) { continue; }
        before.done[id] = rec.version_done.load();
        if (ns == big_namespace) { continue; }
        std::uint64_t const added = rec.added.load();
        if (added == 0 || added > before.start || rec.retiring.load()) { continue; }
        for (std::size_t b = 0; b < batch; ++b) {
          if (spaces[b] == ns) { must[b].push_back(id); }
        }
      }
    }
    std::vector<memory_request> served;
    try {
      if (steps) {
        std::vector<cache_slice> slices(batch);
        std::vector<memory_step_request<cache_slice>> requests;
        for (std::size_t b = 0; b < batch; ++b) {
          slices[b] = {&cache, 128 * static_cast<std::int64_t>(b)};
          requests.push_back({spaces[b], queries[b], 0, &slices[b]});
        }
        served = s.mem->serve_step(embedder, requests, k, rotation);
      } else {
        served.push_back(s.mem->serve(embedder, spaces[0], queries[0], k, 0, cache, rotation));
      }
    } catch (std::exception const& e) {
      s.fail(std::string{"serve threw: "} + e.what());
      continue;
    }
    for (std::size_t b = 0; b < batch; ++b) {
      check_request(s, served[b], cache, 128 * static_cast<std::int64_t>(b), spaces[b], &before);
      n.facts_checked += static_cast<std::int64_t>(served[b].fact_ids.size());
      for (std::uint64_t id : must[b]) {
        bool const found = std::find(served[b].fact_ids.begin(), served[b].fact_ids.end(), id) !=
                           served[b].fact_ids.end();
        if (!found && !s.facts[id].retiring.load()) {
          s.fail("namespace " + std::to_string(spaces[b]) + ": fact " + std::to_string(id) +
                 " was added before the request began and is not served (a lost add)");
        }
        ++n.presence_checked;
      }
      ++n.requests;
    }
    // The catalogue's reads, between requests.
    std::uint64_t const id = 1 + rng() % (s.high[0].load() - 1);
    if (s.mem->tracks(id)) {
      try {
        fact_state const f = s.mem->fact(id);
        if (f.namespace_id != s.facts[id].ns.load()) { s.fail("fact(): wrong namespace"); }
      } catch (logic_error const&) {
        // erased between tracks() and fact(): two calls, two states
      }
    }
    (void)s.mem->instruction_prefix();
    (void)s.mem->direct_facts_seeing_turn(1 + rng() % small_namespaces, 0);
    n.reads += 3;
  }
  return n;
}

// ---- the mutators ----------------------------------------------------------------------------

constexpr unsigned ran_update = 1u, ran_supersede = 2u, ran_erase = 4u, ran_compaction = 8u,
                   ran_save = 16u, ran_all = 31u;

struct mutator_counts {
  std::int64_t adds{0}, updates{0}, supersedes{0}, erases{0}, compactions{0}, saves{0};
};

/// What one mutator owns: its live facts (id -> version) and their namespaces; superseded
/// facts it keeps for audit until it erases them.
struct owned_facts {
  std::map<std::uint64_t, std::int32_t> live;
  std::set<std::uint64_t> audit;
};

class mutator {
 public:
  mutator(shared_state& s, int which, std::uint64_t first_id, std::uint64_t last_id)
    : s_{s}, which_{which}, next_id_{first_id}, last_id_{last_id}, rng_{77u + unsigned(which)}
  {
    s_.high[static_cast<std::size_t>(which_)].store(first_id);
  }

  void add(std::uint64_t ns, std::int64_t count)
  {
    std::vector<direct_fact> facts;
    std::vector<std::string> texts;
    for (std::int64_t i = 0; i < count && next_id_ < last_id_; ++i) {
      std::uint64_t const id = new_id(ns);
      facts.push_back({id, context, tokens_of(id, 0), 0, {}});
      texts.push_back(text_of(id, ns, 0));
    }
    if (facts.empty()) { return; }
    s_.mem->add_facts(model_, embedder_, ns, facts, texts);
    std::uint64_t const seq = s_.sequence.fetch_add(1) + 1;
    for (direct_fact const& f : facts) {
      s_.facts[f.fact_id].added.store(seq);
      owned_.live[f.fact_id] = 0;
    }
    ++n_.adds;
  }

  /// Runs mutations until told to stop (saving into `save_dir` every 25 of them when given); a
  /// call that throws is a failure (every call is valid: this mutator owns the facts it names).
  mutator_counts run(std::string const& save_dir)
  {
    try {
      loop(save_dir);
    } catch (std::exception const& e) {
      s_.fail("mutator " + std::to_string(which_) + ": " + e.what());
      s_.stop.store(true);
    }
    return n_;
  }

  owned_facts const& owned() const { return owned_; }

 private:
  void loop(std::string const& save_dir)
  {
    std::int64_t ops = 0;
    while (!s_.stop.load()) {
      int const op = static_cast<int>(rng_() % 10);
      if (op < 3) {
        std::uint64_t const ns = 1 + rng_() % small_namespaces;
        if (live_in(ns) + 2 <= small_capacity / 2) {
          add(ns, 1 + static_cast<std::int64_t>(rng_() % 2));
        }
      } else if (op < 6 && !owned_.live.empty()) {
        update(pick(), false);
      } else if (op < 7 && !owned_.live.empty()) {
        std::uint64_t const id = pick();
        if (s_.facts[id].ns.load() != big_namespace && next_id_ < last_id_) { update(id, true); }
      } else if (op < 9 && !owned_.live.empty()) {
        std::uint64_t const id = pick();
        if (s_.facts[id].ns.load() != big_namespace) { erase(id); }
      } else if (!owned_.audit.empty()) {
        erase(*owned_.audit.begin());
      } else {
        s_.mem->compact_index();
        ++n_.compactions;
        s_.ran.fetch_or(ran_compaction);
      }
      if (!save_dir.empty() && ++ops % 25 == 0) {
        save_memory(*s_.mem, save_dir);
        ++n_.saves;
        s_.ran.fetch_or(ran_save);
      }
    }
  }

  std::uint32_t live_in(std::uint64_t ns) const
  {
    // Both mutators add to the small namespaces: half the capacity each.
    std::uint32_t n = 0;
    for (auto const& [id, v] : owned_.live) {
      n += s_.facts[id].ns.load() == ns ? 1u : 0u;
    }
    return n;
  }

  /// The next id of this mutator's range, its namespace recorded before readers can see it.
  std::uint64_t new_id(std::uint64_t ns)
  {
    std::uint64_t const id = next_id_++;
    s_.facts[id].ns.store(ns);
    s_.high[static_cast<std::size_t>(which_)].store(next_id_);
    return id;
  }

  std::uint64_t pick()
  {
    auto it = owned_.live.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng_() % owned_.live.size()));
    return it->first;
  }

  void update(std::uint64_t id, bool supersede)
  {
    fact_record& rec       = s_.facts[id];
    std::uint64_t const ns = rec.ns.load();
    std::int32_t const v   = owned_.live[id] + 1;
    fact_update u;
    u.fact_id   = id;
    u.new_id    = supersede ? new_id(ns) : id;
    u.token_ids = tokens_of(u.new_id, supersede ? 0 : v);
    u.text      = text_of(u.new_id, ns, supersede ? 0 : v);
    if (supersede) {
      rec.retiring.store(true);
    } else {
      rec.version_started.store(v);
    }
    s_.mem->update_fact(model_, embedder_, u);
    std::uint64_t const seq = s_.sequence.fetch_add(1) + 1;
    if (supersede) {
      rec.retired.store(seq);
      s_.facts[u.new_id].added.store(seq);
      owned_.live.erase(id);
      owned_.audit.insert(id);
      owned_.live[u.new_id] = 0;
      ++n_.supersedes;
      s_.ran.fetch_or(ran_supersede);
    } else {
      rec.version_done.store(v);
      owned_.live[id] = v;
      ++n_.updates;
      s_.ran.fetch_or(ran_update);
    }
  }

  void erase(std::uint64_t id)
  {
    fact_record& rec = s_.facts[id];
    rec.retiring.store(true);
    s_.mem->erase_fact(id);
    rec.retired.store(s_.sequence.fetch_add(1) + 1);
    owned_.live.erase(id);
    owned_.audit.erase(id);
    ++n_.erases;
    s_.ran.fetch_or(ran_erase);
  }

  shared_state& s_;
  int which_;
  std::uint64_t next_id_;
  std::uint64_t last_id_;
  std::mt19937_64 rng_;
  plain_model model_;
  word_embedder embedder_;
  owned_facts owned_;
  mutator_counts n_;
};

double stress_seconds()
{
  char const* e = std::getenv("INFERSCALE_STRESS_SECONDS");
  return e != nullptr ? std::atof(e) : 3.0;
}

/// Serves every retrievable fact of `m` (prepare + inject, 32 at a time) and checks each one's
/// tokens and V rows as a request's; returns the facts checked.
std::int64_t check_all_served(shared_state& s, memory const& m)
{
  plain_model const model;
  std::int64_t n = 0;
  for (std::uint64_t ns : m.index().namespaces()) {
    std::vector<std::uint64_t> ids = m.index().ids(ns);
    std::sort(ids.begin(), ids.end());
    for (std::size_t i = 0; i < ids.size(); i += k_all) {
      memory_request r;
      r.fact_ids.assign(ids.begin() + static_cast<std::ptrdiff_t>(i),
                        ids.begin() + static_cast<std::ptrdiff_t>(std::min(ids.size(), i + k_all)));
      r.plan = m.prepare(r.fact_ids, 0);
      host_cache cache;
      m.inject(r.plan, cache, model.rotation());
      check_request(s, r, cache, 0, ns, nullptr);
      n += static_cast<std::int64_t>(r.fact_ids.size());
    }
  }
  return n;
}

}  // namespace

TEST_CASE("memory under load: 8 serving and 2 mutating threads, every served composition whole",
          "[stress]")
{
  memory mem{make_config()};
  shared_state s;
  s.mem                    = &mem;
  std::uint64_t const half = max_ids / 2;
  mutator a{s, 0, 1, half};
  mutator b{s, 1, half, max_ids};
  // The graph-searched namespace, then a few facts in every small one.
  a.add(big_namespace, big_facts);
  for (std::uint64_t ns = 1; ns <= small_namespaces; ++ns) {
    a.add(ns, 4);
    b.add(ns, 4);
  }
  std::string const dir =
    (std::filesystem::temp_directory_path() / ("inferscale-stress-" + std::to_string(::getpid())))
      .string();
  std::filesystem::create_directories(dir);

  double const seconds = stress_seconds();
  std::vector<reader_counts> reads(8);
  mutator_counts ma, mb;
  auto const t0 = std::chrono::steady_clock::now();
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] { reads[static_cast<std::size_t>(t)] = serve_loop(s, t); });
    }
    threads.emplace_back([&] { ma = a.run(""); });
    threads.emplace_back([&] { mb = b.run(dir); });
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    // A slow build (TSan, a loaded machine) may not have run every kind of mutation yet: the
    // load goes on until each has, up to ten times as long (the checks below then fail).
    auto const cap = t0 + std::chrono::duration<double>(10.0 * std::max(seconds, 3.0));
    while (s.ran.load() != ran_all && std::chrono::steady_clock::now() < cap && !s.stop.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    s.stop.store(true);
    for (std::thread& t : threads) {
      t.join();
    }
  }
  double const elapsed =
    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  reader_counts r;
  for (reader_counts const& x : reads) {
    r.requests += x.requests;
    r.facts_checked += x.facts_checked;
    r.presence_checked += x.presence_checked;
    r.reads += x.reads;
  }
  std::printf(
    "stress: %.1f s, 8 serving threads: %lld requests (%lld served facts checked, %lld "
    "presences checked), %lld catalogue reads; 2 mutating threads: %lld adds, %lld in-place "
    "updates, %lld superseding updates, %lld erases, %lld compactions, %lld saves\n",
    elapsed,
    static_cast<long long>(r.requests),
    static_cast<long long>(r.facts_checked),
    static_cast<long long>(r.presence_checked),
    static_cast<long long>(r.reads),
    static_cast<long long>(ma.adds + mb.adds),
    static_cast<long long>(ma.updates + mb.updates),
    static_cast<long long>(ma.supersedes + mb.supersedes),
    static_cast<long long>(ma.erases + mb.erases),
    static_cast<long long>(ma.compactions + mb.compactions),
    static_cast<long long>(mb.saves));
  for (std::string const& f : s.failures) {
    UNSCOPED_INFO(f);
  }
  CHECK(s.failures.empty());
  // The load was real: every kind of call ran while the others did.
  CHECK(r.requests >= 100);
  CHECK(r.presence_checked > 0);
  CHECK(ma.updates + mb.updates > 0);
  CHECK(ma.supersedes + mb.supersedes > 0);
  CHECK(ma.erases + mb.erases > 0);
  CHECK(ma.compactions + mb.compactions > 0);
  CHECK(mb.saves > 0);

  // The last save made under load loads, and serves every fact whole.
  shared_state quiet;
  for (std::uint64_t id = 1; id < max_ids; ++id) {
    quiet.facts[id].ns.store(s.facts[id].ns.load());
  }
  {
    memory const saved = load_memory(dir, make_config());
    CHECK(check_all_served(quiet, saved) > 0);
  }

  // The memory holds exactly what the mutators' records say: their live facts at their versions
  // (indexed), their superseded facts (stored for audit, not indexed), nothing else.
  std::map<std::uint64_t, std::int32_t> live = a.owned().live;
  live.insert(b.owned().live.begin(), b.owned().live.end());
  std::set<std::uint64_t> audit = a.owned().audit;
  audit.insert(b.owned().audit.begin(), b.owned().audit.end());
  CHECK(mem.store().num_facts() == static_cast<std::int64_t>(live.size() + audit.size()));
  CHECK(mem.index().total_size() == live.size());
  for (auto const& [id, version] : live) {
    INFO("fact " << id);
    REQUIRE(mem.tracks(id));
    CHECK(mem.index().contains(id));
    CHECK(mem.store().at(id).token_ids == tokens_of(id, version));
    CHECK(!mem.fact(id).superseded_by);
  }
  for (std::uint64_t id : audit) {
    INFO("superseded fact " << id);
    REQUIRE(mem.tracks(id));
    CHECK(!mem.index().contains(id));
    CHECK(mem.fact(id).superseded_by);
  }
  CHECK(check_all_served(quiet, mem) == static_cast<std::int64_t>(live.size()));

  // A save now (no load) gives exactly this state back.
  save_memory(mem, dir);
  memory const reloaded = load_memory(dir, make_config());
  CHECK(reloaded.store().num_facts() == mem.store().num_facts());
  for (auto const& [id, version] : live) {
    CHECK(reloaded.store().at(id).token_ids == tokens_of(id, version));
    CHECK(reloaded.index().contains(id));
  }
  CHECK(quiet.failures.empty());
  for (std::string const& f : quiet.failures) {
    UNSCOPED_INFO(f);
  }
  std::filesystem::remove_all(dir);
}
