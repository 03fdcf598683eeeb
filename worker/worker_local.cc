// A worker's local run: a batch of which it is the only live worker (a one-worker job, or the
// last survivor) runs on its device alone, with the exchange's bits (Worker::RunLocal). The
// serve loop is in worker.cc, the device path in worker_device.cc.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/detail/timing.h"
#include "worker/worker.h"

namespace epserve::worker {
using detail::NanosSince;

bool Worker::RunsLocally(const BatchDescriptor& desc) const {
  const ExchangePlan& plan = regions_.plan;
  auto reproduced = [](common::ElementType t) {
    return t == common::ElementType::kFp32 || t == common::ElementType::kBf16;
  };
  return options_.local_pass && desc.live.Count() == 1 && desc.live.Has(me_) &&
         reproduced(plan.dispatch_dtype()) && reproduced(plan.combine_dtype()) &&
         desc.num_rows <= plan.recv_capacity();
}

absl::Status Worker::RunLocal(const Layer& layer, const ExpertPlacement& placement,
                              const BatchDescriptor& desc, float* y, ExchangeStats& stats) {
  const int64_t n = desc.num_rows;
  const int k = cfg_.top_k;
  const int num_local = layer.experts.num_experts;
  stats.rounds = 1;
  stats.expert_pairs.assign(num_local, 0);
  if (n == 0) return absl::OkStatus();

  // ---- the pair table (the `layout` stage): expert-major, tokens in order within an expert ----
  absl::Time t0 = absl::Now();
  local_of_expert_.assign(cfg_.num_experts, -1);
  for (int e = 0; e < placement.count(me_); ++e) local_of_expert_[placement.expert(me_, e)] = e;
  const int64_t pairs = n * k;
  for (int64_t i = 0; i < pairs; ++i) {
    const int32_t id = ids_host_[i];
    const int local = id >= 0 && id < cfg_.num_experts ? local_of_expert_[id] : -1;
    if (local < 0 || local >= num_local) {
      return absl::InternalError(absl::StrCat("token ", i / k, " routed to expert ", id,
                                              ", which this worker does not hold"));
    }
    ++stats.expert_pairs[local];
  }
  local_offsets_.assign(num_local + 1, 0);
  for (int e = 0; e < num_local; ++e) {
    local_offsets_[e + 1] = local_offsets_[e] + stats.expert_pairs[e];
  }
  std::vector<int64_t> next(local_offsets_.begin(), local_offsets_.end() - 1);
  local_pair_row_.resize(pairs);
  local_pair_of_choice_.resize(pairs);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t at = next[local_of_expert_[ids_host_[i]]]++;
    local_pair_row_[at] = static_cast<int32_t>(i / k);
    local_pair_of_choice_[i] = static_cast<int32_t>(at);
  }
  // ids_ (read to the host by Route) now holds each choice's pair.
  EPSERVE_RETURN_IF_ERROR(
      rt_->Write(row_index_, 0, local_pair_row_.data(), pairs * sizeof(int32_t)));
  EPSERVE_RETURN_IF_ERROR(
      rt_->Write(ids_, 0, local_pair_of_choice_.data(), pairs * sizeof(int32_t)));
  stats.layout_ns = NanosSince(t0);

  // ---- the rows as the dispatch payload would deliver them (the `dispatch` stage) ----
  EPSERVE_ASSIGN_OR_RETURN(const kernels::Buffer* rows, LocalRows(n, stats));
  const kernels::Buffer& x = *rows;

  // ---- the experts and the shared expert ----
  t0 = absl::Now();
  EPSERVE_RETURN_IF_ERROR(
      kernels::ExpertFfn(*rt_, layer.experts, x, row_index_, local_offsets_, h_, y_));
  EPSERVE_ASSIGN_OR_RETURN(const kernels::SumStart start, LocalSharedExpert(layer, x, n));
  EPSERVE_RETURN_IF_ERROR(rt_->Finish());
  stats.expert_ns = NanosSince(t0);

  // ---- the owner's sum, on the device, and the output rows down once ----
  t0 = absl::Now();
  EPSERVE_RETURN_IF_ERROR(LocalSum(ids_, start, desc, y));
  stats.combine_ns = NanosSince(t0);
  return absl::OkStatus();
}

absl::StatusOr<const kernels::Buffer*> Worker::LocalRows(int64_t n, ExchangeStats& stats) {
  const absl::Time t0 = absl::Now();
  const bool bf16_rows = regions_.plan.dispatch_dtype() == common::ElementType::kBf16;
  if (bf16_rows) {
    EPSERVE_RETURN_IF_ERROR(kernels::RoundToBf16(*rt_, x_local_, n * cfg_.hidden_size, x_recv_));
  }
  stats.rows_received = n;
  stats.pairs = n * cfg_.top_k;
  stats.dispatch_ns = NanosSince(t0);
  return bf16_rows ? &x_recv_ : &x_local_;
}

absl::StatusOr<kernels::SumStart> Worker::LocalSharedExpert(const Layer& layer,
                                                            const kernels::Buffer& x, int64_t n) {
  if (layer.shared.num_experts == 0) return kernels::SumStart::kZero;
  // The whole shared expert on the unrounded rows (the owner's own), or its one slice on the
  // rows as received (split), as the exchange runs them.
  const bool split = regions_.plan.shared_expert_split();
  EPSERVE_RETURN_IF_ERROR(
      kernels::SharedExpertFfn(*rt_, layer.shared, split ? x : x_local_, n, shared_h_, shared_y_));
  return split ? kernels::SumStart::kAsPart : kernels::SumStart::kOnto;
}

absl::Status Worker::LocalSum(const kernels::Buffer& pair_of_choice, kernels::SumStart start,
                              const BatchDescriptor& desc, float* y) {
  EPSERVE_RETURN_IF_ERROR(kernels::SumPairRows(
      *rt_, y_, pair_of_choice, weights_, desc.num_rows, cfg_.top_k, cfg_.hidden_size, &shared_y_,
      start, regions_.plan.combine_dtype() == common::ElementType::kBf16, shared_y_));
  return DeliverRows(desc, shared_y_, y);
}

bool Worker::GroupsOnDevice(const Layer& layer, int64_t n) const {
  return !rt_->device_info().is_cpu && layer.experts.tensor_cores &&
         n * cfg_.top_k <= kernels::kDeviceGroupingMaxPairs;
}

absl::Status Worker::PrepareDeviceGrouping(const ExpertPlacement& placement,
                                           const kernels::ExpertWeights& experts) {
  local_of_expert_.assign(cfg_.num_experts, -1);
  for (int e = 0; e < placement.count(me_); ++e) local_of_expert_[placement.expert(me_, e)] = e;
  if (local_of_expert_ != local_of_uploaded_) {
    if (local_of_device_.bytes() == 0) {
      EPSERVE_ASSIGN_OR_RETURN(local_of_device_,
                               rt_->Allocate(local_of_expert_.size() * sizeof(int32_t)));
    }
    EPSERVE_RETURN_IF_ERROR(rt_->Write(local_of_device_, 0, local_of_expert_.data(),
                                       local_of_expert_.size() * sizeof(int32_t)));
    local_of_uploaded_ = local_of_expert_;
  }
  if (pair_groups_.num_experts != experts.num_experts) {
    pair_groups_ = kernels::PairGroups();  // the old one's memory first
    const int64_t most = std::min<int64_t>(regions_.plan.max_rows_per_worker() * cfg_.top_k,
                                           kernels::kDeviceGroupingMaxPairs);
    EPSERVE_ASSIGN_OR_RETURN(pair_groups_, kernels::AllocatePairGroups(*rt_, experts, most));
  }
  return absl::OkStatus();
}

absl::Status Worker::RunLocalOnDevice(const Layer& layer, const ExpertPlacement& placement,
                                      const BatchDescriptor& desc, float* y, ExchangeStats& stats) {
  const int64_t n = desc.num_rows;
  const int k = cfg_.top_k;
  stats.rounds = 1;
  stats.expert_pairs.assign(layer.experts.num_experts, 0);
  if (n == 0) return absl::OkStatus();

  EPSERVE_ASSIGN_OR_RETURN(const kernels::Buffer* rows, LocalRows(n, stats));
  const kernels::Buffer& x = *rows;
  absl::Time t0 = absl::Now();
  EPSERVE_RETURN_IF_ERROR(PrepareDeviceGrouping(placement, layer.experts));
  EPSERVE_RETURN_IF_ERROR(kernels::GroupPairs(*rt_, layer.experts, ids_, n, k, local_of_device_,
                                              cfg_.num_experts, pair_groups_));
  stats.layout_ns = NanosSince(t0);

  // The shared expert needs nothing of the routing: it runs beside the routed experts
  // (Runtime::ForkQueue), forked after the grouping so that group_pairs, one work-group, has
  // the device to itself (docs/ARCHITECTURE.md), and the sum waits for it.
  t0 = absl::Now();
  kernels::SumStart start = kernels::SumStart::kZero;
  EPSERVE_RETURN_IF_ERROR(rt_->Forked([&]() -> absl::Status {
    EPSERVE_ASSIGN_OR_RETURN(start, LocalSharedExpert(layer, x, n));
    return absl::OkStatus();
  }));
  EPSERVE_RETURN_IF_ERROR(kernels::ExpertFfnGrouped(*rt_, layer.experts, x, pair_groups_, h_, y_));
  // The routing and the pairs' counts come back with the output: one wait for all three.
  const size_t routing_bytes = static_cast<size_t>(n * k) * sizeof(int32_t);
  EPSERVE_RETURN_IF_ERROR(rt_->ReadAsync(ids_, 0, ids_host_.data(), routing_bytes));
  EPSERVE_RETURN_IF_ERROR(rt_->ReadAsync(weights_, 0, weights_host_.data(), routing_bytes));
  EPSERVE_RETURN_IF_ERROR(kernels::QueuePairCountsRead(*rt_, pair_groups_, pair_counts_host_));
  stats.expert_ns = NanosSince(t0);

  t0 = absl::Now();
  EPSERVE_RETURN_IF_ERROR(rt_->JoinFork());
  EPSERVE_RETURN_IF_ERROR(LocalSum(pair_groups_.pair_of_choice, start, desc, y));
  EPSERVE_RETURN_IF_ERROR(rt_->Finish());  // (the output's delivery waited already, mostly)
  EPSERVE_ASSIGN_OR_RETURN(stats.expert_pairs,
                           kernels::PairCountsOf(pair_groups_, pair_counts_host_));
  EPSERVE_RETURN_IF_ERROR(PutRouting(desc));
  stats.combine_ns = NanosSince(t0);
  return absl::OkStatus();
}

}  // namespace epserve::worker
