// The pairs grouped by expert on the device (GroupPairs) against the host layout a worker
// makes (worker::Worker::RunLocal: expert-major, pairs in order within an expert), and the FFN
// run from that grouping (ExpertFfnGrouped) against ExpertFfn over the host's offsets, bit for
// bit. Fresh random routings each run; outputs poisoned first. On the device
// EPSERVE_TEST_DEVICE names ("cpu" when unset), as kernels_test's other tests.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/synthetic.h"
#include "tests/kernels/kernel_fixture.h"

namespace epserve::kernels {
namespace {

class GroupingTest : public Seeded {
 protected:
  // Poisons every buffer of g (0x7fffffff in each int).
  void Poison(const PairGroups& g) {
    for (const Buffer* b : {&g.row_index, &g.pair_of_choice, &g.groups, &g.counts}) {
      const std::vector<int32_t> bits(b->bytes() / sizeof(int32_t),
                                      std::numeric_limits<int32_t>::max());
      EXPECT_TRUE(R().Write(*b, 0, bits.data(), b->bytes()).ok());
    }
  }
  // n tokens' k distinct experts each, drawn from `held` (global ids).
  std::vector<int32_t> RandomIds(int64_t n, int k, const std::vector<int32_t>& held) {
    std::vector<int32_t> ids(static_cast<size_t>(n * k));
    std::vector<int32_t> pool = held;
    for (int64_t t = 0; t < n; ++t) {
      std::shuffle(pool.begin(), pool.end(), rng_);
      std::copy_n(pool.begin(), k, ids.begin() + t * k);
    }
    return ids;
  }
};

// What RunLocal's host layout makes of ids.
struct HostLayout {
  std::vector<int64_t> offsets;
  std::vector<int32_t> row_index, pair_of_choice;
};
HostLayout Layout(const std::vector<int32_t>& ids, int k, const std::vector<int32_t>& local_of,
                  int num_local) {
  HostLayout l;
  l.offsets.assign(num_local + 1, 0);
  for (int32_t id : ids) ++l.offsets[local_of[id] + 1];
  std::partial_sum(l.offsets.begin(), l.offsets.end(), l.offsets.begin());
  std::vector<int64_t> next(l.offsets.begin(), l.offsets.end() - 1);
  l.row_index.resize(ids.size());
  l.pair_of_choice.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t at = next[local_of[ids[i]]]++;
    l.row_index[at] = static_cast<int32_t>(i / k);
    l.pair_of_choice[i] = static_cast<int32_t>(at);
  }
  return l;
}

TEST_F(GroupingTest, MatchesTheHostLayout) {
  struct Case {
    int64_t n;
    int k, num_global, num_local;
    bool tensor_cores;       // tiles of 128 rows, else of 1
    bool with_full = false;  // short tiles after their expert's full ones (tensor cores)
  };
  for (const Case c :
       {Case{1, 1, 8, 8, true}, Case{16, 4, 60, 60, true}, Case{16, 4, 60, 60, false},
        Case{128, 8, 256, 128, true}, Case{300, 2, 8, 8, true}, Case{517, 6, 64, 21, false},
        Case{2048, 4, 60, 30, true}, Case{300, 2, 8, 8, true, true},
        Case{2048, 4, 60, 30, true, true}, Case{16, 4, 60, 60, true, true}}) {
    SCOPED_TRACE(absl::StrCat("n=", c.n, " k=", c.k, " experts ", c.num_local, " of ", c.num_global,
                              c.tensor_cores ? " tiles of 128" : " tiles of 1",
                              c.with_full ? ", short tiles with the full ones" : ""));
    RuntimeOptions options = TestRuntimeOptions();
    options.short_tiles_with_full = c.with_full;
    std::unique_ptr<Runtime> rt = c.with_full ? CreateTestRuntime(options, false) : nullptr;
    rt_ = rt.get();
    // This worker holds a random subset of the global experts, in a random local order.
    std::vector<int32_t> global(c.num_global);
    std::iota(global.begin(), global.end(), 0);
    std::shuffle(global.begin(), global.end(), rng_);
    const std::vector<int32_t> held(global.begin(), global.begin() + c.num_local);
    std::vector<int32_t> local_of(c.num_global, -1);
    for (int e = 0; e < c.num_local; ++e) local_of[held[e]] = e;
    const std::vector<int32_t> ids = RandomIds(c.n, c.k, held);
    ExpertWeights w;
    w.num_experts = c.num_local;
    w.tensor_cores = c.tensor_cores;
    absl::StatusOr<PairGroups> g = AllocatePairGroups(R(), w, c.n * c.k + 5);
    ASSERT_TRUE(g.ok()) << g.status();
    Poison(*g);
    const Buffer idb = Upload(ids), mapb = Upload(local_of);
    ASSERT_TRUE(GroupPairs(R(), w, idb, c.n, c.k, mapb, c.num_global, *g).ok());
    absl::StatusOr<std::vector<int64_t>> counts = ReadPairCounts(R(), *g);
    ASSERT_TRUE(counts.ok()) << counts.status();
    const HostLayout want = Layout(ids, c.k, local_of, c.num_local);
    for (int e = 0; e < c.num_local; ++e) {
      EXPECT_EQ((*counts)[e], want.offsets[e + 1] - want.offsets[e]) << "expert " << e;
    }
    // The queued read gives the same, into pinned memory poisoned first.
    absl::StatusOr<void*> pinned = R().AllocatePinnedHost((c.num_local + 1) * sizeof(int32_t));
    ASSERT_TRUE(pinned.ok()) << pinned.status();
    auto* queued = static_cast<int32_t*>(*pinned);
    std::fill_n(queued, c.num_local + 1, -7);
    ASSERT_TRUE(QueuePairCountsRead(R(), *g, queued).ok());
    ASSERT_TRUE(R().Finish().ok());
    absl::StatusOr<std::vector<int64_t>> again = PairCountsOf(*g, queued);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(*again, *counts);
    const size_t pairs = ids.size();
    EXPECT_EQ(Download<int32_t>(g->row_index, pairs), want.row_index);
    EXPECT_EQ(Download<int32_t>(g->pair_of_choice, pairs), want.pair_of_choice);
    // Each expert's tile short of `chunk` rows first, then the full tiles, in expert order,
    // then empty ones up to the launch's bound; the short ones within the first
    // min(experts, pairs) groups (the decode forms' launches).
    const int64_t chunk = c.tensor_cores ? 128 : 1;
    std::vector<int32_t> tiles;
    int64_t short_tiles = 0;
    auto follows = [&](int64_t count) { return c.with_full && count > chunk; };
    for (int e = 0; e < c.num_local; ++e) {
      const int64_t count = want.offsets[e + 1] - want.offsets[e];
      if (count % chunk == 0 || follows(count)) continue;
      tiles.insert(tiles.end(), {e, static_cast<int32_t>(want.offsets[e + 1] - count % chunk),
                                 static_cast<int32_t>(want.offsets[e + 1]), 0});
      ++short_tiles;
    }
    for (int e = 0; e < c.num_local; ++e) {
      const int64_t count = want.offsets[e + 1] - want.offsets[e];
      const int64_t end = want.offsets[e + 1] - count % chunk;
      for (int64_t b = want.offsets[e]; b < end; b += chunk) {
        tiles.insert(tiles.end(), {e, static_cast<int32_t>(b), static_cast<int32_t>(b + chunk), 0});
      }
      if (count % chunk != 0 && follows(count)) {
        tiles.insert(tiles.end(),
                     {e, static_cast<int32_t>(end), static_cast<int32_t>(want.offsets[e + 1]), 1});
      }
    }
    EXPECT_LE(short_tiles, std::min<int64_t>(c.num_local, static_cast<int64_t>(pairs)));
    ASSERT_EQ(g->num_groups, MaxPairGroups(static_cast<int64_t>(pairs), c.num_local, chunk));
    ASSERT_LE(tiles.size(), static_cast<size_t>(g->num_groups) * 4);
    tiles.resize(static_cast<size_t>(g->num_groups) * 4, 0);
    EXPECT_EQ(Download<int32_t>(g->groups, tiles.size()), tiles);
    rt_ = nullptr;
  }
}

TEST_F(GroupingTest, ExpertsNotHeldAreCountedAndLeftOut) {
  const int k = 2, num_global = 16;
  std::vector<int32_t> local_of(num_global, -1);
  for (int e = 0; e < 8; ++e) local_of[e] = e;  // experts 8..15 held elsewhere
  std::vector<int32_t> ids = RandomIds(40, k, {0, 1, 2, 3, 4, 5, 6, 7});
  std::uniform_int_distribution<size_t> at(0, ids.size() - 1);
  const size_t a = at(rng_);
  size_t b = at(rng_);
  if (b == a) b = (a + 1) % ids.size();
  ids[a] = 12;          // another worker's
  ids[b] = num_global;  // no expert at all
  ExpertWeights w;
  w.num_experts = 8;
  absl::StatusOr<PairGroups> g = AllocatePairGroups(R(), w, static_cast<int64_t>(ids.size()));
  ASSERT_TRUE(g.ok()) << g.status();
  Poison(*g);
  ASSERT_TRUE(GroupPairs(R(), w, Upload(ids), 40, k, Upload(local_of), num_global, *g).ok());
  absl::StatusOr<std::vector<int64_t>> counts = ReadPairCounts(R(), *g);
  ASSERT_FALSE(counts.ok());
  EXPECT_EQ(counts.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(counts.status().message().find("2 of 80 routed pairs"), std::string::npos)
      << counts.status();
  const std::vector<int32_t> choice = Download<int32_t>(g->pair_of_choice, ids.size());
  EXPECT_EQ(choice[a], -1);
  EXPECT_EQ(choice[b], -1);
  // Every held pair still has its place: 78 distinct positions below 78.
  std::vector<int32_t> placed;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i != a && i != b) placed.push_back(choice[i]);
  }
  std::sort(placed.begin(), placed.end());
  std::vector<int32_t> all(78);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(placed, all);
}

// The FFN's launches hold no tile larger than the batch's tokens, so an expert with more pairs
// (a token that chose it twice) must make the batch fail, not leave rows uncomputed.
TEST_F(GroupingTest, AnExpertWithMorePairsThanTokensIsAnError) {
  const int k = 2, n = 6;
  std::vector<int32_t> ids = RandomIds(n, k, {0, 1, 2, 3});
  std::uniform_int_distribution<int> pick(0, 3);
  const int32_t twice = pick(rng_);
  for (int64_t t = 0; t < n; ++t) ids[t * k] = ids[t * k + 1] = twice;  // 12 pairs of one expert
  std::vector<int32_t> local_of = {0, 1, 2, 3};
  ExpertWeights w;
  w.num_experts = 4;
  w.tensor_cores = true;
  absl::StatusOr<PairGroups> g = AllocatePairGroups(R(), w, static_cast<int64_t>(ids.size()));
  ASSERT_TRUE(g.ok()) << g.status();
  Poison(*g);
  ASSERT_TRUE(GroupPairs(R(), w, Upload(ids), n, k, Upload(local_of), 4, *g).ok());
  absl::StatusOr<std::vector<int64_t>> counts = ReadPairCounts(R(), *g);
  ASSERT_FALSE(counts.ok());
  EXPECT_EQ(counts.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(counts.status().message().find("6 of 12 routed pairs"), std::string::npos)
      << counts.status();
  EXPECT_NE(counts.status().message().find("6 tokens"), std::string::npos) << counts.status();
}

TEST_F(GroupingTest, RefusesMorePairsThanAllocated) {
  ExpertWeights w;
  w.num_experts = 4;
  absl::StatusOr<PairGroups> g = AllocatePairGroups(R(), w, 8);
  ASSERT_TRUE(g.ok()) << g.status();
  const Buffer ids = Upload(std::vector<int32_t>(10, 0)), map = Upload(std::vector<int32_t>(4, 0));
  const absl::Status s = GroupPairs(R(), w, ids, 5, 2, map, 4, *g);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("n * k <= 8"), std::string::npos) << s;
}

// The FFN from the device's grouping has ExpertFfn's bits over the same layout: on tensor-core
// weights (GPUs) its tiles come from the device; elsewhere it reads the counts back.
TEST_F(GroupingTest, FfnFromDeviceGroupsHasTheHostOffsetsBits) {
  absl::StatusOr<model::ModelConfig> cfg = model::SyntheticPreset("tiny");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  const model::SyntheticWeights source(*cfg, seed_);
  const model::MoeLayerConfig& c = cfg->layer;
  for (const common::ElementType dtype : {common::ElementType::kFp32, common::ElementType::kBf16}) {
    SCOPED_TRACE(std::string(common::FlagName(dtype)));
    absl::StatusOr<ExpertWeights> w = UploadExperts(R(), source, 0, 0, c.num_experts, dtype);
    ASSERT_TRUE(w.ok()) << w.status();
    for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{150}}) {
      std::vector<int32_t> held(c.num_experts), local_of(c.num_experts);
      std::iota(held.begin(), held.end(), 0);
      std::iota(local_of.begin(), local_of.end(), 0);
      const std::vector<int32_t> ids = RandomIds(n, c.top_k, held);
      const int64_t pairs = n * c.top_k;
      const std::vector<float> x = Uniform(static_cast<size_t>(n * c.hidden_size));
      const Buffer xb = Upload(x);
      const size_t scratch =
          static_cast<size_t>(pairs * std::max(c.hidden_size, c.expert_ffn_size));
      Buffer h1 = Poisoned(scratch), y1 = Poisoned(scratch), h2 = Poisoned(scratch),
             y2 = Poisoned(scratch);
      const HostLayout want = Layout(ids, c.top_k, local_of, c.num_experts);
      ASSERT_TRUE(ExpertFfn(R(), *w, xb, Upload(want.row_index), want.offsets, h1, y1).ok());
      absl::StatusOr<PairGroups> g = AllocatePairGroups(R(), *w, pairs);
      ASSERT_TRUE(g.ok()) << g.status();
      Poison(*g);
      ASSERT_TRUE(
          GroupPairs(R(), *w, Upload(ids), n, c.top_k, Upload(local_of), c.num_experts, *g).ok());
      ASSERT_TRUE(ExpertFfnGrouped(R(), *w, xb, *g, h2, y2).ok());
      const size_t values = static_cast<size_t>(pairs * c.hidden_size);
      const std::vector<float> a = Download<float>(y1, values), b = Download<float>(y2, values);
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), values * sizeof(float))) << "n=" << n;
      EXPECT_TRUE(std::none_of(b.begin(), b.end(), [](float v) { return std::isnan(v); }));
    }
  }
}

}  // namespace
}  // namespace epserve::kernels
