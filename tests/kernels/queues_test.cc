// The runtime's fork of its queue (Runtime::ForkQueue: the shared expert beside the routed
// experts) gives the bits of one queue in order, and its command timeline
// (Runtime::TakeCommandTimes) names every launch and transfer. Runtimes of their own with
// concurrent queues asked for on every device (CPUs included), on the device
// EPSERVE_TEST_DEVICE names ("cpu" when unset). Fresh random inputs; outputs poisoned first.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "gtest/gtest.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/synthetic.h"
#include "tests/kernels/kernel_fixture.h"

namespace epserve::kernels {
namespace {

class QueuesTest : public Seeded {
 protected:
  static Runtime& ForkingRt() {
    static std::unique_ptr<Runtime> rt = [] {
      RuntimeOptions options = TestRuntimeOptions();
      options.concurrent_queues = RuntimeOptions::ConcurrentQueues::kAlways;
      options.profile_commands = true;
      return CreateTestRuntime(options, false);
    }();
    return *rt;
  }
  void SetUp() override {
    rt_ = &ForkingRt();
    ASSERT_TRUE(rt_->TakeCommandTimes().ok());  // nothing left of an earlier test
  }
};

// The shared expert forked beside the routed experts, joined before its output is read, has
// the bits of the same launches in order on one queue; the routed experts' too.
TEST_F(QueuesTest, ForkedSharedExpertHasTheBitsOfOneQueue) {
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("tiny");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  cfg->layer.shared_ffn_size = 96;
  const model::SyntheticWeights source(*cfg, seed_);
  const model::MoeLayerConfig& c = cfg->layer;
  ASSERT_TRUE(R().concurrent_queues());
  for (const common::ElementType dtype : {common::ElementType::kFp32, common::ElementType::kBf16}) {
    SCOPED_TRACE(std::string(common::FlagName(dtype)));
    absl::StatusOr<ExpertWeights> routed = UploadExperts(R(), source, 0, 0, c.num_experts, dtype);
    absl::StatusOr<ExpertWeights> shared = UploadSharedExpert(R(), source, 0, dtype);
    ASSERT_TRUE(routed.ok() && shared.ok()) << routed.status() << shared.status();
    for (const int64_t n : {int64_t{1}, int64_t{16}, int64_t{150}}) {
      SCOPED_TRACE(absl::StrCat("n=", n));
      const int64_t h = c.hidden_size, pairs = n * c.top_k;
      const Buffer xb = Upload(Uniform(static_cast<size_t>(n * h)));
      // Every token's top_k experts, expert-major: row p of expert p % E.
      std::vector<int32_t> row_index(pairs);
      std::vector<int64_t> offsets(c.num_experts + 1, 0);
      for (int64_t p = 0; p < pairs; ++p) ++offsets[p % c.num_experts + 1];
      std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
      std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
      for (int64_t p = 0; p < pairs; ++p) row_index[next[p % c.num_experts]++] = p / c.top_k;
      const Buffer rib = Upload(row_index);
      const size_t scratch = static_cast<size_t>(pairs * std::max(h, c.expert_ffn_size));
      const size_t shared_scratch = static_cast<size_t>(n * std::max(h, c.shared_ffn_size));
      std::vector<float> want[2], got[2];
      for (const bool fork : {false, true}) {
        Buffer rh = Poisoned(scratch), ry = Poisoned(scratch);
        Buffer sh = Poisoned(shared_scratch), sy = Poisoned(shared_scratch);
        if (fork) {
          ASSERT_TRUE(R().ForkQueue().ok());
        }
        ASSERT_TRUE(SharedExpertFfn(R(), *shared, xb, n, sh, sy).ok());
        if (fork) {
          EXPECT_NE(R().launch_queue(), R().queue());
          ASSERT_TRUE(R().EndFork().ok());
        }
        EXPECT_EQ(R().launch_queue(), R().queue());
        ASSERT_TRUE(ExpertFfn(R(), *routed, xb, rib, offsets, rh, ry).ok());
        if (fork) {
          ASSERT_TRUE(R().JoinFork().ok());
        }
        std::vector<float>* out = fork ? got : want;
        out[0] = Download<float>(sy, static_cast<size_t>(n * h));
        out[1] = Download<float>(ry, static_cast<size_t>(pairs * h));
      }
      for (int i = 0; i < 2; ++i) {
        SCOPED_TRACE(i == 0 ? "shared expert" : "routed experts");
        ASSERT_EQ(want[i].size(), got[i].size());
        EXPECT_EQ(0, std::memcmp(want[i].data(), got[i].data(), want[i].size() * sizeof(float)));
        EXPECT_TRUE(
            std::none_of(got[i].begin(), got[i].end(), [](float v) { return std::isnan(v); }));
      }
    }
  }
}

// While forked, Scratch hands out buffers of the fork's own: the forked launches and the main
// queue's never share one.
TEST_F(QueuesTest, ForkedScratchIsTheForksOwn) {
  absl::StatusOr<Buffer*> main_scratch = R().Scratch(Runtime::kSplitKScratch, 1024);
  ASSERT_TRUE(main_scratch.ok()) << main_scratch.status();
  ASSERT_TRUE(R().ForkQueue().ok());
  absl::StatusOr<Buffer*> forked = R().Scratch(Runtime::kSplitKScratch, 1024);
  ASSERT_TRUE(R().EndFork().ok());
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_NE(*main_scratch, *forked);
  EXPECT_NE((*main_scratch)->mem(), (*forked)->mem());
  absl::StatusOr<Buffer*> again = R().Scratch(Runtime::kSplitKScratch, 1024);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *main_scratch);
  EXPECT_TRUE(R().Finish().ok());
}

// The timeline holds each launch (by its kernel's name) and transfer in the order queued, the
// forked ones marked, each ending after it starts; a second call finds nothing new.
TEST_F(QueuesTest, CommandTimesNameEveryLaunchAndTransfer) {
  const std::vector<float> v = Uniform(4096);
  Buffer a = Upload(v);
  // A long launch last on the main queue (8 Mi values): the forked one must not start before
  // it ends.
  const int64_t big_values = int64_t{1} << 23;
  Buffer big = Poisoned(static_cast<size_t>(big_values));
  ASSERT_TRUE(R().TakeCommandTimes().ok());
  ASSERT_TRUE(R().Write(a, 0, v.data(), v.size() * sizeof(float)).ok());
  ASSERT_TRUE(RoundToBf16(R(), big, big_values, big).ok());
  ASSERT_TRUE(R().ForkQueue().ok());
  ASSERT_TRUE(RoundToBf16(R(), a, static_cast<int64_t>(v.size()), a).ok());
  ASSERT_TRUE(R().EndFork().ok());
  ASSERT_TRUE(R().JoinFork().ok());
  std::vector<float> back(v.size());
  ASSERT_TRUE(R().Read(a, 0, back.data(), back.size() * sizeof(float)).ok());
  absl::StatusOr<std::vector<CommandTime>> times = R().TakeCommandTimes();
  ASSERT_TRUE(times.ok()) << times.status();
  ASSERT_EQ(times->size(), 4u);
  const char* names[] = {"write", "round_to_bf16", "round_to_bf16", "read"};
  for (size_t i = 0; i < times->size(); ++i) {
    const CommandTime& t = (*times)[i];
    EXPECT_EQ(t.name, names[i]) << i;
    EXPECT_EQ(t.forked, i == 2) << i;
    EXPECT_LE(t.start_ns, t.end_ns) << i;
    EXPECT_GT(t.start_ns, 0u) << i;
  }
  // The forked launch waited for what the main queue held at the fork, and the read after
  // the join for the forked launch.
  EXPECT_GE((*times)[2].start_ns, (*times)[1].end_ns);
  EXPECT_GE((*times)[3].start_ns, (*times)[2].end_ns);
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(back[i], common::Bf16ToFloat(common::FloatToBf16(v[i]))) << i;
  }
  absl::StatusOr<std::vector<CommandTime>> none = R().TakeCommandTimes();
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

// Forked ends the fork whatever its launches return, and returns their error.
TEST_F(QueuesTest, ForkedEndsTheForkOnAnError) {
  const absl::Status s = R().Forked([&] {
    EXPECT_NE(R().launch_queue(), R().queue());
    return absl::InternalError("a launch failed");
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(R().launch_queue(), R().queue());
  EXPECT_TRUE(R().Finish().ok());
}

// A kept table is made once per content: the same bytes give the same buffer, holding them;
// other bytes another.
TEST_F(QueuesTest, KeptTablesAreMadeOncePerContent) {
  std::vector<int32_t> a(64), b(64);
  std::uniform_int_distribution<int32_t> value(0, 1 << 20);
  for (size_t i = 0; i < a.size(); ++i) a[i] = b[i] = value(rng_);
  b[17] ^= 1;
  auto bytes = [](const std::vector<int32_t>& v) {
    return std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));
  };
  absl::StatusOr<const Buffer*> first = R().KeptTable(bytes(a));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(Download<int32_t>(**first, a.size()), a);
  absl::StatusOr<const Buffer*> other = R().KeptTable(bytes(b));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE((*other)->mem(), (*first)->mem());
  EXPECT_EQ(Download<int32_t>(**other, b.size()), b);
  absl::StatusOr<const Buffer*> again = R().KeptTable(bytes(a));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *first);
}

// Without concurrent queues a fork does nothing: launches stay on the main queue, in order.
TEST_F(QueuesTest, WithoutConcurrentQueuesAForkStaysInOrder) {
  RuntimeOptions options = TestRuntimeOptions();
  options.concurrent_queues = RuntimeOptions::ConcurrentQueues::kOff;
  std::unique_ptr<Runtime> rt = CreateTestRuntime(options, false);
  ASSERT_NE(rt, nullptr);
  EXPECT_FALSE(rt->concurrent_queues());
  ASSERT_TRUE(rt->ForkQueue().ok());
  EXPECT_EQ(rt->launch_queue(), rt->queue());
  ASSERT_TRUE(rt->EndFork().ok());
  ASSERT_TRUE(rt->JoinFork().ok());
  absl::StatusOr<std::vector<CommandTime>> times = rt->TakeCommandTimes();
  ASSERT_TRUE(times.ok());
  EXPECT_TRUE(times->empty());  // nothing profiled without profile_commands
}

}  // namespace
}  // namespace epserve::kernels
