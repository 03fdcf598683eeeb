// The exchange across real ranks (every rank a worker), both heap backends, every payload
// dtype, contiguous and replicated placements. Token rows encode their source rank and index
// and the routing is a function of (batch, source rank, token), so every receiver knows which
// rows may arrive, with which metadata, every pair is seen computed exactly once over all
// ranks, and every owner knows its combined rows bit for bit.
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>

#include "gtest/gtest.h"
#include "shmem/heap.h"
#include "worker/eplb.h"
#include "worker/exchange.h"

namespace epserve::worker {
namespace {

enum class Routing { kUniform, kSkewed };

struct Case {
  shmem::HeapBackend backend;
  common::ElementType dispatch;
  common::ElementType combine;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& p) {
  return absl::StrCat(shmem::HeapBackendName(p.param.backend), "_",
                      common::FlagName(p.param.dispatch), "_", common::FlagName(p.param.combine));
}

uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

// Everything any rank needs to know about any rank's batch, computed the same everywhere.
class Batch {
 public:
  Batch(const ExchangeShape& c, uint64_t seed, int src, int64_t n, Routing routing)
      : c_(c), n_(n), x_(n * c.hidden), ids_(n * c.top_k), weights_(n * c.top_k) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < c.hidden; ++i) {
        // Source rank, token and column, exactly representable; a negative sign now and then.
        const float v = static_cast<float>(src * 4096 + t) + static_cast<float>(i) / 256.0f;
        x_[t * c.hidden + i] = (i % 7 == 3) ? -v : v;
      }
      // k distinct experts; skewed: expert 0 is nearly always among them.
      std::vector<int> experts(c.num_experts);
      for (int e = 0; e < c.num_experts; ++e) experts[e] = e;
      std::mt19937_64 rng(Mix(seed ^ Mix(src * 1000003ull + t)));
      std::shuffle(experts.begin(), experts.end(), rng);
      if (routing == Routing::kSkewed && rng() % 16 != 0) {
        std::iter_swap(experts.begin(), std::find(experts.begin(), experts.end(), 0));
      }
      for (int j = 0; j < c.top_k; ++j) {
        ids_[t * c.top_k + j] = experts[j];
        weights_[t * c.top_k + j] = static_cast<float>(1 + (rng() % 1000)) / 1024.0f;
      }
    }
  }
  int64_t n() const { return n_; }
  const float* x(int64_t t) const { return &x_[t * c_.hidden]; }
  const int32_t* ids(int64_t t) const { return &ids_[t * c_.top_k]; }
  const float* weights(int64_t t) const { return &weights_[t * c_.top_k]; }

 private:
  const ExchangeShape& c_;
  int64_t n_;
  std::vector<float> x_;
  std::vector<int32_t> ids_;
  std::vector<float> weights_;
};

// The test's "expert e": x + (e + 1). Used by the receivers and by the reference alike.
void ExpertRow(const ExchangeShape& c, const float* x, int expert, float* out) {
  for (int64_t i = 0; i < c.hidden; ++i) out[i] = x[i] + static_cast<float>(expert + 1);
}

class ExchangeTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks_);
    seed_ = std::random_device{}();
    MPI_Bcast(&seed_, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  }

  // Every rank a worker, sending up to kMaxSend tokens.
  static constexpr int64_t kMaxSend = 40;
  ExchangeShape Shape() const {
    return {.num_workers = ranks_,
            .first_rank = 0,
            .num_experts = 2 * ranks_ + 1,  // uneven placement
            .top_k = 3,
            .hidden = 130,  // a partial fp8 block; fp32 rows padded to 16 bytes
            .max_batch_tokens = kMaxSend * ranks_};
  }
  ExchangeOptions Options() const {
    ExchangeOptions o;
    o.dispatch_dtype = GetParam().dispatch;
    o.combine_dtype = GetParam().combine;
    return o;
  }
  static ExchangePlan Plan(const ExchangeShape& shape, const ExchangeOptions& options) {
    absl::StatusOr<ExchangePlan> plan = ExchangePlan::Make(shape, options);
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.value_or(ExchangePlan());
  }

  struct Setup {
    std::unique_ptr<shmem::SymmetricHeap> heap;
    std::unique_ptr<Exchange> exchange;
  };
  Setup Make(const ExchangePlan& plan) {
    Setup s;
    s.heap = *shmem::SymmetricHeap::Create(MPI_COMM_WORLD, ExchangeRegions::BytesNeeded(plan),
                                           GetParam().backend);
    absl::StatusOr<ExchangeRegions> regions = Exchange::Allocate(*s.heap, plan);
    EXPECT_TRUE(regions.ok()) << regions.status();
    absl::StatusOr<std::unique_ptr<Exchange>> ex = Exchange::Create(*s.heap, plan, *regions, rank_);
    EXPECT_TRUE(ex.ok()) << ex.status();
    s.exchange = *std::move(ex);
    // The owner's sum on up to 3 threads of at least 4 tokens (rank 0: 1 thread): every check
    // below is exact, so a split sum must give the same bits.
    if (s.exchange != nullptr) s.exchange->set_reduce_threads(rank_ == 0 ? 1 : 3, 4);
    return s;
  }

  // Runs one batch on every rank (rank r sends sizes[r] tokens) and checks, on every rank,
  // what it received and what came back. Returns the status of Run. `y_out`, when set,
  // receives this rank's combined rows.
  absl::Status RunAndCheck(Exchange& ex, uint64_t batch, const std::vector<int64_t>& sizes,
                           Routing routing, ExchangeStats* stats = nullptr,
                           std::vector<float>* y_out = nullptr) {
    const ExchangePlan& plan = ex.plan();
    const ExchangeShape& c = plan.shape();
    const ExpertPlacement& placement = ex.placement();
    std::vector<Batch> batches;
    std::vector<int64_t> pair_begin(ranks_ + 1, 0);  // (src, t, j) -> a global pair number
    for (int r = 0; r < ranks_; ++r) {
      batches.emplace_back(c, seed_ + batch, r, sizes[r], routing);
      pair_begin[r + 1] = pair_begin[r] + sizes[r] * c.top_k;
    }
    const Batch& mine = batches[rank_];
    const size_t row_bytes = plan.dispatch_row_bytes();

    int wrong_rows = 0, wrong_meta = 0, rounds_seen = 0;
    std::vector<int> pair_seen(pair_begin[ranks_], 0);  // summed over ranks below
    std::vector<unsigned char> expect_row(row_bytes);
    std::vector<float> decoded(c.hidden);
    const Exchange::ExpertStep expert = [&](const ReceivedRows& in, float* pair_out,
                                            float* row_out) {
      ++rounds_seen;
      if ((row_out != nullptr) != plan.shared_expert_split()) ++wrong_meta;
      std::vector<int> row_pairs(in.rows, 0);
      for (int le = 0; le < placement.count(rank_); ++le) {
        const int e = placement.expert(rank_, le);
        for (int64_t p = in.expert_offsets[le]; p < in.expert_offsets[le + 1]; ++p) {
          const int32_t r = in.pair_row[p];
          if (r < 0 || r >= in.rows) {
            ++wrong_meta;
            continue;
          }
          const int src = in.Source(r);
          const int64_t t = in.token[r];
          if (src < 0 || src >= ranks_ || t < 0 || t >= batches[src].n()) {
            ++wrong_meta;
            continue;
          }
          const int32_t* ids = batches[src].ids(t);
          const int j = static_cast<int>(std::find(ids, ids + c.top_k, e) - ids);
          if (j == c.top_k) {  // not a choice of that token
            ++wrong_meta;
            continue;
          }
          ++pair_seen[pair_begin[src] + t * c.top_k + j];
          ++row_pairs[r];
          in.Decode(r, 1, decoded.data());
          ExpertRow(c, decoded.data(), e, pair_out + p * c.hidden);
        }
      }
      for (int64_t r = 0; r < in.rows; ++r) {
        const int src = in.Source(r);
        const int64_t t = in.token[r];
        if (src < 0 || src >= ranks_ || t < 0 || t >= batches[src].n()) {
          ++wrong_meta;
          continue;
        }
        EncodeRow(plan.dispatch_dtype(), batches[src].x(t), c.hidden, expect_row.data());
        const size_t compare = plan.dispatch_dtype() == common::ElementType::kFp32
                                   ? c.hidden * sizeof(float)
                                   : row_bytes;
        wrong_rows += std::memcmp(in.Row(r), expect_row.data(), compare) != 0;
        // A row comes for its pairs (or, split, to every worker); rows of one source arrive
        // in its token order.
        if (row_pairs[r] == 0 && !plan.shared_expert_split()) ++wrong_meta;
        if (r > in.source_begin[src] && in.token[r - 1] >= t) ++wrong_meta;
        if (row_out != nullptr) {
          std::fill(row_out + r * c.hidden, row_out + (r + 1) * c.hidden, Base(plan, rank_));
        }
      }
      return absl::OkStatus();
    };

    std::vector<float> y(std::max<int64_t>(mine.n(), 1) * c.hidden, NAN);
    // Routing arrays of this rank, contiguous.
    std::vector<float> x(mine.n() * c.hidden), w(mine.n() * c.top_k);
    std::vector<int32_t> ids(mine.n() * c.top_k);
    for (int64_t t = 0; t < mine.n(); ++t) {
      std::copy(mine.x(t), mine.x(t) + c.hidden, &x[t * c.hidden]);
      std::copy(mine.ids(t), mine.ids(t) + c.top_k, &ids[t * c.top_k]);
      std::copy(mine.weights(t), mine.weights(t) + c.top_k, &w[t * c.top_k]);
    }
    absl::Status s = ex.Run(x.data(), mine.n(), ids.data(), w.data(), y.data(), false, expert,
                            absl::Now() + absl::Seconds(60), stats);
    if (!s.ok()) return s;

    // Every pair of every sender computed exactly once, over all ranks.
    MPI_Allreduce(MPI_IN_PLACE, pair_seen.data(), static_cast<int>(pair_seen.size()), MPI_INT,
                  MPI_SUM, MPI_COMM_WORLD);
    int pairs_not_once = 0;
    for (int n : pair_seen) pairs_not_once += n != 1;

    // Rows received where every expert has one copy: every (source, token) with an expert
    // of mine (or every one).
    if (stats != nullptr && placement.redundant() == 0) {
      int64_t expected_received = 0;
      for (int r = 0; r < ranks_; ++r) {
        for (int64_t t = 0; t < batches[r].n(); ++t) {
          bool hit = plan.shared_expert_split();
          for (int j = 0; j < c.top_k; ++j)
            hit |= placement.copies(batches[r].ids(t)[j])[0].worker == rank_;
          expected_received += hit;
        }
      }
      EXPECT_EQ(stats->rows_received, expected_received);
    }

    // Reference combine: the row parts in destination order (split), then every choice's
    // expert row, each through the combine dtype, weighted in the order of j
    // (WeightedSumRows, the exchange's own arithmetic: this checks what is summed, in which
    // order).
    int wrong_out = 0;
    std::vector<float> ref(c.hidden), x_rt(c.hidden), part(c.hidden);
    std::vector<unsigned char> enc(row_bytes);
    const size_t combine_bytes = plan.combine_row_bytes();
    std::vector<std::vector<unsigned char>> parts_enc(ranks_ + c.top_k,
                                                      std::vector<unsigned char>(combine_bytes));
    std::vector<const void*> parts;
    std::vector<float> scale;
    for (int64_t t = 0; t < mine.n(); ++t) {
      EncodeRow(plan.dispatch_dtype(), mine.x(t), c.hidden, enc.data());
      DecodeRow(plan.dispatch_dtype(), enc.data(), c.hidden, x_rt.data());
      parts.clear();
      scale.clear();
      if (plan.shared_expert_split()) {
        for (int d = 0; d < ranks_; ++d) {
          std::fill(part.begin(), part.end(), Base(plan, d));
          EncodeRow(plan.combine_dtype(), part.data(), c.hidden, parts_enc[parts.size()].data());
          parts.push_back(parts_enc[parts.size()].data());
          scale.push_back(1.0f);
        }
      }
      for (int j = 0; j < c.top_k; ++j) {
        ExpertRow(c, x_rt.data(), mine.ids(t)[j], part.data());
        EncodeRow(plan.combine_dtype(), part.data(), c.hidden, parts_enc[parts.size()].data());
        parts.push_back(parts_enc[parts.size()].data());
        scale.push_back(mine.weights(t)[j]);
      }
      WeightedSumRows(plan.combine_dtype(), parts.data(), scale.data(),
                      static_cast<int>(parts.size()), c.hidden, ref.data(), false);
      wrong_out += std::memcmp(ref.data(), &y[t * c.hidden], c.hidden * sizeof(float)) != 0;
    }
    EXPECT_EQ(wrong_rows, 0) << "rank " << rank_ << " batch " << batch;
    EXPECT_EQ(wrong_meta, 0) << "rank " << rank_ << " batch " << batch;
    EXPECT_EQ(pairs_not_once, 0) << "rank " << rank_ << " batch " << batch;
    EXPECT_EQ(wrong_out, 0) << "rank " << rank_ << " batch " << batch;
    if (stats != nullptr) {
      EXPECT_EQ(rounds_seen, stats->rounds);
    }
    if (y_out != nullptr) y_out->assign(y.begin(), y.begin() + mine.n() * c.hidden);
    return absl::OkStatus();
  }

  // Tokens each rank sends in the i-th batch of a series: none, 1, all max, then random
  // counts (in batch 3 rank 0 sends nothing while the others do).
  std::vector<int64_t> Sizes(int i, int64_t max, std::mt19937& rng) const {
    std::vector<int64_t> sizes(ranks_);
    for (int64_t& n : sizes) n = i == 0 ? 0 : i == 1 ? 1 : i == 2 ? max : rng() % (max + 1);
    if (i == 3) sizes[0] = 0;
    return sizes;
  }

  // Runs `per_routing` batches of the Sizes series with uniform, then skewed routing on one
  // exchange (buffers never cleared), checking each with RunAndCheck and then `check`.
  void RunSeries(Exchange& exchange, int per_routing,
                 const std::function<void(const std::vector<int64_t>& sizes,
                                          const ExchangeStats& stats)>& check) {
    std::mt19937 rng(static_cast<uint32_t>(seed_));
    uint64_t batch = 0;
    for (Routing routing : {Routing::kUniform, Routing::kSkewed}) {
      for (int i = 0; i < per_routing; ++i) {
        const std::vector<int64_t> sizes = Sizes(i, exchange.plan().max_rows_per_worker(), rng);
        ExchangeStats stats;
        absl::Status st = RunAndCheck(exchange, ++batch, sizes, routing, &stats);
        ASSERT_TRUE(st.ok()) << st;
        check(sizes, stats);
      }
    }
  }

  // What worker d adds to every token it receives when every token goes everywhere.
  static float Base(const ExchangePlan& plan, int d) {
    return plan.shared_expert_split() ? 0.25f * static_cast<float>(d + 1) : 0.0f;
  }

  int rank_ = 0;
  int ranks_ = 0;
  uint64_t seed_ = 0;
};

TEST_P(ExchangeTest, RowsLandWhereExpectedAndCombineIsExact) {
  Setup s = Make(Plan(Shape(), Options()));
  ASSERT_NE(s.exchange, nullptr);
  // Repeated batches of changing sizes, uniform and skewed, with empty ones in between;
  // buffers are never cleared.
  RunSeries(*s.exchange, 8, [](const std::vector<int64_t>&, const ExchangeStats& stats) {
    EXPECT_EQ(stats.rounds, 1);
  });
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_P(ExchangeTest, EveryTokenReachesEveryWorkerWhenAsked) {
  // --shared-expert=split on a model with a shared expert.
  ExchangeShape shape = Shape();
  shape.has_shared_expert = true;
  ExchangeOptions options = Options();
  options.shared_expert = SharedExpertPlacement::kSplit;
  Setup s = Make(Plan(shape, options));
  ASSERT_NE(s.exchange, nullptr);
  ASSERT_TRUE(s.exchange->plan().shared_expert_split());
  RunSeries(*s.exchange, 5, [](const std::vector<int64_t>& sizes, const ExchangeStats& stats) {
    EXPECT_EQ(stats.rows_received, std::accumulate(sizes.begin(), sizes.end(), int64_t{0}));
  });
  MPI_Barrier(MPI_COMM_WORLD);
}

// Placements that replicate experts (a balanced one for the skewed routing, where expert 0
// takes most pairs, and random ones) give bit-identical answers to the contiguous placement,
// batch after batch on one exchange, with and without a split shared expert.
TEST_P(ExchangeTest, ReplicatedPlacementsGiveBitIdenticalAnswers) {
  for (bool split : {false, true}) {
    ExchangeShape shape = Shape();
    shape.redundant_experts = ranks_ + 1;
    shape.has_shared_expert = split;
    ExchangeOptions options = Options();
    options.shared_expert = SharedExpertPlacement::kSplit;
    Setup s = Make(Plan(shape, options));
    ASSERT_NE(s.exchange, nullptr);
    const int experts = shape.num_experts;
    const int redundant = shape.redundant_experts;

    std::vector<ExpertPlacement> placements;
    placements.push_back(s.exchange->placement());  // contiguous
    std::vector<double> load(experts, 1.0);
    load[0] = 3.0 * experts;  // Routing::kSkewed
    absl::StatusOr<BalancedPlacement> balanced = BalanceExperts(load, ranks_, redundant);
    ASSERT_TRUE(balanced.ok()) << balanced.status();
    absl::StatusOr<ExpertPlacement> p = ExpertPlacement::FromSlots(experts, balanced->experts_of);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_GT(p->copies(0).size(), 1u);
    placements.push_back(*std::move(p));
    std::mt19937_64 rng(seed_);
    for (int i = 0; i < 2; ++i) {
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<std::vector<int>> slots(ranks_);
      for (int e = 0; e < experts; ++e) slots[e % ranks_].push_back(order[e]);
      for (int w = 0; w < ranks_; ++w) {
        while (static_cast<int>(slots[w].size()) < SlotsOfWorker(experts, redundant, w, ranks_)) {
          const int e = static_cast<int>(rng() % experts);
          if (std::find(slots[w].begin(), slots[w].end(), e) == slots[w].end()) {
            slots[w].push_back(e);
          }
        }
      }
      p = ExpertPlacement::FromSlots(experts, slots);
      ASSERT_TRUE(p.ok()) << p.status();
      EXPECT_EQ(p->redundant(), redundant);
      placements.push_back(*std::move(p));
    }

    std::mt19937 sizes_rng(static_cast<uint32_t>(seed_));
    for (int i = 0; i < 5; ++i) {
      const std::vector<int64_t> sizes =
          Sizes(i, s.exchange->plan().max_rows_per_worker(), sizes_rng);
      const Routing routing = i % 2 == 0 ? Routing::kSkewed : Routing::kUniform;
      std::vector<float> first, y;
      for (size_t q = 0; q < placements.size(); ++q) {
        ASSERT_TRUE(s.exchange->UsePlacement(placements[q]).ok());
        ExchangeStats stats;
        absl::Status st = RunAndCheck(*s.exchange, 100 + i, sizes, routing, &stats, &y);
        ASSERT_TRUE(st.ok()) << st;
        if (q == 0) {
          first = y;
          continue;
        }
        ASSERT_EQ(y.size(), first.size());
        EXPECT_TRUE(y.empty() || std::memcmp(y.data(), first.data(), y.size() * sizeof(float)) == 0)
            << "placement " << q << " (" << placements[q].Describe() << "), batch " << i
            << ", split " << split << ", rank " << rank_;
      }
    }
    // The balanced placement spreads expert 0's pairs over its copies.
    if (ranks_ > 1) {
      ASSERT_TRUE(s.exchange->UsePlacement(placements[1]).ok());
      const std::vector<int64_t> full(ranks_, kMaxSend);
      ExchangeStats stats;
      ASSERT_TRUE(RunAndCheck(*s.exchange, 200, full, Routing::kSkewed, &stats).ok());
      int64_t pairs = stats.pairs, most = stats.pairs;
      MPI_Allreduce(MPI_IN_PLACE, &pairs, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, &most, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
      const double balancedness = static_cast<double>(pairs) / ranks_ / static_cast<double>(most);
      EXPECT_GT(balancedness, 0.85) << "rank " << rank_;
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST_P(ExchangeTest, APlacementThatDoesNotFitIsRefused) {
  Setup s = Make(Plan(Shape(), Options()));  // no redundant experts
  ASSERT_NE(s.exchange, nullptr);
  const int experts = Shape().num_experts;
  std::vector<std::vector<int>> slots(ranks_);
  for (int e = 0; e < experts; ++e) slots[e % ranks_].push_back(e);
  slots[0].push_back(experts - 1 == slots[0].back() ? 1 : experts - 1);  // one copy too many
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::FromSlots(experts, slots);
  if (ranks_ > 1) {
    ASSERT_TRUE(p.ok()) << p.status();
    absl::Status st = s.exchange->UsePlacement(*p);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("--redundant-experts"), absl::string_view::npos) << st;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_P(ExchangeTest, OverflowFailsEverywhereThenLaterBatchesRun) {
  ExchangeOptions options = Options();
  options.max_recv_tokens_per_rank = kMaxSend;  // a skewed full batch needs ~W * kMaxSend
  options.recv_overflow = OverflowPolicy::kFail;
  Setup s = Make(Plan(Shape(), options));
  ASSERT_NE(s.exchange, nullptr);
  const std::vector<int64_t> full(ranks_, kMaxSend), small(ranks_, 3);
  absl::Status st = RunAndCheck(*s.exchange, 1, full, Routing::kSkewed);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("--max-recv-tokens-per-rank"), absl::string_view::npos) << st;
  st = RunAndCheck(*s.exchange, 2, small, Routing::kSkewed);
  EXPECT_TRUE(st.ok()) << st;
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_P(ExchangeTest, OverflowSplitServesEveryTokenInRounds) {
  ExchangeOptions options = Options();
  options.max_recv_tokens_per_rank = 2 * ranks_ + 1;  // rounds of 2 tokens per sender
  options.recv_overflow = OverflowPolicy::kSplit;
  Setup s = Make(Plan(Shape(), options));
  ASSERT_NE(s.exchange, nullptr);
  for (uint64_t batch = 1; batch <= 3; ++batch) {
    std::vector<int64_t> sizes(ranks_);
    for (int r = 0; r < ranks_; ++r) sizes[r] = batch == 2 ? 0 : 5 + 3 * r;
    ExchangeStats stats;
    absl::Status st = RunAndCheck(*s.exchange, batch, sizes, Routing::kSkewed, &stats);
    ASSERT_TRUE(st.ok()) << st;
    if (batch != 2) {
      EXPECT_EQ(stats.rounds, (5 + 3 * (ranks_ - 1) + 1) / 2);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, ExchangeTest,
    ::testing::Values(
        Case{shmem::HeapBackend::kShm, common::ElementType::kFp32, common::ElementType::kFp32},
        Case{shmem::HeapBackend::kRma, common::ElementType::kFp32, common::ElementType::kFp32},
        Case{shmem::HeapBackend::kShm, common::ElementType::kBf16, common::ElementType::kBf16},
        Case{shmem::HeapBackend::kRma, common::ElementType::kBf16, common::ElementType::kFp32},
        Case{shmem::HeapBackend::kShm, common::ElementType::kFp8E4m3, common::ElementType::kFp32},
        Case{shmem::HeapBackend::kRma, common::ElementType::kFp8E4m3, common::ElementType::kBf16}),
    CaseName);

// A peer that stops taking part: every other rank's wait ends with DEADLINE_EXCEEDED by
// the deadline plus a small margin, naming the peer. The last rank stalls (sleeps without
// taking part) instead of being killed, so that mpirun leaves the others running.
class StallTest : public ::testing::TestWithParam<shmem::HeapBackend> {};

TEST_P(StallTest, OthersFailByTheDeadline) {
  int rank = 0, ranks = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const ExchangePlan plan = *ExchangePlan::Make({.num_workers = ranks,
                                                 .first_rank = 0,
                                                 .num_experts = ranks,
                                                 .top_k = 1,
                                                 .hidden = 64,
                                                 .max_batch_tokens = 8 * ranks},
                                                {});
  std::unique_ptr<shmem::SymmetricHeap> heap =
      *shmem::SymmetricHeap::Create(MPI_COMM_WORLD, ExchangeRegions::BytesNeeded(plan), GetParam());
  std::unique_ptr<Exchange> ex =
      *Exchange::Create(*heap, plan, *Exchange::Allocate(*heap, plan), rank);
  std::vector<float> x(8 * 64, 1.0f), y(8 * 64), w(8, 1.0f);
  std::vector<int32_t> ids(8);
  for (int t = 0; t < 8; ++t) ids[t] = t % ranks;
  const Exchange::ExpertStep copy = [&](const ReceivedRows& in, float* pair_out, float*) {
    for (int64_t p = 0; p < in.pairs; ++p) in.Decode(in.pair_row[p], 1, pair_out + p * 64);
    return absl::OkStatus();
  };
  // One good batch first.
  ASSERT_TRUE(ex->Run(x.data(), 8, ids.data(), w.data(), y.data(), false, copy,
                      absl::Now() + absl::Seconds(30))
                  .ok());
  EXPECT_EQ(y[5 * 64], 1.0f);
  MPI_Barrier(MPI_COMM_WORLD);
  const absl::Duration timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  if (rank == ranks - 1) {
    absl::SleepFor(timeout * 3);  // stuck: takes no part in the batch
  } else {
    absl::Status s =
        ex->Run(x.data(), 8, ids.data(), w.data(), y.data(), false, copy, start + timeout);
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_NE(s.message().find(absl::StrCat("worker ", ranks - 1)), absl::string_view::npos) << s;
    EXPECT_GE(took, timeout);
    EXPECT_LT(took, timeout + absl::Milliseconds(250)) << "rank " << rank;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// A worker's death as the survivors see it (shm): the last rank stops taking part in a batch;
// rank 0 (here: rank 0 itself, from a thread) bumps every survivor's cancel signal, and their
// waits end at once with CANCELLED instead of at the deadline. The survivors then serve the
// next batches without it: live set without the last rank, a new generation, every expert's
// copy on a live worker; every pair is computed and every output is right.
TEST(LostWorkerTest, SurvivorsCancelThenServeOnWithoutIt) {
  int rank = 0, ranks = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  constexpr int kHidden = 64, kTokens = 8, kTopK = 2;
  // Every expert on two workers: worker w holds experts w and w + 1 (mod W).
  const ExchangePlan plan = *ExchangePlan::Make({.num_workers = ranks,
                                                 .first_rank = 0,
                                                 .num_experts = ranks,
                                                 .top_k = std::min(kTopK, ranks),
                                                 .hidden = kHidden,
                                                 .max_batch_tokens = kTokens * ranks,
                                                 .redundant_experts = ranks},
                                                {});
  const int k = plan.shape().top_k;
  std::vector<std::vector<int>> slots(ranks);
  for (int w = 0; w < ranks; ++w) slots[w] = {w, (w + 1) % ranks};
  if (ranks == 1) slots[0] = {0};
  const ExpertPlacement placement = *ExpertPlacement::FromSlots(ranks, slots);
  std::unique_ptr<shmem::SymmetricHeap> heap = *shmem::SymmetricHeap::Create(
      MPI_COMM_WORLD, ExchangeRegions::BytesNeeded(plan) + 4096, shmem::HeapBackend::kShm);
  const ExchangeRegions regions = *Exchange::Allocate(*heap, plan);
  const size_t cancel = *heap->Allocate(64);
  std::unique_ptr<Exchange> ex = *Exchange::Create(*heap, plan, regions, rank);
  ASSERT_TRUE(ex->UsePlacement(placement).ok());
  uint64_t* my_cancel = heap->LocalAs<uint64_t>(cancel);
  ex->CancelWhen(my_cancel, 0);

  // The expert step copies each pair's row: with weights 1/k each, y is x again (exactly,
  // for k = 1 and 2).
  const Exchange::ExpertStep copy = [&](const ReceivedRows& in, float* pair_out, float*) {
    for (int64_t p = 0; p < in.pairs; ++p) {
      in.Decode(in.pair_row[p], 1, pair_out + p * kHidden);
    }
    return absl::OkStatus();
  };
  uint64_t seed = std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 rng(seed + rank);
  std::vector<float> x(kTokens * kHidden), y(kTokens * kHidden), w(kTokens * k, 1.0f / k);
  std::vector<int32_t> ids(kTokens * k);
  auto batch = [&](const char* what) {
    std::uniform_real_distribution<float> u(-1, 1);
    for (float& v : x) v = u(rng);
    std::fill(y.begin(), y.end(), NAN);
    for (int t = 0; t < kTokens; ++t) {
      const int first = static_cast<int>(rng() % ranks);
      for (int j = 0; j < k; ++j) ids[t * k + j] = (first + j) % ranks;
    }
    absl::Status s = ex->Run(x.data(), kTokens, ids.data(), w.data(), y.data(), false, copy,
                             absl::Now() + absl::Seconds(30));
    if (s.ok()) {
      int wrong = 0;
      for (size_t i = 0; i < x.size(); ++i) wrong += y[i] != x[i];
      EXPECT_EQ(wrong, 0) << what << ", rank " << rank;
    }
    return s;
  };
  EXPECT_TRUE(batch("all live").ok());
  MPI_Barrier(MPI_COMM_WORLD);
  if (ranks < 2) return;

  const int lost = ranks - 1;
  if (rank != lost) {
    std::thread canceller;
    if (rank == 0) {
      canceller = std::thread([&] {
        absl::SleepFor(absl::Milliseconds(300));
        for (int r = 0; r < lost; ++r) {
          shmem::SignalStore(heap->DirectAs<uint64_t>(r, cancel), 1);
        }
      });
    }
    const absl::Time start = absl::Now();
    absl::Status s = batch("the lost worker's batch");
    const absl::Duration took = absl::Now() - start;
    if (canceller.joinable()) canceller.join();
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
    EXPECT_LT(took, absl::Seconds(5)) << "rank " << rank << ": cancelled only at the deadline";
  }
  MPI_Barrier(MPI_COMM_WORLD);  // the survivors have all left the abandoned pass
  if (rank != lost) {
    WorkerSet live = WorkerSet::All(ranks);
    live.Remove(lost);
    const absl::StatusOr<ExpertPlacement> survivors = placement.OnlyOn(live);
    ASSERT_TRUE(survivors.ok()) << survivors.status();
    EXPECT_EQ(survivors->count(lost), 0);
    ASSERT_TRUE(ex->UseLiveWorkers(live, 1).ok());
    ASSERT_TRUE(ex->UsePlacement(*survivors).ok());
    ex->CancelWhen(my_cancel, 1);
    for (int i = 0; i < 3; ++i) {
      absl::Status s = batch("over the survivors");
      EXPECT_TRUE(s.ok()) << s << ", rank " << rank << ", batch " << i;
    }
    // A placement that still gives the lost worker experts is refused, not run.
    absl::Status s = ex->UsePlacement(placement);
    if (s.ok()) {
      s = ex->Run(x.data(), kTokens, ids.data(), w.data(), y.data(), false, copy,
                  absl::Now() + absl::Seconds(30));
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(WorkerSetTest, RowSplitGivesTheDeadNothing) {
  WorkerSet live = WorkerSet::All(4);
  live.Remove(1);
  EXPECT_EQ(live.Count(), 3);
  std::vector<int64_t> rows;
  for (int w = 0; w < 4; ++w)
    rows.push_back(RowSplit(10, w + 1, 4, live) - RowSplit(10, w, 4, live));
  EXPECT_EQ(rows, (std::vector<int64_t>{3, 0, 3, 4}));
  EXPECT_EQ(RowSplit(10, 4, 4, live), 10);
  WorkerSet all = WorkerSet::All(kMaxWorkers);
  EXPECT_EQ(all.Count(), kMaxWorkers);
  all.Remove(200);
  EXPECT_FALSE(all.Has(200));
  EXPECT_TRUE(all.Has(199));
}

INSTANTIATE_TEST_SUITE_P(Backends, StallTest,
                         ::testing::Values(shmem::HeapBackend::kShm, shmem::HeapBackend::kRma),
                         [](const ::testing::TestParamInfo<shmem::HeapBackend>& p) {
                           return std::string(shmem::HeapBackendName(p.param));
                         });

}  // namespace
}  // namespace epserve::worker
