// The tensor-core FFN's launches over work tiles already on the device, shared by the FFN
// over host offsets (moe_kernels.cc) and the one over pairs grouped on the device
// (moe_grouped.cc), and the BF16 gather of their activations, which the dot-product FFN shares
// too. Private to kernels/.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"

namespace epserve::kernels::detail {

// The checks of an FFN call's activations every entry point makes: x's dtype one the kernels
// take, its row stride (0: packed rows, set to w.hidden) at least a row.
absl::Status CheckRowFormat(const ExpertWeights& w, RowFormat& x_format);

// Launches `kernel_name` (gather_rows_to_bf16, or a kernel of its arguments) over `global`
// (1-D: a work-item per row; 2-D: per 8 values of a row, rows in dimension 1): the rows of x
// (hidden values, FP32 or BF16 as x_format says, read through row_index when `gather`) into y
// as zero-padded BF16 rows of x_values values, for rows < `rows` (gather_rows_to_bf16: in the
// tensor-core kernels' slice-major layout, expert_ffn_mma.cl's ActChunk).
absl::Status GatherBf16Activations(Runtime& rt, const char* kernel_name, int64_t hidden,
                                   const Buffer& x, RowFormat x_format, const Buffer& row_index,
                                   bool gather, int64_t rows, int64_t x_values,
                                   std::span<const size_t> global, Buffer& y);

// Which tensor-core kernels a launch runs: the 128-row tiles (ffn_mma_*), the decode form's
// tiles of at most kMmaDecodeRows rows (ffn_dec_*) and, where Runtime::mma_decode_rows() is
// more, the wide decode form's of the rows between (ffn_dec_*_wide). Each skips the others'
// tiles; a form may be left out only where no tile of its kind can be.
struct MmaForms {
  bool large = true;
  bool decode = true;
  bool wide = false;
};
// Whether an expert's short last tile that follows full tiles of the same expert goes with them
// to the 128-row kernels (groups' w = 1) instead of the decode forms: where one expert's
// tensor-core weights are more than the device's cache (its L2) holds. The full tiles then
// stream them from memory once, work-groups of one weight tile together (MMA_RASTER), and the
// short tile reads them from L2 in that pass instead of from memory in a launch of its own
// (mixtral-8x7b: 352 MB an expert; the decode forms' second pass over 8 experts took about
// 0.8 ms of a 4096-token layer on an H200).
bool ShortTilesWithFullOnes(const Runtime& rt, const ExpertWeights& w);
// The forms a tile of `rows` rows (1 to kMmaBm) takes on `rt`.
MmaForms FormOfTile(const Runtime& rt, int64_t rows);
// The forms tiles of 1 to `most` rows take on `rt`.
MmaForms FormsUpTo(const Runtime& rt, int64_t most);

// x (FP32 or BF16 as x_format says, rows x_format.row_stride apart, row p read from
// x[row_index[p]] when `gather`, else x[p]) -> BF16 activations in y -> BF16 h in h_scratch ->
// FP32 y, for p < rows, over groups[0 .. num_groups) (int4: local expert, first row, end row,
// 0; at most kMmaBm rows each; a group with end <= first does nothing). Every group of fewer
// than kMmaBm rows lies in groups[0 .. short_groups): the decode forms launch over those only.
absl::Status LaunchFfnMma(Runtime& rt, const ExpertWeights& w, const Buffer& x, RowFormat x_format,
                          const Buffer& row_index, bool gather, int64_t rows, const Buffer& groups,
                          int num_groups, int short_groups, MmaForms forms, Buffer& h_scratch,
                          Buffer& y);

}  // namespace epserve::kernels::detail
