// Clients that send random requests to a synthetic:tiny server and check every answer against
// the reference, for end-to-end tests that change the server under load.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/e2e/reference.h"
#include "tests/e2e/server_process.h"

namespace epserve::testing {

// `clients` clients sending random requests (1-24 tokens, leaning towards some experts) and
// checking every answer against the reference until stopped.
class VerifyingClients {
 public:
  using Clock = std::chrono::steady_clock;

  explicit VerifyingClients(ServerProcess& server, int clients = 4) {
    const uint64_t seed = std::random_device{}();
    seed_ = seed;
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, &server, c, seed] {
        Reference ref;
        auto stub = server.NewStub();
        std::mt19937_64 rng(seed + c);
        for (int i = 0; !stop_.load(); ++i) {
          const int64_t tokens = 1 + static_cast<int64_t>(rng() % 24);
          std::vector<float> x = RandomRows(tokens, rng);
          for (int64_t t = 0; t < tokens; ++t) x[t * kHidden + c % 4] += 2.0f;
          inference::ModelInferRequest req = Request(x, tokens, absl::StrCat(c, "-", i));
          inference::ModelInferResponse resp;
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
          grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
          const Clock::time_point now = Clock::now();
          if (!s.ok() || resp.raw_output_contents_size() != 1 ||
              resp.raw_output_contents(0).size() != static_cast<size_t>(tokens * kHidden * 4)) {
            std::lock_guard<std::mutex> lock(mu_);
            failures_.push_back(absl::StrCat(s.error_code(), " ", s.error_message()));
            continue;
          }
          std::vector<float> y(tokens * kHidden);
          std::memcpy(y.data(), resp.raw_output_contents(0).data(), y.size() * 4);
          if (!(ref.RelError(x, y.data(), tokens) <= 1e-4)) ++wrong_;
          std::lock_guard<std::mutex> lock(mu_);
          answered_at_.push_back(now);
        }
      });
    }
  }
  ~VerifyingClients() { Stop(); }

  void Stop() {
    stop_.store(true);
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  uint64_t seed() const { return seed_; }
  int wrong() const { return wrong_.load(); }
  // After Stop: every failure's status, and when each right answer came.
  const std::vector<std::string>& failures() const { return failures_; }
  std::vector<Clock::time_point> answered_at() const {
    std::vector<Clock::time_point> at = answered_at_;
    std::sort(at.begin(), at.end());
    return at;
  }
  size_t answered() {
    std::lock_guard<std::mutex> lock(mu_);
    return answered_at_.size();
  }

 private:
  uint64_t seed_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> wrong_{0};
  std::mutex mu_;
  std::vector<std::string> failures_;           // guarded by mu_
  std::vector<Clock::time_point> answered_at_;  // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace epserve::testing
