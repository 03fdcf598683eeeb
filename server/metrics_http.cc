#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <unordered_map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/parallel.h"
#include "common/status.h"

namespace epserve::server {
namespace {

using Clock = std::chrono::steady_clock;

Clock::duration ToClock(absl::Duration d) {
  return std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(d));
}

struct Conn {
  int fd = -1;
  uint64_t order = 0;  // accept order: the oldest is evicted first
  bool writing = false;
  bool keep_alive = true;
  bool close_after_write = false;
  std::string in;
  std::string out;
  size_t out_done = 0;
  Clock::time_point deadline;
  HttpEvent on_deadline = HttpEvent::kHeaderTimeout;
};

// The response to one request's head (request line and headers), and whether the connection
// stays open after it.
struct Answer {
  std::string bytes;
  bool keep_alive = false;
  bool bad = false;
};

std::string Response(int code, absl::string_view reason, absl::string_view content_type,
                     const std::string& body, bool head, bool keep_alive) {
  std::string r = absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                               "\r\nContent-Length: ", body.size(),
                               "\r\nConnection: ", keep_alive ? "keep-alive" : "close", "\r\n\r\n");
  if (!head) r += body;
  return r;
}

Answer Respond(absl::string_view request_head, const std::function<std::string()>& render,
               const std::vector<HttpPage>& pages) {
  Answer a;
  const std::vector<absl::string_view> lines = absl::StrSplit(request_head, "\r\n");
  const std::vector<absl::string_view> parts = absl::StrSplit(lines[0], ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) {
    a.bad = true;
    a.bytes = Response(400, "Bad Request", "text/plain", "bad request line\n", false, false);
    return a;
  }
  a.keep_alive = parts[2] == "HTTP/1.1";
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == absl::string_view::npos) continue;
    if (!absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(lines[i].substr(0, colon)),
                                "connection")) {
      continue;
    }
    const absl::string_view value = absl::StripAsciiWhitespace(lines[i].substr(colon + 1));
    if (absl::EqualsIgnoreCase(value, "close")) a.keep_alive = false;
    if (absl::EqualsIgnoreCase(value, "keep-alive")) a.keep_alive = true;
  }
  const bool head = parts[0] == "HEAD";
  if (parts[0] != "GET" && !head) {
    a.bad = true;
    a.bytes = Response(405, "Method Not Allowed", "text/plain", "GET /metrics only\n", false,
                       a.keep_alive);
    return a;
  }
  const absl::string_view path = parts[1].substr(0, parts[1].find('?'));
  for (const HttpPage& page : pages) {
    if (path != page.path) continue;
    a.bytes = Response(200, "OK", page.content_type, page.render(), head, a.keep_alive);
    return a;
  }
  if (path != "/metrics") {
    a.bad = true;
    a.bytes = Response(404, "Not Found", "text/plain", "see /metrics\n", head, a.keep_alive);
    return a;
  }
  a.bytes =
      Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", render(), head, a.keep_alive);
  return a;
}

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// INVALID_ARGUMENT naming the flag of the first option out of its bounds.
absl::Status CheckOptions(const MetricsHttpOptions& options) {
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-max-connections must be >= 1, got ", options.max_connections));
  }
  for (const auto& [flag, value] : {std::pair{"--metrics-header-timeout", options.header_timeout},
                                    {"--metrics-idle-timeout", options.idle_timeout},
                                    {"--metrics-write-timeout", options.write_timeout}}) {
    if (value <= absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " must be > 0"));
    }
  }
  if (options.max_header_bytes < 64 || options.max_pending_bytes < 1) {
    return absl::InvalidArgumentError(
        "metrics server: max_header_bytes must be >= 64 and max_pending_bytes >= 1");
  }
  return absl::OkStatus();
}

// --metrics-address split at its last colon.
struct HostPort {
  std::string prefix;  // what precedes the port, as given ("[::1]", "0.0.0.0", "")
  std::string host;    // the prefix without an IPv6 literal's brackets
  int port = -1;       // 0: any free port
};

absl::StatusOr<HostPort> ParseAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  HostPort a;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &a.port) ||
      a.port < 0 || a.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics-address='", address,
                                                   "' is not host:port with a port in [0, 65535]"));
  }
  a.prefix = address.substr(0, colon);
  a.host = a.prefix;
  if (a.host.size() >= 2 && a.host.front() == '[' && a.host.back() == ']') {
    a.host = a.host.substr(1, a.host.size() - 2);
  }
  return a;
}

// Each connection is a descriptor: makes room for the bound (the soft limit is often 1024),
// as far as the hard limit allows.
void RaiseOpenFileLimit(int max_connections) {
  rlimit lim{};
  const rlim_t want = static_cast<rlim_t>(max_connections) + 256;
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < want) {
    lim.rlim_cur = std::min(want, lim.rlim_max);
    setrlimit(RLIMIT_NOFILE, &lim);
  }
}

// A non-blocking listening socket on `a`; the caller owns it. `address` (the flag's value)
// names it in errors.
absl::StatusOr<int> Listen(const HostPort& a, const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(a.host.empty() ? nullptr : a.host.c_str(), std::to_string(a.port).c_str(), &hints,
                  &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-address='", address, "': cannot resolve '", a.host, "'"));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  const int one = 1;
  // SO_REUSEPORT (as gRPC's port has it): a replacement job binds the same address while the
  // one it replaces drains (deploy/supervisor.py, replace_degraded).
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) != 0 ||
      bind(fd, found->ai_addr, found->ai_addrlen) != 0 || listen(fd, 1024) != 0) {
    const absl::Status st =
        Errno(absl::StrCat("cannot serve metrics on --metrics-address=", address));
    if (fd >= 0) ::close(fd);
    freeaddrinfo(found);
    return st;
  }
  freeaddrinfo(found);
  return fd;
}

// The port the socket `fd` is bound to (the one picked for port 0).
int BoundPort(int fd) {
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  return bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                     : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
}

}  // namespace

const char* HttpEventName(HttpEvent event) {
  switch (event) {
    case HttpEvent::kAccepted:
      return "accepted";
    case HttpEvent::kServed:
      return "served";
    case HttpEvent::kBadRequest:
      return "bad_request";
    case HttpEvent::kHeaderTimeout:
      return "header_timeout";
    case HttpEvent::kIdleTimeout:
      return "idle_timeout";
    case HttpEvent::kWriteTimeout:
      return "write_timeout";
    case HttpEvent::kEvicted:
      return "evicted";
  }
  return "?";
}

// The server thread's state.
struct MetricsHttpServer::Loop {
  MetricsHttpServer& s;
  std::unordered_map<int, Conn> conns;
  uint64_t next_order = 0;
  int64_t pending_bytes = 0;  // responses not yet taken, over every connection

  void Event(HttpEvent e) const {
    if (s.on_event_) s.on_event_(e);
  }
  void Close(int fd, HttpEvent why, bool count = true) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    pending_bytes -= static_cast<int64_t>(it->second.out.size() - it->second.out_done);
    epoll_ctl(s.epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    conns.erase(it);
    s.open_.store(static_cast<int>(conns.size()), std::memory_order_relaxed);
    if (count) Event(why);
  }
  // The oldest connection that is (writing ? waiting for its response to be taken : still
  // sending its request), or -1.
  int Oldest(bool writing) const {
    int fd = -1;
    uint64_t order = UINT64_MAX;
    for (const auto& [f, c] : conns) {
      if (c.writing == writing && c.order < order) {
        order = c.order;
        fd = f;
      }
    }
    return fd;
  }
  void Accept() {
    for (;;) {
      const int fd = accept4(s.listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or out of descriptors: later
      if (static_cast<int>(conns.size()) >= s.options_.max_connections) {
        const int victim = Oldest(/*writing=*/false);
        if (victim < 0) {
          ::close(fd);
          Event(HttpEvent::kEvicted);
          continue;
        }
        Close(victim, HttpEvent::kEvicted);
      }
      Conn c;
      c.fd = fd;
      c.order = next_order++;
      c.deadline = Clock::now() + ToClock(s.options_.header_timeout);
      c.on_deadline = HttpEvent::kHeaderTimeout;
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.fd = fd;
      if (epoll_ctl(s.epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
        ::close(fd);
        continue;
      }
      conns.emplace(fd, std::move(c));
      s.open_.store(static_cast<int>(conns.size()), std::memory_order_relaxed);
      Event(HttpEvent::kAccepted);
    }
  }
  // Answers the first whole request in c.in, if there is one.
  void MaybeAnswer(Conn& c) {
    const size_t end = c.in.find("\r\n\r\n");
    if (end == std::string::npos) {
      if (static_cast<int64_t>(c.in.size()) > s.options_.max_header_bytes) {
        Event(HttpEvent::kBadRequest);
        StartWrite(c,
                   Response(431, "Request Header Fields Too Large", "text/plain",
                            "request head too large\n", false, false),
                   false);
      }
      return;
    }
    Answer a = Respond(absl::string_view(c.in).substr(0, end), s.render_, s.pages_);
    c.in.erase(0, end + 4);
    if (a.bad) Event(HttpEvent::kBadRequest);
    StartWrite(c, std::move(a.bytes), a.keep_alive);
  }
  void StartWrite(Conn& c, std::string bytes, bool keep_alive) {
    c.writing = true;
    c.keep_alive = keep_alive;
    c.out = std::move(bytes);
    c.out_done = 0;
    c.deadline = Clock::now() + ToClock(s.options_.write_timeout);
    c.on_deadline = HttpEvent::kWriteTimeout;
    pending_bytes += static_cast<int64_t>(c.out.size());
    epoll_event ev{};
    ev.events = EPOLLOUT | EPOLLRDHUP;
    ev.data.fd = c.fd;
    epoll_ctl(s.epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
    // Responses held for slow readers stay within the budget: the oldest go first.
    const int self = c.fd;
    while (pending_bytes > s.options_.max_pending_bytes) {
      int victim = -1;
      uint64_t order = UINT64_MAX;
      for (const auto& [f, other] : conns) {
        if (other.writing && f != self && other.order < order) {
          order = other.order;
          victim = f;
        }
      }
      if (victim < 0) break;
      Close(victim, HttpEvent::kEvicted);
    }
    Write(self);
  }
  void Write(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    Conn& c = it->second;
    while (c.out_done < c.out.size()) {
      const ssize_t n =
          ::send(fd, c.out.data() + c.out_done, c.out.size() - c.out_done, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        Close(fd, HttpEvent::kServed, /*count=*/false);
        return;
      }
      c.out_done += static_cast<size_t>(n);
      pending_bytes -= n;
    }
    const bool bad = c.out.compare(0, 12, "HTTP/1.1 200") != 0;
    if (!bad) Event(HttpEvent::kServed);
    if (!c.keep_alive) {
      Close(fd, HttpEvent::kServed, /*count=*/false);
      return;
    }
    c.writing = false;
    c.out.clear();
    c.out_done = 0;
    c.deadline =
        Clock::now() + ToClock(c.in.empty() ? s.options_.idle_timeout : s.options_.header_timeout);
    c.on_deadline = c.in.empty() ? HttpEvent::kIdleTimeout : HttpEvent::kHeaderTimeout;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    epoll_ctl(s.epoll_fd_, EPOLL_CTL_MOD, fd, &ev);
    MaybeAnswer(c);  // a pipelined request already read
  }
  void Read(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    Conn& c = it->second;
    char buf[4096];
    bool peer_done = false;  // the client closed its side (it may still read the answer)
    for (;;) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n < 0) {
        Close(fd, HttpEvent::kServed, /*count=*/false);
        return;
      }
      if (n == 0) {
        peer_done = true;
        break;
      }
      if (c.in.empty() && c.on_deadline == HttpEvent::kIdleTimeout) {
        // A new request on a kept-alive connection: its head has header_timeout from now.
        c.deadline = Clock::now() + ToClock(s.options_.header_timeout);
        c.on_deadline = HttpEvent::kHeaderTimeout;
      }
      c.in.append(buf, static_cast<size_t>(n));
      if (static_cast<int64_t>(c.in.size()) > s.options_.max_header_bytes + 4) break;
    }
    if (!c.writing) MaybeAnswer(c);
    auto again = conns.find(fd);  // MaybeAnswer may have finished and closed it
    if (again == conns.end() || !peer_done) return;
    if (again->second.writing) {
      again->second.keep_alive = false;  // answer, then close
      epoll_event ev{};
      ev.events = EPOLLOUT;  // no more EPOLLRDHUP: it stays set
      ev.data.fd = fd;
      epoll_ctl(s.epoll_fd_, EPOLL_CTL_MOD, fd, &ev);
    } else {
      Close(fd, HttpEvent::kServed, /*count=*/false);  // the client left without asking
    }
  }
  void Expire() {
    const Clock::time_point now = Clock::now();
    std::vector<std::pair<int, HttpEvent>> due;
    for (const auto& [fd, c] : conns) {
      if (c.deadline <= now) due.emplace_back(fd, c.on_deadline);
    }
    for (const auto& [fd, why] : due) Close(fd, why);
  }
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpOptions& options, std::function<std::string()> render,
    std::function<void(HttpEvent)> on_event, std::vector<HttpPage> pages) {
  EPSERVE_RETURN_IF_ERROR(CheckOptions(options));
  absl::StatusOr<HostPort> address = ParseAddress(options.address);
  if (!address.ok()) return address.status();
  RaiseOpenFileLimit(options.max_connections);

  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->options_ = options;
  s->render_ = std::move(render);
  s->pages_ = std::move(pages);
  s->on_event_ = std::move(on_event);
  absl::StatusOr<int> fd = Listen(*address, options.address);
  if (!fd.ok()) return fd.status();
  s->listen_fd_ = *fd;
  s->bound_address_ = absl::StrCat(address->prefix, ":", BoundPort(*fd));
  s->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  s->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (s->wake_fd_ < 0 || s->epoll_fd_ < 0) return Errno("metrics server: eventfd/epoll");
  for (int watched : {s->listen_fd_, s->wake_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = watched;
    if (epoll_ctl(s->epoll_fd_, EPOLL_CTL_ADD, watched, &ev) != 0) {
      return Errno("metrics server: epoll_ctl");
    }
  }
  s->thread_ = std::thread([server = s.get()] {
    common::NameThisThread("ep-metrics-http");
    server->Run();
  });
  return s;
}

void MetricsHttpServer::Run() {
  Loop loop{*this, {}, 0, 0};
  epoll_event events[256];
  for (;;) {
    const int n = epoll_wait(epoll_fd_, events, 256, 100);  // deadlines are checked each 100 ms
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        for (auto& [cfd, c] : loop.conns) ::close(cfd);
        loop.conns.clear();
        open_.store(0);
        return;
      }
      if (fd == listen_fd_) {
        loop.Accept();
        continue;
      }
      if (events[i].events & (EPOLLERR | EPOLLHUP)) {
        loop.Close(fd, HttpEvent::kServed, /*count=*/false);
        continue;
      }
      if (events[i].events & EPOLLOUT) loop.Write(fd);
      if (events[i].events & (EPOLLIN | EPOLLRDHUP)) loop.Read(fd);
    }
    loop.Expire();
  }
}

MetricsHttpServer::~MetricsHttpServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  for (int fd : {listen_fd_, wake_fd_, epoll_fd_}) {
    if (fd >= 0) ::close(fd);
  }
}

}  // namespace epserve::server
