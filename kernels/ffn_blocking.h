// The blocking of the portable expert FFN kernels (kernels/cl/expert_ffn.cl: FP32 and BF16
// weights through FP32 FMAs), chosen per device and expert shape rather than fixed at compile
// time: a register block that fits AVX-512's 32 vector registers spills on AVX2's 16. For BF16
// weights on a runtime that has the BF16 dot-product kernels (bf16_dot()), the choice is also
// between those and the FMA kernels: vdpbf16ps doubles the multiply-adds per instruction on
// AMD Zen 4/5 but runs slower than two FMAs on Intel Sapphire Rapids, so it is timed too.
//
// The choice is made once per (device, driver, kernel source, build options, H, F, weight
// dtype): forced (RuntimeOptions::ffn_blocking or $EPSERVE_FFN_BLOCKING), else read from the
// tuning cache beside the program-binary cache, else timed on the device over a few
// candidates derived from what the device reports (vector width, local memory size, compute
// units) and stored there, else (GPUs, tuning off, or experts of under 8 MiB of weights: toy
// and test shapes) the device default.
// The weight layout follows the choice at upload (ExpertWeights::blocking).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epserve::kernels {

struct DeviceInfo;

struct FfnBlocking {
  // FP32 lanes of one accumulator vector (8 or 16). A weight panel is 2 * vec columns wide:
  // vec gate then vec up columns for gate_up, 2 * vec outputs for down.
  int vec = 16;
  // Rows of x one work-item multiplies against a panel at once (the register block holds
  // rows x 2 vectors of sums). 1 to 16.
  int rows = 12;
  // How far ahead of its loads a work-item prefetches the panel, in k-steps (CPU devices);
  // 0: no software prefetch.
  int prefetch_steps = 64;
  // Rows of one expert one work-item covers: its rows of x stay in cache while it walks a
  // panel, and panels are re-read once per chunk. A multiple of `rows`.
  int row_chunk = 192;
  // BF16 weights on the dot-product kernels (kernels/detail/ffn_layout.h, pair panels), whose
  // register block is their own: the fields above are then unused. Spelled "dot".
  bool dot = false;

  int panel_cols() const { return 2 * vec; }
  // "vec=8 rows=6 prefetch=64 chunk=96", or "dot": the form the flag and
  // $EPSERVE_FFN_BLOCKING take.
  std::string ToString() const;
  bool operator==(const FfnBlocking& o) const {
    if (dot || o.dot) return dot == o.dot;
    return vec == o.vec && rows == o.rows && prefetch_steps == o.prefetch_steps &&
           row_chunk == o.row_chunk;
  }
};

// Parses ToString's form (any subset of the keys, the rest default; separators: spaces or
// commas; "dot" alone). INVALID_ARGUMENT names the key and its bounds.
absl::StatusOr<FfnBlocking> ParseFfnBlocking(absl::string_view text);

// Where a runtime's blocking came from, for the startup line.
enum class FfnBlockingOrigin { kDefault, kForced, kCache, kTuned };
const char* FfnBlockingOriginName(FfnBlockingOrigin origin);

// The candidates the tuner times on `device`: register blocks that fit the vector registers
// its vector width implies (16 on 8-lane devices such as AVX2 and NEON pairs, 32 on 16-lane
// ones such as AVX-512), with a few row chunks. The first is the device default.
std::vector<FfnBlocking> FfnBlockingCandidates(const DeviceInfo& device);
// The dot-product kernels as a choice ("dot").
FfnBlocking DotKernels();
// Every FMA-kernel blocking any device's candidate list can hold, for tests.
std::vector<FfnBlocking> AllFfnBlockingCandidates();

}  // namespace epserve::kernels
