// The exchange's shape (ExchangeConfig, the overflow policy) and the plan of its regions in
// the heap (ExchangeRegions); declared in worker/exchange.h.
#include "worker/exchange.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace epserve::worker {

absl::StatusOr<OverflowPolicy> ParseOverflowPolicy(absl::string_view name) {
  if (name == "fail") return OverflowPolicy::kFail;
  if (name == "split") return OverflowPolicy::kSplit;
  return absl::InvalidArgumentError(
      absl::StrCat("--recv-overflow must be fail or split, got '", name, "'"));
}

const char* OverflowPolicyName(OverflowPolicy policy) {
  return policy == OverflowPolicy::kFail ? "fail" : "split";
}

absl::Status ExchangeConfig::Validate() const {
  if (num_workers < 1 || num_workers > num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("the exchange needs 1 <= workers (", num_workers,
                                                   ") <= experts (", num_experts, ")"));
  }
  if (top_k < 1 || top_k > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k ", top_k, " outside [1, ", num_experts, "]"));
  }
  if (hidden < 1 || max_send_tokens < 1 || max_recv_tokens < 0 || first_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad exchange shape: hidden ", hidden, ", max_send_tokens ", max_send_tokens,
                     ", max_recv_tokens ", max_recv_tokens, ", first_rank ", first_rank));
  }
  EPSERVE_RETURN_IF_ERROR(CheckPayloadType(dispatch_dtype, "the dispatch dtype"));
  EPSERVE_RETURN_IF_ERROR(CheckPayloadType(combine_dtype, "the combine dtype"));
  if (overflow == OverflowPolicy::kSplit && recv_capacity() < num_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--recv-overflow=split needs --max-recv-tokens-per-rank >= the number of workers (",
        num_workers, "), got ", recv_capacity()));
  }
  return absl::OkStatus();
}

int64_t ExchangeConfig::recv_capacity() const {
  const int64_t most = max_send_tokens * num_workers;
  return max_recv_tokens > 0 ? std::min(max_recv_tokens, most) : most;
}

absl::StatusOr<ExchangeRegions> ExchangeRegions::Plan(const ExchangeConfig& c,
                                                      const Allocator& alloc) {
  EPSERVE_RETURN_IF_ERROR(c.Validate());
  ExchangeRegions r{};
  const size_t w = static_cast<size_t>(c.num_workers);
  const size_t cap = static_cast<size_t>(c.recv_capacity());
  const size_t k = static_cast<size_t>(c.top_k);
  const size_t stride = 2 + static_cast<size_t>(c.max_local_experts());
  struct Item {
    size_t* offset;
    size_t bytes;
    size_t align;
  };
  const Item items[] = {
      {&r.count_flag, w * kSignalStride, 64},
      {&r.counts, 2 * w * w * stride * sizeof(int64_t), 64},
      {&r.dispatch_flag, w * kSignalStride, 64},
      {&r.combine_flag, w * kSignalStride, 64},
      {&r.recv_rows, cap * c.dispatch_row_bytes(), 4096},
      {&r.recv_token, cap * sizeof(int32_t), 64},
      {&r.recv_pair, cap * k * sizeof(int32_t), 64},
      {&r.recv_weight, cap * k * sizeof(float), 64},
      {&r.pair_row, cap * k * sizeof(int32_t), 64},
      {&r.combine_rows, cap * c.combine_row_bytes(), 4096},
  };
  for (const Item& item : items) {
    absl::StatusOr<size_t> offset = alloc(item.bytes, item.align);
    if (!offset.ok()) return offset.status();
    *item.offset = *offset;
  }
  return r;
}

size_t ExchangeRegions::BytesNeeded(const ExchangeConfig& config) {
  size_t next = 0;
  Plan(config, [&](size_t bytes, size_t align) -> absl::StatusOr<size_t> {
    const size_t offset = (next + align - 1) / align * align;
    next = offset + bytes;
    return offset;
  }).IgnoreError();
  return next;
}

std::string ExchangeRegions::Describe(const ExchangeConfig& c) {
  const int64_t cap = c.recv_capacity();
  return absl::StrCat("exchange: receive ", cap, " rows x ", c.dispatch_row_bytes(), " B (",
                      common::FlagName(c.dispatch_dtype), ") = ", cap * c.dispatch_row_bytes(),
                      " B, combine ", cap, " rows x ", c.combine_row_bytes(), " B (",
                      common::FlagName(c.combine_dtype), ") = ", cap * c.combine_row_bytes(),
                      " B, metadata ", cap * (1 + 3 * c.top_k) * 4, " B; overflow policy ",
                      OverflowPolicyName(c.overflow), "; ", BytesNeeded(c), " B per rank in all");
}

}  // namespace epserve::worker
