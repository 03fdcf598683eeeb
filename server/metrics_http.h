// The /metrics endpoint: an HTTP/1.1 server of one thread around epoll, so that no client can
// take the endpoint away from Prometheus. Idle and slow connections cost a file descriptor
// and their buffers, never a thread: a request's headers must arrive within header_timeout
// of its first byte (or of the connection's opening), a keep-alive connection may idle for
// idle_timeout, and a response must be taken within write_timeout, else the connection is
// closed. At max_connections the oldest connection that has not sent a whole request is
// closed to admit a new one (a scraper's connection, once it has asked, is never the one
// dropped); responses waiting for slow readers hold at most max_pending_bytes together (the
// oldest is dropped beyond). Every such close is counted (the `on_event` hook).
//
// Thread-safety: Start and the destructor from one thread; bound_address and
// open_connections from any. `render` and `on_event` run on the server's thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace epserve::server {

struct MetricsHttpOptions {
  std::string address = "127.0.0.1:0";  // host:port; port 0 picks a free one
  int max_connections = 1024;
  absl::Duration header_timeout = absl::Seconds(5);
  absl::Duration idle_timeout = absl::Seconds(60);
  absl::Duration write_timeout = absl::Seconds(30);
  int64_t max_header_bytes = 8192;
  int64_t max_pending_bytes = int64_t{64} << 20;
};

// What happened to a connection, for counters.
enum class HttpEvent {
  kAccepted,
  kServed,         // a response written whole
  kBadRequest,     // 400/404/405/431 answered
  kHeaderTimeout,  // closed: the request's headers did not arrive in time
  kIdleTimeout,    // closed: a keep-alive connection idled too long
  kWriteTimeout,   // closed: the client did not take the response in time
  kEvicted,        // closed: the connection bound or the pending-bytes bound was reached
};
inline constexpr int kNumHttpEvents = 7;
const char* HttpEventName(HttpEvent event);  // "accepted", "served", "bad_request", ...

// A page served beside /metrics (GET and HEAD), its body rendered on each request.
struct HttpPage {
  std::string path;  // "/eplb/profile"
  std::string content_type;
  std::function<std::string()> render;
};

class MetricsHttpServer {
 public:
  // Binds and starts serving GET (and HEAD) /metrics with the body `render` returns, and
  // `pages`. Raises the process's soft limit on open files towards max_connections if it is
  // lower.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsHttpOptions& options, std::function<std::string()> render,
      std::function<void(HttpEvent)> on_event = {}, std::vector<HttpPage> pages = {});
  // Stops the thread and closes every connection, within milliseconds.
  ~MetricsHttpServer();

  std::string bound_address() const { return bound_address_; }
  int open_connections() const { return open_.load(std::memory_order_relaxed); }

 private:
  MetricsHttpServer() = default;
  void Run();

  struct Loop;
  MetricsHttpOptions options_;
  std::function<std::string()> render_;
  std::vector<HttpPage> pages_;
  std::function<void(HttpEvent)> on_event_;
  std::string bound_address_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::atomic<int> open_{0};
  std::thread thread_;
};

}  // namespace epserve::server
