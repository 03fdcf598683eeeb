// The exchange's settings and what follows from them, each in one place:
//   ExchangeOptions  the settings, typed (app/flags.cc binds each exchange flag straight to its
//                    field with the parse function below); checked once, by Validate.
//   ExchangeShape    the dimensions the exchange is sized for (model, workers, batch): not
//                    settings, nothing to parse.
//   ExchangePlan     both, checked against each other once (Make), and what follows:
//                    per-worker rows, receive capacity, row bytes. The exchange, the heap's
//                    regions (worker/heap_regions.h), rank 0's coordinator and the workers
//                    read it, held whole; nothing copies its fields into another struct.
//   ExchangeRegions  the offsets of the exchange's regions in the heap, laid out from a plan.
// Code: worker/exchange_config.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/element_type.h"
#include "shmem/heap.h"
#include "worker/payload.h"
#include "worker/placement.h"

namespace epserve::worker {

// --recv-overflow: what happens when a receiver would get more rows than its capacity.
enum class OverflowPolicy {
  kFail,   // the batch fails with RESOURCE_EXHAUSTED on every worker; nothing is sent
  kSplit,  // the batch runs in rounds of at most capacity / W tokens per sender
};
// "fail" or "split"; INVALID_ARGUMENT "--recv-overflow must be fail or split, got '<name>'".
absl::StatusOr<OverflowPolicy> ParseOverflowPolicy(absl::string_view name);
const char* OverflowPolicyName(OverflowPolicy policy);

// --shared-expert: where a model's shared expert runs (nothing, on a model without one).
enum class SharedExpertPlacement {
  // Each worker holds 1/W of the shared expert's intermediate columns and runs them on every
  // token, so every token goes to every worker.
  kSplit,
  // Each worker holds all of it and runs it on its own tokens.
  kOwner,
};
// "split" or "owner"; INVALID_ARGUMENT "--shared-expert must be owner or split, got '<name>'".
absl::StatusOr<SharedExpertPlacement> ParseSharedExpertPlacement(absl::string_view name);
const char* SharedExpertPlacementName(SharedExpertPlacement placement);

// The element types of the rows each way: --dispatch-dtype takes kPayloadTypes (fp32, bf16,
// fp8), --combine-dtype these (expert output rows go back as fp32 or bf16).
inline constexpr common::ElementType kCombineTypes[] = {common::ElementType::kFp32,
                                                        common::ElementType::kBf16};
// One of the flag's types by its spelling; INVALID_ARGUMENT "--dispatch-dtype must be fp32,
// bf16 or fp8, got '<name>'" (--combine-dtype: "must be fp32 or bf16") otherwise.
absl::StatusOr<common::ElementType> ParseDispatchDtype(absl::string_view name);
absl::StatusOr<common::ElementType> ParseCombineDtype(absl::string_view name);

// The exchange's settings, typed, each named by its flag; tests and benchmarks set them alike.
// Every rank must hold the same.
struct ExchangeOptions {
  shmem::HeapBackend heap = shmem::HeapBackend::kAuto;  // --heap: shm, rma or auto
  // --dispatch-dtype: token rows sent to experts, one of kPayloadTypes.
  common::ElementType dispatch_dtype = common::ElementType::kFp32;
  // --combine-dtype: expert output rows sent back to their owners, one of kCombineTypes.
  common::ElementType combine_dtype = common::ElementType::kFp32;
  // --max-recv-tokens-per-rank: most rows one worker receives in one pass; 0: a whole batch,
  // which never overflows (a receiver gets each token at most once).
  int64_t max_recv_tokens_per_rank = 0;
  OverflowPolicy recv_overflow = OverflowPolicy::kFail;  // --recv-overflow
  // --exchange-timeout-ms: every cross-rank wait of a batch ends within this (or the caller's
  // deadline, if earlier).
  int64_t exchange_timeout_ms = 60000;
  // --shared-expert: applies where the model has a shared expert (ExchangeShape).
  SharedExpertPlacement shared_expert = SharedExpertPlacement::kSplit;

  // Each field against its bound (the dtypes against their flag's types, the numbers against
  // their ranges): INVALID_ARGUMENT naming the flag and the bound, as the flag would have.
  absl::Status Validate() const;
};

// The dimensions the exchange is sized for. Every rank must use the same.
struct ExchangeShape {
  int num_workers = 1;
  // Heap rank of worker 0 (worker w is heap rank first_rank + w): kFirstWorkerRank in a
  // serving job, 0 where every heap rank is a worker (the exchange's tests and benchmark).
  int first_rank = kFirstWorkerRank;
  int num_experts = 1;
  int top_k = 1;
  int64_t hidden = 1;
  int64_t max_batch_tokens = 1;    // most token rows of one batch, over all workers
  bool has_shared_expert = false;  // the model has a shared expert (--shared-expert applies)
  // Copies of experts beyond one each, per layer, over all workers (--redundant-experts):
  // sizes the per-expert counts for the most experts a placement may put on one worker.
  int redundant_experts = 0;
};

// The exchange as every worker runs it. Immutable once made; thread-safe to read.
class ExchangePlan {
 public:
  // The plan Make gives for ExchangeShape{} and ExchangeOptions{}.
  ExchangePlan() = default;
  // Checks the options (ExchangeOptions::Validate), then the shape and both together:
  // INVALID_ARGUMENT naming the flag or the bound.
  static absl::StatusOr<ExchangePlan> Make(const ExchangeShape& shape,
                                           const ExchangeOptions& options);

  const ExchangeShape& shape() const { return shape_; }
  const ExchangeOptions& options() const { return options_; }

  // The options, as the plan reads them.
  shmem::HeapBackend heap_backend() const { return options_.heap; }
  common::ElementType dispatch_dtype() const { return options_.dispatch_dtype; }
  common::ElementType combine_dtype() const { return options_.combine_dtype; }
  OverflowPolicy overflow() const { return options_.recv_overflow; }
  absl::Duration timeout() const { return absl::Milliseconds(options_.exchange_timeout_ms); }
  // --shared-expert=split on a model that has a shared expert: every token goes to every
  // worker, also to those that own none of its experts (which receive it with no pairs).
  bool shared_expert_split() const { return shared_expert_split_; }

  // What follows from the shape and the options.
  // Most rows one worker owns in a batch (RowSplit), hence sends in one pass.
  int64_t max_rows_per_worker() const {
    return (shape_.max_batch_tokens + shape_.num_workers - 1) / shape_.num_workers;
  }
  // Most rows one worker receives in one pass: --max-recv-tokens-per-rank, at most a batch.
  int64_t recv_capacity() const;
  // L: the most experts one worker holds, ceil((E + redundant) / W) (SlotsOfWorker).
  int max_local_experts() const {
    return SlotsOfWorker(shape_.num_experts, shape_.redundant_experts, 0, shape_.num_workers);
  }
  // Most pairs one worker receives in one pass (each received row brings at most k).
  int64_t recv_pair_capacity() const { return recv_capacity() * shape_.top_k; }
  // Rows of the combine region: one per pair, then (a split shared expert) one per row.
  int64_t combine_capacity() const {
    return recv_pair_capacity() + (shared_expert_split_ ? recv_capacity() : 0);
  }
  size_t dispatch_row_bytes() const { return PayloadRowBytes(dispatch_dtype(), shape_.hidden); }
  size_t combine_row_bytes() const { return PayloadRowBytes(combine_dtype(), shape_.hidden); }

 private:
  ExchangeShape shape_;
  ExchangeOptions options_;
  bool shared_expert_split_ = false;
};

// Signals (uint64 epochs) of one array sit a cache line apart, so that ranks signalling
// different entries do not share a line.
inline constexpr size_t kSignalStride = 64;
// Offset of signal `index` of the signal array at `base`.
inline size_t SignalOffset(size_t base, int index) {
  return base + static_cast<size_t>(index) * kSignalStride;
}

// Offsets of the exchange's regions in every rank's segment (meaningful on workers).
struct ExchangeRegions {
  size_t count_flag;     // uint64[W] signals: epoch once src's counts landed
  size_t counts;         // int64[2][W][W][2 + L]: per parity, src, dst: rows, src's tokens,
                         // pairs per local expert of dst (L = most experts of one worker)
  size_t dispatch_flag;  // uint64[W] signals: epoch once src's rows and metadata landed
  size_t combine_flag;   // uint64[W] signals: epoch once dst's combine rows landed
  size_t recv_rows;      // [capacity][dispatch_row_bytes]
  size_t recv_token;     // int32[capacity]: token index at its owner
  size_t pair_row;       // int32[capacity * k]: received row of each pair, expert-major
  size_t pair_home;      // int32[capacity * k]: each pair's t * k + j at its owner (written
                         // when rows move device to device: the receiver returns it there)
  size_t combine_rows;   // [combine capacity][combine_row_bytes]: this worker's output rows,
                         // one per pair (pair order), then one per received row (receive
                         // order; a split shared expert); owners read theirs from here

  // Lays the regions out with `alloc(bytes, align) -> offset`, in a fixed order.
  using Allocator = std::function<absl::StatusOr<size_t>(size_t bytes, size_t align)>;
  static absl::StatusOr<ExchangeRegions> Make(const ExchangePlan& plan, const Allocator& alloc);
  // Bytes per rank the regions take, and a one-line breakdown for the startup log.
  static size_t BytesNeeded(const ExchangePlan& plan);
  static std::string Describe(const ExchangePlan& plan);
};

}  // namespace epserve::worker
