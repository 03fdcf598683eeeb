// The EP pipeline across real ranks: rank 0 scatters batches of fresh random rows through
// the symmetric heap, the workers route, dispatch, run the expert FFNs and combine, and
// rank 0 checks every output row against the reference forward pass.
#include <mpi.h>

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/convert.h"
#include "gtest/gtest.h"
#include "model/reference.h"
#include "model/synthetic.h"
#include "worker/coordinator.h"
#include "worker/placement.h"
#include "worker/worker.h"

namespace epserve::worker {
namespace {

struct Cluster {
  int rank = 0;
  int num_ranks = 0;
  std::unique_ptr<model::WeightSource> source;
  std::unique_ptr<shmem::SymmetricHeap> heap;
  HeapRegions regions;
};

struct ClusterOptions {
  std::string preset = "tiny";
  int64_t max_batch_tokens = 64;
  ExchangeOptions exchange;  // the heap backend included
  int stalled_rank = -1;     // this worker loads, says it is ready, then sleeps stall_for
  absl::Duration stall_for = absl::ZeroDuration();
  // WorkerOptions::open_model (weight swaps); empty: the workers refuse swaps.
  std::function<absl::StatusOr<std::unique_ptr<model::WeightSource>>(const std::string&, uint64_t)>
      open_model;
};

Cluster Start(const ClusterOptions& o, uint64_t seed) {
  Cluster c;
  MPI_Comm_rank(MPI_COMM_WORLD, &c.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &c.num_ranks);
  c.source = *model::OpenModel("synthetic:" + o.preset, seed);
  const model::MoeLayerConfig& cfg = c.source->config().layer;
  absl::StatusOr<ExchangePlan> plan =
      ExchangePlan::Make({.num_workers = NumWorkers(c.num_ranks),
                          .num_experts = cfg.num_experts,
                          .top_k = cfg.top_k,
                          .hidden = cfg.hidden_size,
                          .max_batch_tokens = o.max_batch_tokens,
                          .has_shared_expert = cfg.shared_ffn_size > 0},
                         o.exchange);
  EXPECT_TRUE(plan.ok()) << plan.status();
  c.heap = *shmem::SymmetricHeap::Create(MPI_COMM_WORLD, HeapRegions::BytesNeeded(*plan),
                                         plan->heap_backend());
  c.regions = *HeapRegions::Allocate(*c.heap, *plan);
  return c;
}

// Runs on every rank: workers serve until rank 0 stops them; rank 0 runs `body`.
void RunCluster(const ClusterOptions& o, const std::function<void(Cluster&, Coordinator&)>& body) {
  uint64_t seed = std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  Cluster c = Start(o, seed);
  if (c.rank == 0) {
    Coordinator coordinator(*c.heap, c.regions);
    ASSERT_TRUE(coordinator.WaitForWorkers(absl::Now() + absl::Seconds(120)).ok());
    body(c, coordinator);
    EXPECT_TRUE(coordinator.Stop(absl::Now() + absl::Seconds(30)).ok());
  } else {
    WorkerOptions options;
    options.open_model = o.open_model;
    absl::StatusOr<std::unique_ptr<Worker>> w =
        Worker::Create(*c.heap, c.regions, *c.source, options);
    ASSERT_TRUE(w.ok()) << w.status();
    if (c.rank == o.stalled_rank) {
      // Ready as far as rank 0 knows, then stuck for a while.
      ASSERT_TRUE(
          c.heap->SignalSet(0, HeapRegions::Signal(c.regions.ready, WorkerOfRank(c.rank)), 1).ok());
      absl::SleepFor(o.stall_for);
    }
    std::atomic<bool> stop{false};
    EXPECT_TRUE((*w)->Serve(stop).ok());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Checks `out` against the reference, skipping tokens whose routing is a near-tie.
void ExpectMatchesReference(const model::WeightSource& source, int layer,
                            const std::vector<float>& x, const std::vector<float>& out,
                            int64_t tokens, double tolerance = 1e-4) {
  const model::MoeLayerConfig& cfg = source.config().layer;
  model::LayerWeights w = *model::LoadLayer(source, layer);
  std::vector<float> ref(x.size());
  model::Routing routing;
  model::ReferenceForward(cfg, w, x.data(), tokens, ref.data(), &routing);
  double max_err = 0, max_ref = 0;
  int skipped = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (routing.margins[t] < 1e-5) {
      ++skipped;
      continue;
    }
    for (int64_t i = 0; i < cfg.hidden_size; ++i) {
      const double r = ref[t * cfg.hidden_size + i], o = out[t * cfg.hidden_size + i];
      ASSERT_TRUE(std::isfinite(o)) << "token " << t << " column " << i;
      max_err = std::max(max_err, std::abs(r - o));
      max_ref = std::max(max_ref, std::abs(r));
    }
  }
  EXPECT_LE(skipped, tokens / 10 + 1);
  EXPECT_LE(max_err / std::max(max_ref, 1e-30), tolerance) << "max abs error " << max_err;
}

TEST(WorkerPipeline, BatchesOfEverySizeMatchTheReference) {
  RunCluster({}, [](Cluster& c, Coordinator& coord) {
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int64_t h = c.source->config().layer.hidden_size;
    for (int64_t tokens : {1, 2, 7, 33, 64}) {
      for (int layer_pos : {0, 1}) {
        std::vector<float> x(tokens * h), out(tokens * h, NAN);
        for (float& v : x) v = u(rng);
        // Two chunks, as the batcher hands over pieces of different requests.
        const int64_t first = tokens / 3;
        RowChunk chunks[2] = {{x.data(), out.data(), first},
                              {x.data() + first * h, out.data() + first * h, tokens - first}};
        absl::StatusOr<BatchTrace> trace =
            coord.Run(layer_pos, chunks, absl::Now() + absl::Seconds(60));
        ASSERT_TRUE(trace.ok()) << trace.status();
        int64_t pairs = 0;
        for (int64_t n : trace->expert_tokens) pairs += n;
        EXPECT_EQ(pairs, tokens * c.source->config().layer.top_k);
        ExpectMatchesReference(*c.source, c.source->config().moe_layers[layer_pos], x, out, tokens);
      }
    }
  });
}

// Chunks of BF16 and FP16 rows, answered in FP16, BF16 and FP32 (as requests of those types
// reach the coordinator): rank 0 widens them into the heap and narrows the answer out of it,
// each chunk by its own types, and every row matches the reference of the widened inputs to
// within the rounding of its output type. On the shm heap rank 0 converts straight into the
// workers' input regions; on the rma heap into rows of its own that it Puts.
class TypedRows : public ::testing::TestWithParam<shmem::HeapBackend> {};

TEST_P(TypedRows, AreConvertedOnTheirWayInAndOut) {
  ClusterOptions o;
  o.exchange.heap = GetParam();
  RunCluster(o, [](Cluster& c, Coordinator& coord) {
    using common::ElementType;
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int64_t h = c.source->config().layer.hidden_size;
    struct Part {
      ElementType in, out;
      int64_t tokens;
    };
    const Part parts[] = {{ElementType::kBf16, ElementType::kFp16, 5},
                          {ElementType::kFp32, ElementType::kBf16, 9},
                          {ElementType::kFp16, ElementType::kFp32, 4}};
    int64_t tokens = 0;
    for (const Part& p : parts) tokens += p.tokens;
    std::vector<float> x(tokens * h), out(tokens * h, NAN);
    std::vector<std::vector<char>> in_bytes, out_bytes;
    std::vector<RowChunk> chunks;
    int64_t at = 0;
    for (const Part& p : parts) {
      const size_t n = p.tokens * h;
      std::vector<float> values(n);
      for (float& v : values) v = u(rng);
      in_bytes.emplace_back(n * common::ElementBytes(p.in));
      common::FromFp32(p.in, values.data(), in_bytes.back().data(), n);
      // What the workers compute on: the inputs as they widen.
      common::ToFp32(p.in, in_bytes.back().data(), x.data() + at * h, n);
      out_bytes.emplace_back(n * common::ElementBytes(p.out), '\xff');  // NaN in every type
      chunks.push_back({in_bytes.back().data(), out_bytes.back().data(), p.tokens, nullptr, nullptr,
                        p.in, p.out});
      at += p.tokens;
    }
    absl::StatusOr<BatchTrace> trace = coord.Run(0, chunks, absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(trace.ok()) << trace.status();
    at = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      common::ToFp32(parts[i].out, out_bytes[i].data(), out.data() + at * h, parts[i].tokens * h);
      at += parts[i].tokens;
    }
    // BF16 answers carry 8 significant bits: within 2^-8 of the largest value.
    ExpectMatchesReference(*c.source, c.source->config().moe_layers[0], x, out, tokens, 1.0 / 256);
  });
}

INSTANTIATE_TEST_SUITE_P(WorkerPipeline, TypedRows,
                         ::testing::Values(shmem::HeapBackend::kShm, shmem::HeapBackend::kRma),
                         [](const ::testing::TestParamInfo<shmem::HeapBackend>& p) {
                           return std::string(shmem::HeapBackendName(p.param));
                         });

// Two batches in flight (Coordinator::Start / Finish, as the server runs them): the next
// batch's rows go into the other input slot while the workers compute, each batch's output
// comes from its own output slot, and every output row matches the reference. Finish out of
// the order of Start, and a third Start, are refused.
TEST(WorkerPipeline, TwoBatchesInFlightEachMatchTheReference) {
  RunCluster({}, [](Cluster& c, Coordinator& coord) {
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::uniform_int_distribution<int64_t> size(1, 64);
    const int64_t h = c.source->config().layer.hidden_size;
    struct Batch {
      int layer_pos = 0;
      int64_t tokens = 0;
      std::vector<float> x, out;
      RowChunk chunk{};
      uint64_t ticket = 0;
    };
    auto make = [&](int i) {
      auto b = std::make_unique<Batch>();
      b->layer_pos = i % 2;
      b->tokens = size(rng);
      b->x.resize(b->tokens * h);
      b->out.assign(b->tokens * h, NAN);
      for (float& v : b->x) v = u(rng);
      b->chunk = {b->x.data(), b->out.data(), b->tokens};
      absl::StatusOr<uint64_t> t =
          coord.Start(b->layer_pos, {&b->chunk, 1}, absl::Now() + absl::Seconds(60));
      EXPECT_TRUE(t.ok()) << t.status();
      b->ticket = t.ok() ? *t : 0;
      return b;
    };
    auto finish = [&](Batch& b) {
      absl::StatusOr<BatchTrace> trace = coord.Finish(b.ticket);
      ASSERT_TRUE(trace.ok()) << trace.status();
      ExpectMatchesReference(*c.source, c.source->config().moe_layers[b.layer_pos], b.x, b.out,
                             b.tokens);
    };
    std::unique_ptr<Batch> running = make(0);
    for (int i = 1; i < 12; ++i) {
      std::unique_ptr<Batch> next = make(i);
      if (i == 5) {
        EXPECT_EQ(coord.Finish(next->ticket).status().code(), absl::StatusCode::kInternal);
        RowChunk third = next->chunk;
        EXPECT_EQ(coord.Start(0, {&third, 1}, absl::Now() + absl::Seconds(60)).status().code(),
                  absl::StatusCode::kFailedPrecondition);
      }
      finish(*running);
      running = std::move(next);
    }
    finish(*running);
  });
}

// Weight swaps: all workers switch together; when one worker cannot load (here: the last
// one refuses seed 666), none switches and the served weights go on answering; a model of
// another shape is refused by every worker; the exchange stays healthy throughout.
TEST(WorkerPipeline, WeightSwapsAreAllOrNothing) {
  ClusterOptions o;
  o.open_model = [](const std::string& spec,
                    uint64_t seed) -> absl::StatusOr<std::unique_ptr<model::WeightSource>> {
    int rank = 0, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (seed == 666 && rank == size - 1) return absl::DataLossError("seed 666 refused here");
    return model::OpenModel(spec, seed);
  };
  RunCluster(o, [](Cluster& c, Coordinator& coord) {
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int64_t h = c.source->config().layer.hidden_size;
    auto run_and_check = [&](const model::WeightSource& expected) {
      const int64_t tokens = 37;
      std::vector<float> x(tokens * h), out(tokens * h, NAN);
      for (float& v : x) v = u(rng);
      RowChunk chunk{x.data(), out.data(), tokens};
      absl::StatusOr<BatchTrace> trace =
          coord.Run(1, std::span<const RowChunk>(&chunk, 1), absl::Now() + absl::Seconds(60));
      ASSERT_TRUE(trace.ok()) << trace.status();
      ExpectMatchesReference(expected, expected.config().moe_layers[1], x, out, tokens);
    };
    const uint64_t seed = rng() % 1000 + 1000;
    std::unique_ptr<model::WeightSource> next = *model::OpenModel("synthetic:tiny", seed);
    ASSERT_TRUE(coord.SwapWeights("synthetic:tiny", seed, absl::Now() + absl::Seconds(60)).ok());
    run_and_check(*next);

    absl::Status refused =
        coord.SwapWeights("synthetic:tiny", 666, absl::Now() + absl::Seconds(60));
    EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
    EXPECT_NE(refused.message().find("seed 666 refused here"), std::string::npos) << refused;
    EXPECT_TRUE(coord.healthy());
    run_and_check(*next);

    absl::Status shape =
        coord.SwapWeights("synthetic:tiny-grouped", seed, absl::Now() + absl::Seconds(60));
    EXPECT_EQ(shape.code(), absl::StatusCode::kFailedPrecondition) << shape;
    EXPECT_TRUE(coord.healthy());
    run_and_check(*next);

    // Back to the weights it started with.
    ASSERT_TRUE(coord.SwapWeights("synthetic:tiny", 0, absl::Now() + absl::Seconds(60)).code() ==
                absl::StatusCode::kOk);
    run_and_check(*model::OpenModel("synthetic:tiny", 0).value());
  });
}

TEST(WorkerPipeline, GroupedRoutingWithoutGateMatchesTheReference) {
  ClusterOptions o;
  o.preset = "tiny-grouped";
  o.max_batch_tokens = 40;
  RunCluster(o, [](Cluster& c, Coordinator& coord) {
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int64_t h = c.source->config().layer.hidden_size;
    const int64_t tokens = 40;
    std::vector<float> x(tokens * h), out(tokens * h, NAN);
    for (float& v : x) v = u(rng);
    RowChunk chunk{x.data(), out.data(), tokens};
    absl::StatusOr<BatchTrace> trace = coord.Run(0, {&chunk, 1}, absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(trace.ok()) << trace.status();
    ExpectMatchesReference(*c.source, 0, x, out, tokens);
  });
}

// The rma backend, narrow payloads, a small receive capacity split into rounds, and the
// shared expert split across the workers: every output row still matches the reference
// (within the payload's rounding).
struct Variant {
  const char* name;
  shmem::HeapBackend backend;
  common::ElementType dispatch;
  common::ElementType combine;
  int64_t max_recv;
  OverflowPolicy overflow;
  double tolerance;
  SharedExpertPlacement shared_expert = SharedExpertPlacement::kOwner;
};

class PipelineVariants : public ::testing::TestWithParam<Variant> {};

TEST_P(PipelineVariants, MatchTheReference) {
  const Variant& v = GetParam();
  ClusterOptions o;
  o.max_batch_tokens = 48;
  o.exchange.heap = v.backend;
  o.exchange.dispatch_dtype = v.dispatch;
  o.exchange.combine_dtype = v.combine;
  o.exchange.max_recv_tokens_per_rank = v.max_recv;
  o.exchange.recv_overflow = v.overflow;
  o.exchange.shared_expert = v.shared_expert;
  RunCluster(o, [&](Cluster& c, Coordinator& coord) {
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int64_t h = c.source->config().layer.hidden_size;
    for (int64_t tokens : {1, 48, 17}) {
      std::vector<float> x(tokens * h), out(tokens * h, NAN);
      for (float& val : x) val = u(rng);
      RowChunk chunk{x.data(), out.data(), tokens};
      absl::StatusOr<BatchTrace> trace = coord.Run(0, {&chunk, 1}, absl::Now() + absl::Seconds(60));
      ASSERT_TRUE(trace.ok()) << trace.status();
      ExpectMatchesReference(*c.source, c.source->config().moe_layers[0], x, out, tokens,
                             v.tolerance);
    }
  });
}

constexpr auto kRma = shmem::HeapBackend::kRma, kShm = shmem::HeapBackend::kShm;
constexpr auto kFp32 = common::ElementType::kFp32, kBf16 = common::ElementType::kBf16,
               kFp8 = common::ElementType::kFp8E4m3;
constexpr auto kFail = OverflowPolicy::kFail, kRounds = OverflowPolicy::kSplit;
constexpr auto kSplitShared = SharedExpertPlacement::kSplit;

INSTANTIATE_TEST_SUITE_P(
    Exchange, PipelineVariants,
    ::testing::Values(
        Variant{"rma", kRma, kFp32, kFp32, 0, kFail, 1e-4},
        Variant{"shm_bf16", kShm, kBf16, kBf16, 0, kFail, 2e-2},
        Variant{"rma_fp8_split", kRma, kFp8, kFp32, 8, kRounds, 1.5e-1},
        Variant{"shared_split", kShm, kFp32, kFp32, 0, kFail, 1e-4, kSplitShared},
        Variant{"rma_bf16_shared_split", kRma, kBf16, kFp32, 0, kFail, 2e-2, kSplitShared},
        Variant{"fp8_rounds_shared_split", kShm, kFp8, kBf16, 8, kRounds, 1.5e-1, kSplitShared}),
    [](const ::testing::TestParamInfo<Variant>& p) { return std::string(p.param.name); });

TEST(WorkerPipeline, OverflowUnderFailPolicyIsResourceExhaustedAndNextBatchRuns) {
  ClusterOptions o;
  o.max_batch_tokens = 48;
  o.exchange.max_recv_tokens_per_rank = 2;
  RunCluster(o, [&](Cluster& c, Coordinator& coord) {
    const int64_t h = c.source->config().layer.hidden_size;
    std::vector<float> x(48 * h, 0.5f), out(48 * h, NAN);
    RowChunk chunk{x.data(), out.data(), 48};
    absl::StatusOr<BatchTrace> trace = coord.Run(0, {&chunk, 1}, absl::Now() + absl::Seconds(60));
    EXPECT_EQ(trace.status().code(), absl::StatusCode::kResourceExhausted) << trace.status();
    EXPECT_TRUE(coord.healthy());
    chunk.rows = 1;
    trace = coord.Run(0, {&chunk, 1}, absl::Now() + absl::Seconds(60));
    EXPECT_TRUE(trace.ok()) << trace.status();
  });
}

// Rows in a client's CUDA memory (worker/device_rows.h) on CPU workers, which cannot reach
// them: rank 0 refuses the batch before any worker sees it (one worker failing alone would
// leave its peers waiting in the exchange), the exchange stays healthy and the next batch
// runs. (The service refuses to register CUDA regions with such workers in the first place.)
TEST(WorkerPipeline, RowsInCudaMemoryOnCpuWorkersAreAnErrorNamingWhy) {
  RunCluster({}, [&](Cluster& c, Coordinator& coord) {
    EXPECT_FALSE(coord.workers_read_cuda());
    const int64_t h = c.source->config().layer.hidden_size;
    std::mt19937_64 rng(std::random_device{}());
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> x(9 * h), out(9 * h, NAN);
    for (float& v : x) v = u(rng);
    RowChunk chunks[2] = {{x.data(), out.data(), 4}, {nullptr, nullptr, 5}};
    chunks[1].device_input.region_id = 1;
    chunks[1].device_output.region_id = 1;
    absl::StatusOr<BatchTrace> trace = coord.Run(0, chunks, absl::Now() + absl::Seconds(60));
    EXPECT_EQ(trace.status().code(), absl::StatusCode::kFailedPrecondition) << trace.status();
    EXPECT_NE(trace.status().message().find("CUDA shared memory"), std::string::npos)
        << trace.status();
    EXPECT_TRUE(coord.healthy());
    trace = coord.Run(0, {chunks, 1}, absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(trace.ok()) << trace.status();
    ExpectMatchesReference(*c.source, c.source->config().moe_layers[0], x, out, 4);
  });
}

// A worker that stops taking part: rank 0's batch fails with UNAVAILABLE by the exchange
// timeout (plus a small margin), naming the worker; the exchange then stays unhealthy.
TEST(WorkerPipeline, StalledWorkerFailsTheBatchWithUnavailableByTheTimeout) {
  int num_ranks = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &num_ranks);
  ClusterOptions o;
  o.exchange.exchange_timeout_ms = 500;
  o.stalled_rank = num_ranks - 1;
  o.stall_for = absl::Milliseconds(1500);
  RunCluster(o, [&](Cluster& c, Coordinator& coord) {
    const int64_t h = c.source->config().layer.hidden_size;
    std::vector<float> x(16 * h, 0.5f), out(16 * h, NAN);
    RowChunk chunk{x.data(), out.data(), 16};
    const absl::Time start = absl::Now();
    absl::StatusOr<BatchTrace> trace = coord.Run(0, {&chunk, 1}, absl::Now() + absl::Seconds(60));
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(trace.status().code(), absl::StatusCode::kUnavailable) << trace.status();
    EXPECT_NE(trace.status().message().find(absl::StrCat("worker ", num_ranks - 2)),
              absl::string_view::npos)
        << trace.status();
    EXPECT_LT(took, absl::Milliseconds(500 + 250));
    EXPECT_FALSE(coord.healthy());
    trace = coord.Run(0, {&chunk, 1}, absl::Now() + absl::Seconds(60));
    EXPECT_EQ(trace.status().code(), absl::StatusCode::kUnavailable);
  });
}

TEST(WorkerOptions, IdlePollOutsideItsBoundNamesTheFlag) {
  WorkerOptions options;
  EXPECT_TRUE(options.Validate().ok());  // 0: derived from the host
  options.idle_poll = absl::Microseconds(20);
  EXPECT_TRUE(options.Validate().ok());
  for (const absl::Duration bad : {absl::Microseconds(-1), absl::Milliseconds(101)}) {
    options.idle_poll = bad;
    const absl::Status s = options.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("--worker-idle-poll must be in [0, 100ms]"), std::string::npos) << s;
  }
}

TEST(WorkerOptions, MmaDecodeRowsOutsideItsSizesNamesTheFlag) {
  WorkerOptions options;
  for (const int good : {0, 32, 64}) {
    options.device.mma_decode_rows = good;
    EXPECT_TRUE(options.Validate().ok()) << good;
  }
  for (const int bad : {-1, 16, 48, 128}) {
    options.device.mma_decode_rows = bad;
    const absl::Status s = options.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("--mma-decode-rows must be 0, 32 or 64"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace epserve::worker
