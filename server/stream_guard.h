// Holds gRPC connections to --max-concurrent-streams even when the client never acknowledges
// the server's SETTINGS, and the connections to --grpc-max-connections. gRPC 1.51 (Debian
// 12's) enforces the stream bound only once the client has acknowledged it, so a raw HTTP/2
// client that never does can open tens of thousands of streams on one connection (each holds
// a call, about 12 KiB, outside any quota), and it has no bound on connections. The guard
// reads the server's connections from channelz: every interval their stream counters (only
// when the whole server has more calls open than one connection may; every quarter interval
// while a connection is over the bound), and once a second their number, shutting down the
// newest connections without calls beyond the bound. HTTP/2 requires a client to respect the
// stream bound once sent.
//
// channelz counts a stream open until gRPC destroys it, which trails the HTTP/2 stream: for a
// call the service holds (queued, computing, answering), until the service lets go; for one it
// let go, or one not yet handed to it, as long as gRPC's own threads fall behind. Under 10x
// overload on CI's two cores a well-behaved connection (at most 256 streams from its own side)
// showed 1488 "open" beyond what the service held, and in another run 4298 open, gRPC about a
// second behind. So neither a count nor a second's turnover can tell a flood from a backlog;
// ten seconds' turnover can: a backlog drains within the requests' deadlines, a flood holds.
// StreamWatch makes that call for one connection.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace epserve::server {

// The verdict on one connection's streams from its channelz counters at successive passes.
// "Unseen" streams are those open beyond the calls the service holds for the connection.
// Over `bound` unseen streams, the connection is shut down when
//  - of the streams open when it went over, more than `bound` beyond what the service holds
//    now are still open `window` later (held that long: a flood, not a backlog, which drains
//    within the requests' deadlines);
//  - more than 8x `bound` are unseen at any pass, whatever their turnover (a hard ceiling on
//    the memory a connection's streams hold: a client that churns streams to hide held ones
//    cannot hold more, and a flood of tens of thousands goes at the first pass that sees it).
// Streams that complete between passes bound the old ones from below: of the streams open at
// pass A, at least open(A) - completed(A..B) are still open at pass B.
class StreamWatch {
 public:
  struct Counts {
    absl::Time at;
    int64_t started = 0;    // channelz streamsStarted
    int64_t completed = 0;  // streamsSucceeded + streamsFailed
    int64_t held = 0;       // calls the service holds for the connection
    int64_t open() const { return started - completed; }
    int64_t unseen() const { return open() - held; }
  };
  StreamWatch(int64_t bound, absl::Duration window) : bound_(bound), window_(window) {}

  // One pass; true: shut the connection down.
  bool Observe(const Counts& now);
  // Whether the last pass found the connection over the bound.
  bool over() const { return over_; }

 private:
  // Streams open at `then` that are still open at `now`, beyond what the service holds now.
  static int64_t StillOpen(const Counts& then, const Counts& now) {
    return then.open() - (now.completed - then.completed) - now.held;
  }

  const int64_t bound_;
  const absl::Duration window_;
  bool over_ = false;
  Counts since_;  // the pass that started the present window (over_ only)
};

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
  static constexpr int kSlack = 4;  // StreamWatch's bound: kSlack x --max-concurrent-streams
  // StreamWatch's window, a time (passes come faster while a connection is over the bound):
  // twice the deadlines of the overload test's requests; the backlog CI showed was about a
  // second of the server's work.
  static constexpr absl::Duration kWindow = absl::Seconds(10);
  void Run();
  // Bookkeeping for connection `id` just shut down.
  void Closed(int64_t id, const std::string& peer, int64_t open_streams, const char* reason);

  const StreamGuardOptions options_;
  const Callbacks callbacks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;                    // guarded by mu_
  std::map<int64_t, StreamWatch> over_;  // connections over the stream bound in the last pass
  std::set<int64_t> closed_;             // connections already shut down
  absl::Time trim_until_ = absl::InfinitePast();
  std::thread thread_;
};

}  // namespace epserve::server
