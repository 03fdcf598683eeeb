// Dispatch + combine through the symmetric heap (worker/exchange.h; every rank a worker,
// identity experts), against two baselines measured in the same run on the same bytes.
// The identity expert's write of its output rows (into Exchange::ExpertOutput(), where a
// real expert step writes its results) is an expert's cost, not the exchange's: it is timed
// apart and printed in its own column. Baselines:
//   memcpy     every rank copies the bytes it moves (rows it dispatches plus rows it
//              returns) locally, all ranks at once: the bound on one host;
//   alltoallv  MPI_Alltoallv of the same rows, already packed per destination (packing
//              not counted), there and back: what users would reach for instead;
//   floor      what any exchange must at least do to its memory, done locally by every rank
//              at once with no synchronisation: copy each row that crosses ranks once (the
//              rows it sends to other ranks; a token's row for its own rank need not move),
//              and sum each token's parts (one per rank its experts live on) into its output
//              row, as the owner's sum does. alltoallv / floor ("reach") is the most any
//              exchange could gain over Alltoallv on this machine before its counting and
//              signals: where it is below a target, no exchange reaches the target here.
// Times are per batch: back-to-back batches, the slowest rank's mean.
//   mpirun -np 2 bench_exchange [--heap=shm|rma] [--dtype=fp32|bf16|fp8] [--quick]
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "shmem/heap.h"
#include "worker/exchange.h"
#include "worker/payload.h"

namespace epserve {
namespace {

struct Args {
  shmem::HeapBackend backend = shmem::HeapBackend::kShm;
  common::ElementType dtype = common::ElementType::kFp32;
  bool quick = false;
};

// Mean seconds per call of `body` on the slowest rank: back-to-back calls for about
// `budget` seconds (the same count on every rank), after `warmup` calls. When `excluded`
// is set, the seconds `body` adds to it during the timed calls are not counted.
template <typename Body>
double TimePerCall(Body body, double budget, int warmup = 2, double* excluded = nullptr) {
  for (int i = 0; i < warmup; ++i) body();
  MPI_Barrier(MPI_COMM_WORLD);
  double start = MPI_Wtime();
  body();
  double one = MPI_Wtime() - start;
  MPI_Allreduce(MPI_IN_PLACE, &one, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  const int iters = std::clamp(static_cast<int>(budget / std::max(one, 1e-7)), 3, 20000);
  MPI_Barrier(MPI_COMM_WORLD);
  if (excluded != nullptr) *excluded = 0;
  start = MPI_Wtime();
  for (int i = 0; i < iters; ++i) body();
  double mean = (MPI_Wtime() - start - (excluded != nullptr ? *excluded : 0)) / iters;
  MPI_Allreduce(MPI_IN_PLACE, &mean, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return mean;
}

void Fatal(const absl::Status& s) {
  std::fprintf(stderr, "bench_exchange: %s\n", s.ToString().c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
}

struct Result {
  double exchange_s, expert_s, memcpy_s, alltoallv_s, floor_s;
  double bytes;  // moved by the busiest rank: rows dispatched plus rows returned
};

Result RunOne(const Args& args, int ranks, int rank, int64_t tokens, int64_t hidden, int top_k) {
  // Every rank a worker, sending `tokens` rows; narrow payloads combine in bf16.
  worker::ExchangeOptions options;
  options.dispatch_dtype = std::string(common::FlagName(args.dtype));
  options.combine_dtype = args.dtype == common::ElementType::kFp32 ? "fp32" : "bf16";
  absl::StatusOr<worker::ExchangePlan> plan =
      worker::ExchangePlan::Make({.num_workers = ranks,
                                  .first_rank = 0,
                                  .num_experts = 64,
                                  .top_k = top_k,
                                  .hidden = hidden,
                                  .max_batch_tokens = tokens * ranks},
                                 options);
  if (!plan.ok()) Fatal(plan.status());
  absl::StatusOr<std::unique_ptr<shmem::SymmetricHeap>> heap = shmem::SymmetricHeap::Create(
      MPI_COMM_WORLD, worker::ExchangeRegions::BytesNeeded(*plan), args.backend);
  if (!heap.ok()) Fatal(heap.status());
  absl::StatusOr<worker::ExchangeRegions> regions = worker::Exchange::Allocate(**heap, *plan);
  if (!regions.ok()) Fatal(regions.status());
  absl::StatusOr<std::unique_ptr<worker::Exchange>> ex =
      worker::Exchange::Create(**heap, *plan, *regions, rank);
  if (!ex.ok()) Fatal(ex.status());

  // Uniform routing: k distinct experts per token.
  std::mt19937_64 rng(1234 + rank);
  std::vector<int32_t> ids(tokens * top_k);
  std::vector<float> weights(tokens * top_k, 1.0f / top_k);
  const int num_experts = plan->shape().num_experts;
  std::vector<int> experts(num_experts);
  for (int e = 0; e < num_experts; ++e) experts[e] = e;
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    std::copy(experts.begin(), experts.begin() + top_k, &ids[t * top_k]);
  }
  std::vector<float> x(tokens * hidden), y(tokens * hidden);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 1000) / 1000.0f;

  // The exchange: counts (CountAndNotify), dispatch, identity experts, combine, the owner's sum.
  double expert_s = 0;
  auto exchange = [&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    absl::StatusOr<int64_t> most = (*ex)->CountAndNotify(tokens, ids.data(), deadline);
    if (!most.ok()) Fatal(most.status());
    absl::Status s = (*ex)->Dispatch(x.data(), weights.data(), deadline);
    if (!s.ok()) Fatal(s);
    const worker::ReceivedRows& in = (*ex)->received();
    const double e0 = MPI_Wtime();
    float* out = (*ex)->ExpertOutput();
    in.Decode(0, in.rows, out);  // identity experts: each output row is its input row
    expert_s += MPI_Wtime() - e0;
    s = (*ex)->Combine(out);
    if (s.ok()) s = (*ex)->Reduce(y.data(), false, deadline);
    if (!s.ok()) Fatal(s);
  };
  exchange();
  const int64_t sent_rows = (*ex)->rows_sent();
  const int64_t recv_rows = (*ex)->received().rows;
  const double row_bytes = static_cast<double>(hidden) * sizeof(float);
  double bytes = (sent_rows + recv_rows) * row_bytes;
  const double budget = args.quick ? 0.05 : 0.25;
  Result r{};
  r.exchange_s = TimePerCall(exchange, budget, 2, &expert_s);
  // The expert write alone, the slowest rank's mean (once every rank has read its parts).
  MPI_Barrier(MPI_COMM_WORLD);
  r.expert_s = TimePerCall(
      [&] {
        const worker::ReceivedRows& in = (*ex)->received();
        in.Decode(0, in.rows, (*ex)->ExpertOutput());
      },
      budget / 5);

  // Baselines move fp32 rows: the same rows, the same bytes as an fp32 exchange.
  const size_t most_rows = static_cast<size_t>(std::max(sent_rows, recv_rows));
  std::vector<float> a(std::max<size_t>(most_rows, 1) * hidden, 1.0f),
      b(std::max<size_t>(most_rows, 1) * hidden, 2.0f);
  r.memcpy_s = TimePerCall(
      [&] {
        std::memcpy(b.data(), a.data(), sent_rows * hidden * sizeof(float));
        std::memcpy(a.data(), b.data(), recv_rows * hidden * sizeof(float));
      },
      budget);

  // Rows per destination (from the routing) and per source (exchanged); per token, the
  // ranks its experts live on (its parts in the owner's sum).
  std::vector<int> send_counts(ranks, 0), recv_counts(ranks, 0), send_displs(ranks, 0),
      recv_displs(ranks, 0);
  std::vector<int> part_count(tokens, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<bool> hit(ranks, false);
    for (int j = 0; j < top_k; ++j) hit[(*ex)->placement().owner(ids[t * top_k + j])] = true;
    for (int d = 0; d < ranks; ++d) {
      if (!hit[d]) continue;
      send_counts[d] += static_cast<int>(hidden * sizeof(float));
      ++part_count[t];
    }
  }
  MPI_Alltoall(send_counts.data(), 1, MPI_INT, recv_counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  for (int d = 1; d < ranks; ++d) {
    send_displs[d] = send_displs[d - 1] + send_counts[d - 1];
    recv_displs[d] = recv_displs[d - 1] + recv_counts[d - 1];
  }
  r.alltoallv_s = TimePerCall(
      [&] {
        MPI_Alltoallv(a.data(), send_counts.data(), send_displs.data(), MPI_BYTE, b.data(),
                      recv_counts.data(), recv_displs.data(), MPI_BYTE, MPI_COMM_WORLD);
        MPI_Alltoallv(b.data(), recv_counts.data(), recv_displs.data(), MPI_BYTE, a.data(),
                      send_counts.data(), send_displs.data(), MPI_BYTE, MPI_COMM_WORLD);
      },
      budget);
  // The floor: rows sent to other ranks copied once, then every token's parts summed into
  // its output row. The parts lie token after token in `a` (sent_rows rows).
  const size_t cross_sent =
      static_cast<size_t>(send_displs[ranks - 1] + send_counts[ranks - 1] - send_counts[rank]);
  const int64_t parts_total = std::accumulate(part_count.begin(), part_count.end(), int64_t{0});
  if (parts_total != sent_rows) {
    Fatal(absl::InternalError(absl::StrCat("the routing gives ", parts_total,
                                           " parts, the exchange sent ", sent_rows, " rows")));
  }
  std::vector<const void*> part_ptrs(parts_total);
  for (int64_t p = 0; p < parts_total; ++p) part_ptrs[p] = a.data() + p * hidden;
  r.floor_s = TimePerCall(
      [&] {
        std::memcpy(b.data(), a.data(), cross_sent);
        const void* const* parts = part_ptrs.data();
        for (int64_t t = 0; t < tokens; ++t) {
          worker::SumRows(common::ElementType::kFp32, parts, part_count[t], hidden,
                          y.data() + t * hidden, false);
          parts += part_count[t];
        }
      },
      budget);
  MPI_Allreduce(MPI_IN_PLACE, &bytes, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  r.bytes = bytes;
  ex->reset();
  heap->reset();
  return r;
}

}  // namespace
}  // namespace epserve

int main(int argc, char** argv) {
  using namespace epserve;
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      args.quick = true;
    } else if (a.rfind("--heap=", 0) == 0) {
      absl::StatusOr<shmem::HeapBackend> b = shmem::ParseHeapBackend(a.substr(7));
      if (!b.ok()) Fatal(b.status());
      args.backend = *b;
    } else if (a.rfind("--dtype=", 0) == 0) {
      absl::StatusOr<common::ElementType> t = worker::ParsePayloadType(a.substr(8), "dtype");
      if (!t.ok()) Fatal(t.status());
      args.dtype = *t;
    } else {
      Fatal(absl::InvalidArgumentError(absl::StrCat("unknown argument ", a)));
    }
  }
  if (rank == 0) {
    const char* mech = std::getenv("OMPI_MCA_btl_vader_single_copy_mechanism");
    std::printf(
        "# exchange: %d ranks, heap %s, dispatch %s; alltoallv: "
        "btl_vader_single_copy_mechanism=%s\n"
        "# bytes = rows dispatched + rows returned by the busiest rank (fp32 rows); "
        "GB/s = bytes / time; ratios from this run\n",
        ranks, shmem::HeapBackendName(args.backend),
        std::string(common::FlagName(args.dtype)).c_str(), mech != nullptr ? mech : "default");
    std::printf(
        "| ranks | tokens/rank | hidden | top-k | MB/rank | dispatch+combine us | GB/s | "
        "memcpy us | GB/s | vs memcpy | alltoallv us | GB/s | vs alltoallv | expert write us | "
        "floor us | reach: alltoallv / floor |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  }
  const std::vector<int64_t> token_counts =
      args.quick ? std::vector<int64_t>{1, 128} : std::vector<int64_t>{1, 128, 4096};
  for (int64_t tokens : token_counts) {
    for (int64_t hidden : {2048, 7168}) {
      for (int k : {4, 8}) {
        const Result r = RunOne(args, ranks, rank, tokens, hidden, k);
        if (rank == 0) {
          const double gb = r.bytes / 1e9;
          std::printf(
              "| %d | %lld | %lld | %d | %.2f | %.1f | %.1f | %.1f | %.1f | %.2fx | %.1f | "
              "%.1f | %.1fx | %.1f | %.1f | %.1fx |\n",
              ranks, static_cast<long long>(tokens), static_cast<long long>(hidden), k,
              r.bytes / 1e6, r.exchange_s * 1e6, gb / r.exchange_s, r.memcpy_s * 1e6,
              gb / r.memcpy_s, r.memcpy_s / r.exchange_s, r.alltoallv_s * 1e6, gb / r.alltoallv_s,
              r.alltoallv_s / r.exchange_s, r.expert_s * 1e6, r.floor_s * 1e6,
              r.alltoallv_s / r.floor_s);
          std::fflush(stdout);
        }
      }
    }
  }
  MPI_Finalize();
  return 0;
}
