// The EP pipeline across real ranks: rank 0 scatters batches of fresh random rows through
// the symmetric heap, the workers route, dispatch, run the expert FFNs and combine, and
// rank 0 checks every output row against the reference forward pass.
#include <mpi.h>

#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "model/reference.h"
#include "model/synthetic.h"
#include "worker/coordinator.h"
#include "worker/worker.h"

namespace epserve::worker {
namespace {

struct Cluster {
  int rank = 0;
  int num_ranks = 0;
  std::unique_ptr<model::WeightSource> source;
  std::unique_ptr<shmem::SymmetricHeap> heap;
  ExchangeLayout layout;
};

Cluster Start(const std::string& preset, int64_t max_batch_tokens, uint64_t seed) {
  Cluster c;
  MPI_Comm_rank(MPI_COMM_WORLD, &c.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &c.num_ranks);
  c.source = *model::OpenModel("synthetic:" + preset, seed);
  const model::MoeLayerConfig& cfg = c.source->config().layer;
  ExchangeShape shape{c.num_ranks - 1, cfg.num_experts, cfg.top_k, cfg.hidden_size,
                      max_batch_tokens};
  c.heap = *shmem::SymmetricHeap::Create(MPI_COMM_WORLD, ExchangeLayout::BytesNeeded(shape));
  c.layout = *ExchangeLayout::Allocate(*c.heap, shape);
  return c;
}

// Runs on every rank: workers serve until rank 0 stops them; rank 0 runs `body`.
void RunCluster(const std::string& preset, int64_t max_batch_tokens,
                const std::function<void(Cluster&, Coordinator&)>& body) {
  uint64_t seed = std::random_device{}();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  Cluster c = Start(preset, max_batch_tokens, seed);
  if (c.rank == 0) {
    Coordinator coordinator(*c.heap, c.layout);
    ASSERT_TRUE(coordinator.WaitForWorkers(absl::Now() + absl::Seconds(120)).ok());
    body(c, coordinator);
    EXPECT_TRUE(coordinator.Stop(absl::Now() + absl::Seconds(30)).ok());
  } else {
    WorkerOptions options;
    absl::StatusOr<std::unique_ptr<Worker>> w =
        Worker::Create(*c.heap, c.layout, *c.source, options);
    ASSERT_TRUE(w.ok()) << w.status();
    std::atomic<bool> stop{false};
    EXPECT_TRUE((*w)->Serve(stop).ok());
  }
}

// Checks `out` against the reference, skipping tokens whose routing is a near-tie.
void ExpectMatchesReference(const model::WeightSource& source, int layer,
                            const std::vector<float>& x, const std::vector<float>& out,
                            int64_t tokens) {
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
  EXPECT_LE(max_err / std::max(max_ref, 1e-30), 1e-4) << "max abs error " << max_err;
}

TEST(WorkerPipeline, BatchesOfEverySizeMatchTheReference) {
  RunCluster("tiny", 64, [](Cluster& c, Coordinator& coord) {
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

TEST(WorkerPipeline, GroupedRoutingWithoutGateMatchesTheReference) {
  RunCluster("tiny-grouped", 40, [](Cluster& c, Coordinator& coord) {
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

}  // namespace
}  // namespace epserve::worker
