// Dispatch + combine through the symmetric heap (worker/exchange.h; every rank a worker,
// identity experts), against two baselines measured in the same run on the same bytes.
// The identity expert's write of its output rows (into Exchange::PairOutput(), one per
// pair, where a real expert step writes its results) is an expert's cost, not the
// exchange's: it is timed apart and printed in its own column. Baselines:
//   memcpy     every rank copies the bytes it moves (rows it dispatches plus pair rows it
//              returns) locally, all ranks at once: the bound on one host;
//   alltoallv  MPI_Alltoallv of the same rows, already packed per destination (packing
//              not counted), rows there and pair rows back: what users would reach for;
//   floor      what any exchange must at least do to its memory, done locally by every rank
//              at once with no synchronisation: copy each row that crosses ranks once (the
//              rows it sends to other ranks; a token's row for its own rank need not move),
//              and sum each token's k weighted pair rows into its output row, as the
//              owner's sum does. alltoallv / floor ("reach") is the most any
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
  double skipped_need = 0, skipped_have = 0;  // bytes: the case did not fit this host
};

// The host's available memory in bytes (MemAvailable), or 0 when unknown.
double AvailableBytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  double kib = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lf kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib * 1024;
}

// Identity experts: each pair's output row is its input row, written where a real expert
// step writes (the combine region for fp32). Returns that buffer.
float* IdentityExperts(worker::Exchange& ex) {
  const worker::ReceivedRows& in = ex.received();
  float* out = ex.PairOutput();
  for (int64_t p = 0; p < in.pairs; ++p) in.Decode(in.pair_row[p], 1, out + p * in.hidden);
  return out;
}

Result RunOne(const Args& args, int ranks, int rank, int64_t tokens, int64_t hidden, int top_k) {
  // Every rank a worker, sending `tokens` rows; narrow payloads combine in bf16.
  worker::ExchangeOptions options;
  options.dispatch_dtype = args.dtype;
  options.combine_dtype =
      args.dtype == common::ElementType::kFp32 ? args.dtype : common::ElementType::kBf16;
  absl::StatusOr<worker::ExchangePlan> plan =
      worker::ExchangePlan::Make({.num_workers = ranks,
                                  .first_rank = 0,
                                  .num_experts = 64,
                                  .top_k = top_k,
                                  .hidden = hidden,
                                  .max_batch_tokens = tokens * ranks},
                                 options);
  if (!plan.ok()) Fatal(plan.status());
  // The heap (receive and combine regions sized for the worst case: every pair on one
  // rank) and the baselines' buffers of every rank must fit, with room to spare.
  const double need = ranks * (static_cast<double>(worker::ExchangeRegions::BytesNeeded(*plan)) +
                               2.0 * static_cast<double>(tokens) * top_k * hidden * sizeof(float));
  double have = AvailableBytes();
  MPI_Bcast(&have, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (have > 0 && need > 0.7 * have) {
    Result skipped{};
    skipped.skipped_need = need;
    skipped.skipped_have = have;
    return skipped;
  }
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
    absl::Status s = (*ex)->Dispatch(x.data(), deadline);
    if (!s.ok()) Fatal(s);
    const double e0 = MPI_Wtime();
    float* out = IdentityExperts(**ex);
    expert_s += MPI_Wtime() - e0;
    s = (*ex)->Combine(out, nullptr);
    if (s.ok()) s = (*ex)->Reduce(weights.data(), y.data(), false, deadline);
    if (!s.ok()) Fatal(s);
  };
  exchange();
  const int64_t sent_rows = (*ex)->rows_sent();
  const int64_t recv_pairs = (*ex)->received().pairs;
  const double row_bytes = static_cast<double>(hidden) * sizeof(float);
  double bytes = (sent_rows + recv_pairs) * row_bytes;
  const double budget = args.quick ? 0.05 : 0.25;
  Result r{};
  r.exchange_s = TimePerCall(exchange, budget, 2, &expert_s);
  // The expert write alone, the slowest rank's mean (once every rank has read its parts).
  MPI_Barrier(MPI_COMM_WORLD);
  r.expert_s = TimePerCall([&] { IdentityExperts(**ex); }, budget / 5);

  // Baselines move fp32 rows: the same rows, the same bytes as an fp32 exchange.
  const size_t most_rows = static_cast<size_t>(std::max(sent_rows, recv_pairs));
  const size_t my_pairs = static_cast<size_t>(tokens * top_k);
  std::vector<float> a(std::max<size_t>(std::max(most_rows, my_pairs), 1) * hidden, 1.0f),
      b(std::max<size_t>(std::max(most_rows, my_pairs), 1) * hidden, 2.0f);
  r.memcpy_s = TimePerCall(
      [&] {
        std::memcpy(b.data(), a.data(), sent_rows * hidden * sizeof(float));
        std::memcpy(a.data(), b.data(), recv_pairs * hidden * sizeof(float));
      },
      budget);

  // Rows per destination (one per token and rank its pairs go to) and pair rows back, per
  // source (exchanged).
  std::vector<int> send_counts(ranks, 0), recv_counts(ranks, 0), send_displs(ranks, 0),
      recv_displs(ranks, 0);
  std::vector<int> back_send(ranks, 0), back_recv(ranks, 0), back_send_displs(ranks, 0),
      back_recv_displs(ranks, 0);
  const int row_size = static_cast<int>(hidden * sizeof(float));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<bool> hit(ranks, false);
    for (int j = 0; j < top_k; ++j) {
      const int d = (*ex)->destination(t, j);
      hit[d] = true;
      back_recv[d] += row_size;  // pair rows d returns to me
    }
    for (int d = 0; d < ranks; ++d) {
      if (hit[d]) send_counts[d] += row_size;
    }
  }
  MPI_Alltoall(send_counts.data(), 1, MPI_INT, recv_counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  MPI_Alltoall(back_recv.data(), 1, MPI_INT, back_send.data(), 1, MPI_INT, MPI_COMM_WORLD);
  for (int d = 1; d < ranks; ++d) {
    send_displs[d] = send_displs[d - 1] + send_counts[d - 1];
    recv_displs[d] = recv_displs[d - 1] + recv_counts[d - 1];
    back_send_displs[d] = back_send_displs[d - 1] + back_send[d - 1];
    back_recv_displs[d] = back_recv_displs[d - 1] + back_recv[d - 1];
  }
  r.alltoallv_s = TimePerCall(
      [&] {
        MPI_Alltoallv(a.data(), send_counts.data(), send_displs.data(), MPI_BYTE, b.data(),
                      recv_counts.data(), recv_displs.data(), MPI_BYTE, MPI_COMM_WORLD);
        MPI_Alltoallv(b.data(), back_send.data(), back_send_displs.data(), MPI_BYTE, a.data(),
                      back_recv.data(), back_recv_displs.data(), MPI_BYTE, MPI_COMM_WORLD);
      },
      budget);
  // The floor: rows sent to other ranks copied once, then every token's k pair rows,
  // weighted, summed into its output row. The pair rows lie token after token in `a`.
  const size_t cross_sent =
      static_cast<size_t>(send_displs[ranks - 1] + send_counts[ranks - 1] - send_counts[rank]);
  std::vector<const void*> part_ptrs(my_pairs);
  for (size_t p = 0; p < my_pairs; ++p) part_ptrs[p] = a.data() + p * hidden;
  r.floor_s = TimePerCall(
      [&] {
        std::memcpy(b.data(), a.data(), cross_sent);
        for (int64_t t = 0; t < tokens; ++t) {
          worker::WeightedSumRows(common::ElementType::kFp32, &part_ptrs[t * top_k],
                                  &weights[t * top_k], top_k, hidden, y.data() + t * hidden, false);
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
        "# bytes = rows dispatched + pair rows returned by the busiest rank (fp32 rows); "
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
        if (rank == 0 && r.skipped_need > 0) {
          std::printf("| %d | %lld | %lld | %d | skipped: needs %.1f GB, %.1f GB available |\n",
                      ranks, static_cast<long long>(tokens), static_cast<long long>(hidden), k,
                      r.skipped_need / 1e9, r.skipped_have / 1e9);
          std::fflush(stdout);
        } else if (rank == 0) {
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
