// The /metrics endpoint under idle, slow and hostile clients (server/metrics_http.h), on
// loopback with port 0. Timings are bounds, not figures: each attack's wait is far above what
// a served scrape takes and far below the test's timeout.
#include "server/metrics_http.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace epserve::server {
namespace {

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

int Dial(const std::string& address) {
  const size_t colon = address.rfind(':');
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(address.substr(0, colon).c_str(), address.substr(colon + 1).c_str(), &hints,
                  &res) != 0) {
    return -1;
  }
  int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  return fd;
}

// Reads until the peer closes or `timeout_ms` passes; what arrived.
std::string ReadAll(int fd, int timeout_ms) {
  std::string out;
  const Clock::time_point start = Clock::now();
  char buf[65536];
  while (MsSince(start) < timeout_ms) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// Whether the server closed `fd` within `timeout_ms` (read returns 0 or an error).
bool ClosedWithin(int fd, int timeout_ms) {
  const Clock::time_point start = Clock::now();
  char buf[4096];
  while (MsSince(start) < timeout_ms) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 20) <= 0) continue;
    if (read(fd, buf, sizeof(buf)) <= 0) return true;
  }
  return false;
}

// One scrape on a fresh connection (HTTP/1.0): the whole response, "" if none.
std::string Scrape(const std::string& address, const std::string& path = "/metrics") {
  const int fd = Dial(address);
  if (fd < 0) return "";
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: x\r\n\r\n";
  std::string out;
  if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
    out = ReadAll(fd, 5000);
  }
  close(fd);
  return out;
}

class MetricsHttpTest : public ::testing::Test {
 protected:
  // `body_bytes`: the scrape's size (a slow reader holds what exceeds the sockets' buffers,
  // which loopback's autotuning grows to a few MiB).
  void StartServer(MetricsHttpOptions options, size_t body_bytes = 256 << 10) {
    options.address = "127.0.0.1:0";
    body_.assign(body_bytes, '#');
    for (size_t i = 0; i < body_.size(); i += 64) body_[i] = '\n';
    auto s = MetricsHttpServer::Start(
        options, [this] { return body_; },
        [this](HttpEvent e) { events_[static_cast<int>(e)].fetch_add(1); });
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
  }
  int64_t Count(HttpEvent e) const { return events_[static_cast<int>(e)].load(); }

  std::string body_;
  std::array<std::atomic<int64_t>, kNumHttpEvents> events_{};
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttpTest, AnswersScrapesAndRejectsWhatIsNotOne) {
  StartServer({});
  const std::string ok = Scrape(server_->bound_address());
  ASSERT_NE(ok.find("HTTP/1.1 200 OK"), std::string::npos) << ok.substr(0, 200);
  EXPECT_NE(ok.find("Content-Length: " + std::to_string(body_.size())), std::string::npos);
  EXPECT_EQ(ok.substr(ok.find("\r\n\r\n") + 4), body_);
  EXPECT_NE(Scrape(server_->bound_address(), "/other").find(" 404 "), std::string::npos);
  EXPECT_NE(Scrape(server_->bound_address(), "/metrics?x=1").find(" 200 "), std::string::npos);

  // Keep-alive: two scrapes on one HTTP/1.1 connection; POST and garbage get errors.
  const int fd = Dial(server_->bound_address());
  const std::string two =
      "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n"
      "Connection: close\r\n\r\n";
  ASSERT_EQ(write(fd, two.data(), two.size()), static_cast<ssize_t>(two.size()));
  const std::string both = ReadAll(fd, 5000);
  close(fd);
  size_t answers = 0;
  for (size_t at = both.find("HTTP/1.1 200"); at != std::string::npos;
       at = both.find("HTTP/1.1 200", at + 1)) {
    ++answers;
  }
  EXPECT_EQ(answers, 2u);
  const int post = Dial(server_->bound_address());
  const std::string p = "POST /metrics HTTP/1.1\r\n\r\n";
  ASSERT_EQ(write(post, p.data(), p.size()), static_cast<ssize_t>(p.size()));
  EXPECT_NE(ReadAll(post, 300).find(" 405 "), std::string::npos);
  close(post);
  const int junk = Dial(server_->bound_address());
  const std::string j = "\x16\x03\x01 garbage \r\n\r\n";
  ASSERT_EQ(write(junk, j.data(), j.size()), static_cast<ssize_t>(j.size()));
  EXPECT_NE(ReadAll(junk, 1000).find(" 400 "), std::string::npos);
  close(junk);
  const int big = Dial(server_->bound_address());
  const std::string huge = "GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a');
  (void)!write(big, huge.data(), huge.size());
  EXPECT_NE(ReadAll(big, 1000).find(" 431 "), std::string::npos);
  close(big);
  EXPECT_GE(Count(HttpEvent::kBadRequest), 4);
  EXPECT_GE(Count(HttpEvent::kServed), 4);
}

// 1000 connections that never send a byte, and scrapes that must still be answered quickly.
TEST_F(MetricsHttpTest, ThousandIdleConnectionsDoNotBlindIt) {
  MetricsHttpOptions o;
  o.max_connections = 1024;
  StartServer(o);
  std::vector<int> idle;
  for (int i = 0; i < 1000; ++i) {
    const int fd = Dial(server_->bound_address());
    ASSERT_GE(fd, 0) << "connection " << i;
    idle.push_back(fd);
  }
  std::vector<double> ms;
  for (int i = 0; i < 20; ++i) {
    const Clock::time_point t = Clock::now();
    const std::string r = Scrape(server_->bound_address());
    ms.push_back(MsSince(t));
    ASSERT_NE(r.find(" 200 "), std::string::npos) << "scrape " << i;
  }
  std::sort(ms.begin(), ms.end());
  std::printf("[ metrics ] 1000 idle connections: scrape p50 %.1f ms, max %.1f ms\n", ms[10],
              ms.back());
  EXPECT_LT(ms.back(), 1000.0);
  EXPECT_GE(server_->open_connections(), 1000);
  for (int fd : idle) close(fd);
}

// Idle and slowloris connections are closed at the header timeout; the bound evicts the
// oldest idle connection to admit a scraper.
TEST_F(MetricsHttpTest, ReapsIdleAndSlowClientsAndEvictsAtTheBound) {
  MetricsHttpOptions o;
  o.header_timeout = absl::Milliseconds(400);
  o.max_connections = 8;
  StartServer(o);
  const int silent = Dial(server_->bound_address());
  const int slow = Dial(server_->bound_address());
  std::atomic<bool> slow_done{false};
  std::thread loris([&] {  // one byte every 100 ms: never a whole head within 400 ms
    const std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    for (char c : req) {
      if (slow_done.load() || send(slow, &c, 1, MSG_NOSIGNAL) != 1) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  EXPECT_TRUE(ClosedWithin(silent, 2000));
  EXPECT_TRUE(ClosedWithin(slow, 2000));
  slow_done.store(true);
  loris.join();
  close(silent);
  close(slow);
  EXPECT_GE(Count(HttpEvent::kHeaderTimeout), 2);

  std::vector<int> fill;
  for (int i = 0; i < 8; ++i) fill.push_back(Dial(server_->bound_address()));
  EXPECT_NE(Scrape(server_->bound_address()).find(" 200 "), std::string::npos);
  EXPECT_GE(Count(HttpEvent::kEvicted), 1);
  EXPECT_TRUE(ClosedWithin(fill.front(), 2000));  // the oldest idle one went
  for (int fd : fill) close(fd);
}

// A client that reads its scrape one byte at a time holds only its own connection, and only
// until the write timeout.
TEST_F(MetricsHttpTest, SlowReaderDoesNotDelayOthers) {
  MetricsHttpOptions o;
  o.write_timeout = absl::Milliseconds(800);
  StartServer(o, size_t{32} << 20);
  const int slow = Dial(server_->bound_address());
  const int small = 1024;
  setsockopt(slow, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(write(slow, req.data(), req.size()), static_cast<ssize_t>(req.size()));
  std::atomic<bool> stop{false};
  std::thread reader([&] {  // one byte every 20 ms
    char c;
    while (!stop.load() && read(slow, &c, 1) > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  for (int i = 0; i < 3; ++i) {  // 32 MiB each: bounded by copying, not by the slow reader
    const Clock::time_point t = Clock::now();
    EXPECT_NE(Scrape(server_->bound_address()).find(" 200 "), std::string::npos);
    EXPECT_LT(MsSince(t), 2000.0);
  }
  // The server gives the slow reader up at its write timeout (the bytes already in the
  // sockets' buffers may still reach it afterwards).
  const Clock::time_point t = Clock::now();
  while (Count(HttpEvent::kWriteTimeout) < 1 && MsSince(t) < 3000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GE(Count(HttpEvent::kWriteTimeout), 1);
  EXPECT_EQ(server_->open_connections(), 0);
  stop.store(true);
  shutdown(slow, SHUT_RDWR);
  reader.join();
  close(slow);
}

}  // namespace
}  // namespace epserve::server
