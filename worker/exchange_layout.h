// Where the front-end and the workers meet in the symmetric heap. Rank 0 is the
// front-end; worker w is rank w + 1. Every rank computes the same layout from the same
// ExchangeShape, so every offset below is valid on every rank.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "shmem/heap.h"

namespace epserve::worker {

// The stages a worker times for each batch, in order.
enum WorkerStage { kRoute = 0, kLayout, kDispatch, kExpertFfn, kCombine, kNumWorkerStages };
const char* WorkerStageName(int stage);

struct ExchangeShape {
  int num_workers = 1;
  int num_experts = 1;
  int top_k = 1;
  int64_t hidden = 1;
  int64_t max_batch_tokens = 1;

  int64_t max_rows_per_worker() const { return (max_batch_tokens + num_workers - 1) / num_workers; }
  // A receiver gets each token at most once: at most the whole batch.
  int64_t max_recv_rows() const { return max_batch_tokens; }
  // An owner gets back at most one row per token and destination.
  int64_t max_combine_rows() const { return max_rows_per_worker() * std::min(num_workers, top_k); }
  int64_t recv_meta_stride() const { return 1 + 2 * static_cast<int64_t>(top_k); }
};

enum class BatchOp : int32_t { kRun = 1, kStop = 2 };

// Written by rank 0 into each worker's segment before it stores batch_seq.
struct BatchDescriptor {
  BatchOp op;
  int32_t layer_pos;         // index into the served layers
  int64_t row_start;         // first batch row this worker owns
  int64_t num_rows;          // rows this worker owns
  int64_t deadline_unix_us;  // every wait of this batch ends by then
};

// Written by worker w into rank 0's segment before it stores done_seq.
struct WorkerReport {
  int32_t status_code;  // absl::StatusCode
  int32_t pad;
  char message[240];
  int64_t stage_ns[kNumWorkerStages];
  int64_t rows_received;
  int64_t pairs;
};

// Offsets into each rank's segment.
struct ExchangeLayout {
  ExchangeShape shape;
  // rank 0 -> worker
  size_t batch_seq;   // uint64 signal
  size_t descriptor;  // BatchDescriptor
  // worker -> rank 0 (meaningful on rank 0's segment)
  size_t ready;          // uint64[W]: worker w stored 1 once its weights are loaded
  size_t done_seq;       // uint64[W] signals, 64 bytes apart
  size_t reports;        // WorkerReport[W]
  size_t expert_tokens;  // int64[E]: pairs per expert in the last batch
  // worker <-> worker (meaningful on worker segments)
  size_t count_flag;     // uint64[W], 64 bytes apart: batch seq once src's counts row landed
  size_t counts;         // int64[W][W]: rows src sends to dest
  size_t dispatch_flag;  // uint64[W], 64 bytes apart
  size_t combine_flag;   // uint64[W], 64 bytes apart
  // data
  size_t input;  // float[max_rows_per_worker][H], written by rank 0
  size_t recv;   // float[max_recv_rows][H], written by senders
  size_t
      recv_meta;   // int32[max_recv_rows][1 + 2k]: source token, k local ids (-1: none), k weights
  size_t combine;  // float[max_combine_rows][H], written by receivers back to owners
  size_t output;   // float[max_batch_tokens][H] (rank 0's segment), written by owners

  static constexpr size_t kSignalStride = 64;

  // Reserves the regions in `heap`; every rank must call it with the same shape.
  static absl::StatusOr<ExchangeLayout> Allocate(shmem::SymmetricHeap& heap,
                                                 const ExchangeShape& shape);
  // Bytes per rank the layout needs, for sizing the heap.
  static size_t BytesNeeded(const ExchangeShape& shape);

  uint64_t* Signal(const shmem::SymmetricHeap& heap, int rank, size_t base, int index) const {
    return heap.As<uint64_t>(rank, base + static_cast<size_t>(index) * kSignalStride);
  }
};

}  // namespace epserve::worker
