#include "worker/exchange.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/parallel.h"
#include "common/status.h"
#include "worker/detail/timing.h"

namespace epserve::worker {
using detail::NanosSince;

// ---- ReceivedRows ----

void ReceivedRows::Decode(int64_t first_row, int64_t num_rows, float* dst) const {
  if (dtype == common::ElementType::kFp32 &&
      row_bytes == static_cast<size_t>(hidden) * sizeof(float)) {
    std::memcpy(dst, Row(first_row), static_cast<size_t>(num_rows) * row_bytes);
    return;
  }
  for (int64_t r = 0; r < num_rows; ++r)
    DecodeRow(dtype, Row(first_row + r), hidden, dst + r * hidden);
}

// ---- Exchange ----

absl::StatusOr<ExchangeRegions> Exchange::Allocate(shmem::SymmetricHeap& heap,
                                                   const ExchangePlan& plan) {
  return ExchangeRegions::Make(
      plan, [&](size_t bytes, size_t align) { return heap.Allocate(bytes, align); });
}

absl::StatusOr<std::unique_ptr<Exchange>> Exchange::Create(shmem::SymmetricHeap& heap,
                                                           const ExchangePlan& plan,
                                                           const ExchangeRegions& regions, int me) {
  const ExchangeShape& s = plan.shape();
  if (me < 0 || me >= s.num_workers || s.first_rank + s.num_workers > heap.num_ranks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", me, " of ", s.num_workers, " from heap rank ", s.first_rank,
                     " does not fit a heap of ", heap.num_ranks(), " ranks"));
  }
  absl::StatusOr<ExpertPlacement> placement =
      ExpertPlacement::Contiguous(s.num_experts, s.num_workers);
  if (!placement.ok()) return placement.status();
  return std::unique_ptr<Exchange>(new Exchange(heap, plan, regions, *std::move(placement), me));
}

Exchange::Exchange(shmem::SymmetricHeap& heap, const ExchangePlan& plan,
                   const ExchangeRegions& regions, ExpertPlacement contiguous, int me)
    : heap_(heap),
      plan_(plan),
      regions_(regions),
      contiguous_(std::move(contiguous)),
      me_(me),
      num_local_max_(plan.max_local_experts()),
      count_stride_(2 + static_cast<size_t>(plan.max_local_experts())) {
  const size_t w = static_cast<size_t>(plan.shape().num_workers);
  live_ = WorkerSet::All(plan.shape().num_workers);
  counts_.resize(w * w * count_stride_);
  my_counts_.resize(w * count_stride_);
  row_base_.resize(w);
  pair_base_.resize(w * static_cast<size_t>(num_local_max_));
  combine_base_.resize(w + 1);
  source_begin_.resize(w + 1);
  if (!OutputInHeap()) {
    out_.resize(static_cast<size_t>(plan.combine_capacity() * plan.shape().hidden));
  }
  const size_t pairs = static_cast<size_t>(plan.max_rows_per_worker() * plan.shape().top_k);
  slot_.reserve(static_cast<size_t>(plan.max_rows_per_worker()) * w);
  for (std::vector<int32_t>* v : {&dest_, &local_, &pair_local_}) v->reserve(pairs);
  pair_at_.reserve(pairs);
}

absl::Status Exchange::UsePlacement(const ExpertPlacement& placement) {
  const ExchangeShape& s = plan_.shape();
  if (placement.num_experts() != s.num_experts || placement.num_workers() != s.num_workers ||
      placement.max_local() > num_local_max_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a placement of ", placement.num_experts(), " experts over ", placement.num_workers(),
        " workers with up to ", placement.max_local(), " on one does not fit the exchange's ",
        s.num_experts, " experts over ", s.num_workers, " workers with up to ", num_local_max_,
        " on one (--redundant-experts)"));
  }
  placement_ = &placement;
  return absl::OkStatus();
}

absl::Status Exchange::UseLiveWorkers(const WorkerSet& live, uint64_t generation) {
  if (!live.Has(me_)) {
    return absl::InternalError(absl::StrCat("worker ", me_, " is not among the live workers"));
  }
  if (generation < generation_) {
    return absl::InternalError(
        absl::StrCat("exchange generation went back from ", generation_, " to ", generation));
  }
  if (generation != generation_) {
    generation_ = generation;
    epoch_ = generation << 40;
  }
  live_ = live;
  return absl::OkStatus();
}

absl::Status Exchange::WaitFor(size_t base, int index, absl::Time deadline, const char* what) {
  shmem::WaitOptions wait;
  wait.cancel_signal = cancel_signal_;
  wait.cancel_above = cancel_above_;
  return heap_.WaitSignal(signal(base, index), epoch_, deadline, what, index, wait);
}

int64_t Exchange::rows_sent() const {
  int64_t rows = 0;
  for (int d = 0; d < plan_.shape().num_workers; ++d) rows += my_counts_[d * count_stride_];
  return rows;
}

absl::StatusOr<int64_t> Exchange::CountAndNotify(int64_t n, const int32_t* ids,
                                                 absl::Time deadline) {
  if (n < 0 || n > plan_.max_rows_per_worker()) {
    return absl::InternalError(
        absl::StrCat(n, " tokens outside [0, ", plan_.max_rows_per_worker(), "]"));
  }
  for (int w = 0; w < plan_.shape().num_workers; ++w) {
    if (live_.Has(w)) continue;
    if (placement_->count(w) > 0 || plan_.shared_expert_split()) {
      return absl::InternalError(absl::StrCat("worker ", w, " is not live but ",
                                              plan_.shared_expert_split()
                                                  ? "the shared expert is split over every worker"
                                                  : "the placement gives it experts"));
    }
  }
  ++epoch_;
  n_ = n;
  ids_ = CheckedIds(n, ids);
  CountSends();
  EPSERVE_RETURN_IF_ERROR(ShareCounts(deadline));
  return ComputeOffsets();
}

const int32_t* Exchange::CheckedIds(int64_t n, const int32_t* ids) {
  // An expert id out of range is a bug upstream; the pass still runs (with expert 0 in its
  // place) so that peers are not left waiting, and Run reports it afterwards.
  const int64_t size = n * plan_.shape().top_k;
  for (int64_t i = 0; i < size; ++i) {
    if (ids[i] >= 0 && ids[i] < plan_.shape().num_experts) continue;
    if (bad_id_.ok())
      bad_id_ = absl::InternalError(absl::StrCat("router produced expert id ", ids[i]));
    ids_copy_.assign(ids, ids + size);
    for (int32_t& e : ids_copy_) {
      if (e < 0 || e >= plan_.shape().num_experts) e = 0;
    }
    return ids_copy_.data();
  }
  return ids;
}

void Exchange::CountSends() {
  const int num_workers = plan_.shape().num_workers;
  const int k = plan_.shape().top_k;
  const size_t pairs = static_cast<size_t>(n_) * k;
  std::fill(my_counts_.begin(), my_counts_.end(), 0);
  slot_.assign(static_cast<size_t>(n_) * num_workers, -1);
  dest_.resize(pairs);
  local_.resize(pairs);
  pair_local_.resize(pairs);
  ChooseCopies(*placement_, ids_, n_, k, me_, dest_.data(), local_.data());
  for (int64_t t = 0; t < n_; ++t) {
    int64_t* slot = &slot_[t * num_workers];
    for (int j = 0; j < k; ++j) {
      const int d = dest_[t * k + j];
      int64_t* mine = &my_counts_[d * count_stride_];
      if (slot[d] < 0) slot[d] = mine[0]++;
      pair_local_[t * k + j] = static_cast<int32_t>(mine[2 + local_[t * k + j]]++);
    }
    if (plan_.shared_expert_split()) {  // every token to every worker, pairs or not
      for (int d = 0; d < num_workers; ++d) {
        if (slot[d] < 0) slot[d] = my_counts_[d * count_stride_]++;
      }
    }
  }
  for (int d = 0; d < num_workers; ++d) my_counts_[d * count_stride_ + 1] = n_;
}

absl::Status Exchange::ShareCounts(absl::Time deadline) {
  const int num_workers = plan_.shape().num_workers;
  // Notify: my row of the matrix into every worker's segment, then its count signal.
  const size_t parity = epoch_ & 1;
  const size_t block = static_cast<size_t>(num_workers) * count_stride_ * sizeof(int64_t);
  const size_t my_block = regions_.counts + (parity * num_workers + me_) * block;
  for (int d = 0; d < num_workers; ++d) {
    if (!live_.Has(d)) continue;
    EPSERVE_RETURN_IF_ERROR(heap_.Put(rank_of(d), my_block, my_counts_.data(), block));
    EPSERVE_RETURN_IF_ERROR(heap_.SignalSet(rank_of(d), signal(regions_.count_flag, me_), epoch_));
  }
  for (int s = 0; s < num_workers; ++s) {
    if (live_.Has(s))
      EPSERVE_RETURN_IF_ERROR(WaitFor(regions_.count_flag, s, deadline, "counts from worker"));
  }
  std::memcpy(counts_.data(), heap_.Local(regions_.counts + parity * num_workers * block),
              num_workers * block);
  // A dead worker sends nothing: its row of the matrix (whatever an old pass left) is zeros.
  for (int s = 0; s < num_workers; ++s) {
    if (!live_.Has(s)) {
      std::fill_n(counts_.begin() + static_cast<size_t>(s) * num_workers * count_stride_,
                  static_cast<size_t>(num_workers) * count_stride_, 0);
    }
  }
  return absl::OkStatus();
}

int64_t Exchange::ComputeOffsets() {
  const int num_workers = plan_.shape().num_workers;
  // Prefix sums: where my rows and pairs land in every receiver, where peers' rows land
  // in mine, where the parts of my tokens come back.
  int64_t max_recv = 0;
  for (int d = 0; d < num_workers; ++d) {
    int64_t rows = 0;
    for (int s = 0; s < num_workers; ++s) {
      if (s == me_) row_base_[d] = rows;
      rows += count_row(s, d)[0];
    }
    max_recv = std::max(max_recv, rows);
    int64_t expert_begin = 0;
    for (int e = 0; e < placement_->count(d); ++e) {
      int64_t before_me = 0, all = 0;
      for (int s = 0; s < num_workers; ++s) {
        if (s == me_) before_me = all;
        all += count_row(s, d)[2 + e];
      }
      pair_base_[d * num_local_max_ + e] = expert_begin + before_me;
      expert_begin += all;
    }
  }
  source_begin_[0] = 0;
  for (int s = 0; s < num_workers; ++s)
    source_begin_[s + 1] = source_begin_[s] + count_row(s, me_)[0];
  expert_offsets_.assign(static_cast<size_t>(placement_->count(me_)) + 1, 0);
  for (int e = 0; e < placement_->count(me_); ++e) {
    int64_t all = 0;
    for (int s = 0; s < num_workers; ++s) all += count_row(s, me_)[2 + e];
    expert_offsets_[e + 1] = expert_offsets_[e] + all;
  }
  combine_base_[0] = 0;
  for (int d = 0; d < num_workers; ++d)
    combine_base_[d + 1] = combine_base_[d] + count_row(me_, d)[0];
  pair_at_.resize(pair_local_.size());
  for (size_t i = 0; i < pair_at_.size(); ++i) {
    pair_at_[i] = pair_base_[dest_[i] * num_local_max_ + local_[i]] + pair_local_[i];
  }
  return max_recv;
}

absl::Status Exchange::Dispatch(const float* x, absl::Time deadline, DeviceMover* mover) {
  mover_ = mover;
  absl::Status s = RunPass(x, nullptr, nullptr, false, nullptr, deadline, nullptr, nullptr);
  mover_ = nullptr;
  return s;
}

void Exchange::DispatchDirect(const float* x) {
  const int num_workers = plan_.shape().num_workers;
  const int k = plan_.shape().top_k;
  const int64_t hidden = plan_.shape().hidden;
  const common::ElementType dtype = plan_.dispatch_dtype();
  const size_t row_bytes = plan_.dispatch_row_bytes();
  for (int64_t t = 0; t < n_; ++t) {
    const int64_t* slot = &slot_[t * num_workers];
    const float* src = x + t * hidden;
    const void* first = nullptr;  // the row encoded once, copied to its other destinations
    for (int d = 0; d < num_workers; ++d) {
      if (slot[d] < 0) continue;
      const int rank = rank_of(d);
      const int64_t row = row_base_[d] + slot[d];
      void* dst = heap_.Direct(rank, regions_.recv_rows + row * row_bytes);
      if (dtype == common::ElementType::kFp32) {
        std::memcpy(dst, src, static_cast<size_t>(hidden) * sizeof(float));
      } else if (first == nullptr) {
        EncodeRow(dtype, src, hidden, dst);
        first = dst;
      } else {
        std::memcpy(dst, first, row_bytes);
      }
      heap_.DirectAs<int32_t>(rank, regions_.recv_token)[row] =
          static_cast<int32_t>(token_base_ + t);
      int32_t* pair_row = heap_.DirectAs<int32_t>(rank, regions_.pair_row);
      for (int j = 0; j < k; ++j) {
        if (dest_[t * k + j] == d) pair_row[pair_at_[t * k + j]] = static_cast<int32_t>(row);
      }
    }
  }
}

absl::Status Exchange::DispatchStaged(const float* x, bool payload) {
  const int num_workers = plan_.shape().num_workers;
  const int k = plan_.shape().top_k;
  const int64_t hidden = plan_.shape().hidden;
  const common::ElementType dtype = plan_.dispatch_dtype();
  const size_t row_bytes = plan_.dispatch_row_bytes();
  const bool fp32 = dtype == common::ElementType::kFp32;
  const int64_t streams = combine_base_[num_workers];  // my rows to all destinations
  stage_token_.resize(streams);
  stage_pair_row_.resize(static_cast<size_t>(n_) * k);
  if (!payload) stage_pair_home_.resize(static_cast<size_t>(n_) * k);
  if (payload && !fp32) stage_rows_.resize(static_cast<size_t>(n_) * row_bytes);
  ComputeRuns();
  const std::vector<int64_t>& run_base = run_base_;
  for (int64_t t = 0; t < n_; ++t) {
    const int64_t* slot = &slot_[t * num_workers];
    if (payload && !fp32) EncodeRow(dtype, x + t * hidden, hidden, &stage_rows_[t * row_bytes]);
    for (int d = 0; d < num_workers; ++d) {
      if (slot[d] < 0) continue;
      stage_token_[combine_base_[d] + slot[d]] = static_cast<int32_t>(token_base_ + t);
      if (!payload) continue;  // the rows go device to device (DeviceMover::Send)
      const int64_t row = row_base_[d] + slot[d];
      const void* src = fp32 ? static_cast<const void*>(x + t * hidden)
                             : static_cast<const void*>(&stage_rows_[t * row_bytes]);
      EPSERVE_RETURN_IF_ERROR(
          heap_.Put(rank_of(d), regions_.recv_rows + row * row_bytes, src,
                    fp32 ? static_cast<size_t>(hidden) * sizeof(float) : row_bytes));
    }
  }
  // Each pair's entry in its destination's pair table, in one pass over the pairs.
  for (int64_t t = 0, i = 0; t < n_; ++t) {
    const int64_t* slot = &slot_[t * num_workers];
    for (int j = 0; j < k; ++j, ++i) {
      const int d = dest_[i];
      const int64_t at = run_base[d * num_local_max_ + local_[i]] + pair_local_[i];
      stage_pair_row_[at] = static_cast<int32_t>(row_base_[d] + slot[d]);
      if (!payload) stage_pair_home_[at] = static_cast<int32_t>(i);
    }
  }
  // The metadata of each destination in one Put per array, its pair table in one per expert
  // (sequential stores into the destination's segment).
  for (int d = 0; d < num_workers; ++d) {
    const int64_t rows = my_counts_[d * count_stride_];
    if (rows == 0) continue;
    const int rank = rank_of(d);
    const int64_t pos = combine_base_[d];
    const size_t at = static_cast<size_t>(row_base_[d]);
    EPSERVE_RETURN_IF_ERROR(heap_.Put(rank, regions_.recv_token + at * sizeof(int32_t),
                                      &stage_token_[pos], rows * sizeof(int32_t)));
    for (int e = 0; e < placement_->count(d); ++e) {
      const int i = d * num_local_max_ + e;
      const int64_t len = run_base[i + 1] - run_base[i];
      if (len == 0) continue;
      const size_t to = static_cast<size_t>(pair_base_[i]) * sizeof(int32_t);
      EPSERVE_RETURN_IF_ERROR(heap_.Put(rank, regions_.pair_row + to, &stage_pair_row_[run_base[i]],
                                        len * sizeof(int32_t)));
      if (!payload) {
        EPSERVE_RETURN_IF_ERROR(heap_.Put(rank, regions_.pair_home + to,
                                          &stage_pair_home_[run_base[i]], len * sizeof(int32_t)));
      }
    }
  }
  return absl::OkStatus();
}

void Exchange::PublishReceived(ExchangeStats* stats) {
  received_.rows = source_begin_[plan_.shape().num_workers];
  received_.pairs = expert_offsets_.back();
  received_.dtype = plan_.dispatch_dtype();
  received_.row_bytes = plan_.dispatch_row_bytes();
  received_.hidden = plan_.shape().hidden;
  received_.top_k = plan_.shape().top_k;
  received_.on_device = mover_ != nullptr;
  received_.payload = mover_ != nullptr ? nullptr : heap_.Local(regions_.recv_rows);
  received_.token = heap_.LocalAs<int32_t>(regions_.recv_token);
  received_.pair_row = heap_.LocalAs<int32_t>(regions_.pair_row);
  received_.pair_home = heap_.LocalAs<int32_t>(regions_.pair_home);
  received_.expert_offsets = expert_offsets_;
  received_.source_begin = source_begin_;
  if (stats == nullptr) return;
  stats->rows_received += received_.rows;
  stats->pairs += received_.pairs;
  stats->expert_pairs.resize(expert_offsets_.size() - 1);
  for (size_t e = 0; e + 1 < expert_offsets_.size(); ++e) {
    stats->expert_pairs[e] += expert_offsets_[e + 1] - expert_offsets_[e];
  }
}

absl::Status Exchange::RunPass(const float* x, const float* weights, float* y, bool accumulate,
                               const ExpertStep& expert, absl::Time deadline, ExchangeStats* stats,
                               const std::function<absl::Status()>* overlap) {
  const int num_workers = plan_.shape().num_workers;
  absl::Time t0 = absl::Now();

  // ---- dispatch: each row once per destination, with its metadata ----
  bool direct = true;
  for (int d = 0; d < num_workers && direct; ++d) direct = heap_.Direct(rank_of(d), 0) != nullptr;
  if (mover_ != nullptr) {
    if (!direct) {
      return absl::FailedPreconditionError(
          "rows moved device to device need a heap with load/store access to every worker");
    }
    EPSERVE_RETURN_IF_ERROR(mover_->Send(*this));
    // The metadata while the rows move, staged: stores into a peer's segment in order cost
    // far less than the pair table's scattered ones.
    EPSERVE_RETURN_IF_ERROR(DispatchStaged(x, /*payload=*/false));
    EPSERVE_RETURN_IF_ERROR(mover_->Sync());
  } else if (direct) {
    DispatchDirect(x);
  } else {
    EPSERVE_RETURN_IF_ERROR(DispatchStaged(x));
  }
  for (int d = 0; d < num_workers; ++d) {
    if (!live_.Has(d)) continue;
    EPSERVE_RETURN_IF_ERROR(
        heap_.SignalSet(rank_of(d), signal(regions_.dispatch_flag, me_), epoch_));
  }
  if (overlap != nullptr && *overlap) {
    const absl::Time o0 = absl::Now();
    EPSERVE_RETURN_IF_ERROR((*overlap)());
    if (stats != nullptr) stats->expert_ns += NanosSince(o0);
    t0 += absl::Now() - o0;
  }
  for (int s = 0; s < num_workers; ++s) {
    if (live_.Has(s))
      EPSERVE_RETURN_IF_ERROR(WaitFor(regions_.dispatch_flag, s, deadline, "rows from worker"));
  }
  PublishReceived(stats);
  if (stats != nullptr) stats->dispatch_ns += NanosSince(t0);
  if (!expert) return absl::OkStatus();  // Dispatch() only

  // ---- the caller's expert step ----
  t0 = absl::Now();
  float* pair_out = mover_ != nullptr ? nullptr : PairOutput();
  float* row_out = mover_ != nullptr ? nullptr : RowOutput();
  EPSERVE_RETURN_IF_ERROR(expert(received_, pair_out, row_out));
  if (stats != nullptr) stats->expert_ns += NanosSince(t0);

  // ---- combine and reduce ----
  t0 = absl::Now();
  if (mover_ != nullptr) EPSERVE_RETURN_IF_ERROR(mover_->Return(*this));
  EPSERVE_RETURN_IF_ERROR(Combine(pair_out, row_out));
  if (mover_ != nullptr) {
    EPSERVE_RETURN_IF_ERROR(WaitForCombined(deadline));
    EPSERVE_RETURN_IF_ERROR(mover_->Sum(*this, y, accumulate));
  } else {
    EPSERVE_RETURN_IF_ERROR(Reduce(weights, y, accumulate, deadline));
  }
  if (stats != nullptr) stats->combine_ns += NanosSince(t0);
  return absl::OkStatus();
}

absl::Status Exchange::TakeBadIdError() {
  absl::Status s = std::move(bad_id_);
  bad_id_ = absl::OkStatus();
  return s;
}

absl::Status Exchange::Run(const float* x, int64_t n, const int32_t* ids, const float* weights,
                           float* y, bool accumulate, const ExpertStep& expert, absl::Time deadline,
                           ExchangeStats* stats, const std::function<absl::Status()>& overlap,
                           DeviceMover* mover) {
  const int k = plan_.shape().top_k;
  const int64_t hidden = plan_.shape().hidden;
  const int64_t capacity = plan_.recv_capacity();
  mover_ = nullptr;
  absl::Time t0 = absl::Now();
  absl::StatusOr<int64_t> max_recv = CountAndNotify(n, ids, deadline);
  if (!max_recv.ok()) return max_recv.status();
  if (stats != nullptr) stats->layout_ns += NanosSince(t0);
  token_base_ = 0;
  if (*max_recv <= capacity) {
    if (stats != nullptr) stats->rounds += 1;
    mover_ = mover;
    absl::Status s = RunPass(x, weights, y, accumulate, expert, deadline, stats, &overlap);
    mover_ = nullptr;
    EPSERVE_RETURN_IF_ERROR(s);
    return TakeBadIdError();
  }
  if (plan_.overflow() == OverflowPolicy::kFail) {
    bad_id_ = absl::OkStatus();
    return absl::ResourceExhaustedError(absl::StrCat(
        "the batch needs ", *max_recv, " rows on one worker, over its receive capacity of ",
        capacity, " (--max-recv-tokens-per-rank); --recv-overflow=split would run it in rounds"));
  }
  // Split: rounds of at most capacity / W tokens per sender always fit.
  const int64_t per_round = capacity / plan_.shape().num_workers;
  int64_t most_tokens = 0;
  for (int s = 0; s < plan_.shape().num_workers; ++s)
    most_tokens = std::max(most_tokens, count_row(s, 0)[1]);
  const int64_t rounds = (most_tokens + per_round - 1) / per_round;
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t begin = std::min(n, r * per_round);
    const int64_t count = std::min(n, begin + per_round) - begin;
    t0 = absl::Now();
    max_recv = CountAndNotify(count, ids + begin * k, deadline);
    if (!max_recv.ok()) return max_recv.status();
    if (stats != nullptr) {
      stats->layout_ns += NanosSince(t0);
      stats->rounds += 1;
    }
    if (*max_recv > capacity) return absl::InternalError("a split round overflowed its capacity");
    token_base_ = begin;
    EPSERVE_RETURN_IF_ERROR(RunPass(x + begin * hidden, weights + begin * k, y + begin * hidden,
                                    accumulate, expert, deadline, stats,
                                    r == 0 ? &overlap : nullptr));
  }
  token_base_ = 0;
  return TakeBadIdError();
}

}  // namespace epserve::worker
