// The tensor-core FFN's launches over work tiles already on the device, shared by the FFN
// over host offsets (moe_kernels.cc) and the one over pairs grouped on the device
// (moe_grouped.cc). Private to kernels/.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"

namespace epserve::kernels::detail {

// Which tensor-core kernels a launch runs: the 128-row tiles (ffn_mma_*) and those of at most
// kMmaDecodeRows rows (ffn_dec_*). Each skips the other's tiles; a form may be left out only
// where no tile of its kind can be.
struct MmaForms {
  bool large = true;
  bool decode = true;
};

// x (FP32 or BF16 as x_format says, rows x_format.row_stride apart, row p read from
// x[row_index[p]] when `gather`, else x[p]) -> BF16 activations in y -> BF16 h in h_scratch ->
// FP32 y, for p < rows, over groups[0 .. num_groups) (int4: local expert, first row, end row,
// 0; at most kMmaBm rows each; a group with end <= first does nothing).
absl::Status LaunchFfnMma(Runtime& rt, const ExpertWeights& w, const Buffer& x, RowFormat x_format,
                          const Buffer& row_index, bool gather, int64_t rows, const Buffer& groups,
                          int num_groups, MmaForms forms, Buffer& h_scratch, Buffer& y);

}  // namespace epserve::kernels::detail
