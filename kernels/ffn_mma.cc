// The tensor-core FFN's launches over work tiles already on the device (kernels/detail/ffn_mma.h):
// the 128-row tiles and the decode form, each K split into parts where a launch has few tiles.
#include "kernels/detail/ffn_mma.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/detail/launch.h"
#include "kernels/dtype.h"

namespace epserve::kernels {

namespace detail {

namespace {

// Parts of K (k_pad values) for a tensor-core launch of `tiles` work-groups: enough that about
// two work-groups per multiprocessor stream the weights, each part at least 4 slices of kMmaBk;
// 1 where the launch has that many tiles already.
int KSplits(const Runtime& rt, int64_t tiles, int64_t k_pad) {
  const int64_t want = 2 * static_cast<int64_t>(rt.device_info().compute_units);
  if (tiles >= want) return 1;
  const int64_t slices = k_pad / kMmaBk;
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(kMmaMaxKSplits, slices / 4));
  const int64_t parts = std::min(most, CeilDiv(want, std::max<int64_t>(tiles, 1)));
  // Parts of equal slices: the last one is not empty.
  return static_cast<int>(CeilDiv(slices, CeilDiv(slices, parts)));
}

// The kernels of one GEMM in each form (MmaForms), which take the same arguments.
struct MmaKernels {
  const char* large;
  const char* decode;
  const char* wide;
};
constexpr MmaKernels kGateUp = {"ffn_mma_gate_up", "ffn_dec_gate_up", "ffn_dec_gate_up_wide"};
constexpr MmaKernels kDown = {"ffn_mma_down", "ffn_dec_down", "ffn_dec_down_wide"};
constexpr MmaKernels kPartial = {"ffn_mma_partial", "ffn_dec_partial", "ffn_dec_partial_wide"};

// Launches each form's kernel of `kernels` that `forms` says tiles may need (each skips the
// others' tiles) over the global size `global` (3 dimensions; dimension 1 the groups), the
// decode forms over the first `short_groups` groups only (the groups short of kMmaBm rows lead
// the list): at prefill sizes most tiles are full, and a launch of work-groups that all return
// at once still takes 0.17-0.26 ms for mixtral-8x7b's 224 x 72 tiles on an H200.
template <typename... Args>
absl::Status LaunchTiles(Runtime& rt, MmaForms forms, const MmaKernels& kernels,
                         const size_t* global, int short_groups, const Args&... args) {
  const size_t local[3] = {static_cast<size_t>(kMmaThreads), 1, 1};
  const size_t short_global[3] = {
      global[0], std::min(global[1], static_cast<size_t>(std::max(short_groups, 0))), global[2]};
  for (const auto& [name, wanted, size] : {std::tuple{kernels.large, forms.large, global},
                                           std::tuple{kernels.decode, forms.decode, short_global},
                                           std::tuple{kernels.wide, forms.wide, short_global}}) {
    if (!wanted || size[1] == 0) continue;
    EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel(name));
    EPSERVE_RETURN_IF_ERROR(SetArgs(kernel, args...));
    EPSERVE_RETURN_IF_ERROR(Launch(rt, kernel, 3, size, local));
  }
  return absl::OkStatus();
}

// One GEMM of the tensor-core FFN in `splits` parts of K: ffn_mma_partial (ffn_dec_partial for
// the decode form's tiles) writes each part's products of a [rows, k_pad] (BF16, slice-major as
// gather_rows_to_bf16 and the gate_up kernels lay it out: expert_ffn_mma.cl's ActChunk) and the
// n_rows weight rows of w into FP32 partial sums, then `reduce` (ffn_reduce_gate_up: h, BF16;
// ffn_reduce_down: y, FP32 columns < out_cols) adds the parts in order and finishes as the
// unsplit kernels do.
absl::Status LaunchSplitK(Runtime& rt, MmaForms forms, const Buffer& a, const Buffer& groups,
                          int num_groups, int short_groups, const Buffer& w, int64_t n_rows,
                          int64_t k_pad, int splits, int64_t rows, const char* reduce,
                          int64_t out_cols, Buffer& out) {
  const int64_t slices = k_pad / kMmaBk;
  const int64_t per_split = CeilDiv(slices, splits);
  EPSERVE_ASSIGN_OR_RETURN(Buffer * partial,
                           rt.Scratch(Runtime::kSplitKScratch,
                                      static_cast<size_t>(splits * rows * n_rows) * sizeof(float)));
  const size_t global[3] = {static_cast<size_t>(n_rows / kMmaBn * kMmaThreads),
                            static_cast<size_t>(num_groups), static_cast<size_t>(splits)};
  EPSERVE_RETURN_IF_ERROR(LaunchTiles(rt, forms, kPartial, global, short_groups, a, groups, w,
                                      static_cast<cl_int>(n_rows), static_cast<cl_int>(k_pad),
                                      static_cast<cl_int>(per_split), static_cast<cl_int>(rows),
                                      *partial));
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel sum, rt.Kernel(reduce));
  EPSERVE_RETURN_IF_ERROR(SetArgs(sum, *partial, cl_int{splits}, static_cast<cl_int>(rows),
                                  static_cast<cl_int>(n_rows), static_cast<cl_int>(out_cols), out));
  const size_t sum_global[2] = {static_cast<size_t>(out_cols), static_cast<size_t>(rows)};
  return Launch(rt, sum, 2, sum_global, nullptr);
}

}  // namespace

MmaForms FormOfTile(const Runtime& rt, int64_t rows) {
  if (rows <= kMmaDecodeRows) return {.large = false, .decode = true, .wide = false};
  if (rows <= rt.mma_decode_rows()) return {.large = false, .decode = false, .wide = true};
  return {.large = true, .decode = false, .wide = false};
}

bool ShortTilesWithFullOnes(const Runtime& rt, const ExpertWeights& w) {
  const uint64_t expert_bytes = static_cast<uint64_t>(
      (MmaGateUpValuesPerExpert(w.hidden, w.ffn) + MmaDownValuesPerExpert(w.hidden, w.ffn)) *
      static_cast<int64_t>(sizeof(uint16_t)));
  const uint64_t cache = rt.device_info().cache_bytes;
  return w.tensor_cores && (rt.short_tiles_with_full() || (cache > 0 && expert_bytes > cache));
}

MmaForms FormsUpTo(const Runtime& rt, int64_t most) {
  return {.large = most > rt.mma_decode_rows(),
          .decode = true,
          .wide = most > kMmaDecodeRows && rt.mma_decode_rows() > kMmaDecodeRows};
}

absl::Status GatherBf16Activations(Runtime& rt, const char* kernel_name, int64_t hidden,
                                   const Buffer& x, RowFormat x_format, const Buffer& row_index,
                                   bool gather, int64_t rows, int64_t x_values,
                                   std::span<const size_t> global, Buffer& y) {
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel(kernel_name));
  const cl_long x_rows =
      RowsInBuffer(x, common::ElementBytes(x_format.dtype), hidden, x_format.row_stride);
  EPSERVE_RETURN_IF_ERROR(SetArgs(
      kernel, x, cl_int{x_format.dtype == common::ElementType::kBf16 ? 1 : 0}, x_rows,
      cl_long{x_format.row_stride}, row_index, cl_int{gather ? 1 : 0}, static_cast<cl_int>(rows),
      static_cast<cl_int>(hidden), static_cast<cl_int>(x_values), y));
  // One work-item per row (1-D), or per 8 values of a row (2-D, rows in dimension 1).
  static constexpr size_t kCpuChunksPerGroup[2] = {64, 1};
  return LaunchBounded(rt, kernel, static_cast<cl_uint>(global.size()), global.data(),
                       global.size() == 1 ? kCpuRowsPerGroup : kCpuChunksPerGroup);
}

absl::Status LaunchFfnMma(Runtime& rt, const ExpertWeights& w, const Buffer& x, RowFormat x_format,
                          const Buffer& row_index, bool gather, int64_t rows, const Buffer& groups,
                          int num_groups, int short_groups, MmaForms forms, Buffer& h_scratch,
                          Buffer& y) {
  if (rows == 0 || num_groups == 0) return absl::OkStatus();
  const int64_t k_pad = MmaKPad(w.hidden);
  const int64_t f_pad = MmaFfnPad(w.ffn);
  const int64_t down_rows = MmaDownRows(w.hidden);
  EPSERVE_RETURN_IF_ERROR(NeedBytes(y, rows * k_pad * sizeof(uint16_t), "y (BF16 activations)"));
  EPSERVE_RETURN_IF_ERROR(
      NeedBytes(h_scratch, rows * f_pad * sizeof(uint16_t), "h_scratch (BF16 h)"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(groups, num_groups * 4 * sizeof(cl_int), "groups"));
  const size_t gather_global[2] = {static_cast<size_t>(k_pad / 8), static_cast<size_t>(rows)};
  EPSERVE_RETURN_IF_ERROR(GatherBf16Activations(rt, "gather_rows_to_bf16", w.hidden, x, x_format,
                                                row_index, gather, rows, k_pad, gather_global, y));
  // Launches of fewer tiles than twice the device's multiprocessors (a shared expert, or a few
  // experts, at decode sizes) split K, so that more work-groups stream the weights; the parts
  // are summed in a fixed order. How many parts follows from the rows and the device only, so
  // the device's grouping and the host's give the same bits.
  const int64_t tile_bound = MaxPairGroups(rows, w.num_experts, kMmaBm);
  const int gu_splits = KSplits(rt, 2 * f_pad / kMmaBn * tile_bound, k_pad);
  const int down_splits = KSplits(rt, down_rows / kMmaBn * tile_bound, f_pad);
  if (gu_splits > 1) {
    EPSERVE_RETURN_IF_ERROR(LaunchSplitK(rt, forms, y, groups, num_groups, short_groups, w.gate_up,
                                         2 * f_pad, k_pad, gu_splits, rows, "ffn_reduce_gate_up",
                                         f_pad, h_scratch));
  } else {
    const size_t gu_global[3] = {static_cast<size_t>(2 * f_pad / kMmaBn * kMmaThreads),
                                 static_cast<size_t>(num_groups), 1};
    EPSERVE_RETURN_IF_ERROR(LaunchTiles(rt, forms, kGateUp, gu_global, short_groups, y, groups,
                                        w.gate_up, static_cast<cl_int>(k_pad),
                                        static_cast<cl_int>(f_pad), static_cast<cl_int>(rows),
                                        h_scratch));
  }
  if (down_splits > 1) {
    return LaunchSplitK(rt, forms, h_scratch, groups, num_groups, short_groups, w.down, down_rows,
                        f_pad, down_splits, rows, "ffn_reduce_down", w.hidden, y);
  }
  const size_t down_global[3] = {static_cast<size_t>(down_rows / kMmaBn * kMmaThreads),
                                 static_cast<size_t>(num_groups), 1};
  return LaunchTiles(rt, forms, kDown, down_global, short_groups, h_scratch, groups, w.down,
                     static_cast<cl_int>(f_pad), static_cast<cl_int>(down_rows),
                     static_cast<cl_int>(w.hidden), static_cast<cl_int>(rows), y);
}

}  // namespace detail

}  // namespace epserve::kernels
