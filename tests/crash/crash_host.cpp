// Crash-safe saves (issue 31, item 3): a save killed with SIGKILL at any moment leaves its file or
// directory loading to exactly the previous state or exactly the new one, for the four snapshot
// kinds (save_store, save_index, save_tiers, save_memory), and the next save cleans up what the
// killed one left; a save that runs out of space (a small tmpfs) fails with the path and the
// system's reason (ENOSPC), leaves the previous snapshot loading as it was and no file of its own.
//
// Expectations are the test's own: a state is a fingerprint read through the public accessors
// (every fact's namespace, id, tokens and page bytes; every namespace's live ids and the answers of
// fixed graph searches; residency, pins and LRU order; the facade's tracked facts), taken from the
// in-memory objects before the save, and what the path loads to after the kill must equal one of
// the two fingerprints byte for byte. A child process saves; it is killed either
//  - at a system call of its save (ptrace): the file system changes only through system calls, so
//    killing on entry to each of them in turn reaches every state the save passes through on disk
//    (200 kills per kind at least, every call of the save used); or
//  - after a delay drawn uniformly from [0, 1.2 x a measured save's duration] from the moment its
//    save started (100 kills per kind): the save as it runs, with no tracer in between.
// The child marks in shared memory when its save starts and returns, so each kill is known to
// have landed before, during or after it.
#include "../snapshot/snapshot_common.hpp"
#include "fake_model.hpp"
#include "index_answers.hpp"
#include "memory_fixtures.hpp"

#include <inferscale/error.hpp>
#include <inferscale/index.hpp>
#include <inferscale/index_snapshot.hpp>
#include <inferscale/memory.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>
#include <inferscale/tier.hpp>

#include <catch2/catch.hpp>

#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::snapshot;

namespace {

// -------------------------------------------------------------------------------------------------
// Fingerprints: a state as bytes, read through the public accessors.

class fingerprint {
 public:
  template <class T>
  fingerprint& operator<<(T const& v)
  {
    static_assert(std::is_trivially_copyable_v<T>);
    bytes_.append(reinterpret_cast<char const*>(&v), sizeof v);
    return *this;
  }
  template <class T>
  fingerprint& operator<<(std::vector<T> const& v)
  {
    *this << static_cast<std::uint64_t>(v.size());
    bytes_.append(reinterpret_cast<char const*>(v.data()), v.size() * sizeof(T));
    return *this;
  }
  void append(unsigned char const* p, std::size_t n)
  {
    bytes_.append(reinterpret_cast<char const*>(p), n);
  }
  std::string const& str() const noexcept { return bytes_; }

 private:
  std::string bytes_;
};

template <class T>
std::vector<T> sorted(std::vector<T> v)
{
  std::sort(v.begin(), v.end());
  return v;
}

/// Every namespace (ascending), its facts (ascending ids) with tokens and the bytes of their pages
/// in page order; the fact and free-page counts.
void add_store(fingerprint& f, kv_store const& s)
{
  std::vector<unsigned char> const pool = s.pool_to_host();
  std::size_t const page                = s.page_bytes();
  std::vector<std::uint64_t> const nss  = sorted(s.namespace_ids());
  f << s.num_facts() << s.free_pages() << nss;
  for (std::uint64_t ns : nss) {
    std::vector<std::uint64_t> const ids = sorted(s.namespace_fact_ids(ns));
    f << ids;
    for (std::uint64_t id : ids) {
      fact_record const& r = s.at(id);
      f << r.namespace_id << r.token_ids << static_cast<std::uint64_t>(r.pages.size());
      for (std::int64_t p : r.pages) {
        f.append(pool.data() + static_cast<std::size_t>(p) * page, page);
      }
    }
  }
}

/// `n` fixed queries of `dim` elements (a seeded normal draw).
std::vector<float> queries_for(std::int64_t dim, int n)
{
  std::mt19937_64 rng(4242);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(dim * n));
  for (float& x : q) {
    x = d(rng);
  }
  return q;
}

/// Every namespace (ascending), its live ids (ascending) and the ids and distances of 6 fixed
/// graph searches in it.
void add_index(fingerprint& f, graph_index const& x)
{
  std::vector<float> const q          = queries_for(x.dim(), 6);
  std::vector<std::uint64_t> const ns = sorted(x.namespaces());
  f << ns;
  for (std::uint64_t n : ns) {
    f << sorted(x.ids(n));
    inferscale::test::answers const a = inferscale::test::run_search(x, q, {n}, 5, search_params{});
    f << a.ids << a.distances;
  }
}

// -------------------------------------------------------------------------------------------------
// The four kinds: an in-memory state that steps (a fact added, the oldest erased: same size) or
// grows (facts added), its save, its fingerprint, and the fingerprint of what a path loads to.

struct crash_kind {
  std::string name;
  std::size_t entries{1};  ///< directory entries of one complete snapshot
  std::function<void()> step;
  std::function<void()> grow;
  std::function<void(std::string const&)> save;
  std::function<std::string()> state;
  std::function<std::string(std::string const&)> load;
};

/// K and V of fact `id`: `n` elements, multiples of 1/64 in [-2, 2) (exact in bf16).
std::vector<float> kv_values(std::uint64_t id, std::size_t n, std::uint64_t salt)
{
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] =
      static_cast<float>(static_cast<std::int64_t>((id * 131 + i * 7 + salt) % 256) - 128) / 64.0f;
  }
  return v;
}

std::vector<std::int32_t> tokens_of(std::uint64_t id, std::int64_t n)
{
  std::vector<std::int32_t> t;
  for (std::int64_t j = 0; j < n; ++j) {
    t.push_back(static_cast<std::int32_t>(100 * id + static_cast<std::uint64_t>(j)));
  }
  return t;
}

struct store_state {
  kv_store store{shard_config(dtype::float32, 96)};
  std::uint64_t next{1};
  std::deque<std::uint64_t> live;
  void add()
  {
    std::uint64_t const id = next++;
    insert_fact(store, id, id % 3, 1 + static_cast<std::int64_t>(id % 7));
    live.push_back(id);
  }
  void step()
  {
    store.erase(live.front());
    live.pop_front();
    add();
  }
};

crash_kind store_kind()
{
  auto s = std::make_shared<store_state>();
  for (int i = 0; i < 6; ++i) {
    s->add();
  }
  crash_kind k;
  k.name = "store";
  k.step = [s] { s->step(); };
  k.grow = [s] {
    for (int i = 0; i < 24; ++i) {
      s->add();
    }
  };
  k.save  = [s](std::string const& dir) { save_store(s->store, dir + "/facts.iskv"); };
  k.state = [s] {
    fingerprint f;
    add_store(f, s->store);
    return f.str();
  };
  k.load = [](std::string const& dir) {
    fingerprint f;
    add_store(f, load_store(dir + "/facts.iskv", shard_config(dtype::float32, 96)));
    return f.str();
  };
  return k;
}

index_config index_settings(std::int64_t dim, distance_metric metric)
{
  index_config c;
  c.dim                    = dim;
  c.metric                 = metric;
  c.build_threads          = 1;
  c.exact_search_threshold = 0;  // every search walks the graph
  return c;
}

struct index_state {
  graph_index index{index_settings(16, distance_metric::squared_l2)};
  std::uint64_t next{1};
  std::deque<std::uint64_t> live;
  void add(std::uint64_t ns)
  {
    std::uint64_t const id = next++;
    std::mt19937_64 rng(id);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> v(16);
    for (float& x : v) {
      x = d(rng);
    }
    index.add(ns,
              make_matrix_view<float const>(v.data(), 1, 16),
              cuda::std::span<std::uint64_t const>{&id, 1});
    live.push_back(id);
  }
  void step()
  {
    std::uint64_t const oldest = live.front();
    index.erase(cuda::std::span<std::uint64_t const>{&oldest, 1});
    live.pop_front();
    add(next % 3);
  }
};

crash_kind index_kind()
{
  auto s = std::make_shared<index_state>();
  for (int i = 0; i < 45; ++i) {
    s->add(static_cast<std::uint64_t>(i % 3));
  }
  crash_kind k;
  k.name = "index";
  k.step = [s] { s->step(); };
  k.grow = [s] {
    for (int i = 0; i < 150; ++i) {
      s->add(static_cast<std::uint64_t>(i % 3));
    }
  };
  k.save  = [s](std::string const& dir) { save_index(s->index, dir + "/facts.isx"); };
  k.state = [s] {
    fingerprint f;
    add_index(f, s->index);
    return f.str();
  };
  k.load = [](std::string const& dir) {
    fingerprint f;
    add_index(f, load_index(dir + "/facts.isx"));
    return f.str();
  };
  return k;
}

tiered_store_config tier_settings()
{
  tiered_store_config c;
  c.device.model       = kv_geometry{3, 2, 8};
  c.device.store_dtype = dtype::bfloat16;
  c.device.page_size   = 4;
  c.device.num_pages   = 64;
  c.device.space       = memory_space::host;
  c.host_pages         = 128;
  return c;
}

struct tier_state {
  tiered_store tiers{tier_settings()};
  std::uint64_t next{1};
  std::deque<std::uint64_t> live;  ///< unpinned facts, oldest first
  void add(fact_residency where)
  {
    std::uint64_t const id     = next++;
    std::int32_t const n       = 1 + static_cast<std::int32_t>(id % 6);
    std::size_t const values   = static_cast<std::size_t>(3 * n * 2 * 8);
    std::vector<float> const k = kv_values(id, values, 0), v = kv_values(id, values, 77);
    tiers.insert<float>(id,
                        id % 2,
                        tokens_of(id, n),
                        make_fact_kv_view<float const>(k.data(), 3, n, 2, 8),
                        make_fact_kv_view<float const>(v.data(), 3, n, 2, 8),
                        where);
    live.push_back(id);
  }
  void step()
  {
    tiers.erase(live.front());
    live.pop_front();
    add(next % 2 == 0 ? fact_residency::host : fact_residency::both);
    if (next % 3 == 0) {  // a host-only fact admitted: a device copy, the LRU order changes
      for (std::uint64_t id : live) {
        if (tiers.residency(id) == fact_residency::host) {
          tier_request r = tiers.admit({id});
          tiers.stage_host(r);
          break;
        }
      }
    }
  }
};

/// Both tiers, every fact's residency and pin, every namespace's LRU order.
std::string tiers_fingerprint(tiered_store const& t)
{
  fingerprint f;
  add_store(f, t.device_tier());
  add_store(f, t.host_tier());
  std::vector<std::uint64_t> ids;
  std::set<std::uint64_t> nss;
  for (kv_store const* tier : {&t.device_tier(), &t.host_tier()}) {
    for (std::uint64_t ns : tier->namespace_ids()) {
      nss.insert(ns);
      for (std::uint64_t id : tier->namespace_fact_ids(ns)) {
        ids.push_back(id);
      }
    }
  }
  ids = sorted(ids);
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  f << t.num_facts() << ids;
  for (std::uint64_t id : ids) {
    f << static_cast<int>(t.residency(id)) << t.is_pinned(id);
  }
  for (std::uint64_t ns : nss) {
    f << ns << t.lru_order(ns);
  }
  return f.str();
}

crash_kind tier_kind()
{
  auto s = std::make_shared<tier_state>();
  s->add(fact_residency::both);
  s->tiers.pin(s->live.front());  // pinned for good: never stepped out
  s->live.pop_front();
  for (int i = 0; i < 6; ++i) {
    s->add(i % 2 == 0 ? fact_residency::host : fact_residency::both);
  }
  crash_kind k;
  k.name    = "tiers";
  k.entries = 3;  // the manifest and two tier files
  k.step    = [s] { s->step(); };
  k.grow    = [s] {
    for (int i = 0; i < 12; ++i) {
      s->add(fact_residency::both);
    }
  };
  k.save  = [s](std::string const& dir) { save_tiers(s->tiers, dir); };
  k.state = [s] { return tiers_fingerprint(s->tiers); };
  k.load  = [](std::string const& dir) {
    return tiers_fingerprint(load_tiers(dir, tier_settings()));
  };
  return k;
}

memory_config memory_settings()
{
  memory_config c;
  c.store.model       = inferscale_test::fake::tiny;
  c.store.store_dtype = dtype::bfloat16;
  c.store.page_size   = 4;
  c.store.num_pages   = 256;
  c.store.space       = memory_space::host;
  c.index             = index_settings(32, distance_metric::cosine);
  return c;
}

struct memory_state {
  memory mem{memory_settings()};
  inferscale_test::fake::branching_model model;
  inferscale_test::memory_fixtures::word_embedder embedder;
  std::uint64_t next{1};
  std::deque<std::uint64_t> live;
  memory_state() { mem.set_instruction_prefix(model, {11, 12, 13}, 999999, 0); }
  void add()
  {
    std::uint64_t const id = next++;
    std::int32_t const t   = static_cast<std::int32_t>(id);
    direct_fact f;
    f.fact_id              = id;
    f.context              = {1, 2, 300 + t % 50};
    f.token_ids            = {5000 + t, 6000 + t, 7000 + t % 11};
    f.first_position       = static_cast<std::int64_t>(id % 5);
    f.turns                = {static_cast<std::int64_t>(id % 4)};
    std::string const text = "topic" + std::to_string(id) + " alpha" + std::to_string(id * 7 % 23) +
                             " beta" + std::to_string(id * 13 % 17);
    (void)mem.add_facts(model, embedder, 5 + id % 2, {f}, {text});
    live.push_back(id);
  }
  void step()
  {
    mem.erase_fact(live.front());
    live.pop_front();
    add();
  }
};

/// The store, the index (ids and graph searches), the prefix, and every stored fact's lifecycle
/// record (namespace, turns, superseded or not).
std::string memory_fingerprint(memory const& m)
{
  fingerprint f;
  add_store(f, m.store());
  add_index(f, m.index());
  f << m.instruction_prefix().has_value() << m.instruction_prefix().value_or(0);
  for (std::uint64_t ns : sorted(m.store().namespace_ids())) {
    for (std::uint64_t id : sorted(m.store().namespace_fact_ids(ns))) {
      f << id << m.tracks(id);
      if (m.tracks(id)) {
        fact_state const s = m.fact(id);
        f << s.namespace_id << s.turns << s.superseded_by.has_value();
      }
    }
  }
  return f.str();
}

crash_kind memory_kind()
{
  auto s = std::make_shared<memory_state>();
  for (int i = 0; i < 12; ++i) {
    s->add();
  }
  crash_kind k;
  k.name    = "memory";
  k.entries = 4;  // the manifest, the store, the index and the lifecycle file
  k.step    = [s] { s->step(); };
  k.grow    = [s] {
    for (int i = 0; i < 40; ++i) {
      s->add();
    }
  };
  k.save  = [s](std::string const& dir) { save_memory(s->mem, dir); };
  k.state = [s] { return memory_fingerprint(s->mem); };
  k.load  = [](std::string const& dir) {
    return memory_fingerprint(load_memory(dir, memory_settings()));
  };
  return k;
}

// -------------------------------------------------------------------------------------------------
// Directory listings.

std::vector<std::string> names_in(std::string const& directory)
{
  std::vector<std::string> names;
  for (auto const& entry : fs::directory_iterator(directory)) {
    names.push_back(entry.path().filename().string());
  }
  return sorted(names);
}

std::string joined(std::vector<std::string> const& names)
{
  std::string out;
  for (std::string const& n : names) {
    out += (out.empty() ? "" : " ") + n;
  }
  return out;
}

/// Every entry's name, size and modification time (nanoseconds).
std::vector<std::string> stamps(std::string const& directory)
{
  std::vector<std::string> out;
  for (std::string const& name : names_in(directory)) {
    struct stat s {};
    if (stat((directory + "/" + name).c_str(), &s) != 0) { continue; }
    out.push_back(name + " " + std::to_string(s.st_size) + " " + std::to_string(s.st_mtim.tv_sec) +
                  "." + std::to_string(s.st_mtim.tv_nsec));
  }
  return out;
}

// -------------------------------------------------------------------------------------------------
// Kill trials.

std::int64_t monotonic_ns()
{
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

/// What the saving child marks, in memory shared with the parent.
struct child_marks {
  std::atomic<int> phase;  ///< 0 forked, 1 in the save, 2 the save returned
  std::atomic<std::int64_t> start_ns;
  std::atomic<std::int64_t> end_ns;
};

class shared_marks {
 public:
  shared_marks()
  {
    void* p =
      mmap(nullptr, sizeof(child_marks), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    marks_ = new (p) child_marks{};
  }
  ~shared_marks() { (void)munmap(marks_, sizeof(child_marks)); }
  shared_marks(shared_marks const&)            = delete;
  shared_marks& operator=(shared_marks const&) = delete;
  child_marks& operator*() const noexcept { return *marks_; }

 private:
  child_marks* marks_{nullptr};
};

struct child_run {
  int phase{0};
  bool killed{false};
  bool failed{false};             ///< the child's save threw or the child died otherwise
  double start_ms{0}, end_ms{0};  ///< the save's start and return, after the fork
  std::int64_t syscalls{0};       ///< traced: the save's system calls that ran
  std::string syscall;            ///< traced: the call the kill landed on
};

/// Forks a child that saves `k`'s state into `dir`; kills it `kill_after_ms` after its save
/// started (never, when negative).
child_run save_in_child(crash_kind const& k,
                        std::string const& dir,
                        double kill_after_ms,
                        child_marks& marks)
{
  marks.phase.store(0);
  marks.start_ns.store(0);
  marks.end_ns.store(0);
  std::int64_t const t0 = monotonic_ns();
  pid_t const pid       = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    marks.start_ns.store(monotonic_ns());
    marks.phase.store(1);
    try {
      k.save(dir);
    } catch (...) {
      _exit(3);
    }
    marks.end_ns.store(monotonic_ns());
    marks.phase.store(2);
    _exit(0);
  }
  child_run r;
  if (kill_after_ms >= 0) {
    while (marks.phase.load() == 0) {  // the child is starting (a fork costs about a millisecond)
    }
    std::int64_t const at = monotonic_ns() + static_cast<std::int64_t>(kill_after_ms * 1e6);
    while (monotonic_ns() < at) {}
    (void)kill(pid, SIGKILL);
  } else {
    while (marks.phase.load() != 2) {  // as in a trial: the parent busy while its child saves
      siginfo_t gone{};
      if (waitid(P_PID, static_cast<id_t>(pid), &gone, WEXITED | WNOHANG | WNOWAIT) != 0 ||
          gone.si_pid != 0) {
        break;
      }
    }
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  r.phase  = marks.phase.load();
  r.killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  r.failed = !r.killed && !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  if (marks.start_ns.load() != 0) { r.start_ms = double(marks.start_ns.load() - t0) / 1e6; }
  if (marks.end_ns.load() != 0) { r.end_ms = double(marks.end_ns.load() - t0) / 1e6; }
  return r;
}

/// The name of a system call a kill landed on (the file system's, by name).
std::string syscall_name(std::uint64_t nr)
{
  switch (static_cast<long>(nr)) {
    case SYS_openat: return "openat";
    case SYS_write: return "write";
    case SYS_read: return "read";
    case SYS_fsync: return "fsync";
    case SYS_close: return "close";
    case SYS_rename: return "rename";
    case SYS_renameat: return "renameat";
    case SYS_renameat2: return "renameat2";
    case SYS_unlink: return "unlink";
    case SYS_unlinkat: return "unlinkat";
    case SYS_fstat: return "fstat";
    case SYS_newfstatat: return "newfstatat";
    case SYS_lseek: return "lseek";
    case SYS_getdents64: return "getdents64";
    case SYS_exit_group: return "exit_group";
    case SYS_mmap: return "mmap";
    case SYS_munmap: return "munmap";
    case SYS_brk: return "brk";
    default: return "other";
  }
}

/**
 * Forks a child that saves `k`'s state into `dir` under ptrace, and kills it as it enters the
 * save's system call number `kill_at` (from 0: that many of the save's calls have run; the call
 * after the save's last one is the child's exit). Never killed when `kill_at` is negative; then
 * `syscalls` is the number of calls the save made. The file system changes only through system
 * calls, so stopping at each one reaches every state a save passes through on disk.
 */
child_run save_traced(crash_kind const& k,
                      std::string const& dir,
                      std::int64_t kill_at,
                      child_marks& marks)
{
  marks.phase.store(0);
  pid_t const pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    if (ptrace(PTRACE_TRACEME, 0, nullptr, nullptr) != 0) { _exit(4); }
    (void)raise(SIGSTOP);
    marks.phase.store(1);
    try {
      k.save(dir);
    } catch (...) {
      _exit(3);
    }
    marks.phase.store(2);
    _exit(0);
  }
  child_run r;
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  if (!WIFSTOPPED(status)) {
    FAIL(
      "the kills at system calls trace the saving child with ptrace, and PTRACE_TRACEME was "
      "refused (a seccomp filter, or Yama's ptrace_scope 3?)");
  }
  REQUIRE(ptrace(PTRACE_SETOPTIONS, pid, nullptr, PTRACE_O_TRACESYSGOOD | PTRACE_O_EXITKILL) == 0);
  int deliver = 0;
  for (;;) {
    REQUIRE(ptrace(PTRACE_SYSCALL, pid, nullptr, deliver) == 0);
    deliver = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    if (WIFEXITED(status) || WIFSIGNALED(status)) { break; }
    if (WSTOPSIG(status) != (SIGTRAP | 0x80)) {  // a signal: passed on
      deliver = WSTOPSIG(status);
      continue;
    }
    __ptrace_syscall_info info{};
    REQUIRE(ptrace(PTRACE_GET_SYSCALL_INFO, pid, sizeof info, &info) > 0);
    int const phase = marks.phase.load();
    if (info.op != PTRACE_SYSCALL_INFO_ENTRY || phase == 0) { continue; }
    if (kill_at >= 0 && r.syscalls == kill_at) {
      r.phase   = phase;
      r.syscall = syscall_name(info.entry.nr);
      REQUIRE(kill(pid, SIGKILL) == 0);
      REQUIRE(waitpid(pid, &status, 0) == pid);
      break;
    }
    if (phase == 1) { ++r.syscalls; }
  }
  if (r.syscall.empty()) { r.phase = marks.phase.load(); }
  r.killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  r.failed = !r.killed && !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return r;
}

/// How a trial picks its kill point.
enum class kill_by {
  delay,    ///< a delay after the save started, uniform in [0, 1.2 x a measured save's duration]
  syscall,  ///< a system call of the save (ptrace), every one of them in turn, shuffled
};

struct kill_tally {
  int trials{0};
  int before{0}, during{0}, after{0};  ///< where the kill landed
  int old_state{0}, new_state{0};      ///< what the path loaded to
  int during_old{0}, during_new{0};
  int wrote{0};       ///< kills after which the directory had changed (files written, renamed)
  int leftovers{0};   ///< kills after which the directory held more than one snapshot's files
  double save_ms{0};  ///< delay: an uninterrupted save's median duration
  std::vector<double> completed_ms;
  std::int64_t syscalls{0};  ///< syscall: the save's system calls (the most of the measured saves)
  std::int64_t points{0};    ///< syscall: distinct kill points used
  std::map<std::string, int> landed;  ///< syscall: the calls the kills landed on
  std::vector<std::string> failures;
};

std::string describe(kill_tally const& t, kill_by how)
{
  std::ostringstream o;
  o << t.trials << " kills ";
  if (how == kill_by::delay) {
    std::vector<double> c = t.completed_ms;
    std::sort(c.begin(), c.end());
    o << "after random delays (medians: an uninterrupted save " << t.save_ms << " ms, the trials' "
      << "saves that completed " << (c.empty() ? 0.0 : c[c.size() / 2]) << " ms)";
  } else {
    o << "at system calls (a save makes " << t.syscalls << "; kills before";
    for (auto const& [name, n] : t.landed) {
      o << " " << name << " " << n;
    }
    o << ")";
  }
  o << ": " << t.before << " before the save, " << t.during << " during it (" << t.during_old
    << " loaded the old state, " << t.during_new << " the new), " << t.after << " after it; "
    << t.old_state << " old, " << t.new_state << " new; the directory had changed after " << t.wrote
    << " kills and held leftovers of killed saves after " << t.leftovers;
  return o.str();
}

/// `trials` saves (more where a save makes more system calls) of a stepped state over the
/// previous one, each killed as `how` says; then a save that completes.
kill_tally kill_trials(crash_kind& k, int trials, kill_by how, std::uint64_t seed)
{
  scratch_dir dir;
  shared_marks marks;
  kill_tally t;
  auto fail = [&](std::string const& what) {
    if (t.failures.size() < 8) { t.failures.push_back(what); }
  };

  // the old state, saved whole
  k.save(dir.path());
  std::string current = k.state();
  REQUIRE(k.load(dir.path()) == current);

  // Delays: the save's duration drifts with the disk's load (an fsync takes 0.1 to 40 ms on the
  // shared CI disk): the delays follow the median of the last 9 durations measured, first of
  // uninterrupted saves, then of the trials' saves that completed.
  std::deque<double> durations;
  std::vector<double> all_durations;
  auto const measure = [&](int saves) {
    for (int i = 0; i < saves; ++i) {
      child_run const r = save_in_child(k, dir.path(), -1, *marks);
      REQUIRE_FALSE(r.failed);
      REQUIRE(r.phase == 2);
      durations.push_back(r.end_ms - r.start_ms);
      all_durations.push_back(r.end_ms - r.start_ms);
      if (durations.size() > 9) { durations.pop_front(); }
    }
    current = k.state();
    REQUIRE(k.load(dir.path()) == current);
  };
  // System calls: the kill points are 0 .. S (S: the most calls of 3 traced saves; S itself is
  // the child's exit), each used in turn in a shuffled order.
  std::vector<std::int64_t> points;
  std::mt19937_64 rng(seed);
  if (how == kill_by::delay) {
    measure(9);
  } else {
    for (int i = 0; i < 3; ++i) {
      child_run const r = save_traced(k, dir.path(), -1, *marks);
      REQUIRE_FALSE(r.failed);
      REQUIRE(r.phase == 2);
      t.syscalls = std::max(t.syscalls, r.syscalls);
    }
    current = k.state();
    REQUIRE(k.load(dir.path()) == current);
    for (std::int64_t p = 0; p <= t.syscalls; ++p) {
      points.push_back(p);
    }
    std::shuffle(points.begin(), points.end(), rng);
    trials   = std::max<int>(trials, static_cast<int>(points.size()));
    t.points = static_cast<std::int64_t>(std::min<std::size_t>(points.size(), trials));
  }
  t.trials = trials;

  for (int trial = 0; trial < trials; ++trial) {
    k.step();
    std::string const next = k.state();
    REQUIRE(next != current);
    auto const before = stamps(dir.path());
    child_run r;
    if (how == kill_by::delay) {
      std::vector<double> recent(durations.begin(), durations.end());
      std::sort(recent.begin(), recent.end());
      std::uniform_real_distribution<double> delay(0.0, 1.2 * recent[recent.size() / 2]);
      r = save_in_child(k, dir.path(), delay(rng), *marks);
      if (r.phase == 2) {  // a duration under the trials' own conditions
        durations.push_back(r.end_ms - r.start_ms);
        durations.pop_front();
        t.completed_ms.push_back(r.end_ms - r.start_ms);
      }
    } else {
      r =
        save_traced(k, dir.path(), points[static_cast<std::size_t>(trial) % points.size()], *marks);
      t.landed[r.syscall.empty() ? "none (the save ended sooner)" : r.syscall]++;
    }
    std::string const at =
      "trial " + std::to_string(trial) + " (phase " + std::to_string(r.phase) + "): ";
    if (r.failed) { fail(at + "the child's save failed"); }
    (r.phase == 0 ? t.before : r.phase == 1 ? t.during : t.after)++;
    if (names_in(dir.path()).size() != k.entries) { ++t.leftovers; }
    if (stamps(dir.path()) != before) { ++t.wrote; }
    std::string loaded;
    try {
      loaded = k.load(dir.path());
    } catch (std::exception const& e) {
      fail(at + "the load failed: " + e.what() + " [" + joined(names_in(dir.path())) + "]");
      continue;
    }
    bool const is_old = loaded == current;
    bool const is_new = loaded == next;
    if (!is_old && !is_new) {
      fail(at + "loaded neither the old nor the new state [" + joined(names_in(dir.path())) + "]");
      continue;
    }
    if (r.phase == 0 && !is_old) { fail(at + "killed before its save, yet the new state loads"); }
    if (r.phase == 2 && !is_new) { fail(at + "its save returned, yet the old state loads"); }
    (is_old ? t.old_state : t.new_state)++;
    if (r.phase == 1) { (is_old ? t.during_old : t.during_new)++; }
    if (is_new) { current = next; }
  }
  if (!all_durations.empty()) {
    std::sort(all_durations.begin(), all_durations.end());
    t.save_ms = all_durations[all_durations.size() / 2];
  }

  // a save after the kills succeeds and leaves exactly one snapshot: the killed saves' files are
  // gone (temporaries reused, orphaned files removed)
  k.step();
  k.save(dir.path());
  if (k.load(dir.path()) != k.state()) { fail("the save after the kills does not load"); }
  std::vector<std::string> const left = names_in(dir.path());
  if (left.size() != k.entries) {
    fail("after a clean save the directory holds more than one snapshot: [" + joined(left) + "]");
  }
  return t;
}

void check_kills(crash_kind k, kill_by how, int trials, std::uint64_t seed)
{
  auto const start   = std::chrono::steady_clock::now();
  kill_tally const t = kill_trials(k, trials, how, seed);
  double const s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("crash %s: %s; %.1f s\n", k.name.c_str(), describe(t, how).c_str(), s);
  INFO(k.name << ": " << describe(t, how));
  for (std::string const& f : t.failures) {
    UNSCOPED_INFO(f);
  }
  CHECK(t.failures.empty());
  CHECK(t.old_state + t.new_state == t.trials);
  CHECK(t.before == 0);
  if (how == kill_by::syscall) {
    // every call of the save was a kill point; the new state appears only at its end (the
    // rename of the file or the manifest), so most kills inside the save leave the old state
    CHECK(t.points == t.syscalls + 1);
    CHECK(t.trials >= t.points);
    CHECK(t.during_old > t.during_new);
    CHECK(t.during_new > 0);
  } else {
    // the delays reach into the save: with the disk's speed steady 1 / 1.2 of the kills land
    // inside it; an fsync's time on a shared disk varies tenfold from one save to the next (29 to
    // 99 % landed inside in runs on the CI machine), so a tenth is asked for here; the kills at
    // system calls are the ones that reach every point of the save
    CHECK(t.during * 10 >= t.trials);
  }
}

// -------------------------------------------------------------------------------------------------
// A full disk: a small tmpfs in a private mount namespace, in a child process (so nothing stays
// mounted whatever happens); the child reports one line per kind through a pipe.

/// An expectation of the child (no Catch there): throws with `what`.
void expect(bool ok, std::string const& what)
{
  if (!ok) { throw std::runtime_error(what); }
}

void mount_tmpfs(std::string const& at, std::uint64_t bytes, bool remount)
{
  std::string const options = "size=" + std::to_string(bytes) + ",mode=0700";
  int const done  = mount("tmpfs", at.c_str(), "tmpfs", remount ? MS_REMOUNT : 0, options.c_str());
  int const error = errno;
  expect(done == 0,
         "cannot " + std::string{remount ? "resize" : "mount"} + " a tmpfs of " +
           std::to_string(bytes) + " bytes at '" + at + "': " + std::strerror(error));
}

std::uint64_t used_bytes(std::string const& at)
{
  struct statvfs v {};
  expect(statvfs(at.c_str(), &v) == 0, "cannot statvfs '" + at + "'");
  return static_cast<std::uint64_t>(v.f_blocks - v.f_bfree) * v.f_frsize;
}

std::vector<std::pair<std::string, std::vector<unsigned char>>> files_of(std::string const& dir)
{
  std::vector<std::pair<std::string, std::vector<unsigned char>>> files;
  for (std::string const& name : names_in(dir)) {
    files.emplace_back(name, read_bytes(dir + "/" + name));
  }
  return files;
}

/// Saves a state into `mnt/<kind>`, grows it, then tries the grown save with 0, 4 KiB, 8 KiB, ...
/// free on the file system until it fits: every refusal names the path and ENOSPC's text and
/// leaves the old files byte for byte (nothing of its own), which load to the old state.
std::string full_disk(crash_kind& k, std::string const& mnt)
{
  std::string const dir = mnt + "/" + k.name;
  mount_tmpfs(mnt, std::uint64_t{64} << 20, true);
  expect(fs::create_directory(dir), "cannot create '" + dir + "'");
  k.save(dir);
  std::string const old = k.state();
  expect(k.load(dir) == old, "the old state does not load back");
  auto const old_files     = files_of(dir);
  std::uint64_t const base = used_bytes(mnt);
  k.grow();
  std::string const next   = k.state();
  std::string const reason = std::strerror(ENOSPC);
  int refused              = 0;
  std::set<std::string> failing;  // the files whose writes ran out of space
  std::string first;              // the first refusal's message
  for (std::uint64_t extra = 0;; extra += 4096) {
    expect(extra <= (std::uint64_t{4} << 20), "the grown state never fitted");
    mount_tmpfs(mnt, base + extra, true);
    std::string message;
    try {
      k.save(dir);
    } catch (logic_error const& e) {
      message = e.what();
    }
    if (message.empty()) {
      expect(k.load(dir) == next, "the save that fitted does not load to the new state");
      expect(names_in(dir).size() == k.entries,
             "the save that fitted left [" + joined(names_in(dir)) + "]");
      break;
    }
    ++refused;
    if (first.empty()) { first = message; }
    std::string const at = "with " + std::to_string(extra) + " bytes free: ";
    expect(message.find(reason) != std::string::npos && message.find(dir) != std::string::npos,
           at + "the error does not name the path and ENOSPC: " + message);
    std::size_t const path = message.rfind(dir + "/");
    failing.insert(
      message.substr(path + dir.size() + 1, message.find('\'', path) - path - dir.size() - 1));
    expect(files_of(dir) == old_files,
           at + "the directory changed: [" + joined(names_in(dir)) + "] (" + message + ")");
    expect(k.load(dir) == old, at + "the old state does not load (" + message + ")");
  }
  expect(refused > 0, "the grown state fitted at once");
  fs::remove_all(dir);
  std::vector<std::string> names(failing.begin(), failing.end());
  return std::to_string(refused) + " refused saves, out of space in [" + joined(names) +
         "]; the first said: " + first;
}

/// The child's side: a private mount namespace, a tmpfs at `mnt`, the four kinds, unmounted.
void full_disk_child(std::string const& mnt, int out)
{
  auto const say = [out](std::string line) {
    line += '\n';
    for (std::size_t done = 0; done < line.size();) {
      ssize_t const n = write(out, line.data() + done, line.size() - done);
      if (n <= 0) { return; }
      done += static_cast<std::size_t>(n);
    }
  };
  // as root a private mount namespace; otherwise one inside a user namespace of our own, where
  // the kernel allows unprivileged ones (this child is single-threaded, as that requires)
  if (unshare(CLONE_NEWNS) != 0) {
    int const error  = errno;
    uid_t const uid  = getuid();
    gid_t const gid  = getgid();
    auto const write = [](char const* file, std::string const& text) {
      FILE* const f = std::fopen(file, "w");
      bool const ok = f != nullptr && std::fputs(text.c_str(), f) >= 0;
      return f != nullptr && std::fclose(f) == 0 && ok;
    };
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0 || !write("/proc/self/setgroups", "deny") ||
        !write("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1") ||
        !write("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1")) {
      say("mount cannot enter a private mount namespace: " + std::string{std::strerror(error)} +
          ", nor a user namespace: " + std::strerror(errno));
      return;
    }
  }
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    int const error = errno;
    say("mount cannot make the mounts private: " + std::string{std::strerror(error)});
    return;
  }
  try {
    mount_tmpfs(mnt, std::uint64_t{64} << 20, false);
  } catch (std::exception const& e) {
    say(std::string{"mount "} + e.what());
    return;
  }
  for (auto make : {store_kind, index_kind, tier_kind, memory_kind}) {
    crash_kind k = make();
    try {
      say("ok " + k.name + ": " + full_disk(k, mnt));
    } catch (std::exception const& e) {
      say("fail " + k.name + ": " + e.what());
    }
  }
  if (umount(mnt.c_str()) != 0) {
    int const error = errno;
    say("fail umount: " + std::string{std::strerror(error)});
  }
}

}  // namespace

TEST_CASE("crash: a killed save_store leaves the old or the new store", "[crash]")
{
  check_kills(store_kind(), kill_by::syscall, 200, 1);
  check_kills(store_kind(), kill_by::delay, 100, 11);
}

TEST_CASE("crash: a killed save_index leaves the old or the new index", "[crash]")
{
  check_kills(index_kind(), kill_by::syscall, 200, 2);
  check_kills(index_kind(), kill_by::delay, 100, 12);
}

TEST_CASE("crash: a killed save_tiers leaves the old or the new tiers", "[crash]")
{
  check_kills(tier_kind(), kill_by::syscall, 200, 3);
  check_kills(tier_kind(), kill_by::delay, 100, 13);
}

TEST_CASE("crash: a killed save_memory leaves the old or the new deployment", "[crash]")
{
  check_kills(memory_kind(), kill_by::syscall, 200, 4);
  check_kills(memory_kind(), kill_by::delay, 100, 14);
}

TEST_CASE("crash: a save that runs out of space leaves the previous snapshot", "[crash]")
{
  scratch_dir dir;
  std::string const mnt = dir.file("tmpfs");
  fs::create_directory(mnt);
  int pipe_ends[2];
  REQUIRE(pipe(pipe_ends) == 0);
  pid_t const pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    (void)close(pipe_ends[0]);
    full_disk_child(mnt, pipe_ends[1]);
    _exit(0);
  }
  (void)close(pipe_ends[1]);
  std::string report;
  char buffer[4096];
  for (;;) {
    ssize_t const n = read(pipe_ends[0], buffer, sizeof buffer);
    if (n <= 0) { break; }
    report.append(buffer, static_cast<std::size_t>(n));
  }
  (void)close(pipe_ends[0]);
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  std::istringstream lines{report};
  std::string line;
  int passed = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("mount ", 0) == 0) {
      FAIL(
        "the full-disk test mounts a small tmpfs in a private mount namespace (it needs root, "
        "or unprivileged user namespaces) and could not: "
        << line.substr(6));
    }
    std::printf("crash full disk %s\n", line.c_str());
    INFO(line);
    CHECK(line.rfind("ok ", 0) == 0);
    passed += line.rfind("ok ", 0) == 0 ? 1 : 0;
  }
  CHECK(passed == 4);
}
