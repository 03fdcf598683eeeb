// The router's selection for softmax routing in a work-group per token
// (route_select_softmax_wg, the GPUs' form) against the one work-item per token of
// route_select, bit for bit, on the same logits: random ones, rows of ties (equal logits, where
// the lowest expert must win), rows with NaN and infinite logits. On the device
// EPSERVE_TEST_DEVICE names ("cpu" when unset). Fresh random logits; outputs poisoned first.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/detail/launch.h"
#include "kernels/runtime.h"
#include "tests/kernels/kernel_fixture.h"

namespace epserve::kernels {
namespace {

class RouterSelectTest : public Seeded {
 protected:
  // Logits of n tokens over `experts`: rows of random values, of few distinct values (ties),
  // and now and then a NaN or an infinity.
  std::vector<float> Logits(int64_t n, int experts) {
    std::vector<float> v(static_cast<size_t>(n * experts));
    std::uniform_real_distribution<float> wide(-6.0f, 6.0f);
    std::uniform_int_distribution<int> few(-2, 2), kind(0, 9), at(0, experts - 1);
    for (int64_t t = 0; t < n; ++t) {
      float* row = v.data() + t * experts;
      const int k = kind(rng_);
      for (int e = 0; e < experts; ++e) row[e] = k < 5 ? wide(rng_) : 0.5f * few(rng_);
      if (k == 8) row[at(rng_)] = std::numeric_limits<float>::quiet_NaN();
      if (k == 9) row[at(rng_)] = std::numeric_limits<float>::infinity();
    }
    return v;
  }
};

TEST_F(RouterSelectTest, WorkGroupFormHasTheBitsOfOneWorkItemPerToken) {
  for (const int experts : {2, 8, 60, 64, 100, 512}) {
    for (const int k : {1, 2, 4, 8}) {
      if (k > experts) continue;
      for (const int norm : {0, 1}) {
        const int64_t n = 1 + static_cast<int64_t>(rng_() % 70);
        SCOPED_TRACE(absl::StrCat("experts ", experts, " k ", k, " norm ", norm, " n ", n));
        const Buffer logits = Upload(Logits(n, experts));
        const Buffer no_bias;
        const float scale = norm != 0 ? 1.0f : 2.5f;
        std::vector<int32_t> ids[2];
        std::vector<float> weights[2];
        for (int form = 0; form < 2; ++form) {
          Buffer idb = Poisoned(static_cast<size_t>(n * k));
          Buffer wb = Poisoned(static_cast<size_t>(n * k));
          absl::Status s;
          if (form == 0) {
            absl::StatusOr<cl_kernel> kernel = R().Kernel("route_select");
            ASSERT_TRUE(kernel.ok()) << kernel.status();
            s = detail::SetArgs(*kernel, logits, no_bias, static_cast<cl_int>(n), cl_int{experts},
                                cl_int{k}, cl_int{0}, cl_int{norm}, cl_int{1}, cl_int{1},
                                cl_float{scale}, idb, wb);
            const size_t global[1] = {static_cast<size_t>(n)}, local[1] = {1};
            if (s.ok()) s = detail::Launch(R(), *kernel, 1, global, local);
          } else {
            absl::StatusOr<cl_kernel> kernel = R().Kernel("route_select_softmax_wg");
            ASSERT_TRUE(kernel.ok()) << kernel.status();
            s = detail::SetArgs(*kernel, logits, static_cast<cl_int>(n), cl_int{experts}, cl_int{k},
                                cl_int{norm}, cl_float{scale}, idb, wb);
            const size_t local[1] = {static_cast<size_t>(detail::kRouterSelectGroupSize)};
            const size_t global[1] = {static_cast<size_t>(n) * local[0]};
            if (s.ok()) s = detail::Launch(R(), *kernel, 1, global, local);
          }
          ASSERT_TRUE(s.ok()) << s;
          ids[form] = Download<int32_t>(idb, static_cast<size_t>(n * k));
          weights[form] = Download<float>(wb, static_cast<size_t>(n * k));
        }
        EXPECT_EQ(ids[1], ids[0]);
        EXPECT_EQ(0, std::memcmp(weights[1].data(), weights[0].data(),
                                 weights[0].size() * sizeof(float)));
        for (int32_t id : ids[1]) {
          ASSERT_GE(id, 0);
          ASSERT_LT(id, experts);
        }
      }
    }
  }
}

}  // namespace
}  // namespace epserve::kernels
