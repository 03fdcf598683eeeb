#include "kernels/moe_kernels.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/detail/ffn_mma.h"
#include "kernels/detail/launch.h"

namespace epserve::kernels {
namespace {

using detail::Launch;
using detail::LaunchBounded;
using detail::NeedBytes;
using detail::NeedIntRange;
using detail::RowsInBuffer;
using detail::SetArgs;

// Work tiles on the device: groups[g] = (local expert, first row, end row, 0), covering the
// rows of every non-empty expert in chunks of at most `chunk` rows. One expert's (a shared
// expert's, whose tiles follow from its row count) are kept by the runtime (KeptTable); others
// are made for the call.
struct WorkTiles {
  Buffer made;
  const Buffer* kept = nullptr;
  int num_groups = 0;
  int short_groups = 0;  // with short_first: the leading groups of fewer than `chunk` rows
  const Buffer& groups() const { return kept != nullptr ? *kept : made; }
};
absl::StatusOr<WorkTiles> UploadGroups(Runtime& rt, std::span<const int64_t> offsets, int64_t chunk,
                                       bool short_first = false, bool tails_with_full = false) {
  std::vector<cl_int4> groups;
  auto add = [&groups](size_t e, int64_t begin, int64_t end, int w) {
    groups.push_back(
        cl_int4{{static_cast<cl_int>(e), static_cast<cl_int>(begin), static_cast<cl_int>(end), w}});
  };
  // As group_pairs (router.cl) orders them where short_first.
  auto follows = [&](int64_t count) { return tails_with_full && count > chunk; };
  WorkTiles tiles;
  if (short_first) {
    for (size_t e = 0; e + 1 < offsets.size(); ++e) {
      const int64_t count = offsets[e + 1] - offsets[e];
      if (count % chunk != 0 && !follows(count)) {
        add(e, offsets[e + 1] - count % chunk, offsets[e + 1], 0);
      }
    }
    tiles.short_groups = static_cast<int>(groups.size());
  }
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t count = offsets[e + 1] - offsets[e];
    const int64_t end = short_first ? offsets[e + 1] - count % chunk : offsets[e + 1];
    for (int64_t begin = offsets[e]; begin < end; begin += chunk) {
      add(e, begin, std::min(begin + chunk, end), 0);
    }
    if (short_first && count % chunk != 0 && follows(count)) add(e, end, offsets[e + 1], 1);
  }
  tiles.num_groups = static_cast<int>(groups.size());
  if (offsets.size() == 2) {
    const std::string_view bytes(reinterpret_cast<const char*>(groups.data()),
                                 groups.size() * sizeof(cl_int4));
    EPSERVE_ASSIGN_OR_RETURN(tiles.kept, rt.KeptTable(bytes));
    return tiles;
  }
  EPSERVE_ASSIGN_OR_RETURN(tiles.made,
                           rt.AllocateCopy(groups.data(), groups.size() * sizeof(cl_int4)));
  return tiles;
}

// gate_up then down over the expert-major rows of `offsets` through the FMA blocking `form`,
// in tiles of at most form.row_chunk rows of one expert: x FP32 rows x_stride values apart,
// row p reading x[row_index[p]] (gather) or x[p].
absl::Status RunFfn(Runtime& rt, const ExpertWeights& w, const FfnBlocking& form, const Buffer& x,
                    int64_t x_stride, const Buffer& row_index, bool gather,
                    std::span<const int64_t> offsets, Buffer& h_scratch, Buffer& y) {
  EPSERVE_ASSIGN_OR_RETURN(const WorkTiles tiles, UploadGroups(rt, offsets, form.row_chunk));
  const int num_groups = tiles.num_groups;
  if (num_groups == 0) return absl::OkStatus();
  const Buffer& groups = tiles.groups();
  const char* w_name = w.dtype == common::ElementType::kBf16 ? "_wbf16" : "_wf32";
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel gate_up,
                           rt.FfnKernel(absl::StrCat("ffn_gate_up", w_name), form));
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel down, rt.FfnKernel(absl::StrCat("ffn_down", w_name), form));
  const cl_int hidden = static_cast<cl_int>(w.hidden);
  const cl_int ffn = static_cast<cl_int>(w.ffn);
  const int64_t pw = form.panel_cols();
  const cl_int gu_panels = static_cast<cl_int>(detail::GateUpPanels(w.ffn, pw));
  const cl_int down_panels = static_cast<cl_int>(detail::DownPanels(w.hidden, pw));
  const cl_long x_rows = RowsInBuffer(x, sizeof(float), w.hidden, x_stride);
  const size_t local[2] = {1, 1};
  EPSERVE_RETURN_IF_ERROR(SetArgs(gate_up, x, x_rows, cl_long{x_stride}, row_index,
                                  cl_int{gather ? 1 : 0}, groups, w.gate_up, hidden, ffn, gu_panels,
                                  h_scratch));
  const size_t gu_global[2] = {static_cast<size_t>(gu_panels), static_cast<size_t>(num_groups)};
  EPSERVE_RETURN_IF_ERROR(Launch(rt, gate_up, 2, gu_global, local));
  EPSERVE_RETURN_IF_ERROR(SetArgs(down, h_scratch, groups, w.down, hidden, ffn, down_panels, y));
  const size_t down_global[2] = {static_cast<size_t>(down_panels), static_cast<size_t>(num_groups)};
  return Launch(rt, down, 2, down_global, local);
}

// out[p, :] = x[row_index[p], :] widened to FP32 for p < rows; x BF16 rows `stride` apart.
absl::Status GatherBf16Rows(Runtime& rt, const Buffer& x, int64_t hidden, int64_t stride,
                            const Buffer& row_index, int64_t rows, Buffer& out) {
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("gather_bf16_rows"));
  const cl_long x_rows = RowsInBuffer(x, sizeof(uint16_t), hidden, stride);
  EPSERVE_RETURN_IF_ERROR(SetArgs(kernel, x, x_rows, cl_long{stride}, row_index,
                                  static_cast<cl_int>(rows), static_cast<cl_int>(hidden), out));
  const size_t global[1] = {static_cast<size_t>(rows)};
  return LaunchBounded(rt, kernel, 1, global, detail::kCpuRowsPerGroup);
}

// What the FFNs with BF16 activations (tensor cores, dot products) do before their GEMMs:
// checks that y and h_scratch hold the BF16 rows (x_values and h_values per row), uploads the
// work tiles (at most `chunk` rows of one expert each), and launches `gather_kernel` (the
// arguments of gather_rows_to_bf16) over `gather_global` to write the rows of x (FP32 or
// BF16 as x_format says, through row_index when `gather`) into y as zero-padded BF16 rows of
// x_values values; with no gather_kernel, neither (the FFN's first kernel reads x itself).
// num_groups == 0: there is nothing to run.
absl::StatusOr<WorkTiles> StageBf16Rows(Runtime& rt, const ExpertWeights& w, const Buffer& x,
                                        RowFormat x_format, const Buffer& row_index, bool gather,
                                        std::span<const int64_t> offsets, int64_t chunk,
                                        int64_t x_values, int64_t h_values,
                                        const char* gather_kernel,
                                        std::span<const size_t> gather_global, Buffer& h_scratch,
                                        Buffer& y) {
  const int64_t rows = offsets.back();
  if (gather_kernel != nullptr) {
    EPSERVE_RETURN_IF_ERROR(
        NeedBytes(y, rows * x_values * sizeof(uint16_t), "y (BF16 activations)"));
  }
  EPSERVE_RETURN_IF_ERROR(
      NeedBytes(h_scratch, rows * h_values * sizeof(uint16_t), "h_scratch (BF16 h)"));
  EPSERVE_ASSIGN_OR_RETURN(WorkTiles tiles, UploadGroups(rt, offsets, chunk));
  if (tiles.num_groups == 0 || gather_kernel == nullptr) return tiles;
  EPSERVE_RETURN_IF_ERROR(detail::GatherBf16Activations(rt, gather_kernel, w.hidden, x, x_format,
                                                        row_index, gather, rows, x_values,
                                                        gather_global, y));
  return tiles;
}

// The tensor-core FFN over `rows` rows: x (FP32 or BF16 as x_format says, rows x_stride
// apart, gathered through row_index when `gather`) -> BF16 activations in y -> BF16 h in
// h_scratch -> FP32 y. Tiles of kMmaBm rows of one expert.
absl::Status RunFfnMma(Runtime& rt, const ExpertWeights& w, const Buffer& x, RowFormat x_format,
                       const Buffer& row_index, bool gather, std::span<const int64_t> offsets,
                       Buffer& h_scratch, Buffer& y) {
  const bool tails_with_full = detail::ShortTilesWithFullOnes(rt, w);
  EPSERVE_ASSIGN_OR_RETURN(
      const WorkTiles tiles,
      UploadGroups(rt, offsets, detail::kMmaBm, /*short_first=*/true, tails_with_full));
  // Which forms have tiles: an expert's tiles of 128 rows, and its last (or only) one.
  detail::MmaForms forms{.large = false, .decode = false, .wide = false};
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t count = offsets[e + 1] - offsets[e];
    if (count == 0) continue;
    const detail::MmaForms last =
        tails_with_full && count > detail::kMmaBm
            ? detail::MmaForms{.large = true, .decode = false, .wide = false}
            : detail::FormOfTile(rt, (count - 1) % detail::kMmaBm + 1);
    forms.large = forms.large || last.large || count > detail::kMmaBm;
    forms.decode = forms.decode || last.decode;
    forms.wide = forms.wide || last.wide;
  }
  return detail::LaunchFfnMma(rt, w, x, x_format, row_index, gather, offsets.back(), tiles.groups(),
                              tiles.num_groups, tiles.short_groups, forms, h_scratch, y);
}

// The pair-panel FFN through form `form` (its DotOp) over `rows` rows: x (FP32 or BF16 as
// x_format says, rows x_stride apart, gathered through row_index when `gather`) -> BF16
// activations in y -> BF16 h in h_scratch -> FP32 y. Tiles of kDotRowChunk rows of one
// expert; a direct form (no expert of more than kDotDirectRows rows) has gate_up read x itself
// (ffn_gate_up_x_dot) and saves the gather launch, the larger share of a few-row call on a
// many-core CPU.
absl::Status RunFfnDot(Runtime& rt, const ExpertWeights& w, const FfnBlocking& form,
                       const Buffer& x, RowFormat x_format, const Buffer& row_index, bool gather,
                       std::span<const int64_t> offsets, Buffer& h_scratch, Buffer& y) {
  const int64_t kp_hidden = detail::DotKPairs(w.hidden);
  const int64_t kp_ffn = detail::DotKPairs(w.ffn);
  const cl_int gu_panels = static_cast<cl_int>(detail::GateUpPanels(w.ffn, detail::kDotPanelCols));
  const cl_int down_panels =
      static_cast<cl_int>(detail::DownPanels(w.hidden, detail::kDotPanelCols));
  const bool direct = form.direct;
  const size_t gather_global[1] = {static_cast<size_t>(offsets.back())};
  EPSERVE_ASSIGN_OR_RETURN(
      const WorkTiles tiles,
      StageBf16Rows(rt, w, x, x_format, row_index, gather, offsets, detail::kDotRowChunk,
                    2 * kp_hidden, 2 * kp_ffn, direct ? nullptr : "gather_rows_to_bf16_pairs",
                    gather_global, h_scratch, y));
  if (tiles.num_groups == 0) return absl::OkStatus();
  cl_kernel gate_up = nullptr;
  if (direct) {
    EPSERVE_ASSIGN_OR_RETURN(gate_up, rt.FfnKernel("ffn_gate_up_x_dot", form));
    const bool x_bf16 = x_format.dtype == common::ElementType::kBf16;
    const cl_long x_rows =
        RowsInBuffer(x, common::ElementBytes(x_format.dtype), w.hidden, x_format.row_stride);
    EPSERVE_RETURN_IF_ERROR(SetArgs(
        gate_up, x, cl_int{x_bf16 ? 1 : 0}, x_rows, cl_long{x_format.row_stride}, row_index,
        cl_int{gather ? 1 : 0}, static_cast<cl_int>(w.hidden), static_cast<cl_int>(kp_hidden),
        tiles.groups(), w.gate_up, gu_panels, h_scratch, static_cast<cl_int>(kp_ffn)));
  } else {
    EPSERVE_ASSIGN_OR_RETURN(gate_up, rt.FfnKernel("ffn_gate_up_dot", form));
    EPSERVE_RETURN_IF_ERROR(SetArgs(gate_up, y, static_cast<cl_int>(kp_hidden), tiles.groups(),
                                    w.gate_up, gu_panels, h_scratch, static_cast<cl_int>(kp_ffn)));
  }
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel down, rt.FfnKernel("ffn_down_dot", form));
  const size_t local[2] = {1, 1};
  const size_t gu_global[2] = {static_cast<size_t>(gu_panels),
                               static_cast<size_t>(tiles.num_groups)};
  EPSERVE_RETURN_IF_ERROR(Launch(rt, gate_up, 2, gu_global, local));
  EPSERVE_RETURN_IF_ERROR(SetArgs(down, h_scratch, static_cast<cl_int>(kp_ffn), tiles.groups(),
                                  w.down, static_cast<cl_int>(w.hidden), down_panels, y));
  const size_t down_global[2] = {static_cast<size_t>(down_panels),
                                 static_cast<size_t>(tiles.num_groups)};
  return Launch(rt, down, 2, down_global, local);
}
}  // namespace

absl::Status Route(Runtime& rt, const RouterWeights& w, const Buffer& x, int64_t n, Buffer& ids,
                   Buffer& weights) {
  const model::MoeLayerConfig& c = w.cfg;
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(n, "n"));
  if (n == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(x, n * c.hidden_size * sizeof(float), "x"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(ids, n * c.top_k * sizeof(int32_t), "ids"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(weights, n * c.top_k * sizeof(float), "weights"));
  // CPUs: one work-item per block of tokens.
  if (!rt.work_group_forms()) {
    EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("route_tokens"));
    EPSERVE_RETURN_IF_ERROR(
        SetArgs(kernel, x, w.router, w.bias, static_cast<cl_int>(n),
                static_cast<cl_int>(c.hidden_size), cl_int{c.num_experts}, cl_int{c.top_k},
                static_cast<cl_int>(c.routing), cl_int{c.norm_topk_prob ? 1 : 0}, cl_int{c.n_group},
                cl_int{c.topk_group}, cl_float{c.routed_scaling_factor}, ids, weights));
    const size_t global[1] = {static_cast<size_t>(detail::CeilDiv(n, detail::kRouterTokens))};
    const size_t local[1] = {1};
    return Launch(rt, kernel, 1, global, local);
  }
  // Other devices (RuntimeOptions::work_group_forms): the logits over work-groups of (experts,
  // tokens), then the selection.
  EPSERVE_ASSIGN_OR_RETURN(Buffer * logit_sums,
                           rt.Scratch(Runtime::kRouterLogitsScratch,
                                      static_cast<size_t>(n * c.num_experts) * sizeof(float)));
  // Large batches of a router of several expert groups: tiles of 32 tokens x 64 experts, where
  // there are enough of them for half the device's compute units; else work-groups of 8 x 8,
  // which spread a few tokens over many compute units.
  const int64_t token_tiles = detail::CeilDiv(n, detail::kRouterTileTokens);
  const bool tiled = c.num_experts > detail::kRouterLogitExperts &&
                     2 * token_tiles >= static_cast<int64_t>(rt.device_info().compute_units);
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel logits,
                           rt.Kernel(tiled ? "route_logits_tiled" : "route_logits_wg"));
  EPSERVE_RETURN_IF_ERROR(SetArgs(logits, x, w.router, static_cast<cl_int>(n),
                                  static_cast<cl_int>(c.hidden_size), cl_int{c.num_experts},
                                  *logit_sums));
  const size_t local[2] = {
      static_cast<size_t>(tiled ? detail::kRouterTileGroupSize : detail::kRouterGroupSize), 1};
  const size_t global[2] = {
      static_cast<size_t>(detail::CeilDiv(
          c.num_experts, tiled ? detail::kRouterTileExperts : detail::kRouterLogitExperts)) *
          local[0],
      static_cast<size_t>(tiled ? token_tiles : detail::CeilDiv(n, detail::kRouterGroupTokens))};
  EPSERVE_RETURN_IF_ERROR(Launch(rt, logits, 2, global, local));
  if (c.routing == model::RoutingKind::kSoftmaxTopK && c.n_group <= 1) {
    // A work-group per token (the same bits as route_select).
    EPSERVE_ASSIGN_OR_RETURN(cl_kernel select, rt.Kernel("route_select_softmax_wg"));
    EPSERVE_RETURN_IF_ERROR(
        SetArgs(select, *logit_sums, static_cast<cl_int>(n), cl_int{c.num_experts}, cl_int{c.top_k},
                cl_int{c.norm_topk_prob ? 1 : 0}, cl_float{c.routed_scaling_factor}, ids, weights));
    const size_t select_local[1] = {static_cast<size_t>(detail::kRouterSelectGroupSize)};
    const size_t select_global[1] = {static_cast<size_t>(n) * select_local[0]};
    return Launch(rt, select, 1, select_global, select_local);
  }
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel select, rt.Kernel("route_select"));
  EPSERVE_RETURN_IF_ERROR(SetArgs(
      select, *logit_sums, w.bias, static_cast<cl_int>(n), cl_int{c.num_experts}, cl_int{c.top_k},
      static_cast<cl_int>(c.routing), cl_int{c.norm_topk_prob ? 1 : 0}, cl_int{c.n_group},
      cl_int{c.topk_group}, cl_float{c.routed_scaling_factor}, ids, weights));
  const size_t select_global[1] = {static_cast<size_t>(n)};
  return LaunchBounded(rt, select, 1, select_global, detail::kCpuRowsPerGroup);
}

std::vector<int64_t> ExpertFfnWarmUpRows(const ExpertWeights& w) {
  std::vector<int64_t> rows = {1};
  if (w.tensor_cores) return rows;
  for (int c = 1; c < kFfnRowClasses; ++c) {
    bool seen = false;
    for (int d = 0; d < c; ++d) seen = seen || w.plan.forms[d] == w.plan.forms[c];
    if (!seen) rows.push_back(FfnRowClassFirst(c));
  }
  return rows;
}

namespace detail {

absl::Status CheckRowFormat(const ExpertWeights& w, RowFormat& x_format) {
  EPSERVE_RETURN_IF_ERROR(CheckKernelType(x_format.dtype, "x's element type"));
  if (x_format.row_stride == 0) x_format.row_stride = w.hidden;
  if (x_format.row_stride < w.hidden) {
    return absl::InvalidArgumentError(absl::StrCat("x row stride ", x_format.row_stride,
                                                   " is shorter than a row (", w.hidden, ")"));
  }
  return absl::OkStatus();
}

}  // namespace detail

namespace {

// ExpertFfn's checks of its arguments; the rows of the largest expert into *most_rows.
absl::Status CheckFfnCall(const ExpertWeights& w, const Buffer& x, const Buffer& row_index,
                          std::span<const int64_t> expert_offsets, const Buffer& h_scratch,
                          const Buffer& y, RowFormat& x_format, int64_t* most_rows) {
  EPSERVE_RETURN_IF_ERROR(detail::CheckRowFormat(w, x_format));
  if (expert_offsets.size() != static_cast<size_t>(w.num_experts) + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert_offsets has ", expert_offsets.size(),
                     " entries, needs num_experts + 1 = ", w.num_experts + 1));
  }
  if (expert_offsets[0] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert_offsets[0] must be 0, got ", expert_offsets[0]));
  }
  *most_rows = 0;
  for (size_t e = 0; e + 1 < expert_offsets.size(); ++e) {
    if (expert_offsets[e + 1] < expert_offsets[e]) {
      return absl::InvalidArgumentError(absl::StrCat("expert_offsets must ascend; entry ", e + 1,
                                                     " = ", expert_offsets[e + 1], " < ",
                                                     expert_offsets[e]));
    }
    *most_rows = std::max(*most_rows, expert_offsets[e + 1] - expert_offsets[e]);
  }
  const int64_t rows = expert_offsets.back();
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(rows, "expert_offsets.back()"));
  if (rows == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(x, w.hidden * common::ElementBytes(x_format.dtype), "x"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(row_index, rows * sizeof(int32_t), "row_index"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(h_scratch, rows * w.ffn * sizeof(float), "h_scratch"));
  return NeedBytes(y, rows * w.hidden * sizeof(float), "y");
}

// The FFN over checked arguments through `form` (ignored on tensor cores).
absl::Status RunFfnForm(Runtime& rt, const ExpertWeights& w, const FfnBlocking& form,
                        const Buffer& x, const Buffer& row_index,
                        std::span<const int64_t> expert_offsets, Buffer& h_scratch, Buffer& y,
                        RowFormat x_format) {
  const int64_t rows = expert_offsets.back();
  if (rows == 0) return absl::OkStatus();
  if (w.tensor_cores) {
    return RunFfnMma(rt, w, x, x_format, row_index, /*gather=*/true, expert_offsets, h_scratch, y);
  }
  if (form.dot) {
    return RunFfnDot(rt, w, form, x, x_format, row_index, /*gather=*/true, expert_offsets,
                     h_scratch, y);
  }
  if (x_format.dtype == common::ElementType::kBf16) {
    // Widened and gathered into y, which gate_up reads before down overwrites it.
    EPSERVE_RETURN_IF_ERROR(
        GatherBf16Rows(rt, x, w.hidden, x_format.row_stride, row_index, rows, y));
    return RunFfn(rt, w, form, y, w.hidden, row_index, /*gather=*/false, expert_offsets, h_scratch,
                  y);
  }
  return RunFfn(rt, w, form, x, x_format.row_stride, row_index, /*gather=*/true, expert_offsets,
                h_scratch, y);
}

}  // namespace

absl::Status ExpertFfn(Runtime& rt, const ExpertWeights& w, const Buffer& x,
                       const Buffer& row_index, std::span<const int64_t> expert_offsets,
                       Buffer& h_scratch, Buffer& y, RowFormat x_format) {
  int64_t most_rows = 0;
  EPSERVE_RETURN_IF_ERROR(
      CheckFfnCall(w, x, row_index, expert_offsets, h_scratch, y, x_format, &most_rows));
  return RunFfnForm(rt, w, w.plan.For(most_rows), x, row_index, expert_offsets, h_scratch, y,
                    x_format);
}

absl::Status ExpertFfnAs(Runtime& rt, const ExpertWeights& w, const FfnBlocking& form,
                         const Buffer& x, const Buffer& row_index,
                         std::span<const int64_t> expert_offsets, Buffer& h_scratch, Buffer& y,
                         RowFormat x_format) {
  int64_t most_rows = 0;
  EPSERVE_RETURN_IF_ERROR(
      CheckFfnCall(w, x, row_index, expert_offsets, h_scratch, y, x_format, &most_rows));
  if (w.tensor_cores || !SameFfnLayout(form, w.blocking)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the FFN form ", form.ToString(), " does not read these weights' layout (",
                     w.tensor_cores ? "tensor cores" : w.blocking.ToString(), ")"));
  }
  if (!FfnFormServes(form, FfnRowClass(most_rows))) {
    return absl::InvalidArgumentError(absl::StrCat("the FFN form ", form.ToString(),
                                                   " serves at most ", detail::kDotDirectRows,
                                                   " rows per expert, not ", most_rows));
  }
  return RunFfnForm(rt, w, form, x, row_index, expert_offsets, h_scratch, y, x_format);
}

absl::Status SharedExpertFfn(Runtime& rt, const ExpertWeights& w, const Buffer& x, int64_t n,
                             Buffer& h_scratch, Buffer& y) {
  if (w.num_experts != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shared expert has num_experts == 1, got ", w.num_experts));
  }
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(n, "n"));
  if (n == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(x, n * w.hidden * sizeof(float), "x"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(h_scratch, n * w.ffn * sizeof(float), "h_scratch"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(y, n * w.hidden * sizeof(float), "y"));
  const int64_t offsets[2] = {0, n};
  const Buffer no_index;
  const RowFormat x_format = {common::ElementType::kFp32, w.hidden};
  const FfnBlocking& form = w.plan.For(n);
  EPSERVE_RETURN_IF_ERROR(
      w.tensor_cores
          ? RunFfnMma(rt, w, x, x_format, no_index, /*gather=*/false, offsets, h_scratch, y)
      : form.dot
          ? RunFfnDot(rt, w, form, x, x_format, no_index, /*gather=*/false, offsets, h_scratch, y)
          : RunFfn(rt, w, form, x, w.hidden, no_index, /*gather=*/false, offsets, h_scratch, y));
  if (w.gate.mem() == nullptr) return absl::OkStatus();
  if (rt.work_group_forms()) {  // a work-group per row
    EPSERVE_ASSIGN_OR_RETURN(cl_kernel scale, rt.Kernel("scale_rows_by_sigmoid_gate_wg"));
    EPSERVE_RETURN_IF_ERROR(
        SetArgs(scale, x, w.gate, static_cast<cl_int>(n), static_cast<cl_long>(w.hidden), y));
    const size_t local[1] = {static_cast<size_t>(detail::kGateGroupSize)};
    const size_t global[1] = {static_cast<size_t>(n) * local[0]};
    return Launch(rt, scale, 1, global, local);
  }
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel scale, rt.Kernel("scale_rows_by_sigmoid_gate"));
  EPSERVE_RETURN_IF_ERROR(
      SetArgs(scale, x, w.gate, static_cast<cl_int>(n), static_cast<cl_long>(w.hidden), y));
  const size_t global[1] = {static_cast<size_t>(n)};
  return LaunchBounded(rt, scale, 1, global, detail::kCpuRowsPerGroup);
}

absl::Status WeightedCombine(Runtime& rt, const Buffer& y, const Buffer& pair_index,
                             const Buffer& pair_weight, int64_t n, int k, int64_t hidden,
                             Buffer& out) {
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(n, "n"));
  if (k < 1) return absl::InvalidArgumentError(absl::StrCat("k must be >= 1, got ", k));
  if (hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("hidden must be >= 1, got ", hidden));
  }
  if (n == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(pair_index, n * k * sizeof(int32_t), "pair_index"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(pair_weight, n * k * sizeof(float), "pair_weight"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(out, n * hidden * sizeof(float), "out"));
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("weighted_combine"));
  const cl_long y_rows = static_cast<cl_long>(y.bytes() / (hidden * sizeof(float)));
  EPSERVE_RETURN_IF_ERROR(SetArgs(kernel, y, y_rows, pair_index, pair_weight,
                                  static_cast<cl_int>(n), cl_int{k}, cl_long{hidden}, out));
  const size_t global[2] = {static_cast<size_t>(hidden), static_cast<size_t>(n)};
  return LaunchBounded(rt, kernel, 2, global, detail::kCpuCombineGroup);
}

absl::Status SumPairRows(Runtime& rt, const Buffer& y, const Buffer& pair_index,
                         const Buffer& pair_weight, int64_t n, int k, int64_t hidden,
                         const Buffer* base, SumStart start, bool round_bf16, Buffer& out,
                         int num_parts) {
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(n, "n"));
  if (k < 1) return absl::InvalidArgumentError(absl::StrCat("k must be >= 1, got ", k));
  if (hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("hidden must be >= 1, got ", hidden));
  }
  if (start != SumStart::kZero && base == nullptr) {
    return absl::InvalidArgumentError("SumPairRows: a start from base needs a base buffer");
  }
  if (num_parts < 1 || (num_parts > 1 && start != SumStart::kAsPart)) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_parts must be 1, or more with SumStart::kAsPart; got ", num_parts));
  }
  if (n == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(pair_index, n * k * sizeof(int32_t), "pair_index"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(pair_weight, n * k * sizeof(float), "pair_weight"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(out, n * hidden * sizeof(float), "out"));
  if (start != SumStart::kZero) {
    EPSERVE_RETURN_IF_ERROR(NeedBytes(*base, num_parts * n * hidden * sizeof(float), "base"));
  }
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("sum_pair_rows"));
  const Buffer none;
  const cl_long y_rows = static_cast<cl_long>(y.bytes() / (hidden * sizeof(float)));
  EPSERVE_RETURN_IF_ERROR(SetArgs(kernel, y, y_rows, pair_index, pair_weight,
                                  static_cast<cl_int>(n), cl_int{k}, cl_long{hidden},
                                  base != nullptr ? *base : none, static_cast<cl_int>(start),
                                  cl_int{num_parts}, cl_int{round_bf16 ? 1 : 0}, out));
  const size_t global[2] = {static_cast<size_t>(hidden), static_cast<size_t>(n)};
  return LaunchBounded(rt, kernel, 2, global, detail::kCpuCombineGroup);
}

absl::Status RoundToBf16(Runtime& rt, const Buffer& src, int64_t count, Buffer& dst) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("count must be >= 0, got ", count));
  if (count == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(src, count * sizeof(float), "src"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(dst, count * sizeof(float), "dst"));
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("round_to_bf16"));
  EPSERVE_RETURN_IF_ERROR(SetArgs(kernel, src, cl_long{count}, dst));
  const size_t global[1] = {static_cast<size_t>(count)};
  return LaunchBounded(rt, kernel, 1, global, detail::kCpuValuesPerGroup);
}

namespace {
// widen_to_fp32 / narrow_from_fp32's code for `type`, or why not.
absl::StatusOr<cl_int> RowTypeCode(common::ElementType type, int64_t src_at, int64_t dst_at,
                                   int64_t count) {
  if (src_at < 0 || dst_at < 0 || count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("row conversion: offsets ", src_at, " and ",
                                                   dst_at, ", count ", count, " (need >= 0)"));
  }
  switch (type) {
    case common::ElementType::kFp32:
      return 0;
    case common::ElementType::kBf16:
      return 1;
    case common::ElementType::kFp16:
      return 2;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "row conversion: element type ", common::FlagName(type), " is not FP32, BF16 or FP16"));
  }
}
}  // namespace

absl::Status WidenToFp32(Runtime& rt, const Buffer& src, int64_t src_at,
                         common::ElementType src_type, int64_t count, Buffer& dst, int64_t dst_at) {
  EPSERVE_ASSIGN_OR_RETURN(const cl_int type, RowTypeCode(src_type, src_at, dst_at, count));
  if (count == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(src, (src_at + count) * common::ElementBytes(src_type), "src"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(dst, (dst_at + count) * sizeof(float), "dst"));
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("widen_to_fp32"));
  EPSERVE_RETURN_IF_ERROR(
      SetArgs(kernel, src, cl_long{src_at}, type, cl_long{count}, dst, cl_long{dst_at}));
  const size_t global[1] = {static_cast<size_t>(count)};
  return LaunchBounded(rt, kernel, 1, global, detail::kCpuValuesPerGroup);
}

absl::Status NarrowFromFp32(Runtime& rt, const Buffer& src, int64_t src_at, int64_t count,
                            common::ElementType dst_type, Buffer& dst, int64_t dst_at) {
  EPSERVE_ASSIGN_OR_RETURN(const cl_int type, RowTypeCode(dst_type, src_at, dst_at, count));
  if (count == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(src, (src_at + count) * sizeof(float), "src"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(dst, (dst_at + count) * common::ElementBytes(dst_type), "dst"));
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("narrow_from_fp32"));
  EPSERVE_RETURN_IF_ERROR(
      SetArgs(kernel, src, cl_long{src_at}, cl_long{count}, type, dst, cl_long{dst_at}));
  const size_t global[1] = {static_cast<size_t>(count)};
  return LaunchBounded(rt, kernel, 1, global, detail::kCpuValuesPerGroup);
}

absl::Status AddInto(Runtime& rt, const Buffer& src, int64_t count, Buffer& dst) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat("count must be >= 0, got ", count));
  if (count == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedBytes(src, count * sizeof(float), "src"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(dst, count * sizeof(float), "dst"));
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("add_into"));
  EPSERVE_RETURN_IF_ERROR(SetArgs(kernel, src, cl_long{count}, dst));
  const size_t global[1] = {static_cast<size_t>(count)};
  return LaunchBounded(rt, kernel, 1, global, detail::kCpuValuesPerGroup);
}

}  // namespace epserve::kernels
