// Store snapshots (snapshot.hpp): save_store and load_store of a 1 GiB host store, each timed
// next to the ceiling measured in the same iteration on the same bytes:
//   - save: save_store (catalogue, CRC-64 and finiteness check of every pool byte, write, fsync of
//     the file, rename over the previous snapshot, fsync of the directory) vs the same atomic
//     replacement done plainly: write() of the same byte count to a temporary, fsync, rename over
//     the previous file, fsync of the directory ("write_fsync_GB/s", "vs_write_fsync" = its time
//     / save's time: 1 means save runs at the speed of the disk);
//   - load, warm (the file in the page cache, as right after a save) and cold (the file's pages
//     dropped with posix_fadvise(DONTNEED) before each load and each ceiling read, so both read
//     from the disk): load_store into a new host store (allocation and zeroing of the pool, the
//     checks, the CRC, the copy) vs a plain read() of the same file into a new allocation (its
//     page faults included: any loader builds a new pool; "read_GB/s", "vs_read" = its time /
//     load's time) and into a pre-touched buffer ("read_touched_GB/s", the page cache's or the
//     disk's own speed);
//   - load with conversion (bf16 file -> float32 store), warm;
//   - every case also reports memcpy of the same bytes between pre-touched buffers
//     ("memcpy_GB/s") and the CRC-64 alone over the pool ("crc64_GB/s"), the two in-memory
//     floors of any checked copy.
// GB/s are decimal (file bytes / seconds / 1e9). Store: Llama-3.1-8B geometry (32 layers, 8 KV
// heads, head_dim 128), bf16, pages of 16 tokens (2 MiB each), 512 pages = 1 GiB, every page in
// use (256 facts of 29 .. 32 tokens, reserved and filled with finite bf16 bits). Files are
// written under $INFERSCALE_BENCH_DIR (default: the system's temporary directory) and removed;
// INFERSCALE_SNAPSHOT_BENCH_PAGES overrides the page count (each page is 2 MiB).
#include "../common/fixture.hpp"

#include <inferscale/detail/serialize.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <benchmark/benchmark.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace ib = inferscale::bench;
namespace fs = std::filesystem;
using inferscale::dtype;
using inferscale::kv_store;
using inferscale::memory_space;

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0)
{
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

std::string bench_dir()
{
  if (char const* d = std::getenv("INFERSCALE_BENCH_DIR")) { return d; }
  return fs::temp_directory_path().string();
}

std::int64_t bench_pages()
{
  if (char const* p = std::getenv("INFERSCALE_SNAPSHOT_BENCH_PAGES")) { return std::atoll(p); }
  return 512;
}

/// The 1 GiB store, built once (reserve + finite bf16 bits written into the pool).
kv_store const& bench_store()
{
  static kv_store const store = [] {
    inferscale::kv_store_config c;
    c.model       = inferscale::kv_geometry{32, 8, 128};
    c.store_dtype = dtype::bfloat16;
    c.page_size   = 16;
    c.num_pages   = bench_pages();
    c.space       = memory_space::host;
    kv_store s{c};
    std::uint64_t id = 1;
    while (s.free_pages() >= 2) {
      std::vector<std::int32_t> tokens(static_cast<std::size_t>(29 + id % 4));
      for (std::size_t t = 0; t < tokens.size(); ++t) {
        tokens[t] = static_cast<std::int32_t>(1000 + id * 40 + t);
      }
      (void)s.reserve(id, id % 16, tokens);
      ++id;
    }
    // xorshift bits with the exponent kept in [2^-8, 2^8): finite, varied
    auto* p             = static_cast<std::uint16_t*>(s.ref().pool);
    std::size_t const n = s.pool_bytes() / 2;
    std::uint64_t x     = 0x9E3779B97F4A7C15ull;
    for (std::size_t i = 0; i < n; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::uint16_t const sign     = static_cast<std::uint16_t>((x >> 20) & 0x8000u);
      std::uint16_t const exponent = static_cast<std::uint16_t>(119 + (x >> 40) % 16) << 7;
      p[i]                         = static_cast<std::uint16_t>(sign | exponent | (x & 0x7Fu));
    }
    return s;
  }();
  return store;
}

void fail_if(bool failed, char const* what)
{
  if (failed) { throw std::runtime_error(std::string{what} + ": " + std::strerror(errno)); }
}

/// write() of `bytes` from `data` to `path + ".tmp"`, fsync, rename over `path`, fsync of the
/// directory: the save ceiling (the same atomic replacement, without format or checks).
double timed_write_fsync(std::string const& path, unsigned char const* data, std::size_t bytes)
{
  std::string const temporary = path + ".tmp";
  auto const t0               = clock_type::now();
  int const fd                = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  fail_if(fd < 0, "open");
  for (std::size_t done = 0; done < bytes;) {
    ssize_t const n = ::write(fd, data + done, std::min<std::size_t>(bytes - done, 1u << 30));
    fail_if(n <= 0, "write");
    done += static_cast<std::size_t>(n);
  }
  fail_if(::fsync(fd) != 0, "fsync");
  fail_if(::close(fd) != 0, "close");
  fail_if(std::rename(temporary.c_str(), path.c_str()) != 0, "rename");
  int const directory = ::open(fs::path(path).parent_path().c_str(), O_RDONLY | O_DIRECTORY);
  fail_if(directory < 0, "open directory");
  fail_if(::fsync(directory) != 0, "fsync directory");
  fail_if(::close(directory) != 0, "close directory");
  return seconds_since(t0);
}

/// read() of the whole file into a new allocation (not pre-touched: the page faults count).
double timed_read_new(std::string const& path, std::size_t bytes)
{
  auto const t0 = clock_type::now();
  std::unique_ptr<unsigned char[]> buffer(new unsigned char[bytes]);
  int const fd = ::open(path.c_str(), O_RDONLY);
  fail_if(fd < 0, "open");
  for (std::size_t done = 0; done < bytes;) {
    ssize_t const n =
      ::read(fd, buffer.get() + done, std::min<std::size_t>(bytes - done, 1u << 30));
    fail_if(n <= 0, "read");
    done += static_cast<std::size_t>(n);
  }
  fail_if(::close(fd) != 0, "close");
  benchmark::DoNotOptimize(buffer.get());
  double const t = seconds_since(t0);
  buffer.reset();
  return t;
}

/// read() of the whole file into `buffer` (pre-touched): the load ceiling.
double timed_read(std::string const& path, unsigned char* buffer, std::size_t bytes)
{
  auto const t0 = clock_type::now();
  int const fd  = ::open(path.c_str(), O_RDONLY);
  fail_if(fd < 0, "open");
  for (std::size_t done = 0; done < bytes;) {
    ssize_t const n = ::read(fd, buffer + done, std::min<std::size_t>(bytes - done, 1u << 30));
    fail_if(n <= 0, "read");
    done += static_cast<std::size_t>(n);
  }
  fail_if(::close(fd) != 0, "close");
  return seconds_since(t0);
}

/// Drops the file's pages from the page cache (they are clean after the fsync of the save).
void drop_cached(std::string const& path)
{
  int const fd = ::open(path.c_str(), O_RDONLY);
  fail_if(fd < 0, "open");
  (void)::fdatasync(fd);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  (void)::close(fd);
}

struct floors {
  double memcpy_seconds{};
  double crc_seconds{};
};

/// memcpy and CRC-64 of the same bytes, once per iteration.
floors time_floors(unsigned char const* source, unsigned char* destination, std::size_t bytes)
{
  floors f;
  auto t0 = clock_type::now();
  std::memcpy(destination, source, bytes);
  benchmark::DoNotOptimize(destination);
  benchmark::ClobberMemory();
  f.memcpy_seconds        = seconds_since(t0);
  t0                      = clock_type::now();
  std::uint64_t const crc = inferscale::detail::serial::crc64_of(source, bytes);
  benchmark::DoNotOptimize(crc);
  f.crc_seconds = seconds_since(t0);
  return f;
}

void report(benchmark::State& state,
            double file_bytes,
            double seconds,
            double ceiling_seconds,
            char const* ceiling_name,
            char const* ratio_name,
            floors const& total)
{
  double const n = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<std::int64_t>(file_bytes * n));
  state.counters["GB/s"]        = file_bytes * n / seconds / 1e9;
  state.counters[ceiling_name]  = file_bytes * n / ceiling_seconds / 1e9;
  state.counters[ratio_name]    = ceiling_seconds / seconds;
  state.counters["memcpy_GB/s"] = file_bytes * n / total.memcpy_seconds / 1e9;
  state.counters["crc64_GB/s"]  = file_bytes * n / total.crc_seconds / 1e9;
  state.counters["file_MB"]     = file_bytes / 1e6;
}

struct scratch {
  std::string snapshot, ceiling;
  std::vector<unsigned char> buffer, copy;
  explicit scratch(std::string const& name, std::size_t bytes)
    : snapshot(bench_dir() + "/inferscale-bench-" + name + ".iskv"),
      ceiling(bench_dir() + "/inferscale-bench-" + name + ".ceiling"),
      buffer(bytes, 1),
      copy(bytes, 2)
  {
  }
  ~scratch()
  {
    std::error_code ignored;
    fs::remove(snapshot, ignored);
    fs::remove(ceiling, ignored);
    fs::remove(ceiling + ".tmp", ignored);
  }
};

void save_bench(benchmark::State& state)
{
  ib::run_guarded(state, [&] {
    kv_store const& store        = bench_store();
    auto const* pool             = static_cast<unsigned char const*>(store.ref().pool);
    std::size_t const pool_bytes = store.pool_bytes();
    scratch s{"save", pool_bytes};
    inferscale::save_store(store, s.snapshot);             // warm-up (and the file size)
    (void)timed_write_fsync(s.ceiling, pool, pool_bytes);  // so each timed ceiling replaces a file
    std::size_t const file_bytes = static_cast<std::size_t>(fs::file_size(s.snapshot));
    s.buffer.resize(file_bytes, 1);
    double seconds = 0, ceiling = 0;
    floors total;
    for (auto _ : state) {
      auto const t0 = clock_type::now();
      inferscale::save_store(store, s.snapshot);
      double const t = seconds_since(t0);
      state.SetIterationTime(t);
      seconds += t;
      ceiling += timed_write_fsync(s.ceiling, s.buffer.data(), file_bytes);
      floors const f = time_floors(pool, s.copy.data(), pool_bytes);
      total.memcpy_seconds += f.memcpy_seconds;
      total.crc_seconds += f.crc_seconds;
    }
    report(state,
           static_cast<double>(file_bytes),
           seconds,
           ceiling,
           "write_fsync_GB/s",
           "vs_write_fsync",
           total);
  });
}

void load_bench(benchmark::State& state, bool cold, bool convert)
{
  ib::run_guarded(state, [&] {
    kv_store const& store        = bench_store();
    auto const* pool             = static_cast<unsigned char const*>(store.ref().pool);
    std::size_t const pool_bytes = store.pool_bytes();
    std::string const name =
      std::string{"load-"} + (cold ? "cold" : "warm") + (convert ? "-f32" : "");
    inferscale::store_load_options options;
    if (convert) { options.store_dtype = dtype::float32; }
    scratch s{name, pool_bytes + (std::size_t{1} << 20)};
    inferscale::save_store(store, s.snapshot);
    std::size_t const file_bytes = static_cast<std::size_t>(fs::file_size(s.snapshot));
    s.buffer.resize(file_bytes, 1);
    {  // warm-up; the loaded store is checked once against the original (outside the timing)
      kv_store const loaded = inferscale::load_store(s.snapshot, options);
      if (!convert) {
        auto const* a = static_cast<unsigned char const*>(loaded.ref().pool);
        if (loaded.pool_bytes() != pool_bytes || std::memcmp(a, pool, pool_bytes) != 0) {
          throw std::runtime_error("the loaded pool differs from the saved one");
        }
      }
    }
    double seconds = 0, ceiling = 0, touched = 0;
    floors total;
    for (auto _ : state) {
      if (cold) { drop_cached(s.snapshot); }
      auto const t0 = clock_type::now();
      {
        kv_store loaded = inferscale::load_store(s.snapshot, options);
        benchmark::DoNotOptimize(loaded.ref().pool);
        double const t = seconds_since(t0);
        state.SetIterationTime(t);
        seconds += t;
      }  // the store is freed outside the timing
      if (cold) { drop_cached(s.snapshot); }
      ceiling += timed_read_new(s.snapshot, file_bytes);
      if (cold) { drop_cached(s.snapshot); }
      touched += timed_read(s.snapshot, s.buffer.data(), file_bytes);
      floors const f = time_floors(pool, s.copy.data(), pool_bytes);
      total.memcpy_seconds += f.memcpy_seconds;
      total.crc_seconds += f.crc_seconds;
    }
    report(state, static_cast<double>(file_bytes), seconds, ceiling, "read_GB/s", "vs_read", total);
    state.counters["read_touched_GB/s"] =
      static_cast<double>(file_bytes) * static_cast<double>(state.iterations()) / touched / 1e9;
  });
}

void register_benchmarks()
{
  auto const shape = [](benchmark::internal::Benchmark* b) {
    b->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(3);
  };
  benchmark::RegisterBenchmark("snapshot/save/host/bf16/GiB:1", save_bench)->Apply(shape);
  benchmark::RegisterBenchmark("snapshot/load/host/bf16/GiB:1/warm", [](benchmark::State& s) {
    load_bench(s, false, false);
  })->Apply(shape);
  benchmark::RegisterBenchmark("snapshot/load/host/bf16/GiB:1/cold", [](benchmark::State& s) {
    load_bench(s, true, false);
  })->Apply(shape);
  benchmark::RegisterBenchmark("snapshot/load/host/bf16->f32/GiB:1/warm", [](benchmark::State& s) {
    load_bench(s, false, true);
  })->Apply(shape);
}

}  // namespace

int main(int argc, char** argv)
{
  register_benchmarks();
  return ib::benchmark_main(argc, argv);
}
