// Test-side: a redis-server process the test starts itself on 127.0.0.1 (a free port, its own
// scratch directory), waits for, and stops (SIGTERM, then SIGKILL) -- never one assumed running.
// A machine without redis-server (Debian's redis-server, .ci/setup) fails the test with a message
// saying so. Free of Catch macros.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace inferscale_test {

/// @brief The full path of `program` on PATH, or "" when absent.
inline std::string find_on_path(std::string const& program)
{
  char const* path = std::getenv("PATH");
  std::stringstream dirs{path != nullptr ? path : "/usr/bin:/bin"};
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    std::string const candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) { return candidate; }
  }
  return "";
}

/// @brief A port on 127.0.0.1 that was free a moment ago (bound to 0, read back, released).
inline int free_port()
{
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) { throw std::runtime_error("free_port: socket() failed"); }
  sockaddr_in a{};
  a.sin_family      = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port        = 0;
  socklen_t length  = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length) != 0) {
    ::close(fd);
    throw std::runtime_error("free_port: cannot bind a port on 127.0.0.1");
  }
  int const port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

/// @brief `op(fd, address)` on a fresh TCP socket for 127.0.0.1:`port` (closed after); false
/// when no socket can be made.
template <class Op>
bool with_loopback_socket(int port, Op&& op)
{
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) { return false; }
  sockaddr_in a{};
  a.sin_family      = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port        = htons(static_cast<std::uint16_t>(port));
  bool const ok     = op(fd, a);
  ::close(fd);
  return ok;
}

/// @brief Whether `port` on 127.0.0.1 can be bound now.
inline bool bindable(int port)
{
  return with_loopback_socket(port, [](int fd, sockaddr_in const& a) {
    return ::bind(fd, reinterpret_cast<sockaddr const*>(&a), sizeof a) == 0;
  });
}

/// @brief A free port whose cluster bus port (port + 10000, Redis Cluster's rule) is free too.
inline int free_cluster_port()
{
  for (int attempt = 0; attempt < 1000; ++attempt) {
    int const port = free_port();
    if (port + 10000 < 65536 && bindable(port + 10000)) { return port; }
  }
  throw std::runtime_error("free_cluster_port: no port P with P + 10000 free on 127.0.0.1");
}

/// @brief Whether something accepts TCP connections on 127.0.0.1:`port`.
inline bool accepts(int port)
{
  return with_loopback_socket(port, [](int fd, sockaddr_in const& a) {
    return ::connect(fd, reinterpret_cast<sockaddr const*>(&a), sizeof a) == 0;
  });
}

/// @brief How a redis_server runs.
struct redis_server_options {
  bool append_only{false};  ///< --appendonly yes --appendfsync always (else no persistence)
  bool cluster{false};      ///< --cluster-enabled yes
};

/// @brief A redis-server child process on 127.0.0.1.
class redis_server {
 public:
  using options = redis_server_options;

  redis_server() : redis_server(options{}) {}
  explicit redis_server(options o) : options_{o}
  {
    binary_ = find_on_path("redis-server");
    if (binary_.empty()) {
      throw std::runtime_error(
        "redis-server is not on PATH: the Redis tests start their own server and need Debian's "
        "redis-server (apt-get install redis-server redis-tools libhiredis-dev; .ci/setup does)");
    }
    std::random_device seed;
    dir_ = std::filesystem::temp_directory_path() /
           ("inferscale-redis-" + std::to_string(seed()) + "-" + std::to_string(seed()));
    std::filesystem::create_directories(dir_);
    port_ = o.cluster ? free_cluster_port() : free_port();
    start();
  }
  redis_server(redis_server const&)            = delete;
  redis_server& operator=(redis_server const&) = delete;
  ~redis_server()
  {
    stop();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  int port() const noexcept { return port_; }
  std::string directory() const { return dir_.string(); }
  bool running() const noexcept { return pid_ > 0; }

  /// @brief Starts the server (again, on the same port and directory) and waits until it accepts
  /// connections; throws with the end of its log when it does not within 10 s.
  void start()
  {
    if (pid_ > 0) { return; }
    std::vector<std::string> args{binary_,
                                  "--port",
                                  std::to_string(port_),
                                  "--bind",
                                  "127.0.0.1",
                                  "--save",
                                  "",
                                  "--dir",
                                  dir_.string(),
                                  "--logfile",
                                  (dir_ / "redis.log").string(),
                                  "--daemonize",
                                  "no",
                                  "--appendonly",
                                  options_.append_only ? "yes" : "no"};
    if (options_.append_only) { args.insert(args.end(), {"--appendfsync", "always"}); }
    if (options_.cluster) {
      args.insert(args.end(),
                  {"--cluster-enabled",
                   "yes",
                   "--cluster-config-file",
                   (dir_ / "nodes.conf").string(),
                   "--cluster-node-timeout",
                   "2000"});
    }
    pid_ = ::fork();
    if (pid_ < 0) { throw std::runtime_error("redis_server: fork failed"); }
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) {
        argv.push_back(a.data());
      }
      argv.push_back(nullptr);
      int const null = ::open("/dev/null", O_RDWR);
      if (null >= 0) {
        ::dup2(null, 1);
        ::dup2(null, 2);
      }
      ::execv(binary_.c_str(), argv.data());
      ::_exit(127);
    }
    auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("redis-server exited at start-up: " + log_tail());
      }
      if (accepts(port_)) { return; }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stop();
    throw std::runtime_error("redis-server did not accept connections within 10 s: " + log_tail());
  }

  /// @brief SIGTERM (Redis shuts down cleanly, fsyncing its append-only file), SIGKILL after 10 s.
  void stop() { signal_and_wait(SIGTERM); }

  /// @brief The last 600 bytes of a file in the server's directory.
  std::string tail_of(std::string const& name) const
  {
    std::ifstream in(dir_ / name);
    std::string all{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    return all.size() > 600 ? all.substr(all.size() - 600) : all;
  }

  /// @brief SIGKILL: the server dies at once, as in a crash.
  void kill() { signal_and_wait(SIGKILL); }

  /// @brief SIGSTOP: the server keeps its connections but answers nothing (a hung server).
  void pause() const
  {
    if (pid_ > 0) { ::kill(pid_, SIGSTOP); }
  }

  /// @brief SIGCONT after pause().
  void resume() const
  {
    if (pid_ > 0) { ::kill(pid_, SIGCONT); }
  }

 private:
  void signal_and_wait(int signal_number)
  {
    if (pid_ <= 0) { return; }
    ::kill(pid_, SIGCONT);  // a paused server must run to shut down
    ::kill(pid_, signal_number);
    auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    int status          = 0;
    while (::waitpid(pid_, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    pid_ = -1;
  }

  /// @brief The last 600 bytes of the server's log.
  std::string log_tail() const
  {
    std::ifstream in(dir_ / "redis.log");
    std::string all{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    return all.size() > 600 ? all.substr(all.size() - 600) : all;
  }

  options options_;
  std::string binary_;
  std::filesystem::path dir_;
  int port_{0};
  pid_t pid_{-1};
};

}  // namespace inferscale_test
