// The exchange's options, plan and regions (worker/exchange_config.h).
#include "worker/exchange_config.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/placement.h"

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

absl::StatusOr<SharedExpertPlacement> ParseSharedExpertPlacement(absl::string_view name) {
  if (name == "split") return SharedExpertPlacement::kSplit;
  if (name == "owner") return SharedExpertPlacement::kOwner;
  return absl::InvalidArgumentError(
      absl::StrCat("--shared-expert must be owner or split, got '", name, "'"));
}

const char* SharedExpertPlacementName(SharedExpertPlacement placement) {
  return placement == SharedExpertPlacement::kSplit ? "split" : "owner";
}

absl::StatusOr<common::ElementType> ParseDispatchDtype(absl::string_view name) {
  return common::ParseFlagName(name, "--dispatch-dtype", kPayloadTypes);
}

absl::StatusOr<common::ElementType> ParseCombineDtype(absl::string_view name) {
  return common::ParseFlagName(name, "--combine-dtype", kCombineTypes);
}

absl::Status ExchangeOptions::Validate() const {
  EPSERVE_RETURN_IF_ERROR(
      common::CheckElementType(dispatch_dtype, "--dispatch-dtype", kPayloadTypes));
  EPSERVE_RETURN_IF_ERROR(
      common::CheckElementType(combine_dtype, "--combine-dtype", kCombineTypes));
  if (max_recv_tokens_per_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-recv-tokens-per-rank must be >= 0 (0: --max-batch-tokens), got ",
                     max_recv_tokens_per_rank));
  }
  if (exchange_timeout_ms < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--exchange-timeout-ms must be >= 1, got ", exchange_timeout_ms));
  }
  return absl::OkStatus();
}

absl::StatusOr<ExchangePlan> ExchangePlan::Make(const ExchangeShape& shape,
                                                const ExchangeOptions& options) {
  EPSERVE_RETURN_IF_ERROR(options.Validate());
  const ExchangeShape& s = shape;
  if (s.num_workers < 1 || s.num_workers > s.num_experts || s.num_workers > kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrCat("the exchange needs 1 <= workers (",
                                                   s.num_workers, ") <= experts (", s.num_experts,
                                                   ") and at most ", kMaxWorkers, " workers"));
  }
  if (s.top_k < 1 || s.top_k > s.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k ", s.top_k, " outside [1, ", s.num_experts, "]"));
  }
  const int most_redundant = s.num_experts * (s.num_workers - 1);
  if (s.redundant_experts < 0 || s.redundant_experts > most_redundant) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--redundant-experts must be in [0, experts x (workers - 1) = ", most_redundant,
        "] (a worker holds at most one copy of an expert), got ", s.redundant_experts));
  }
  if (s.hidden < 1 || s.max_batch_tokens < 1 || s.first_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad exchange shape: hidden ", s.hidden,
                                                   ", max_batch_tokens ", s.max_batch_tokens,
                                                   ", first_rank ", s.first_rank));
  }
  ExchangePlan plan;
  plan.shape_ = shape;
  plan.options_ = options;
  plan.shared_expert_split_ =
      options.shared_expert == SharedExpertPlacement::kSplit && shape.has_shared_expert;
  // Split rounds carry capacity / W tokens per sender.
  if (plan.overflow() == OverflowPolicy::kSplit && plan.recv_capacity() < s.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--recv-overflow=split needs --max-recv-tokens-per-rank >= the number of workers (",
        s.num_workers, "), got ", plan.recv_capacity()));
  }
  return plan;
}

int64_t ExchangePlan::recv_capacity() const {
  const int64_t per_rank = options_.max_recv_tokens_per_rank;
  return per_rank > 0 ? std::min(per_rank, shape_.max_batch_tokens) : shape_.max_batch_tokens;
}

absl::StatusOr<ExchangeRegions> ExchangeRegions::Make(const ExchangePlan& plan,
                                                      const Allocator& alloc) {
  ExchangeRegions r{};
  const size_t w = static_cast<size_t>(plan.shape().num_workers);
  const size_t cap = static_cast<size_t>(plan.recv_capacity());
  const size_t k = static_cast<size_t>(plan.shape().top_k);
  const size_t stride = 2 + static_cast<size_t>(plan.max_local_experts());
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
      {&r.recv_rows, cap * plan.dispatch_row_bytes(), 4096},
      {&r.recv_token, cap * sizeof(int32_t), 64},
      {&r.pair_row, cap * k * sizeof(int32_t), 64},
      {&r.pair_home, cap * k * sizeof(int32_t), 64},
      {&r.combine_rows, static_cast<size_t>(plan.combine_capacity()) * plan.combine_row_bytes(),
       4096},
  };
  for (const Item& item : items) {
    EPSERVE_ASSIGN_OR_RETURN(*item.offset, alloc(item.bytes, item.align));
  }
  return r;
}

size_t ExchangeRegions::BytesNeeded(const ExchangePlan& plan) {
  size_t next = 0;
  Make(plan, [&](size_t bytes, size_t align) -> absl::StatusOr<size_t> {
    const size_t offset = (next + align - 1) / align * align;
    next = offset + bytes;
    return offset;
  }).IgnoreError();
  return next;
}

std::string ExchangeRegions::Describe(const ExchangePlan& plan) {
  const int64_t cap = plan.recv_capacity();
  const int64_t combine = plan.combine_capacity();
  const size_t dispatch_row = plan.dispatch_row_bytes();
  const size_t combine_row = plan.combine_row_bytes();
  return absl::StrCat("exchange: receive ", cap, " rows x ", dispatch_row, " B (",
                      common::FlagName(plan.dispatch_dtype()), ") = ", cap * dispatch_row,
                      " B, combine ", combine, " rows x ", combine_row, " B (",
                      common::FlagName(plan.combine_dtype()), ") = ", combine * combine_row,
                      " B, metadata ", cap * (1 + plan.shape().top_k) * 4, " B; overflow policy ",
                      OverflowPolicyName(plan.overflow()), "; ", BytesNeeded(plan),
                      " B per rank in all");
}

}  // namespace epserve::worker
