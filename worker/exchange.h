// The expert-parallel exchange among W workers through the symmetric heap: count/notify,
// dispatch, combine. One Exchange per worker rank; every worker of a batch runs the same
// sequence of calls. No OpenCL here: the expert step between dispatch and combine is the
// caller's (worker.cc runs the FFN kernels; tests and benchmarks run plain functions).
//
// One pass (a batch, or one round of a split batch):
//   Count     each sender chooses, for each of its (token, expert) pairs, the copy of the
//             expert that computes it (ChooseCopies, worker/placement.h: one holder, or the
//             copy whose worker has the fewest of its pairs so far); it counts, per
//             destination worker d and per local expert of d, the rows and pairs it sends,
//             and writes its counts into every worker's segment; after the W count signals
//             every worker knows the whole matrix and hence, by prefix sums, where each of
//             its rows and pairs lands (CountAndNotify; the stage metrics call `layout`).
//   Dispatch  each token row is stored once per destination worker (encoded in the
//             dispatch dtype) into that worker's receive buffer, sender-major, with the
//             token's index at the owner; the expert-major pair table (pair -> received row)
//             is written by the senders too, so the receiver never sorts.
//   (caller)  the receiver computes one output row per received pair (its expert's output
//             for the pair's row, not weighted), in pair order, and, when every token goes
//             to every worker (a split shared expert), one row per received row (what it
//             adds to every token it gets), written (fp32 combine) straight into its own
//             segment's combine region.
//   Combine   the output rows are in that region (encoded in the combine dtype); the worker
//             signals every owner.
//   Reduce    each owner reads its rows where they are, in the peers' segments, and sums,
//             per token: the per-row parts in destination order, then each choice j's
//             pair row times its routing weight, in the order of j. The order depends on
//             the routing alone, not on which worker computed a pair, so every placement
//             (replicated or not) gives bit-identical answers. Each returned row is moved
//             once, by the read that sums it.
// Every signal carries the pass's epoch (a counter all workers advance together), so a
// signal left from an earlier pass never satisfies a later wait, and buffers are reused
// across passes without being cleared: a sender writes pass p+1 into a receiver's buffers
// only after that receiver's combine signal of pass p, which it stores once it has read
// them; a worker overwrites its combine region in pass p+1 only after every peer's dispatch
// signal of p+1, which each peer sends after it has read its rows of pass p; the count
// matrix is double-buffered by epoch parity. Every wait has a deadline.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "shmem/heap.h"
#include "worker/exchange_config.h"
#include "worker/payload.h"
#include "worker/placement.h"

namespace epserve::worker {

// What the receiver of a pass holds once Dispatch returned; pointers into its own segment,
// valid until its Combine.
struct ReceivedRows {
  int64_t rows = 0;   // received rows, sender-major
  int64_t pairs = 0;  // (row, local expert) pairs
  common::ElementType dtype = common::ElementType::kFp32;
  size_t row_bytes = 0;
  int64_t hidden = 0;
  int top_k = 0;
  // The rows are in the receiver's device memory, FP32 (rounded to the dispatch dtype's
  // values), not in the heap: a DeviceMover moved them; payload is then null.
  bool on_device = false;
  const void* payload = nullptr;            // [rows][row_bytes]
  const int32_t* token = nullptr;           // [rows]: the token's index in its owner's batch
  const int32_t* pair_row = nullptr;        // [pairs], expert-major: the pair's received row
  const int32_t* pair_home = nullptr;       // [pairs] when on_device: t * k + j at its owner
  std::span<const int64_t> expert_offsets;  // [local experts + 1]: pairs of local expert e
                                            // are [offsets[e], offsets[e + 1])
  std::span<const int64_t> source_begin;    // [W + 1]: rows of worker s are [b[s], b[s+1])

  const void* Row(int64_t r) const { return static_cast<const char*>(payload) + r * row_bytes; }
  // fp32 payload: the rows themselves; else nullptr.
  const float* Fp32Rows() const {
    return dtype == common::ElementType::kFp32 ? static_cast<const float*>(payload) : nullptr;
  }
  void Decode(int64_t first_row, int64_t num_rows, float* dst) const;
  // The sending worker of row r: -1 below the first sender's rows, W past the last's. (A scan:
  // few workers, called per pair.)
  int Source(int64_t r) const {
    int s = -1;
    for (const int64_t b : source_begin) {
      if (r < b) break;
      ++s;
    }
    return s;
  }
};

struct ExchangeStats {
  int64_t layout_ns = 0;    // CountAndNotify, the `layout` stage
  int64_t dispatch_ns = 0;  // including waiting for peers' rows
  int64_t expert_ns = 0;    // the caller's step
  int64_t combine_ns = 0;   // including waiting for parts and the owner's sum
  int64_t rows_received = 0;
  int64_t pairs = 0;
  int rounds = 0;
  std::vector<int64_t> expert_pairs;  // per local expert, summed over rounds
};

class Exchange;

// Moves a pass's rows between the workers' devices instead of through the heap (GPU workers,
// worker/device_exchange.h): the exchange still counts, lays out and signals, and the heap
// still carries the metadata (tokens, pair table); the rows go device to device. A pass takes
// it when Exchange::Run is given one and the batch fits one pass (every worker decides alike:
// the fit follows from the shared count matrix).
class DeviceMover {
 public:
  virtual ~DeviceMover() = default;
  // Starts this worker's rows of the pass (ex.n() tokens) into their destinations' device
  // receive rows (receiver row ex.row_base(d) + token t's slot for d, ex.slots()); Sync waits until
  // they are there (the exchange writes the pass's metadata between the two).
  virtual absl::Status Send(const Exchange& ex) = 0;
  virtual absl::Status Sync() = 0;
  // After the expert step, before this worker's combine signals: its output rows for the
  // rows it received (ex.received()) into their owners' devices (pair p to its owner's
  // position pair_home[p], and with a split shared expert each received row's part), there
  // when it returns.
  virtual absl::Status Return(const Exchange& ex) = 0;
  // Once every worker's combine signal came: the owner's sum of its ex.n() tokens from the rows
  // returned to its device, into y [n][hidden], with the bits Exchange::Reduce gives (onto the
  // shared expert's output when `accumulate`).
  virtual absl::Status Sum(const Exchange& ex, float* y, bool accumulate) = 0;
};

// Not thread-safe: one thread drives an Exchange. The heap must outlive it.
class Exchange {
 public:
  // Reserves the regions in `heap`: every rank of the heap (workers or not) must call it
  // with the same plan, in the same order as its other allocations.
  static absl::StatusOr<ExchangeRegions> Allocate(shmem::SymmetricHeap& heap,
                                                  const ExchangePlan& plan);
  // `me`: this rank's worker index. The Exchange keeps a copy of `plan`; it starts with the
  // contiguous placement (ExpertPlacement::Contiguous).
  static absl::StatusOr<std::unique_ptr<Exchange>> Create(shmem::SymmetricHeap& heap,
                                                          const ExchangePlan& plan,
                                                          const ExchangeRegions& regions, int me);

  // The placement later passes follow (every worker must use the same one for a pass);
  // `placement` must outlive its use. INVALID_ARGUMENT where it does not fit the plan (experts,
  // workers, more than plan().max_local_experts() on one worker).
  absl::Status UsePlacement(const ExpertPlacement& placement);

  // The caller's step: pair_out[p] [pairs][hidden], local expert e's output for pair p's row
  // (not weighted); and where every token goes to every worker (a split shared expert),
  // row_out[r] [rows][hidden], what this worker adds to every token it receives (else
  // row_out is null).
  using ExpertStep =
      std::function<absl::Status(const ReceivedRows& in, float* pair_out, float* row_out)>;

  // One batch: x [n][hidden] this worker's token rows, ids/weights [n][k] their routing
  // (global expert ids). y [n][hidden] receives the combined rows (added to y when
  // `accumulate`, else overwriting it). `overlap`, when set, runs once while peers
  // dispatch. Errors: RESOURCE_EXHAUSTED (capacity, policy fail; every worker returns it
  // and nothing was sent), DEADLINE_EXCEEDED (a peer did not take part in time: the
  // exchange is then unusable).
  // With `mover`, a batch that fits one pass moves its rows device to device (the expert step
  // then gets received().on_device rows and null output pointers: it leaves its outputs on
  // the device); one that needs rounds goes through the heap.
  absl::Status Run(const float* x, int64_t n, const int32_t* ids, const float* weights, float* y,
                   bool accumulate, const ExpertStep& expert, absl::Time deadline,
                   ExchangeStats* stats = nullptr,
                   const std::function<absl::Status()>& overlap = {}, DeviceMover* mover = nullptr);
  // Whether the pass under way moves its rows on the devices (a DeviceMover).
  bool device_pass() const { return mover_ != nullptr; }

  // ---- the stages of one pass, for tests and benchmarks (Run calls them) ----
  // The counting step of a pass (the `layout` stage of metrics): counts the rows and pairs
  // of tokens [0, n) per destination, puts the counts into every worker's segment and
  // signals it, waits for every worker's counts and computes, by prefix sums, where each
  // row and pair lands. Returns the most rows any worker would receive in this pass.
  absl::StatusOr<int64_t> CountAndNotify(int64_t n, const int32_t* ids, absl::Time deadline);
  // Sends rows x [n][hidden] and waits for every peer's rows.
  // With `mover`, the rows move device to device (DeviceMover::Send) and received() is
  // on_device.
  absl::Status Dispatch(const float* x, absl::Time deadline, DeviceMover* mover = nullptr);
  const ReceivedRows& received() const { return received_; }
  // Where the expert step writes its rows, [pair capacity][hidden] and [recv capacity][hidden]
  // (null unless every token goes to every worker): with an fp32 combine the combine region
  // in this worker's segment itself (Combine then copies nothing), else buffers that Combine
  // encodes from.
  float* PairOutput();
  float* RowOutput();
  // Makes pair_out [received().pairs][hidden] and row_out [received().rows][hidden] (the
  // buffers above or any others) available to the owners and signals them.
  absl::Status Combine(const float* pair_out, const float* row_out);
  // Waits for every worker's rows, reads them and sums them into y [n][hidden] (onto y when
  // `accumulate`), each pair row times its weight in `weights` [n][k].
  absl::Status Reduce(const float* weights, float* y, bool accumulate, absl::Time deadline);

  // The workers that take part in later passes (a worker outside `live` died: nothing is
  // sent to it, nothing awaited from it; the placement must give it no experts and the
  // shared expert must not be split). `generation` counts the passes rank 0 ended early
  // (CancelWhen); when it differs from the last one, the signal epochs restart at
  // generation << 40, above any signal a pass of an older generation left, so that workers
  // that stopped a pass at different steps start the next one together. It never goes back.
  absl::Status UseLiveWorkers(const WorkerSet& live, uint64_t generation);
  const WorkerSet& live_workers() const { return live_; }
  // Every later wait ends with CANCELLED once the signal word at `signal` (this worker's own
  // memory) exceeds `above`; null: never.
  void CancelWhen(const uint64_t* signal, uint64_t above) {
    cancel_signal_ = signal;
    cancel_above_ = above;
  }

  // The fewest tokens a Reduce thread sums by default: below this a thread's start costs more
  // than it saves.
  static constexpr int64_t kTokensPerThread = 64;
  // Threads Reduce sums a pass's tokens on (common::ParallelFor; 1: the calling thread), each
  // at least `min_tokens` of them.
  void set_reduce_threads(int threads, int64_t min_tokens = kTokensPerThread) {
    reduce_threads_ = std::max(threads, 1);
    reduce_grain_ = std::max<int64_t>(min_tokens, 1);
  }

  const ExchangePlan& plan() const { return plan_; }
  const ExpertPlacement& placement() const { return *placement_; }
  // The worker that computes choice j of token t of the current pass (ChooseCopies).
  int destination(int64_t t, int j) const { return dest_[t * plan_.shape().top_k + j]; }
  // The current pass's layout, for a DeviceMover: its tokens; token t's position in the rows
  // this worker sends worker d (-1: none); where those rows start in d's receive rows; pair
  // i = t * k + j's index in its destination's pair table.
  int me() const { return me_; }
  int64_t n() const { return n_; }
  // Every token's slots, token t's for worker d at [t * workers + d] (-1: none).
  std::span<const int64_t> slots() const { return slot_; }
  int64_t row_base(int d) const { return row_base_[d]; }
  // Rows this worker sends worker d: slots 0 to rows_to(d) - 1, given in token order (so with
  // rows_to(d) == n(), token t's slot is t).
  int64_t rows_to(int d) const { return count_row(me_, d)[0]; }
  int64_t pair_at(int64_t i) const { return pair_at_[i]; }
  // Tokens worker s has in the current pass.
  int64_t tokens_of(int s) const { return count_row(s, me_)[1]; }
  // Rows this worker sends in the current pass (all destinations).
  int64_t rows_sent() const;

 private:
  Exchange(shmem::SymmetricHeap& heap, const ExchangePlan& plan, const ExchangeRegions& regions,
           ExpertPlacement contiguous, int me);
  // Dispatch, the expert step (when set), combine and reduce of the pass counted last.
  absl::Status RunPass(const float* x, const float* weights, float* y, bool accumulate,
                       const ExpertStep& expert, absl::Time deadline, ExchangeStats* stats,
                       const std::function<absl::Status()>* overlap);
  // CountAndNotify's steps. `ids`, or a copy with out-of-range ids replaced by expert 0
  // (the error is kept for Run to return).
  const int32_t* CheckedIds(int64_t n, const int32_t* ids);
  // Each pair's copy (dest_, local_), my rows and pairs per destination (my_counts_), each
  // token's stream position per destination (slot_) and each pair's index among mine to its
  // copy (pair_local_).
  void CountSends();
  // Puts my counts into every worker's segment, signals it, waits for every worker's counts
  // and copies the matrix (counts_).
  absl::Status ShareCounts(absl::Time deadline);
  // Prefix sums over the matrix (row_base_, pair_base_, source_begin_, expert_offsets_,
  // combine_base_) and each pair's index in its destination's pair table (pair_at_);
  // returns the most rows any worker receives.
  int64_t ComputeOffsets();
  // Dispatch's two ways of sending: stores straight into peers' segments (backends with
  // load/store access), or rows encoded once into staging and put (the others; with
  // payload false, only the metadata, pair_home too, for rows moved device to device).
  void DispatchDirect(const float* x);
  absl::Status DispatchStaged(const float* x, bool payload = true);
  // run_base_: where my pairs of each (destination, local expert) start among all of mine.
  void ComputeRuns();
  // Reduce where peers' segments have no load/store access: fetches my pairs' rows into
  // pulled_, in runs per (destination, local expert), then my row parts per destination;
  // points pair_base_at_ and row_base_at_ there and gives each pair's row in `pulled_at`.
  absl::Status PullCombined(std::vector<int64_t>& pulled_at);
  // Points received() at what peers dispatched this pass; adds its counts to stats.
  void PublishReceived(ExchangeStats* stats);
  absl::Status TakeBadIdError();
  bool OutputInHeap() const;  // the expert step writes straight into the output region
  int rank_of(int worker) const { return plan_.shape().first_rank + worker; }
  size_t signal(size_t base, int index) const { return SignalOffset(base, index); }
  // Waits for peer `index`'s signal at `base` to reach this pass's epoch.
  absl::Status WaitFor(size_t base, int index, absl::Time deadline, const char* what);
  // Waits for every live worker's combine signal of this pass.
  absl::Status WaitForCombined(absl::Time deadline);
  const int64_t* count_row(int src, int dst) const {
    return &counts_[(static_cast<size_t>(src) * plan_.shape().num_workers + dst) * count_stride_];
  }

  shmem::SymmetricHeap& heap_;
  const ExchangePlan plan_;
  const ExchangeRegions regions_;
  const ExpertPlacement contiguous_;
  const ExpertPlacement* placement_ = &contiguous_;
  const int me_;
  const int num_local_max_;    // L
  const size_t count_stride_;  // 2 + L
  uint64_t epoch_ = 0;
  WorkerSet live_;
  uint64_t generation_ = 0;
  const uint64_t* cancel_signal_ = nullptr;
  uint64_t cancel_above_ = 0;

  // The current pass.
  int64_t n_ = 0;
  int64_t token_base_ = 0;  // batch index of the pass's first token (split rounds)
  const int32_t* ids_ = nullptr;
  std::vector<int32_t> ids_copy_;  // ids with out-of-range entries replaced
  absl::Status bad_id_;
  std::vector<int64_t> counts_;          // [W][W][2 + L] copy of the matrix
  std::vector<int64_t> my_counts_;       // [W][2 + L] what I send to each destination
  std::vector<int64_t> slot_;            // [n][W]: my stream position to d, or -1
  std::vector<int32_t> dest_, local_;    // [n][k]: the copy computing each pair
  std::vector<int32_t> pair_local_;      // [n][k]: index among my pairs to that copy
  std::vector<int64_t> pair_at_;         // [n][k]: the pair's index in its dest's pair table
  std::vector<int64_t> row_base_;        // [W]: where my rows start in d's receive buffer
  std::vector<int64_t> pair_base_;       // [W][L]: where my pairs of (d, e) start in d's table
  std::vector<int64_t> combine_base_;    // [W + 1]: prefix sums of my rows per destination
  std::vector<int64_t> source_begin_;    // [W + 1]
  std::vector<int64_t> expert_offsets_;  // [L_me + 1]
  ReceivedRows received_;
  // Staging for backends without load/store access to peers.
  std::vector<char> stage_rows_;
  std::vector<int32_t> stage_token_, stage_pair_row_, stage_pair_home_;
  std::vector<int64_t> run_base_;  // [W * L + 1]: runs of my pairs per (d, local e)
  std::vector<float> out_;         // the expert step's output when not OutputInHeap()
  std::vector<char> pulled_;       // my rows fetched from peers without load/store access
  std::vector<const char*> pair_base_at_, row_base_at_;  // [W]: where my rows at d start
  int reduce_threads_ = 1;
  int64_t reduce_grain_ = kTokensPerThread;
  DeviceMover* mover_ = nullptr;  // the pass under way moves its rows on the devices
};

}  // namespace epserve::worker
