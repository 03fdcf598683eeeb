// What the kernel tests share: the device they run on (EPSERVE_TEST_DEVICE: "cpu" when unset;
// "gpu" or "<platform>:<device>"), one runtime per kind built once per process, and a fixture
// with a fresh random seed per test (printed with every failure) and device buffers from host
// vectors.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/runtime.h"
#include "tests/common/seeded.h"

namespace epserve::kernels {

inline RuntimeOptions TestRuntimeOptions() {
  RuntimeOptions options;
  if (const char* d = std::getenv("EPSERVE_TEST_DEVICE"); d != nullptr && *d != '\0') {
    options.device = d;
  }
  return options;
}

// A runtime of `options`, or nullptr with the test failed; `describe` prints its device.
inline std::unique_ptr<Runtime> CreateTestRuntime(const RuntimeOptions& options, bool describe) {
  absl::StatusOr<std::unique_ptr<Runtime>> r = Runtime::Create(options);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return nullptr;
  if (describe) std::cout << "[ device ] " << (*r)->device_info().Describe() << "\n";
  return *std::move(r);
}

// One random seed per test, printed with every failure (tests/common/seeded.h).
class Seeded : public epserve::tests::SeededTest {
 protected:
  std::vector<float> Uniform(size_t count, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(count);
    for (float& f : v) f = dist(rng_);
    return v;
  }
  static Runtime& Rt() {
    static std::unique_ptr<Runtime> rt = CreateTestRuntime(TestRuntimeOptions(), true);
    return *rt;
  }
  // A runtime whose router and shared-expert gate take their work-group forms (the GPUs'
  // kernels) on any device, CPUs included.
  static Runtime& WorkGroupFormsRt() {
    static std::unique_ptr<Runtime> rt = [] {
      RuntimeOptions options = TestRuntimeOptions();
      options.work_group_forms = RuntimeOptions::WorkGroupForms::kAlways;
      return CreateTestRuntime(options, false);
    }();
    return *rt;
  }
  // The runtime the helpers below use: rt_ where a test sets one, else the shared one.
  Runtime& R() { return rt_ != nullptr ? *rt_ : Rt(); }
  // A device buffer holding `v`.
  template <typename T>
  Buffer Upload(const std::vector<T>& v) {
    absl::StatusOr<Buffer> b = R().Allocate(std::max<size_t>(v.size(), 1) * sizeof(T));
    EXPECT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(R().Write(*b, 0, v.data(), v.size() * sizeof(T)).ok());
    return *std::move(b);
  }
  // A device buffer of `count` floats (or ints) filled with NaN bits.
  Buffer Poisoned(size_t count) {
    return Upload(std::vector<float>(count, std::numeric_limits<float>::quiet_NaN()));
  }
  template <typename T>
  std::vector<T> Download(const Buffer& b, size_t count) {
    std::vector<T> v(count);
    absl::Status s = R().Read(b, 0, v.data(), count * sizeof(T));
    EXPECT_TRUE(s.ok()) << s;
    return v;
  }

  Runtime* rt_ = nullptr;
};

}  // namespace epserve::kernels
