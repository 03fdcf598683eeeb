// The FFN tuner's coordination between the processes of a host: the lock files
// (kernels/detail/file_lock.h) and Runtime::ChooseFfnPlans, which lets runtimes that serve the
// same shapes tune different ones at once, each shape tuned once.
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/detail/file_lock.h"
#include "kernels/ffn_blocking.h"
#include "kernels/runtime.h"
#include "tests/kernels/kernel_fixture.h"

namespace epserve::kernels {
namespace {

using common::ElementType;

std::filesystem::path FreshDir(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat(name, "-", std::random_device{}());
  std::filesystem::remove_all(dir);
  return dir;
}

TEST(FileLockTest, ExcludesOtherHoldersUntilReleased) {
  const std::filesystem::path dir = FreshDir("epserve-file-lock-test");
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "x.lock").string();
  detail::FileLock first(path, 0);
  EXPECT_TRUE(first.held());
  EXPECT_FALSE(first.busy());
  // Another holder in the same process is refused (one try, then a short wait).
  detail::FileLock second(path, 0);
  EXPECT_FALSE(second.held());
  EXPECT_TRUE(second.busy());
  detail::FileLock third(path, 0.05);
  EXPECT_TRUE(third.busy());
  // Moved, the lock stays held; released, the next holder takes it.
  detail::FileLock moved = std::move(first);
  EXPECT_TRUE(moved.held());
  EXPECT_FALSE(detail::FileLock(path, 0).held());
  moved.Release();
  EXPECT_TRUE(detail::FileLock(path, 0).held());
  // No path, or a folder that does not exist: not held, and not busy either.
  EXPECT_FALSE(detail::FileLock("", 1).held());
  const detail::FileLock missing((dir / "no" / "such.lock").string(), 1);
  EXPECT_FALSE(missing.held());
  EXPECT_FALSE(missing.busy());
  std::filesystem::remove_all(dir);
}

// The few-row cases' experts: each half past twice the cache, within the memory budget.
TEST(FfnBlockingTest, FewRowCasesStreamPastTheCacheWithinTheBudget) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  const int64_t expert = 17 * kMiB;  // qwen1.5-moe-a2.7b's, BF16
  // A 32 MiB L3 and 24 GiB: 4 experts (68 MiB) a half.
  EXPECT_EQ(FewRowTuneExperts(32 * kMiB, expert, 24 * 1024 * kMiB / 16), 4);
  // A 300 MiB cache and 128 GiB: 36 experts (612 MiB) a half, no fixed cap.
  EXPECT_EQ(FewRowTuneExperts(300 * kMiB, expert, 128 * 1024 * kMiB / 16), 36);
  // The budget binds: 340 MiB of weights in both halves hold 10 experts a half.
  EXPECT_EQ(FewRowTuneExperts(300 * kMiB, expert, 340 * kMiB), 10);
  // At least one, whatever the device says.
  EXPECT_EQ(FewRowTuneExperts(0, expert, 0), 1);
  EXPECT_EQ(FewRowTuneExperts(300 * kMiB, 0, 1), 1);
}

// Two runtimes (the workers of a host) choose the plans of the same two shapes at once, on
// two threads: each shape is tuned by one of them and read from the cache by the other, both
// ending with the same plans, whichever runtime took which shape.
TEST(FfnBlockingTest, WorkersTuneEachShapeOnce) {
  const std::filesystem::path dir = FreshDir("epserve-ffn-plans-test");
  RuntimeOptions options = TestRuntimeOptions();
  options.cache_dir = dir.string();
  std::unique_ptr<Runtime> a = CreateTestRuntime(options, false);
  std::unique_ptr<Runtime> b = CreateTestRuntime(options, false);
  ASSERT_TRUE(a != nullptr && b != nullptr);
  if (FfnBlockingCandidates(a->device_info()).size() < 2) {
    GTEST_SKIP() << "the device has one candidate: nothing to tune";
  }
  // Both of at least 8 MiB of FP32 weights (tuned, not the default).
  const std::vector<FfnShape> shapes = {{2048, 768, ElementType::kFp32},
                                        {2048, 384, ElementType::kFp32}};
  absl::Status sa, sb;
  std::thread ta([&] { sa = a->ChooseFfnPlans(shapes); });
  std::thread tb([&] { sb = b->ChooseFfnPlans(shapes); });
  ta.join();
  tb.join();
  ASSERT_TRUE(sa.ok()) << sa;
  ASSERT_TRUE(sb.ok()) << sb;
  ASSERT_EQ(a->ffn_choices().size(), 2u);
  ASSERT_EQ(b->ffn_choices().size(), 2u);
  for (const FfnShape& s : shapes) {
    int tuned = 0, cached = 0;
    std::vector<FfnPlan> plans;
    for (const Runtime* rt : {a.get(), b.get()}) {
      for (const FfnChoice& c : rt->ffn_choices()) {
        if (c.ffn != s.ffn) continue;
        tuned += c.origin == FfnBlockingOrigin::kTuned;
        cached += c.origin == FfnBlockingOrigin::kCache;
        plans.push_back(c.plan);
      }
    }
    EXPECT_EQ(tuned, 1) << "F=" << s.ffn;
    EXPECT_EQ(cached, 1) << "F=" << s.ffn;
    ASSERT_EQ(plans.size(), 2u);
    EXPECT_EQ(plans[0], plans[1]) << plans[0].ToString() << " against " << plans[1].ToString();
  }
  // A runtime's later upload of a shape finds its plan made.
  absl::StatusOr<FfnPlan> again = a->ChooseFfnPlan(2048, 384, ElementType::kFp32);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(a->ffn_choices().size(), 2u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace epserve::kernels
