#include "worker/device_exchange.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/moe_kernels.h"

namespace epserve::worker {

namespace {

// Whether this worker can take part in a device exchange of `kind` with these pieces: the shm
// heap, a device of the kind, pieces NVIDIA's driver imports.
absl::Status CheckUsable(const kernels::Runtime& rt, const shmem::SymmetricHeap& heap,
                         shmem::PeerMemoryKind kind, const std::vector<size_t>& pieces) {
  const kernels::DeviceInfo& device = rt.device_info();
  if (heap.backend() != shmem::HeapBackend::kShm) {
    return absl::FailedPreconditionError("rows moved device to device need the shm heap");
  }
  if (kind == shmem::PeerMemoryKind::kHost && !device.is_cpu) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device-exchange=host needs CPU devices; ", device.device_name, " is not"));
  }
  if (kind != shmem::PeerMemoryKind::kCuda) return absl::OkStatus();
  if (!device.imports_opaque_fd || device.uuid.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(device.device_name,
                     " does not import CUDA memory (cl_khr_external_memory_opaque_fd and "
                     "cl_khr_device_uuid are needed)"));
  }
  for (size_t bytes : pieces) {
    if (bytes > kMaxImportBytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a device exchange buffer of ", bytes, " bytes is over the ", kMaxImportBytes,
          " NVIDIA's OpenCL driver imports; lower --max-recv-tokens-per-rank"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceExchange>> DeviceExchange::Create(
    kernels::Runtime& rt, shmem::SymmetricHeap& heap, const HeapRegions& regions, int me,
    shmem::PeerMemoryKind kind, int64_t row_parts_rows, const Own& own, const Inputs& inputs,
    absl::Time deadline) {
  const ExchangePlan& plan = regions.plan;
  const int num_workers = plan.shape().num_workers;
  const size_t row = static_cast<size_t>(plan.shape().hidden) * sizeof(float);
  const size_t recv = static_cast<size_t>(plan.recv_capacity());
  const size_t k = static_cast<size_t>(plan.shape().top_k);
  const size_t n = static_cast<size_t>(plan.max_rows_per_worker());
  const size_t w = static_cast<size_t>(num_workers);
  // Receive rows, pair rows, row parts (what this worker computes), and the pair rows and row
  // parts its tokens' receivers return to it.
  const std::vector<size_t> pieces = {
      recv * std::max(row, plan.dispatch_row_bytes()), recv * k * row,
      static_cast<size_t>(std::max<int64_t>(row_parts_rows, 1)) * row, n * k * row, w * n * row};
  // Every worker checks what it can before the rendezvous and takes part in it either way, so
  // that a refusal is every worker's at once (PeerMemory::Create fails them all).
  const absl::Status usable = CheckUsable(rt, heap, kind, pieces);
  shmem::PeerGroup group;
  group.heap = &heap;
  group.first_rank = plan.shape().first_rank;
  group.size = num_workers;
  group.me = me;
  group.rendezvous = regions.peer_memory;
  group.signal_stride = kSignalStride;
  // A worker that cannot take part still answers the rendezvous, as declining.
  if (!usable.ok()) {
    EPSERVE_RETURN_IF_ERROR(shmem::PeerMemory::Decline(group));
    return usable;
  }
  absl::StatusOr<std::unique_ptr<shmem::PeerMemory>> memory =
      shmem::PeerMemory::Create(group, kind, pieces, rt.device_info().uuid, deadline);
  if (!memory.ok()) return memory.status();

  std::unique_ptr<DeviceExchange> dx(new DeviceExchange(rt, regions, me, own, inputs));
  dx->memory_ = *std::move(memory);
  dx->recv_.resize(num_workers);
  dx->returned_pairs_.resize(num_workers);
  dx->returned_parts_.resize(num_workers);
  for (int d = 0; d < num_workers; ++d) {
    std::vector<kernels::Buffer> b(pieces.size());
    for (size_t p = 0; p < pieces.size(); ++p) {
      EPSERVE_ASSIGN_OR_RETURN(b[p], dx->Import(d, static_cast<int>(p)));
    }
    if (d == me) {
      *own.recv_rows = std::move(b[0]);
      *own.pair_rows = std::move(b[1]);
      *own.row_parts = std::move(b[2]);
    } else {
      dx->recv_[d] = std::move(b[0]);
    }
    dx->returned_pairs_[d] = std::move(b[3]);
    dx->returned_parts_[d] = std::move(b[4]);
  }
  std::vector<int32_t> identity(n * k);
  std::iota(identity.begin(), identity.end(), 0);
  EPSERVE_ASSIGN_OR_RETURN(dx->identity_,
                           rt.AllocateCopy(identity.data(), identity.size() * sizeof(int32_t)));
  // The most moves of a pass: every token to every worker (Send), or every received pair and
  // row back (Return).
  const size_t moves = std::max(n * w, recv * (k + 1));
  EPSERVE_ASSIGN_OR_RETURN(dx->moves_, rt.Allocate(moves * 2 * sizeof(int32_t)));
  return dx;
}

absl::StatusOr<kernels::Buffer> DeviceExchange::Import(int d, int p) {
  if (memory_->kind() == shmem::PeerMemoryKind::kHost) {
    return rt_.WrapHostMemory(memory_->host(d, p), memory_->bytes(p));
  }
  return rt_.ImportOpaqueFd(memory_->fd(d, p), memory_->bytes(p));
}

bool DeviceExchange::Serves(const BatchDescriptor& desc) const {
  const ExchangePlan& plan = regions_.plan;
  auto reproduced = [](common::ElementType t) {
    return t == common::ElementType::kFp32 || t == common::ElementType::kBf16;
  };
  return desc.live.Count() == plan.shape().num_workers && reproduced(plan.dispatch_dtype()) &&
         reproduced(plan.combine_dtype());
}

void DeviceExchange::StartRuns() {
  moves_host_.clear();
  run_first_.assign(1, 0);
  run_src_.clear();
  run_dst_.clear();
}

void DeviceExchange::CloseRun(int to_worker, const kernels::Buffer* from, const kernels::Buffer* to,
                              size_t* rows_to_peers) {
  const int64_t end = static_cast<int64_t>(moves_host_.size() / 2);
  if (end == run_first_.back()) return;
  if (to_worker != me_) *rows_to_peers += static_cast<size_t>(end - run_first_.back());
  run_first_.push_back(end);
  run_src_.push_back(from);
  run_dst_.push_back(to);
}

absl::Status DeviceExchange::RunMoves(bool round_bf16) {
  if (moves_host_.empty()) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(
      rt_.Write(moves_, 0, moves_host_.data(), moves_host_.size() * sizeof(int32_t)));
  const int64_t hidden = regions_.plan.shape().hidden;
  for (size_t r = 0; r < run_src_.size(); ++r) {
    EPSERVE_RETURN_IF_ERROR(kernels::CopyRows(rt_, *run_src_[r], moves_, run_first_[r],
                                              run_first_[r + 1] - run_first_[r], hidden, round_bf16,
                                              *run_dst_[r]));
  }
  return absl::OkStatus();
}

absl::Status DeviceExchange::Send(const Exchange& ex) {
  const int num_workers = regions_.plan.shape().num_workers;
  const int64_t n = ex.n();
  const int64_t capacity = regions_.plan.recv_capacity();
  StartRuns();
  size_t rows_to_peers = 0;
  for (int d = 0; d < num_workers; ++d) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t s = ex.slot(t, d);
      if (s < 0) continue;
      const int64_t row = ex.row_base(d) + s;
      if (row >= capacity) {
        return absl::InternalError(absl::StrCat("a row for worker ", d, " at ", row,
                                                ", over its receive capacity ", capacity));
      }
      moves_host_.push_back(static_cast<int32_t>(t));
      moves_host_.push_back(static_cast<int32_t>(row));
    }
    CloseRun(d, inputs_.x, &RecvRows(d), &rows_to_peers);
  }
  bytes_sent_to_peers_ =
      rows_to_peers * static_cast<size_t>(regions_.plan.shape().hidden) * sizeof(float);
  return RunMoves(regions_.plan.dispatch_dtype() == common::ElementType::kBf16);
}

// The rows must be in the receivers' memory before the dispatch signals say so.
absl::Status DeviceExchange::Sync() { return rt_.Finish(); }

absl::Status DeviceExchange::Return(const Exchange& ex) {
  const ExchangePlan& plan = regions_.plan;
  const int num_workers = plan.shape().num_workers;
  const int k = plan.shape().top_k;
  const bool split = plan.shared_expert_split();
  const ReceivedRows& in = ex.received();
  StartRuns();
  size_t rows_to_peers = 0;
  // Pair p goes back to the sender of its row, at the position the sender gave it.
  pairs_of_.assign(num_workers, {});
  for (int64_t p = 0; p < in.pairs; ++p) {
    pairs_of_[in.Source(in.pair_row[p])].push_back(static_cast<int32_t>(p));
  }
  for (int s = 0; s < num_workers; ++s) {
    const int64_t homes = ex.tokens_of(s) * k;
    for (int32_t p : pairs_of_[s]) {
      const int32_t home = in.pair_home[p];
      if (home < 0 || home >= homes) {
        return absl::InternalError(absl::StrCat("pair ", p, " from worker ", s, " returns to ",
                                                home, ", outside its ", homes, " pairs"));
      }
      moves_host_.push_back(p);
      moves_host_.push_back(home);
    }
    CloseRun(s, own_.pair_rows, &returned_pairs_[s], &rows_to_peers);
  }
  if (split) {
    // Each received row's part into block me_ of its owner's parts, at the token's index.
    for (int s = 0; s < num_workers; ++s) {
      const int64_t tokens = ex.tokens_of(s);
      for (int64_t r = in.source_begin[s]; r < in.source_begin[s + 1]; ++r) {
        const int32_t t = in.token[r];
        if (t < 0 || t >= tokens) {
          return absl::InternalError(absl::StrCat("received row ", r, " names token ", t,
                                                  " of worker ", s, ", which has ", tokens));
        }
        moves_host_.push_back(static_cast<int32_t>(r));
        moves_host_.push_back(static_cast<int32_t>(me_ * tokens + t));
      }
      CloseRun(s, own_.row_parts, &returned_parts_[s], &rows_to_peers);
    }
  }
  bytes_returned_to_peers_ =
      rows_to_peers * static_cast<size_t>(plan.shape().hidden) * sizeof(float);
  EPSERVE_RETURN_IF_ERROR(RunMoves(/*round_bf16=*/false));
  // The rows must be in the owners' memory before the combine signals say so.
  return rt_.Finish();
}

absl::Status DeviceExchange::Sum(const Exchange& ex, float* y, bool accumulate) {
  const ExchangePlan& plan = regions_.plan;
  const int num_workers = plan.shape().num_workers;
  const int k = plan.shape().top_k;
  const int64_t hidden = plan.shape().hidden;
  const int64_t n = ex.n();
  if (n == 0) return absl::OkStatus();
  const bool split = plan.shared_expert_split();
  // What the receivers returned: pair t * k + j at row t * k + j, worker d's part of token t at
  // row d * n + t.
  kernels::Buffer& pairs = returned_pairs_[me_];
  kernels::Buffer& parts = returned_parts_[me_];

  // The owner's sum, as Exchange::Reduce adds: row parts in worker order, then each choice's
  // pair row times its weight in the order of j; onto the shared expert's output with it.
  const bool bf16 = plan.combine_dtype() == common::ElementType::kBf16;
  kernels::Buffer* out = &parts;
  if (split) {
    EPSERVE_RETURN_IF_ERROR(kernels::SumPairRows(rt_, pairs, identity_, *inputs_.weights, n, k,
                                                 hidden, &parts, kernels::SumStart::kAsPart, bf16,
                                                 parts, num_workers));
  } else if (accumulate) {
    out = own_.row_parts;  // the shared expert's output on this worker's rows
    EPSERVE_RETURN_IF_ERROR(kernels::SumPairRows(rt_, pairs, identity_, *inputs_.weights, n, k,
                                                 hidden, out, kernels::SumStart::kOnto, bf16,
                                                 *out));
  } else {
    EPSERVE_RETURN_IF_ERROR(kernels::SumPairRows(rt_, pairs, identity_, *inputs_.weights, n, k,
                                                 hidden, nullptr, kernels::SumStart::kZero, bf16,
                                                 *out));
  }
  if (deliver_) return deliver_(*out, y);
  return rt_.Read(*out, 0, y, static_cast<size_t>(n * hidden) * sizeof(float));
}

absl::Status DeviceExchange::WarmUp() {
  StartRuns();
  moves_host_ = {0, 0};
  size_t rows_to_peers = 0;
  CloseRun(me_, inputs_.x, own_.recv_rows, &rows_to_peers);
  EPSERVE_RETURN_IF_ERROR(RunMoves(/*round_bf16=*/false));
  return rt_.Finish();
}

}  // namespace epserve::worker
