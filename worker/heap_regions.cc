#include "worker/heap_regions.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace epserve::worker {

const char* WorkerStageName(int stage) {
  static const char* const kNames[kNumWorkerStages] = {"route", "layout", "dispatch", "expert_ffn",
                                                       "combine"};
  return stage >= 0 && stage < kNumWorkerStages ? kNames[stage] : "unknown";
}

namespace {

// Runs the same sequence of allocations on a real heap or on a size counter.
template <typename Alloc>
absl::Status Reserve(const ExchangePlan& plan, HeapRegions& l, Alloc alloc) {
  const ExchangeShape& s = plan.shape();
  const size_t w = static_cast<size_t>(s.num_workers);
  const size_t rows_per_worker = static_cast<size_t>(plan.max_rows_per_worker());
  const size_t row_bytes = static_cast<size_t>(s.hidden) * sizeof(float);
  const size_t sig = kSignalStride;
  const size_t slots = HeapRegions::kSlots;
  struct Item {
    size_t* offset;
    size_t bytes;
    size_t align;
  };
  const Item items[] = {
      {&l.batch_seq, sig, 64},
      {&l.descriptor, sizeof(BatchDescriptor), 64},
      {&l.control, sizeof(ControlMessage), 64},
      {&l.ready, w * sig, 64},
      {&l.done_seq, w * sig, 64},
      {&l.reports, w * sizeof(WorkerReport), 64},
      {&l.expert_tokens, static_cast<size_t>(s.num_workers) * s.num_experts * sizeof(int64_t), 64},
      {&l.heartbeats, w * sig, 64},
      {&l.pids, w * sig, 64},
      {&l.front_end_pid, sig, 64},
      {&l.cancel, sig, 64},
      {&l.staged, w * sig, 64},
      {&l.stage_reports, w * sizeof(WorkerReport), 64},
      {&l.peer_memory, w * sig, 64},
      {&l.rows_ahead, 2 * sizeof(RowsAhead), 64},
      {&l.rows_ahead_seq, sig, 64},
      {&l.input, slots * rows_per_worker * row_bytes, 4096},
      {&l.device_rows, slots * DeviceRowTable::BytesFor(plan.max_rows_per_worker()), 64},
      {&l.output, slots * static_cast<size_t>(s.max_batch_tokens) * row_bytes, 4096},
      {&l.topk_ids, slots * static_cast<size_t>(s.max_batch_tokens * s.top_k) * sizeof(int32_t),
       64},
      {&l.topk_weights, slots * static_cast<size_t>(s.max_batch_tokens * s.top_k) * sizeof(float),
       64},
  };
  for (const Item& item : items) {
    absl::StatusOr<size_t> offset = alloc(item.bytes, item.align);
    if (!offset.ok()) return offset.status();
    *item.offset = *offset;
  }
  EPSERVE_ASSIGN_OR_RETURN(l.exchange, ExchangeRegions::Make(plan, alloc));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HeapRegions> HeapRegions::Allocate(shmem::SymmetricHeap& heap,
                                                  const ExchangePlan& plan) {
  HeapRegions l{};
  l.plan = plan;
  EPSERVE_RETURN_IF_ERROR(
      Reserve(plan, l, [&](size_t bytes, size_t align) { return heap.Allocate(bytes, align); }));
  return l;
}

size_t HeapRegions::BytesNeeded(const ExchangePlan& plan) {
  HeapRegions l{};
  size_t next = 0;
  Reserve(plan, l, [&](size_t bytes, size_t align) -> absl::StatusOr<size_t> {
    const size_t offset = (next + align - 1) / align * align;
    next = offset + bytes;
    return offset;
  }).IgnoreError();
  return next;
}

}  // namespace epserve::worker
