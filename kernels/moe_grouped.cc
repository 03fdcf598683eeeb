// The pairs of a batch grouped by expert on the device (group_pairs in router.cl) and the
// expert FFN run from that grouping: a layer's route, layout and FFN enqueued without a wait.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/detail/ffn_mma.h"
#include "kernels/detail/launch.h"
#include "kernels/moe_kernels.h"

namespace epserve::kernels {
namespace {

using detail::NeedBytes;
using detail::NeedIntRange;
using detail::SetArgs;

// The most work-items group_pairs runs in its one work-group (its GROUP_WG_MAX).
constexpr size_t kGroupWorkGroupMax = 1024;
// CPU devices: PoCL runs a work-group's items as loops; a few keep its barriers cheap.
constexpr size_t kGroupWorkGroupCpu = 16;

// The work-group of group_pairs on this device: a power of two the kernel can run.
absl::StatusOr<size_t> GroupWorkGroup(Runtime& rt, cl_kernel kernel) {
  if (rt.device_info().is_cpu) return kGroupWorkGroupCpu;
  size_t most = 0;
  CL_CHECK(clGetKernelWorkGroupInfo(kernel, rt.device(), CL_KERNEL_WORK_GROUP_SIZE, sizeof(most),
                                    &most, nullptr));
  size_t wg = 1;
  while (wg * 2 <= std::min(most, kGroupWorkGroupMax)) wg *= 2;
  return wg;
}

// Rows per work tile of w's FFN kernels.
int64_t TileRows(const ExpertWeights& w) { return w.tensor_cores ? detail::kMmaBm : 1; }

}  // namespace

int64_t MaxPairGroups(int64_t pairs, int num_experts, int64_t chunk) {
  // Each non-empty expert has at most one tile short of `chunk` rows.
  return pairs / chunk + std::min<int64_t>(num_experts, pairs);
}

absl::StatusOr<PairGroups> AllocatePairGroups(Runtime& rt, const ExpertWeights& w,
                                              int64_t max_pairs) {
  if (max_pairs < 1 || w.num_experts < 1 || w.num_experts > detail::kRouterMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat("AllocatePairGroups: max_pairs ", max_pairs,
                                                   " (need >= 1), local experts ", w.num_experts,
                                                   " (need 1 to ", detail::kRouterMaxExperts, ")"));
  }
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(max_pairs, "max_pairs"));
  PairGroups g;
  g.max_pairs = max_pairs;
  g.num_experts = w.num_experts;
  const size_t pairs = static_cast<size_t>(max_pairs);
  const size_t tiles = static_cast<size_t>(MaxPairGroups(max_pairs, w.num_experts, TileRows(w)));
  EPSERVE_ASSIGN_OR_RETURN(g.row_index, rt.Allocate(pairs * sizeof(cl_int)));
  EPSERVE_ASSIGN_OR_RETURN(g.pair_of_choice, rt.Allocate(pairs * sizeof(cl_int)));
  EPSERVE_ASSIGN_OR_RETURN(g.groups, rt.Allocate(tiles * sizeof(cl_int4)));
  EPSERVE_ASSIGN_OR_RETURN(g.counts,
                           rt.Allocate(static_cast<size_t>(w.num_experts + 1) * sizeof(cl_int)));
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("group_pairs"));
  EPSERVE_ASSIGN_OR_RETURN(g.work_group, GroupWorkGroup(rt, kernel));
  return g;
}

absl::Status GroupPairs(Runtime& rt, const ExpertWeights& w, const Buffer& ids, int64_t n, int k,
                        const Buffer& local_of, int num_global, PairGroups& g) {
  const int64_t pairs = n * k;
  if (n < 0 || k < 1 || pairs > g.max_pairs || w.num_experts != g.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GroupPairs: n ", n, ", k ", k, " (need n >= 0, k >= 1, n * k <= ", g.max_pairs,
        "); experts ", w.num_experts, " (the groups were made for ", g.num_experts, ")"));
  }
  EPSERVE_RETURN_IF_ERROR(NeedBytes(ids, pairs * sizeof(cl_int), "ids"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(local_of, num_global * sizeof(cl_int), "local_of"));
  g.pairs = pairs;
  g.tokens = n;
  g.num_groups = static_cast<int>(MaxPairGroups(pairs, w.num_experts, TileRows(w)));
  if (pairs == 0) return absl::OkStatus();
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("group_pairs"));
  const cl_int tails_with_full = detail::ShortTilesWithFullOnes(rt, w) ? 1 : 0;
  EPSERVE_RETURN_IF_ERROR(SetArgs(
      kernel, ids, static_cast<cl_int>(pairs), cl_int{k}, local_of, cl_int{num_global},
      cl_int{w.num_experts}, static_cast<cl_int>(TileRows(w)), cl_int{g.num_groups},
      tails_with_full, static_cast<cl_int>(n), g.row_index, g.pair_of_choice, g.groups, g.counts));
  const size_t global[1] = {g.work_group};
  const size_t local[1] = {g.work_group};
  return detail::Launch(rt, kernel, 1, global, local);
}

absl::StatusOr<std::vector<int64_t>> ReadPairCounts(Runtime& rt, const PairGroups& g) {
  std::vector<cl_int> counts(static_cast<size_t>(g.num_experts) + 1, 0);
  if (g.pairs > 0) {
    EPSERVE_RETURN_IF_ERROR(rt.Read(g.counts, 0, counts.data(), counts.size() * sizeof(cl_int)));
  }
  return PairCountsOf(g, counts.data());
}

absl::Status QueuePairCountsRead(Runtime& rt, const PairGroups& g, int32_t* counts) {
  const size_t n = static_cast<size_t>(g.num_experts) + 1;
  if (g.pairs == 0) {
    std::fill(counts, counts + n, 0);
    return absl::OkStatus();
  }
  return rt.ReadAsync(g.counts, 0, counts, n * sizeof(cl_int));
}

absl::StatusOr<std::vector<int64_t>> PairCountsOf(const PairGroups& g, const int32_t* counts) {
  const int32_t beyond = counts[g.num_experts];
  if (beyond != 0) {
    return absl::InternalError(
        absl::StrCat(beyond, " of ", g.pairs,
                     " routed pairs name an expert not held here, or one their token chose twice "
                     "(an expert with more pairs than the batch's ",
                     g.tokens, " tokens)"));
  }
  return std::vector<int64_t>(counts, counts + g.num_experts);
}

absl::Status ExpertFfnGrouped(Runtime& rt, const ExpertWeights& w, const Buffer& x,
                              const PairGroups& g, Buffer& h_scratch, Buffer& y,
                              RowFormat x_format) {
  if (w.num_experts != g.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ExpertFfnGrouped: ", w.num_experts, " experts, the groups were made for ", g.num_experts));
  }
  if (g.pairs == 0) return absl::OkStatus();
  if (!w.tensor_cores) {
    EPSERVE_ASSIGN_OR_RETURN(std::vector<int64_t> counts, ReadPairCounts(rt, g));
    std::vector<int64_t> offsets(counts.size() + 1, 0);
    for (size_t e = 0; e < counts.size(); ++e) offsets[e + 1] = offsets[e] + counts[e];
    return ExpertFfn(rt, w, x, g.row_index, offsets, h_scratch, y, x_format);
  }
  EPSERVE_RETURN_IF_ERROR(detail::CheckRowFormat(w, x_format));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(h_scratch, g.pairs * w.ffn * sizeof(float), "h_scratch"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(y, g.pairs * w.hidden * sizeof(float), "y"));
  // Tiles of any form may be there, but none larger than the batch's tokens (a token's choices
  // are distinct experts; group_pairs makes a batch where one is not fail); the short ones (one
  // at most per expert, and no more than the pairs) lead the list.
  const int short_groups = static_cast<int>(std::min<int64_t>(w.num_experts, g.pairs));
  return detail::LaunchFfnMma(rt, w, x, x_format, g.row_index, /*gather=*/true, g.pairs, g.groups,
                              g.num_groups, short_groups,
                              detail::FormsUpTo(rt, std::min(g.pairs, g.tokens)), h_scratch, y);
}

}  // namespace epserve::kernels
