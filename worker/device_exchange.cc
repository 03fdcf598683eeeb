#include "worker/device_exchange.h"

#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/moe_kernels.h"

namespace epserve::worker {

namespace {

int64_t NanosBetween(absl::Time from, absl::Time to) { return absl::ToInt64Nanoseconds(to - from); }

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
  EPSERVE_ASSIGN_OR_RETURN(void* pinned, rt.AllocatePinnedHost(moves * 2 * sizeof(int32_t)));
  dx->moves_host_ = static_cast<int32_t*>(pinned);
  dx->moves_capacity_ = static_cast<int64_t>(moves);
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

absl::Status DeviceExchange::StartRuns(int64_t most_moves) {
  if (most_moves > moves_capacity_) {
    return absl::InternalError(absl::StrCat("a pass of up to ", most_moves, " row moves, over the ",
                                            moves_capacity_, " planned"));
  }
  // A pass that ended early (an error) may have uploads of the table still queued.
  if (queued_) EPSERVE_RETURN_IF_ERROR(rt_.Finish());
  queued_ = false;
  moves_count_ = 0;
  run_start_ = 0;
  pending_.clear();
  run_to_peer_.clear();
  return absl::OkStatus();
}

void DeviceExchange::CloseRun(int to_worker, const kernels::Buffer* from, const kernels::Buffer* to,
                              size_t* rows_to_peers) {
  AddRun(to_worker, {from, to, run_start_, moves_count_ - run_start_}, rows_to_peers);
  run_start_ = moves_count_;
}

void DeviceExchange::AddRun(int to_worker, const kernels::RowRun& run, size_t* rows_to_peers) {
  if (run.count == 0) return;
  if (to_worker != me_) *rows_to_peers += static_cast<size_t>(run.count);
  pending_.push_back(run);
  run_to_peer_.push_back(to_worker != me_);
}

absl::Status DeviceExchange::RunMoves(bool round_bf16) {
  if (pending_.empty()) return absl::OkStatus();
  // The moves go up without a wait (straight from pinned memory), the runs into peers' memory
  // first, those within this worker's memory in the same launches beside them, all submitted
  // before the host's part of the pass.
  if (moves_count_ > 0) {
    EPSERVE_RETURN_IF_ERROR(rt_.WriteAsync(
        moves_, 0, moves_host_, static_cast<size_t>(moves_count_) * 2 * sizeof(int32_t)));
    queued_ = true;
  }
  runs_.clear();
  for (bool to_peers : {true, false}) {
    for (size_t r = 0; r < pending_.size(); ++r) {
      if (run_to_peer_[r] == to_peers) runs_.push_back(pending_[r]);
    }
  }
  EPSERVE_RETURN_IF_ERROR(
      kernels::CopyRowRuns(rt_, runs_, moves_, regions_.plan.shape().hidden, round_bf16));
  return rt_.Flush();
}

absl::Status DeviceExchange::Send(const Exchange& ex) {
  const absl::Time start = absl::Now();
  const int num_workers = regions_.plan.shape().num_workers;
  const int64_t n = ex.n();
  const int64_t capacity = regions_.plan.recv_capacity();
  EPSERVE_RETURN_IF_ERROR(StartRuns(n * num_workers));
  // A destination that gets every token (every one, with a split shared expert) gets token t
  // at slot t: a block, no moves to build or upload. The others' runs of moves lie one after
  // the other, worker d's from table_at_[d] on, its slots 0 to rows_to(d) - 1 in token order:
  // each token's move goes straight to its place.
  const bool round_bf16 = regions_.plan.dispatch_dtype() == common::ElementType::kBf16;
  const bool blocks = kernels::RowRunsTakeBlocks(rt_, regions_.plan.shape().hidden, round_bf16);
  size_t rows_to_peers = 0;
  table_at_.assign(num_workers, -1);
  for (int d = 0; d < num_workers; ++d) {
    const int64_t rows = ex.rows_to(d);
    const int64_t base = ex.row_base(d);
    if (rows > capacity - base) {
      return absl::InternalError(absl::StrCat(rows, " rows for worker ", d, " from its row ", base,
                                              ", over its receive capacity ", capacity));
    }
    if (blocks && rows == n) {
      AddRun(d, {inputs_.x, &RecvRows(d), 0, n, 0, base}, &rows_to_peers);
    } else if (rows > 0) {
      table_at_[d] = moves_count_;
      AddRun(d, {inputs_.x, &RecvRows(d), moves_count_, rows}, &rows_to_peers);
      moves_count_ += rows;
    }
  }
  // Locals, so that the stores into the table do not make the compiler reload them.
  const int64_t* slot = ex.slots().data();
  int32_t* const moves = moves_host_;
  for (int d = 0; d < num_workers; ++d) {
    const int64_t at = table_at_[d];
    if (at < 0) continue;
    const int32_t base = static_cast<int32_t>(ex.row_base(d));
    for (int64_t t = 0; t < n; ++t) {
      const int64_t s = slot[t * num_workers + d];
      if (s < 0) continue;
      moves[2 * (at + s)] = static_cast<int32_t>(t);
      moves[2 * (at + s) + 1] = base + static_cast<int32_t>(s);
    }
  }
  bytes_sent_to_peers_ =
      rows_to_peers * static_cast<size_t>(regions_.plan.shape().hidden) * sizeof(float);
  const absl::Time built = absl::Now();
  const absl::Status s = RunMoves(round_bf16);
  send_times_ = {NanosBetween(start, built), NanosBetween(built, absl::Now()), 0};
  return s;
}

// The rows must be in the receivers' memory before the dispatch signals say so.
absl::Status DeviceExchange::Sync() {
  const absl::Time start = absl::Now();
  const absl::Status s = rt_.Finish();
  if (s.ok()) queued_ = false;
  send_times_.wait_ns = NanosBetween(start, absl::Now());
  return s;
}

absl::Status DeviceExchange::Return(const Exchange& ex) {
  const absl::Time start = absl::Now();
  const ExchangePlan& plan = regions_.plan;
  size_t rows_to_peers = 0;
  absl::Time first_launch = start;
  absl::Status status = rt_.device_info().is_cpu ? ReturnByMoves(ex, &rows_to_peers, &first_launch)
                                                 : ReturnByTable(ex, &rows_to_peers, &first_launch);
  bytes_returned_to_peers_ =
      rows_to_peers * static_cast<size_t>(plan.shape().hidden) * sizeof(float);
  const absl::Time queued = absl::Now();
  // The rows must be in the owners' memory before the combine signals say so (and a pass that
  // failed leaves nothing queued).
  const absl::Status finished = rt_.Finish();
  if (finished.ok()) queued_ = false;
  return_times_ = {NanosBetween(start, first_launch), NanosBetween(first_launch, queued),
                   NanosBetween(queued, absl::Now())};
  return status.ok() ? finished : status;
}

absl::Status DeviceExchange::ReturnByTable(const Exchange& ex, size_t* rows_to_peers,
                                           absl::Time* first_launch) {
  const ExchangePlan& plan = regions_.plan;
  const int num_workers = plan.shape().num_workers;
  const int k = plan.shape().top_k;
  const bool split = plan.shared_expert_split();
  const ReceivedRows& in = ex.received();
  const int64_t rows = split ? in.rows : 0;
  // The table (pair_row, pair_home, token) in the moves' pinned memory, up and run at once;
  // the host checks it while the device moves the rows.
  const int64_t ints = 2 * in.pairs + rows;
  EPSERVE_RETURN_IF_ERROR(StartRuns((ints + 1) / 2));
  std::copy_n(in.pair_row, in.pairs, moves_host_);
  std::copy_n(in.pair_home, in.pairs, moves_host_ + in.pairs);
  std::copy_n(in.token, rows, moves_host_ + 2 * in.pairs);
  *first_launch = absl::Now();
  EPSERVE_RETURN_IF_ERROR(
      rt_.WriteAsync(moves_, 0, moves_host_, static_cast<size_t>(ints) * sizeof(int32_t)));
  queued_ = true;
  table_pairs_to_.resize(num_workers);
  table_parts_to_.resize(num_workers);
  table_tokens_.resize(num_workers);
  for (int s = 0; s < num_workers; ++s) {
    table_pairs_to_[s] = &returned_pairs_[s];
    table_parts_to_[s] = &returned_parts_[s];
    table_tokens_[s] = ex.tokens_of(s);
  }
  kernels::ReturnRowsArgs a;
  a.pair_rows = own_.pair_rows;
  a.row_parts = split ? own_.row_parts : nullptr;
  a.pairs_to = table_pairs_to_;
  if (split) a.parts_to = table_parts_to_;
  a.source_begin = in.source_begin;
  a.tokens = table_tokens_;
  a.tables = &moves_;
  a.pairs = in.pairs;
  a.rows = rows;
  a.me = me_;
  a.hidden = plan.shape().hidden;
  EPSERVE_RETURN_IF_ERROR(kernels::ReturnRows(rt_, a));
  EPSERVE_RETURN_IF_ERROR(rt_.Flush());

  // Pair p goes back to the sender s of its row, at the position the sender gave it; each
  // received row's part into block me_ of its sender's parts, at the token's index.
  const std::span<const int64_t> begin = in.source_begin;
  for (int64_t p = 0; p < in.pairs; ++p) {
    const int32_t row = in.pair_row[p];
    const int s = in.Source(row);
    const int64_t homes = s >= 0 && s < num_workers ? ex.tokens_of(s) * k : 0;
    const int32_t home = in.pair_home[p];
    if (home < 0 || home >= homes) {
      return absl::InternalError(absl::StrCat("pair ", p, " of received row ", row, " returns to ",
                                              home, ", outside its sender's ", homes, " pairs"));
    }
    if (s != me_) ++*rows_to_peers;
  }
  for (int s = 0; s < num_workers && split; ++s) {
    const int64_t tokens = ex.tokens_of(s);
    for (int64_t r = begin[s]; r < begin[s + 1]; ++r) {
      const int32_t t = in.token[r];
      if (t < 0 || t >= tokens) {
        return absl::InternalError(absl::StrCat("received row ", r, " names token ", t,
                                                " of worker ", s, ", which has ", tokens));
      }
    }
    if (s != me_) *rows_to_peers += static_cast<size_t>(begin[s + 1] - begin[s]);
  }
  return absl::OkStatus();
}

absl::Status DeviceExchange::ReturnByMoves(const Exchange& ex, size_t* rows_to_peers,
                                           absl::Time* first_launch) {
  const ExchangePlan& plan = regions_.plan;
  const int num_workers = plan.shape().num_workers;
  const int k = plan.shape().top_k;
  const bool split = plan.shared_expert_split();
  const ReceivedRows& in = ex.received();
  EPSERVE_RETURN_IF_ERROR(StartRuns(in.pairs + (split ? in.rows : 0)));
  for (int s = 0; s < num_workers; ++s) {
    // Pair p goes back to the sender s of its row, at the position the sender gave it.
    const int64_t homes = ex.tokens_of(s) * k;
    const int64_t lo = in.source_begin[s], hi = in.source_begin[s + 1];
    for (int64_t p = 0; p < in.pairs; ++p) {
      const int32_t row = in.pair_row[p];
      if (row < lo || row >= hi) continue;
      const int32_t home = in.pair_home[p];
      if (home < 0 || home >= homes) {
        return absl::InternalError(absl::StrCat("pair ", p, " of received row ", row,
                                                " returns to ", home, ", outside its sender's ",
                                                homes, " pairs"));
      }
      AddMove(static_cast<int32_t>(p), home);
    }
    CloseRun(s, own_.pair_rows, &returned_pairs_[s], rows_to_peers);
    if (!split) continue;
    // Each received row's part into block me_ of its sender's parts, at the token's index.
    const int64_t tokens = ex.tokens_of(s);
    for (int64_t r = lo; r < hi; ++r) {
      const int32_t t = in.token[r];
      if (t < 0 || t >= tokens) {
        return absl::InternalError(absl::StrCat("received row ", r, " names token ", t,
                                                " of worker ", s, ", which has ", tokens));
      }
      AddMove(static_cast<int32_t>(r), static_cast<int32_t>(me_ * tokens + t));
    }
    CloseRun(s, own_.row_parts, &returned_parts_[s], rows_to_peers);
  }
  *first_launch = absl::Now();
  return RunMoves(/*round_bf16=*/false);
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
  EPSERVE_RETURN_IF_ERROR(StartRuns(1));
  AddMove(0, 0);
  size_t rows_to_peers = 0;
  CloseRun(me_, inputs_.x, own_.recv_rows, &rows_to_peers);
  EPSERVE_RETURN_IF_ERROR(RunMoves(/*round_bf16=*/false));
  EPSERVE_RETURN_IF_ERROR(rt_.Finish());
  queued_ = false;
  return absl::OkStatus();
}

}  // namespace epserve::worker
