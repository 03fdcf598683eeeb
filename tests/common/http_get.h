// A minimal HTTP/1.0 GET for tests that scrape /metrics.
#pragma once

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace epserve::testing {

// GET http://address/path ("host:port"); the body, or "" when nothing answers.
inline std::string HttpGet(const std::string& address, const std::string& path) {
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
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) out.append(buf, n);
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  const size_t body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

// A metric's value in a scrape (the first series whose line starts with `series`), or -1.
inline double MetricValue(const std::string& metrics, const std::string& series) {
  const size_t at = metrics.find("\n" + series);
  if (at == std::string::npos) return -1;
  const size_t end = metrics.find('\n', at + 1);
  const std::string line = metrics.substr(at + 1, end - at - 1);
  return std::stod(line.substr(line.rfind(' ') + 1));
}

}  // namespace epserve::testing
