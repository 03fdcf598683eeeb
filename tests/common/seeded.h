// A test fixture with one fresh random seed per test (std::random_device), a generator seeded
// with it, and the seed printed with every failure of the test. Tests draw their inputs from
// rng_, or hand seed_ to a generator of their own (synthetic weights).
#pragma once

#include <cstdint>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace epserve::tests {

class SeededTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    trace_ =
        std::make_unique<::testing::ScopedTrace>(__FILE__, __LINE__, absl::StrCat("seed=", seed_));
  }

  uint32_t seed_ = 0;
  std::mt19937_64 rng_;
  std::unique_ptr<::testing::ScopedTrace> trace_;
};

}  // namespace epserve::tests
