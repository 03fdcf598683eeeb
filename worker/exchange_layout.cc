#include "worker/exchange_layout.h"

namespace epserve::worker {

const char* WorkerStageName(int stage) {
  static const char* const kNames[kNumWorkerStages] = {"route", "layout", "dispatch", "expert_ffn",
                                                       "combine"};
  return stage >= 0 && stage < kNumWorkerStages ? kNames[stage] : "unknown";
}

namespace {

// Runs the same sequence of allocations on a real heap or on a size counter.
template <typename Alloc>
absl::Status Plan(const ExchangeShape& s, ExchangeLayout& l, Alloc alloc) {
  const size_t w = static_cast<size_t>(s.num_workers);
  const size_t row_bytes = static_cast<size_t>(s.hidden) * sizeof(float);
  const size_t sig = ExchangeLayout::kSignalStride;
  struct Item {
    size_t* offset;
    size_t bytes;
    size_t align;
  };
  const Item items[] = {
      {&l.batch_seq, sig, 64},
      {&l.descriptor, sizeof(BatchDescriptor), 64},
      {&l.ready, w * sig, 64},
      {&l.done_seq, w * sig, 64},
      {&l.reports, w * sizeof(WorkerReport), 64},
      {&l.expert_tokens, static_cast<size_t>(s.num_experts) * sizeof(int64_t), 64},
      {&l.count_flag, w * sig, 64},
      {&l.counts, w * w * sizeof(int64_t), 64},
      {&l.dispatch_flag, w * sig, 64},
      {&l.combine_flag, w * sig, 64},
      {&l.input, static_cast<size_t>(s.max_rows_per_worker()) * row_bytes, 4096},
      {&l.recv, static_cast<size_t>(s.max_recv_rows()) * row_bytes, 4096},
      {&l.recv_meta,
       static_cast<size_t>(s.max_recv_rows() * s.recv_meta_stride()) * sizeof(int32_t), 64},
      {&l.combine, static_cast<size_t>(s.max_combine_rows()) * row_bytes, 4096},
      {&l.output, static_cast<size_t>(s.max_batch_tokens) * row_bytes, 4096},
  };
  for (const Item& item : items) {
    absl::StatusOr<size_t> offset = alloc(item.bytes, item.align);
    if (!offset.ok()) return offset.status();
    *item.offset = *offset;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ExchangeLayout> ExchangeLayout::Allocate(shmem::SymmetricHeap& heap,
                                                        const ExchangeShape& shape) {
  ExchangeLayout l{};
  l.shape = shape;
  absl::Status s =
      Plan(shape, l, [&](size_t bytes, size_t align) { return heap.Allocate(bytes, align); });
  if (!s.ok()) return s;
  return l;
}

size_t ExchangeLayout::BytesNeeded(const ExchangeShape& shape) {
  ExchangeLayout l{};
  size_t next = 0;
  Plan(shape, l, [&](size_t bytes, size_t align) -> absl::StatusOr<size_t> {
    const size_t offset = (next + align - 1) / align * align;
    next = offset + bytes;
    return offset;
  }).IgnoreError();
  return next;
}

}  // namespace epserve::worker
