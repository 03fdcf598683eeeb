// The form of the expert FFN kernels (kernels/cl/expert_ffn.cl) for each row class, chosen per
// device and expert shape rather than fixed at compile time. A form is a blocking of the
// portable FMA kernels (FP32 and BF16 weights through FP32 FMAs: a register block that fits
// AVX-512's 32 vector registers spills on AVX2's 16), or, for BF16 weights on a runtime that
// has the BF16 dot-product kernels (bf16_dot()), one of the pair-panel forms: BF16 dot
// products (AMX tiles where the runtime runs them), vdpbf16ps alone (where AMX runs too),
// or FP32 FMAs on the same pair panels; each of those either reads x's rows itself in gate_up
// (few rows: "-direct") or after a gather launch. Which is fastest depends on the CPU and on
// the rows per expert: vdpbf16ps doubles the multiply-adds per instruction on AMD Zen 4/5 but
// runs slower than two FMAs on Intel Sapphire Rapids, where at one row, which the weights'
// stream bounds, FMAs on the weights ran faster than the dot products (issue 39).
// So the forms are timed per row class (FfnRowClass) and the fastest kept per class, among
// forms of one weight layout (the weights are stored once): an FfnPlan.
//
// The plan is made once per (device, driver, kernel source, build options, H, F, weight
// dtype): forced (RuntimeOptions::ffn_blocking or $EPSERVE_FFN_BLOCKING), else read from the
// tuning cache beside the program-binary cache, else timed on the device over the candidates
// derived from what the device reports (vector width, compute units, cache size) and stored
// there, else (GPUs, tuning off, or experts of under 8 MiB of weights: toy and test shapes)
// the device default.
// The weight layout follows the plan at upload (ExpertWeights::blocking, the plan's layout).
#pragma once

#include <array>
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
  // BF16 weights on the pair-panel kernels (kernels/detail/ffn_layout.h), whose register
  // block is their own: the fields above are then unused.
  bool dot = false;
  // How the pair-panel kernels make their products (dot forms only).
  enum class DotOp {
    kDefault,  // "dot": AMX tiles where the runtime runs them, else vdpbf16ps
    kVdp,      // "dot-vdp": vdpbf16ps even where AMX tiles run
    kFma,      // "pair-fma": FP32 FMAs on the pair panels' widened values
  };
  DotOp dot_op = DotOp::kDefault;
  // Dot forms only: gate_up reads x's rows itself, rounding them to BF16 pairs as it goes
  // ("-direct"; tiles of at most kDotDirectRows rows), instead of after a gather launch.
  bool direct = false;

  int panel_cols() const { return 2 * vec; }
  // "vec=8 rows=6 prefetch=64 chunk=96", or "dot", "dot-direct", "dot-vdp", "pair-fma",
  // "pair-fma-direct" ...: the form the flag and $EPSERVE_FFN_BLOCKING take.
  std::string ToString() const;
  bool operator==(const FfnBlocking& o) const {
    if (dot || o.dot) return dot == o.dot && dot_op == o.dot_op && direct == o.direct;
    return vec == o.vec && rows == o.rows && prefetch_steps == o.prefetch_steps &&
           row_chunk == o.row_chunk;
  }
};

// Whether weights laid out for form a serve form b as they are (both pair panels, or FMA
// panels of one width).
bool SameFfnLayout(const FfnBlocking& a, const FfnBlocking& b);

// The row classes of the expert FFN: a call's class is that of its largest expert's rows per
// expert: 1, 2-8 (up to kDotDirectRows: the direct dot forms' tiles), 9-64, 65 and more.
inline constexpr int kFfnRowClasses = 4;
int FfnRowClass(int64_t rows_per_expert);
const char* FfnRowClassName(int row_class);  // "1", "2-8", "9-64", "65+"
int64_t FfnRowClassFirst(int row_class);     // its fewest rows: 1, 2, 9, 65
// The rows per expert the tuner times the class at: 1, 8, 32, 128.
int64_t FfnRowClassSample(int row_class);
// Whether form b can serve the class (a direct form only up to kDotDirectRows rows).
bool FfnFormServes(const FfnBlocking& b, int row_class);
// The experts in each of the two halves of the tuning weights that the few-row cases
// alternate between: enough that a half holds twice the device's cache, so that a run finds
// none of the weights the run before it read (serving, each layer's weights stream from
// memory past the cache), but no more than `budget_bytes` of weights in both halves; at least
// one. The tuner's budget is a sixteenth of the device's memory.
int FewRowTuneExperts(int64_t cache_bytes, int64_t expert_bytes, int64_t budget_bytes);

// One form per row class, all of one weight layout.
struct FfnPlan {
  std::array<FfnBlocking, kFfnRowClasses> forms;
  // b for every class; a dot form reads x directly in the classes that allow it (the form
  // "dot" has always meant) and after a gather above.
  static FfnPlan Uniform(const FfnBlocking& b);
  const FfnBlocking& layout() const { return forms[0]; }
  const FfnBlocking& For(int64_t rows_per_expert) const {
    return forms[FfnRowClass(rows_per_expert)];
  }
  // "1: pair-fma-direct; 2-8: dot-direct; 9-64: dot; 65+: dot", or one form where
  // Uniform(that form) gives the plan.
  std::string ToString() const;
  bool operator==(const FfnPlan& o) const { return forms == o.forms; }
};

// Parses ToString's form (any subset of the keys, the rest default; separators: spaces or
// commas; a dot form's name alone). INVALID_ARGUMENT names the key and its bounds.
absl::StatusOr<FfnBlocking> ParseFfnBlocking(absl::string_view text);
// Parses FfnPlan::ToString's form: one form (Uniform), or "<class>: <form>" for every class,
// separated by ';'. INVALID_ARGUMENT says what is wrong (an unknown class, a missing one,
// forms of two layouts, a direct form above its rows).
absl::StatusOr<FfnPlan> ParseFfnPlan(absl::string_view text);

// Where a runtime's blocking came from, for the startup line.
enum class FfnBlockingOrigin { kDefault, kForced, kCache, kTuned };
const char* FfnBlockingOriginName(FfnBlockingOrigin origin);

// The candidates the tuner times on `device`: register blocks that fit the vector registers
// its vector width implies (16 on 8-lane devices such as AVX2 and NEON pairs, 32 on 16-lane
// ones such as AVX-512), with a few row chunks. The first is the device default.
std::vector<FfnBlocking> FfnBlockingCandidates(const DeviceInfo& device);
// The pair-panel kernels as a form ("dot" and the others above).
FfnBlocking DotKernels(FfnBlocking::DotOp op = FfnBlocking::DotOp::kDefault, bool direct = false);
// Every pair-panel form a runtime runs: with `amx` (Runtime::bf16_amx) the vdpbf16ps forms too.
std::vector<FfnBlocking> DotForms(bool amx);
// Every FMA-kernel blocking any device's candidate list can hold, for tests.
std::vector<FfnBlocking> AllFfnBlockingCandidates();

}  // namespace epserve::kernels
