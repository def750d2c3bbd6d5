// Test-side helpers of the Redis tests: the layout and facts, a reference store, byte access to a
// store's pages, a raw command to a server (hiredis directly, not the code under test), and a
// retry while a restarted server comes back. Free of Catch macros.
#pragma once

#include "redis_server.hpp"

#include <inferscale/redis_source.hpp>
#include <inferscale/store.hpp>
#include <inferscale/tier.hpp>

#include <hiredis/hiredis.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace inferscale_test::redis {

using namespace inferscale;

constexpr std::int32_t layers    = 3;
constexpr std::int32_t heads     = 2;
constexpr std::int32_t head_dim  = 8;
constexpr std::int32_t page_size = 4;

inline kv_store_config store_config(std::int64_t pages, std::int32_t page = page_size)
{
  kv_store_config c;
  c.model       = kv_geometry{layers, heads, head_dim};
  c.store_dtype = dtype::bfloat16;
  c.page_size   = page;
  c.num_pages   = pages;
  c.space       = memory_space::host;
  return c;
}

inline tiered_store_config tiers_config(std::int64_t device_pages, std::int64_t host_pages)
{
  tiered_store_config c;
  c.device     = store_config(device_pages);
  c.host_pages = host_pages;
  return c;
}

inline redis_options options_for(int port, std::string model = "test/Fake-135M@r1")
{
  redis_options o;
  o.port       = port;
  o.model      = std::move(model);
  o.timeout_ms = 3000;
  return o;
}

/// Inserts fact `id` (`tokens` tokens, bf16-exact values depending on id and `salt`).
inline void add(kv_store& s, std::uint64_t id, std::uint64_t ns, std::int32_t tokens, int salt = 0)
{
  std::size_t const n = static_cast<std::size_t>(layers) * tokens * heads * head_dim;
  std::vector<float> k(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    k[i] = static_cast<float>(
             static_cast<std::int64_t>((id * 131 + i * 7 + static_cast<std::size_t>(salt)) % 256) -
             128) /
           64.0f;
    v[i] = static_cast<float>(static_cast<std::int64_t>((id * 17 + i * 13) % 256) - 128) / 64.0f;
  }
  std::vector<std::int32_t> t;
  for (std::int32_t j = 0; j < tokens; ++j) {
    t.push_back(static_cast<std::int32_t>(id * 100 + j));
  }
  s.insert<float>(id,
                  ns,
                  t,
                  make_fact_kv_view<float const>(k.data(), layers, tokens, heads, head_dim),
                  make_fact_kv_view<float const>(v.data(), layers, tokens, heads, head_dim));
}

/// The bytes a store's pool holds for fact `id`, its pages in token order.
inline std::vector<unsigned char> fact_bytes(kv_store const& s, std::uint64_t id)
{
  std::vector<unsigned char> const pool = s.pool_to_host();
  std::vector<unsigned char> out;
  for (std::int64_t p : s.at(id).pages) {
    auto const from = pool.begin() + static_cast<std::ptrdiff_t>(p * s.page_bytes());
    out.insert(out.end(), from, from + static_cast<std::ptrdiff_t>(s.page_bytes()));
  }
  return out;
}

/// An embedding for fact `id`.
inline std::vector<float> embedding_of(std::uint64_t id)
{
  return {static_cast<float>(id), 0.5f, -1.25f, static_cast<float>(id) / 8.0f};
}

struct reply_free {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using raw_reply = std::unique_ptr<redisReply, reply_free>;

/// One command on a fresh connection (hiredis directly).
inline raw_reply raw_command(int port, std::vector<std::string> const& args)
{
  redisContext* c = redisConnect("127.0.0.1", port);
  if (c == nullptr || c->err != 0) {
    std::string const why = c != nullptr ? c->errstr : "no context";
    if (c != nullptr) { redisFree(c); }
    throw std::runtime_error("raw_command: cannot connect to 127.0.0.1:" + std::to_string(port) +
                             ": " + why);
  }
  std::vector<char const*> argv;
  std::vector<std::size_t> lengths;
  for (std::string const& a : args) {
    argv.push_back(a.data());
    lengths.push_back(a.size());
  }
  auto* r = static_cast<redisReply*>(
    redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lengths.data()));
  redisFree(c);
  if (r == nullptr) { throw std::runtime_error("raw_command: no reply"); }
  return raw_reply{r};
}

/// Calls `f` until it does not throw source_unavailable (a restarted server loading), up to 10 s.
template <class F>
auto until_available(F&& f) -> decltype(f())
{
  auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    try {
      return f();
    } catch (source_unavailable const&) {
      if (std::chrono::steady_clock::now() > deadline) { throw; }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

}  // namespace inferscale_test::redis
