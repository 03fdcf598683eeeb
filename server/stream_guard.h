// Holds gRPC connections to --max-concurrent-streams even when the client never acknowledges
// the server's SETTINGS, and the connections to --grpc-max-connections. gRPC 1.51 (Debian
// 12's) enforces the stream bound only once the client has acknowledged it, so a raw HTTP/2
// client that never does can open tens of thousands of streams on one connection (each holds
// a call, about 12 KiB, outside any quota), and it has no bound on connections. The guard
// reads the server's connections from channelz: every interval their open streams (only when
// the whole server has more calls open than one connection may), shutting down a connection
// over 4x the bound in two passes in a row or 16x in one, not counting the calls the service
// holds for it (gRPC counts a stream closed only once it is destroyed, which for a call the
// service still holds is after it lets go: 1524 on a well-behaved connection under a bound of
// 256 at 10x overload), then returning the freed memory to the system; and once a second
// their number, shutting down the newest connections without calls beyond the bound. HTTP/2
// requires a client to respect the stream bound once sent.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace epserve::server {

// Each bound is set by its flag; FrontEndOptions::streams is their home, which also gives gRPC
// the stream bound (GRPC_ARG_MAX_CONCURRENT_STREAMS).
struct StreamGuardOptions {
  int max_streams = 256;           // --max-concurrent-streams: per connection
  int64_t max_connections = 4096;  // --grpc-max-connections: past their HTTP/2 handshake
  absl::Duration interval = absl::Milliseconds(100);

  // INVALID_ARGUMENT naming the flag and its bound.
  absl::Status Validate() const;
};

class StreamGuard {
 public:
  struct Callbacks {
    // A connection shut down: its peer, its open streams and why ("stream_limit",
    // "connection_limit").
    std::function<void(const std::string& peer, int64_t open_streams, const char* reason)> on_close;
    // About once a second: the connections the gRPC server has open past their handshake.
    std::function<void(int64_t connections)> on_count;
    // The calls the service holds for the connection to `peer` (grpc::ServerContext::peer()).
    std::function<int64_t(const std::string& peer)> held_calls;
  };

  StreamGuard(const StreamGuardOptions& options, Callbacks callbacks);  // copies `options`
  ~StreamGuard();                                                       // stops the thread

  // One pass over the streams: shuts down the connections over the bound; returns how many.
  // (The thread calls it every interval.)
  int CheckOnce();
  // One pass over the connections (the thread calls it once a second): counts them and,
  // over max_connections, shuts down the newest that have no call open; returns how many.
  int CheckConnections();

 private:
  static constexpr int kSlack = 4;
  void Run();
  // Bookkeeping for connection `id` just shut down.
  void Closed(int64_t id, const std::string& peer, int64_t open_streams, const char* reason);

  const StreamGuardOptions options_;
  const Callbacks callbacks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;         // guarded by mu_
  std::set<int64_t> over_;    // connections over the stream bound in the last pass
  std::set<int64_t> closed_;  // connections already shut down
  absl::Time trim_until_ = absl::InfinitePast();
  std::thread thread_;
};

}  // namespace epserve::server
