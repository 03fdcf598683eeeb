#include "worker/heap_regions.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace epserve::worker {

const char* WorkerStageName(int stage) {
  static const char* const kNames[kNumWorkerStages] = {"route", "layout", "dispatch", "expert_ffn",
                                                       "combine"};
  return stage >= 0 && stage < kNumWorkerStages ? kNames[stage] : "unknown";
}

ExchangeConfig ExchangeShape::exchange() const {
  ExchangeConfig c;
  c.num_workers = num_workers;
  c.first_rank = RankOfWorker(0);
  c.num_experts = num_experts;
  c.top_k = top_k;
  c.hidden = hidden;
  c.max_send_tokens = max_rows_per_worker();
  // A receiver gets each token at most once: at most the whole batch.
  c.max_recv_tokens = max_recv_tokens_per_rank > 0
                          ? std::min(max_recv_tokens_per_rank, max_batch_tokens)
                          : max_batch_tokens;
  c.dispatch_dtype = dispatch_dtype;
  c.combine_dtype = combine_dtype;
  c.overflow = overflow;
  c.every_token_to_every_worker = shared_expert_split;
  return c;
}

absl::Status ExchangeFlags::Apply(ExchangeShape& shape) const {
  EPSERVE_ASSIGN_OR_RETURN(shape.dispatch_dtype,
                           ParsePayloadType(dispatch_dtype, "dispatch-dtype"));
  EPSERVE_ASSIGN_OR_RETURN(shape.combine_dtype, ParsePayloadType(combine_dtype, "combine-dtype"));
  if (shape.combine_dtype == common::ElementType::kFp8E4m3) {
    return absl::InvalidArgumentError("--combine-dtype must be fp32 or bf16, got 'fp8'");
  }
  EPSERVE_ASSIGN_OR_RETURN(shape.overflow, ParseOverflowPolicy(recv_overflow));
  if (max_recv_tokens_per_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-recv-tokens-per-rank must be >= 0 (0: --max-batch-tokens), got ",
                     max_recv_tokens_per_rank));
  }
  shape.max_recv_tokens_per_rank = max_recv_tokens_per_rank;
  if (exchange_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--exchange-timeout-ms must be >= 1, got ", exchange_timeout_ms));
  }
  shape.exchange_timeout = absl::Milliseconds(exchange_timeout_ms);
  if (shared_expert != "owner" && shared_expert != "split") {
    return absl::InvalidArgumentError(
        absl::StrCat("--shared-expert must be owner or split, got '", shared_expert, "'"));
  }
  shape.shared_expert_split = shared_expert == "split";
  return shape.exchange().Validate();
}

namespace {

// Runs the same sequence of allocations on a real heap or on a size counter.
template <typename Alloc>
absl::Status Plan(const ExchangeShape& s, HeapRegions& l, Alloc alloc) {
  const size_t w = static_cast<size_t>(s.num_workers);
  const size_t row_bytes = static_cast<size_t>(s.hidden) * sizeof(float);
  const size_t sig = kSignalStride;
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
      {&l.expert_tokens, static_cast<size_t>(s.num_experts) * sizeof(int64_t), 64},
      {&l.heartbeats, w * sig, 64},
      {&l.staged, w * sig, 64},
      {&l.stage_reports, w * sizeof(WorkerReport), 64},
      {&l.input, static_cast<size_t>(s.max_rows_per_worker()) * row_bytes, 4096},
      {&l.output, static_cast<size_t>(s.max_batch_tokens) * row_bytes, 4096},
      {&l.topk_ids, static_cast<size_t>(s.max_batch_tokens * s.top_k) * sizeof(int32_t), 64},
      {&l.topk_weights, static_cast<size_t>(s.max_batch_tokens * s.top_k) * sizeof(float), 64},
  };
  for (const Item& item : items) {
    absl::StatusOr<size_t> offset = alloc(item.bytes, item.align);
    if (!offset.ok()) return offset.status();
    *item.offset = *offset;
  }
  absl::StatusOr<ExchangeRegions> regions = ExchangeRegions::Plan(s.exchange(), alloc);
  if (!regions.ok()) return regions.status();
  l.exchange = *regions;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HeapRegions> HeapRegions::Allocate(shmem::SymmetricHeap& heap,
                                                  const ExchangeShape& shape) {
  HeapRegions l{};
  l.shape = shape;
  EPSERVE_RETURN_IF_ERROR(
      Plan(shape, l, [&](size_t bytes, size_t align) { return heap.Allocate(bytes, align); }));
  return l;
}

size_t HeapRegions::BytesNeeded(const ExchangeShape& shape) {
  HeapRegions l{};
  size_t next = 0;
  Plan(shape, l, [&](size_t bytes, size_t align) -> absl::StatusOr<size_t> {
    const size_t offset = (next + align - 1) / align * align;
    next = offset + bytes;
    return offset;
  }).IgnoreError();
  return next;
}

}  // namespace epserve::worker
