#include "server/stream_guard.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/parallel.h"

namespace epserve::server {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// Parses one channelz answer (a JSON string gRPC allocated) and frees it.
bool ParseChannelz(char* json, Struct* out) {
  if (json == nullptr) return false;
  const bool ok = google::protobuf::util::JsonStringToMessage(json, out).ok();
  gpr_free(json);
  return ok;
}

// A field by its camelCase name or its snake_case one (gRPC versions write either).
const Value* Field(const Struct& s, const char* name) {
  auto it = s.fields().find(name);
  if (it != s.fields().end()) return &it->second;
  std::string snake;
  for (const char* c = name; *c != 0; ++c) {
    if (*c >= 'A' && *c <= 'Z') {
      snake += '_';
      snake += static_cast<char>(*c - 'A' + 'a');
    } else {
      snake += *c;
    }
  }
  it = s.fields().find(snake);
  return it == s.fields().end() ? nullptr : &it->second;
}

// channelz writes int64 fields as JSON strings; absent means 0.
int64_t Int(const Struct& s, const char* name) {
  const Value* v = Field(s, name);
  if (v == nullptr) return 0;
  if (v->has_number_value()) return static_cast<int64_t>(v->number_value());
  int64_t n = 0;
  return absl::SimpleAtoi(v->string_value(), &n) ? n : 0;
}

const Struct* Sub(const Struct& s, const char* name) {
  const Value* v = Field(s, name);
  return v != nullptr && v->has_struct_value() ? &v->struct_value() : nullptr;
}

struct Endpoint {
  std::string ip;  // raw bytes (4 or 16)
  int port = 0;
};

bool ParseAddress(const Struct* addr, Endpoint* out) {
  const Struct* tcp = addr ? Sub(*addr, "tcpipAddress") : nullptr;
  if (tcp == nullptr) return false;
  const Value* ip = Field(*tcp, "ipAddress");
  if (ip == nullptr || !absl::Base64Unescape(ip->string_value(), &out->ip)) return false;
  out->port = static_cast<int>(Int(*tcp, "port"));
  return true;
}

bool SameEndpoint(const sockaddr_storage& sa, const Endpoint& e) {
  if (sa.ss_family == AF_INET && e.ip.size() == 4) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(sa);
    return ntohs(in.sin_port) == e.port && std::memcmp(&in.sin_addr, e.ip.data(), 4) == 0;
  }
  if (sa.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(sa);
    if (ntohs(in6.sin6_port) != e.port) return false;
    if (e.ip.size() == 16) return std::memcmp(&in6.sin6_addr, e.ip.data(), 16) == 0;
    // An IPv4 peer on a dual-stack socket: ::ffff:a.b.c.d
    return e.ip.size() == 4 && IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr) &&
           std::memcmp(reinterpret_cast<const char*>(&in6.sin6_addr) + 12, e.ip.data(), 4) == 0;
  }
  return false;
}

// Shuts down this process's TCP socket whose local and remote ends are `local` and
// `remote`; true if one was found.
bool ShutDownSocket(const Endpoint& local, const Endpoint& remote) {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return false;
  bool done = false;
  while (dirent* e = readdir(d)) {
    int fd = 0;
    if (!absl::SimpleAtoi(e->d_name, &fd) || fd == dirfd(d)) continue;
    sockaddr_storage peer{}, self{};
    socklen_t pl = sizeof(peer), sl = sizeof(self);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&self), &sl) != 0) continue;
    if (SameEndpoint(peer, remote) && SameEndpoint(self, local)) {
      done = shutdown(fd, SHUT_RDWR) == 0;
      break;
    }
  }
  closedir(d);
  return done;
}

// What channelz tells of one server connection.
struct Connection {
  int64_t started = 0;    // streams the client started
  int64_t completed = 0;  // streams destroyed: succeeded or failed
  int64_t open_streams() const { return started - completed; }
  std::string peer;  // as grpc::ServerContext::peer() names it
  Endpoint local, remote;
  std::string name;
};

// The ids of every gRPC server connection past its handshake, oldest first.
std::vector<int64_t> ConnectionIds(const Struct& servers) {
  std::vector<int64_t> ids;
  const Value* list = Field(servers, "server");
  if (list == nullptr) return ids;
  for (const Value& server : list->list_value().values()) {
    const Struct* ref = Sub(server.struct_value(), "ref");
    if (ref == nullptr) continue;
    int64_t start = 0;
    while (true) {
      Struct page;
      if (!ParseChannelz(grpc_channelz_get_server_sockets(Int(*ref, "serverId"), start, 0),
                         &page)) {
        break;
      }
      const Value* refs = Field(page, "socketRef");
      if (refs == nullptr || refs->list_value().values_size() == 0) break;
      for (const Value& r : refs->list_value().values()) {
        const int64_t id = Int(r.struct_value(), "socketId");
        ids.push_back(id);
        start = std::max(start, id + 1);
      }
      const Value* end = Field(page, "end");
      if (end != nullptr && end->bool_value()) break;  // absent on all but the last page
    }
  }
  std::sort(ids.begin(), ids.end());  // channelz numbers objects as it creates them
  return ids;
}

bool Describe(int64_t id, Connection* c) {
  Struct socket;
  if (!ParseChannelz(grpc_channelz_get_socket(id), &socket)) return false;
  const Struct* sock = Sub(socket, "socket");
  const Struct* data = sock ? Sub(*sock, "data") : nullptr;
  if (data == nullptr) return false;
  c->started = Int(*data, "streamsStarted");
  c->completed = Int(*data, "streamsSucceeded") + Int(*data, "streamsFailed");
  const Struct* ref = Sub(*sock, "ref");
  const Value* name = ref ? Field(*ref, "name") : nullptr;
  c->name = name ? name->string_value() : std::string("?");
  c->peer = c->name.substr(std::min(c->name.find(' ') + 1, c->name.size()));  // "chttp2 <peer>"
  return ParseAddress(Sub(*sock, "local"), &c->local) &&
         ParseAddress(Sub(*sock, "remote"), &c->remote);
}

// Calls open in the whole server (0 when channelz cannot tell).
int64_t OpenCalls(const Struct& servers) {
  int64_t open = 0;
  const Value* list = Field(servers, "server");
  if (list == nullptr) return 0;
  for (const Value& server : list->list_value().values()) {
    const Struct* d = Sub(server.struct_value(), "data");
    if (d != nullptr) {
      open += Int(*d, "callsStarted") - Int(*d, "callsSucceeded") - Int(*d, "callsFailed");
    }
  }
  return open;
}

}  // namespace

bool StreamWatch::Observe(const Counts& now) {
  if (now.unseen() <= bound_) {
    over_ = false;
    return false;
  }
  if (now.unseen() > 8 * bound_) return true;
  if (!over_) {
    over_ = true;
    since_ = now;
    return false;
  }
  if (now.at - since_.at < window_) return false;
  if (StillOpen(since_, now) > bound_) return true;
  since_ = now;  // a backlog that drains: the next window starts here
  return false;
}

absl::Status StreamGuardOptions::Validate() const {
  if (max_connections < 1) return absl::InvalidArgumentError("--grpc-max-connections must be >= 1");
  if (max_streams < 1) return absl::InvalidArgumentError("--max-concurrent-streams must be >= 1");
  return absl::OkStatus();
}

StreamGuard::StreamGuard(const StreamGuardOptions& options, Callbacks callbacks)
    : options_(options), callbacks_(std::move(callbacks)) {
  thread_ = std::thread([this] {
    common::NameThisThread("ep-stream-guard");
    Run();
  });
}

StreamGuard::~StreamGuard() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StreamGuard::Run() {
  absl::Time next_count = absl::InfinitePast();
  std::unique_lock<std::mutex> lock(mu_);
  // While a connection is over the bound, passes come four times as often: a flood grows by
  // thousands of streams between two passes, and each is memory until the connection goes.
  while (!cv_.wait_for(
      lock, absl::ToChronoNanoseconds(over_.empty() ? options_.interval : options_.interval / 4),
      [this] { return stop_; })) {
    lock.unlock();
    CheckOnce();
    if (absl::Now() >= next_count) {
      CheckConnections();
      next_count = absl::Now() + absl::Seconds(1);
    }
    lock.lock();
  }
}

void StreamGuard::Closed(int64_t id, const std::string& peer, int64_t open_streams,
                         const char* reason) {
  closed_.insert(id);
  trim_until_ = absl::Now() + absl::Seconds(10);
  if (callbacks_.on_close) callbacks_.on_close(peer, open_streams, reason);
}

int StreamGuard::CheckConnections() {
  Struct servers;
  if (!ParseChannelz(grpc_channelz_get_servers(0), &servers)) return 0;
  const std::vector<int64_t> ids = ConnectionIds(servers);
  if (callbacks_.on_count) callbacks_.on_count(static_cast<int64_t>(ids.size()));
  int64_t excess = static_cast<int64_t>(ids.size()) - options_.max_connections;
  int closed = 0;
  // Over the bound: the newest connections without a call go (as if they had been refused;
  // established clients keep theirs, and a connection with calls is serving someone).
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    const int64_t id = *it;
    if (excess <= 0) break;
    Connection c;
    if (closed_.count(id) > 0 || !Describe(id, &c) || c.open_streams() > 0) continue;
    if (ShutDownSocket(c.local, c.remote)) {
      Closed(id, c.name, c.open_streams(), "connection_limit");
      ++closed;
      --excess;
    }
  }
  return closed;
}

int StreamGuard::CheckOnce() {
  int closed = 0;
  Struct servers;
  if (!ParseChannelz(grpc_channelz_get_servers(0), &servers)) return 0;
  std::map<int64_t, StreamWatch> over;  // connections over the bound in this pass
  // Cheap first: fewer calls open in the whole server than one connection may have cannot
  // put any connection over the bound.
  if (OpenCalls(servers) > options_.max_streams) {
    const absl::Time now = absl::Now();
    for (int64_t id : ConnectionIds(servers)) {
      Connection c;
      if (closed_.count(id) > 0 || !Describe(id, &c)) continue;
      StreamWatch::Counts counts;
      counts.at = now;
      counts.started = c.started;
      counts.completed = c.completed;
      counts.held = callbacks_.held_calls ? callbacks_.held_calls(c.peer) : 0;
      auto it = over_.find(id);
      StreamWatch watch =
          it != over_.end() ? it->second : StreamWatch(kSlack * options_.max_streams, kWindow);
      const bool shut = watch.Observe(counts);
      if (shut && ShutDownSocket(c.local, c.remote)) {
        Closed(id, c.name, c.open_streams(), "stream_limit");
        ++closed;
      } else if (watch.over()) {
        over.emplace(id, watch);
      }
    }
  }
  over_ = std::move(over);
  // The closed connections' calls go over the next seconds (tens of thousands take a while):
  // memory is returned at every pass for 10 s after a close.
  if (closed == 0 && absl::Now() < trim_until_) malloc_trim(0);
  if (closed_.size() > 65536) closed_.clear();
  return closed;
}

}  // namespace epserve::server
