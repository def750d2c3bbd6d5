/**
 * @file detail/redis/connection.hpp
 * @brief The Redis client under redis_source.hpp: one hiredis connection (timeouts, pipelines,
 * SIGPIPE blocked during socket I/O), Redis Cluster's key slots (CRC-16 of the hash tag),
 * `MOVED`, `ASK` (with `ASKING`) and `TRYAGAIN` replies, and the checks of a reply (a server
 * loading or a cluster down is source_unavailable). Needs hiredis (`<hiredis/hiredis.h>`).
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/fact_source.hpp>

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <sys/time.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace inferscale {

namespace detail::redis {

/// @brief CRC-16/XMODEM (polynomial 0x1021, initial 0), the hash of Redis Cluster's key slots.
inline std::uint16_t crc16(char const* p, std::size_t n) noexcept
{
  std::uint16_t crc = 0;
  for (std::size_t i = 0; i < n; ++i) {
    crc = static_cast<std::uint16_t>(
      crc ^ (static_cast<std::uint16_t>(static_cast<unsigned char>(p[i])) << 8));
    for (int b = 0; b < 8; ++b) {
      crc = (crc & 0x8000u) != 0 ? static_cast<std::uint16_t>((crc << 1) ^ 0x1021u)
                                 : static_cast<std::uint16_t>(crc << 1);
    }
  }
  return crc;
}

/// @brief The cluster slot of `key`: the CRC-16 of its hash tag (the text between its first `{`
/// and the next `}`, when not empty) or of the whole key, modulo 16384.
inline int hash_slot(std::string const& key) noexcept
{
  std::size_t const open = key.find('{');
  if (open != std::string::npos) {
    std::size_t const close = key.find('}', open + 1);
    if (close != std::string::npos && close > open + 1) {
      return crc16(key.data() + open + 1, close - open - 1) & 16383;
    }
  }
  return crc16(key.data(), key.size()) & 16383;
}

struct reply_deleter {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using reply_ptr = std::unique_ptr<redisReply, reply_deleter>;

/// @brief SIGPIPE blocked in this thread while a socket is written (a peer that closed must give
/// an error, not kill the process); a SIGPIPE raised meanwhile is consumed before unblocking.
class sigpipe_guard {
 public:
  sigpipe_guard() noexcept
  {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigemptyset(&pending);
    was_pending_ = sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
    blocked_     = pthread_sigmask(SIG_BLOCK, &pipe_, &old_) == 0;
  }
  ~sigpipe_guard()
  {
    if (!blocked_) { return; }
    if (!was_pending_) {
      sigset_t pending;
      sigemptyset(&pending);
      if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
        timespec const zero{0, 0};
        (void)sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    (void)pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  sigpipe_guard(sigpipe_guard const&)            = delete;
  sigpipe_guard& operator=(sigpipe_guard const&) = delete;

 private:
  sigset_t pipe_{};
  sigset_t old_{};
  bool was_pending_{false};
  bool blocked_{false};
};

/// @brief A server redirected a command: the slot and the node (`host:port`) that owns it.
struct moved {
  int slot;
  std::string endpoint;
};

/// @brief The slot is migrating and the command's keys are on the importing node (`ASK`): ask
/// that node this once (after `ASKING`); the slot's owner is unchanged.
struct asked {
  int slot;
  std::string endpoint;
};

/// @brief The keys of one command or transaction are split between the two nodes of a
/// migrating slot (`TRYAGAIN`): retry shortly.
struct try_again {
  std::string text;
};

/// @brief One connection to one server, opened on first use and after a failure.
class connection {
 public:
  connection(std::string host, int port, std::int32_t timeout_ms)
    : host_{std::move(host)}, port_{port}, timeout_ms_{timeout_ms}
  {
  }
  connection(connection const&)            = delete;
  connection& operator=(connection const&) = delete;
  ~connection() { close(); }

  std::string endpoint() const { return host_ + ":" + std::to_string(port_); }

  /// @brief Sends `commands` in one pipeline and returns one reply per command.
  /// @throw source_unavailable when the server cannot be reached or the connection fails (the
  ///        connection is closed; the next call reopens it)
  std::vector<reply_ptr> pipeline(std::vector<std::vector<std::string>> const& commands)
  {
    sigpipe_guard const guard;
    open();
    std::vector<char const*> argv;
    std::vector<std::size_t> lengths;
    std::vector<bool> asking;  // per command sent: an ASKING this class added
    bool in_transaction = false;
    auto const send     = [&](std::vector<std::string> const& command) {
      argv.clear();
      lengths.clear();
      for (std::string const& a : command) {
        argv.push_back(a.data());
        lengths.push_back(a.size());
      }
      if (redisAppendCommandArgv(
            context_, static_cast<int>(argv.size()), argv.data(), lengths.data()) != REDIS_OK) {
        fail("cannot queue a command");
      }
    };
    static std::vector<std::string> const asking_command{"ASKING"};
    for (auto const& command : commands) {
      // ASKING holds for the next command only, except that a MULTI keeps it to its EXEC
      if (asking_ && !in_transaction) {
        send(asking_command);
        asking.push_back(true);
      }
      if (!command.empty() && command.front() == "MULTI") { in_transaction = true; }
      if (!command.empty() && (command.front() == "EXEC" || command.front() == "DISCARD")) {
        in_transaction = false;
      }
      send(command);
      asking.push_back(false);
    }
    std::vector<reply_ptr> replies;
    replies.reserve(commands.size());
    for (bool const added : asking) {
      void* reply = nullptr;
      if (redisGetReply(context_, &reply) != REDIS_OK || reply == nullptr) {
        if (reply != nullptr) { freeReplyObject(reply); }
        fail("no reply");
      }
      reply_ptr r{static_cast<redisReply*>(reply)};
      if (added) {
        if (r->type == REDIS_REPLY_ERROR) {
          throw source_unavailable{"redis " + endpoint() +
                                   ": ASKING refused: " + std::string{r->str, r->len}};
        }
        continue;
      }
      replies.push_back(std::move(r));
    }
    return replies;
  }

  /// @brief While set, every command of a pipeline (a transaction: its MULTI) is preceded by
  /// `ASKING`, so a node importing a slot serves it (an `ASK` redirection being followed).
  void set_asking(bool on) noexcept { asking_ = on; }

  void close() noexcept
  {
    if (context_ != nullptr) { redisFree(context_); }
    context_ = nullptr;
  }

 private:
  void open()
  {
    if (context_ != nullptr) { return; }
    timeval const tv{timeout_ms_ / 1000, static_cast<suseconds_t>((timeout_ms_ % 1000) * 1000)};
    context_ = redisConnectWithTimeout(host_.c_str(), port_, tv);
    if (context_ == nullptr) {
      throw source_unavailable{"redis " + endpoint() + ": cannot allocate a connection"};
    }
    if (context_->err != 0 || redisSetTimeout(context_, tv) != REDIS_OK) { fail("cannot connect"); }
  }

  [[noreturn]] void fail(char const* what)
  {
    std::string const reason =
      context_ != nullptr && context_->err != 0 ? std::string{context_->errstr} : "I/O error";
    close();
    throw source_unavailable{"redis " + endpoint() + ": " + what + ": " + reason};
  }

  std::string host_;
  int port_;
  std::int32_t timeout_ms_;
  redisContext* context_{nullptr};
  bool asking_{false};
};

/// @brief Throws for an error reply: moved (MOVED), asked (ASK), try_again (TRYAGAIN),
/// source_unavailable (the server is loading, the cluster is down, a timeout), logic_error
/// otherwise (naming `what`). A transaction aborted by an error queued in it (EXECABORT) is
/// reported by that error, which comes first in the replies.
inline void check_reply(redisReply const* r, std::string const& what, connection const& c)
{
  if (r->type != REDIS_REPLY_ERROR) { return; }
  std::string const text{r->str, r->len};
  for (char const* kind : {"MOVED ", "ASK "}) {
    std::size_t const n = std::strlen(kind);
    if (text.rfind(kind, 0) == 0) {
      std::size_t const space = text.find(' ', n);
      int const slot          = std::atoi(text.c_str() + n);
      std::string endpoint    = space == std::string::npos ? std::string{} : text.substr(space + 1);
      if (kind[0] == 'M') { throw moved{slot, std::move(endpoint)}; }
      throw asked{slot, std::move(endpoint)};
    }
  }
  if (text.rfind("TRYAGAIN", 0) == 0) { throw try_again{"redis " + c.endpoint() + ": " + text}; }
  if (text.rfind("LOADING", 0) == 0 || text.rfind("CLUSTERDOWN", 0) == 0 ||
      text.rfind("MASTERDOWN", 0) == 0) {
    throw source_unavailable{"redis " + c.endpoint() + ": " + what + ": " + text};
  }
  INFERSCALE_FAIL("redis " + c.endpoint() + ": " + what + ": " + text);
}

}  // namespace detail::redis

}  // namespace inferscale
