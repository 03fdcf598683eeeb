// The /metrics endpoint's lifetime: it serves once started and stops promptly.
#include "server/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace epserve::server {
namespace {

// GET http://address/metrics with HTTP/1.0; the whole reply, or "" when nobody listens.
std::string Scrape(const std::string& address) {
  const size_t colon = address.rfind(':');
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(address.substr(0, colon).c_str(), address.substr(colon + 1).c_str(), &hints,
                  &res) != 0) {
    return "";
  }
  const int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  std::string out;
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

MetricsConfig Config(const std::string& address) {
  MetricsConfig c;
  c.address = address;
  c.model_name = "moe";
  c.num_workers = 2;
  c.num_experts = 4;
  return c;
}

TEST(Metrics, ServesUntilDestroyedAndStopsWithoutWaitingOutTheListenerPoll) {
  // civetweb polls its listening socket for up to 2 s between looks at its stop flag; a
  // just-started endpoint is at the start of such a poll, so an unprompted stop takes ~2 s.
  for (int round = 0; round < 3; ++round) {
    absl::StatusOr<std::unique_ptr<Metrics>> m = Metrics::Start(Config("127.0.0.1:0"));
    ASSERT_TRUE(m.ok()) << m.status();
    const std::string address = (*m)->bound_address();
    EXPECT_NE(Scrape(address).find("epserve_build_info"), std::string::npos) << address;
    const absl::Time start = absl::Now();
    m->reset();
    const absl::Duration took = absl::Now() - start;
    EXPECT_LT(took, absl::Seconds(1)) << "round " << round;
    EXPECT_EQ(Scrape(address), "") << "still listening on " << address;
  }
}

}  // namespace
}  // namespace epserve::server
