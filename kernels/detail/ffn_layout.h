// The device layout of expert weights and the tile sizes of the FFN and router kernels, shared
// by the host launchers and (through build options) the .cl sources. Private to kernels/.
//
// A projection from K inputs to N outputs is stored as ceil(N / panel_cols) column panels,
// panel_cols = 2 * FfnBlocking::vec (kernels/ffn_blocking.h: the blocking chosen for the
// device, so the layout follows it at upload); panel j holds, for every k in [0, K),
// panel_cols consecutive values (FP32 or BF16, the expert set's dtype; the *FloatsPerExpert
// counts are in values): the weights of outputs [j * panel_cols, (j + 1) * panel_cols) for
// input k (zero beyond N). A panel is thus read front to back as the kernel walks k, and
// every k-step is two aligned vector loads (FP32), or one (BF16: the panel row's values are
// stored as panel_cols / 2 pairs, column c of the first half then column c of the second, so
// that one 32-bit word holds both and widens to two FP32 values with a shift and a mask).
//   gate_up of expert e: panels over F of panel_cols / 2 gate columns followed by the
//     same panel_cols / 2 columns of up (so one pass yields silu(gate) * up), K = H.
//   down of expert e: panels over H of panel_cols columns, K = F.
// Experts are stored one after the other.
//
// The tensor-core layout (BF16 weights on NVIDIA devices of compute capability 8.0 or more,
// kernels/cl/expert_ffn_mma.cl) instead stores each projection as an [N, K] BF16 matrix, K
// padded with zeros to a multiple of kMmaBk, in tiles of kMmaBn x kMmaBk (MmaTiledOffset):
//   gate_up of expert e: N = 2 * MmaFfnPad(F) rows in blocks of 16: the gate rows of 8
//     outputs f then the up rows of the same 8 (zero rows for f >= F), K = MmaKPad(H).
//   down of expert e: N = MmaDownRows(H) rows (zero rows beyond H), K = MmaFfnPad(F).
// Activations go through the GEMMs as BF16 rows of MmaKPad(H) values, h as BF16 rows of
// MmaFfnPad(F) values, both "slice-major" (expert_ffn_mma.cl's ActChunk: blocks of kMmaBm rows,
// each stored K slice by K slice, so that a tile's slice is one contiguous copy); every sum is
// FP32.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace epserve::kernels::detail {

// Largest expert count the router kernel supports (its per-token scratch is private).
inline constexpr int kRouterMaxExperts = 512;
// Tokens one router work-item routes (it reads each router row once for all of them).
inline constexpr int kRouterTokens = 4;
// The GPU router (route_logits_wg): work-items per group and tokens per group.
inline constexpr int kRouterGroupSize = 256;
inline constexpr int kRouterGroupTokens = 8;
// Work-items of route_select_softmax_wg's work-group (one token); router.cl's SELECT_WG.
inline constexpr int kRouterSelectGroupSize = 32;
// Experts of one work-group of route_logits_wg (router.cl's ROUTER_LG_EXPERTS).
inline constexpr int kRouterLogitExperts = 8;
// route_logits_tiled's work-group and tile (router.cl's RT_WG, RT_TOKENS, RT_EXPERTS).
inline constexpr int kRouterTileGroupSize = 256;
inline constexpr int kRouterTileTokens = 32;
inline constexpr int kRouterTileExperts = 64;
// Work-items per row of scale_rows_by_sigmoid_gate_wg (combine.cl's GATE_WG).
inline constexpr int kGateGroupSize = 256;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// Tile of the tensor-core kernels: rows x weight rows x K per step (expert_ffn_mma.cl).
inline constexpr int64_t kMmaBm = 128;
inline constexpr int64_t kMmaBn = 128;
inline constexpr int64_t kMmaBk = 32;
inline constexpr int kMmaThreads = 128;
// Register caps of the tensor-core program (the kernels declare no work-group size, so the
// compiler is told): a multiprocessor's registers (the device's CL_DEVICE_REGISTERS_PER_BLOCK_NV;
// kMmaDefaultRegisters where it says none, 0) shared by the work-groups it is to hold, in
// multiples of 8, at most 255. mma.sync's tile keeps about 240 registers a work-item: two
// work-groups. wgmma's keeps its 128 sums in 168: three work-groups, whose 3 x 48 KiB of local
// memory Hopper holds too; the cap keeps it there, since with any more registers (the compiler
// takes what it is not refused) a third work-group no longer fits, and that alone cost up to
// 14% (a kernel change that took a few more registers, on an H200).
inline constexpr int kMmaDefaultRegisters = 65536;
inline constexpr int kMmaWorkGroups = 2;       // mma.sync's a multiprocessor
inline constexpr int kMmaWgmmaWorkGroups = 3;  // wgmma's
inline constexpr int MmaRegisterCap(int registers, int work_groups) {
  const int share =
      (registers > 0 ? registers : kMmaDefaultRegisters) / (work_groups * kMmaThreads) / 8 * 8;
  return share > 255 ? 255 : share;
}
static_assert(MmaRegisterCap(kMmaDefaultRegisters, kMmaWgmmaWorkGroups) == 168);
static_assert(MmaRegisterCap(kMmaDefaultRegisters, kMmaWorkGroups) == 255);
static_assert(MmaRegisterCap(0, kMmaWgmmaWorkGroups) == 168);  // a device that says none
// Local-memory stages of the tensor-core kernels' K loop: 16 KiB each (a 128 x 32 slice of
// both operands), so three fill the 48 KiB a work-group may declare.
inline constexpr int kMmaStages = 3;
// Tiles of the tensor-core FFN with at most this many rows take its decode form (ffn_dec_*,
// expert_ffn_mma.cl's MMA_DEC_BM): a few m16 row tiles, several work-groups a multiprocessor.
inline constexpr int64_t kMmaDecodeRows = 32;
// Tiles of kMmaDecodeRows + 1 to this many rows take a wide decode form of their own (by default;
// RuntimeOptions::mma_decode_rows 32 leaves them to the 128-row tiles).
inline constexpr int64_t kMmaWideDecodeRows = 64;
// The most parts a tensor-core launch of few tiles splits K into (LaunchFfnMma).
inline constexpr int64_t kMmaMaxKSplits = 16;
// Element offset of (n, k) in a tensor-core weight matrix of k_pad columns, stored as tiles of
// kMmaBn rows x kMmaBk columns (row tile major, then k slice), each tile the 16-byte chunks of
// its rows in the order the kernels keep them in local memory (MmaSwizzle), so that one
// K slice of a tile is one contiguous copy.
inline int64_t MmaSwizzle(int64_t r, int64_t c) { return r * 4 + (c ^ ((r >> 1) & 3)); }
inline int64_t MmaTiledOffset(int64_t n, int64_t k, int64_t k_pad) {
  const int64_t tile = (n / kMmaBn) * (k_pad / kMmaBk) + k / kMmaBk;
  return (tile * kMmaBn * (kMmaBk / 8) + MmaSwizzle(n % kMmaBn, (k % kMmaBk) / 8)) * 8 + k % 8;
}
inline int64_t MmaKPad(int64_t hidden) { return RoundUp(hidden, kMmaBk); }
inline int64_t MmaFfnPad(int64_t ffn) { return RoundUp(ffn, kMmaBn / 2); }
inline int64_t MmaDownRows(int64_t hidden) { return RoundUp(hidden, kMmaBn); }
inline int64_t MmaGateUpValuesPerExpert(int64_t hidden, int64_t ffn) {
  return 2 * MmaFfnPad(ffn) * MmaKPad(hidden);
}
inline int64_t MmaDownValuesPerExpert(int64_t hidden, int64_t ffn) {
  return MmaDownRows(hidden) * MmaFfnPad(ffn);
}
// Whether the BF16 activations [rows, MmaKPad(H)] and h [rows, MmaFfnPad(F)] fit the FP32
// y [rows, H] and h [rows, F] buffers ExpertFfn's callers provide (true unless H or F is tiny).
inline bool MmaFitsCallerBuffers(int64_t hidden, int64_t ffn) {
  return hidden > 0 && ffn > 0 && MmaKPad(hidden) <= 2 * hidden && MmaFfnPad(ffn) <= 2 * ffn;
}
// Panels of the gate_up projection (over F) and of the down projection (over H), for panels
// of panel_cols columns.
inline int64_t GateUpPanels(int64_t ffn, int64_t panel_cols) {
  return CeilDiv(ffn, panel_cols / 2);
}
inline int64_t DownPanels(int64_t hidden, int64_t panel_cols) {
  return CeilDiv(hidden, panel_cols);
}
// Values of one expert in each buffer.
inline int64_t GateUpFloatsPerExpert(int64_t hidden, int64_t ffn, int64_t panel_cols) {
  return GateUpPanels(ffn, panel_cols) * hidden * panel_cols;
}
inline int64_t DownFloatsPerExpert(int64_t hidden, int64_t ffn, int64_t panel_cols) {
  return DownPanels(hidden, panel_cols) * ffn * panel_cols;
}

// The pair-panel layout (BF16 weights on CPU devices with AVX512-BF16, the *_dot kernels of
// kernels/cl/expert_ffn.cl): the panels above over K in steps of two, each k pair's panel row
// holding, per group of 16 columns, the column's values for k = 2j and 2j + 1 side by side
// (kDotPanelCols * 2 values per pair; a zero pads K to even). gate_up panels hold 16 gate then
// the same 16 up columns, as above. Activations go through the GEMMs as BF16 rows of
// 2 * DotKPairs(K) values.
// The pair panels are 32 columns wide whatever the FP32 blocking (the dot kernels' register
// block of 12 rows x 2 x 16 sums is fixed: they run only on AVX-512 hosts).
inline constexpr int64_t kDotPanelCols = 32;
inline int64_t DotKPairs(int64_t k) { return CeilDiv(k, 2); }
inline int64_t GateUpDotValuesPerExpert(int64_t hidden, int64_t ffn) {
  return GateUpPanels(ffn, kDotPanelCols) * DotKPairs(hidden) * 2 * kDotPanelCols;
}
inline int64_t DownDotValuesPerExpert(int64_t hidden, int64_t ffn) {
  return DownPanels(hidden, kDotPanelCols) * DotKPairs(ffn) * 2 * kDotPanelCols;
}
// Rows of one expert a dot-product work-item covers.
inline constexpr int64_t kDotRowChunk = 192;
// Experts of at most this many rows go through ffn_gate_up_x_dot, which reads x itself,
// instead of a gather launch and ffn_gate_up_dot (its blocks are 1, 4 and 8 rows).
inline constexpr int64_t kDotDirectRows = 8;
// Offset of (column c of a panel, k) within that panel of the pair-panel layout.
inline int64_t DotPanelOffset(int64_t c, int64_t k) {
  return (k / 2) * 2 * kDotPanelCols + (c / 16) * 32 + (c % 16) * 2 + k % 2;
}

// How the pair-panel kernels spell vdpbf16ps for the device's compiler (DotFormBuilds):
// clang's builtin with 16-int operands (clang 15 and earlier), or one instruction of inline
// assembly (clang 16 and later, whose builtin takes 32 __bf16 instead); kNone: no dot kernels.
enum class DotForm { kNone, kBuiltin, kInlineAsm };

// Options every program is built with. On CPU devices the FFN kernels prefetch weight panels
// ahead of their loads (FFN_PREFETCH); GPU compilers need not know the builtin. FFN_BF16_DOT
// builds the pair-panel kernels (x86 AVX512-BF16), only where they run, in the form `dot`
// names (FFN_BF16_DOT_ASM); FFN_BF16_AMX runs their rows through AMX tiles (amx: only where
// detail::HostRunsAmx). The FP32 FFN kernels' blocking comes on top, per variant
// (FfnBlockingOptions in runtime.cc).
inline std::string ProgramBuildOptions(bool cpu, DotForm dot, bool amx = false) {
  return absl::StrCat("-cl-std=CL1.2", cpu ? " -DFFN_PREFETCH=1" : "",
                      dot != DotForm::kNone ? " -DFFN_BF16_DOT=1" : "",
                      dot != DotForm::kNone && amx ? " -DFFN_BF16_AMX=1" : "",
                      dot == DotForm::kInlineAsm ? " -DFFN_BF16_DOT_ASM=1" : "",
                      " -DROUTER_MAX_EXPERTS=", kRouterMaxExperts,
                      " -DROUTER_TOKENS=", kRouterTokens, " -DROUTER_WG=", kRouterGroupSize,
                      " -DROUTER_WG_TOKENS=", kRouterGroupTokens,
                      " -DSELECT_WG=", kRouterSelectGroupSize, " -DMMA_BM=", kMmaBm,
                      " -DMMA_BN=", kMmaBn, " -DMMA_BK=", kMmaBk, " -DMMA_THREADS=", kMmaThreads,
                      " -DMMA_STAGES=", kMmaStages, " -DDOT_DIRECT_ROWS=", kDotDirectRows);
}

}  // namespace epserve::kernels::detail
