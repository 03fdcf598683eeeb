// Launchers of the MoE kernels, grouped by stage. Each takes explicit buffers and sizes
// and enqueues on the runtime's in-order queue; results are ready after Runtime::Finish
// or a blocking Read. Not thread-safe (the Runtime is not).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "kernels/ffn_blocking.h"
#include "kernels/runtime.h"
#include "model/moe_config.h"
#include "model/weights.h"

namespace epserve::kernels {

// ---- weights on the device ----

struct RouterWeights {
  model::MoeLayerConfig cfg;
  Buffer router;  // [E, H]
  Buffer bias;    // [E] for kSigmoidGroupedTopK, else empty
};
absl::StatusOr<RouterWeights> UploadRouter(Runtime& rt, const model::WeightSource& source,
                                           int layer);

// Experts of one layer (a list of ids, or [first_expert, first_expert + num_experts); or the
// shared expert, num_experts = 1), local expert i being the i-th, in the layout the FFN kernels
// read. Filled straight from the source, without a second host copy of the whole set. The dtype is
// one of kKernelTypes (others are INVALID_ARGUMENT). With dtype kBf16 the gate, up and down
// projections are stored as BF16, each value rounded to nearest even (FloatToBf16) once at upload;
// the shared expert's sigmoid gate stays FP32. BF16 weights on a runtime with tensor_cores() take
// the tensor-core layout (when H and F are not tiny, see detail::MmaFitsCallerBuffers): the FFN
// then also rounds its activations x and the intermediate h = silu(gate x) * up x to BF16 (nearest
// even) before each GEMM, as BF16 GEMM libraries do; sums stay FP32. BF16 weights on a runtime with
// bf16_dot() (x86 CPUs with AVX512-BF16) take the pair-panel layout and round x and h the
// same way where Runtime::ChooseFfnPlan picks the pair-panel forms for the shape (always
// where it does not time them, else where they ran faster than the FMA kernels' layout).
struct ExpertWeights {
  std::vector<int> experts;  // the layer's expert id of each local expert
  int num_experts = 0;
  int64_t hidden = 0;                                      // H
  int64_t ffn = 0;                                         // F of these experts
  common::ElementType dtype = common::ElementType::kFp32;  // of gate_up and down
  bool tensor_cores = false;  // the tensor-core layout and kernels (BF16 x and h)
  bool bf16_dot = false;      // the pair-panel layout and BF16 dot-product kernels (BF16 x, h)
  // The form of the FFN kernels per row class (neither tensor_cores), chosen at upload by
  // Runtime::ChooseFfnPlan; `blocking` is its layout's form (plan.layout()), which the panel
  // layout follows.
  FfnPlan plan;
  FfnBlocking blocking;
  Buffer gate_up;                // layout private to kernels/
  Buffer down;                   // layout private to kernels/
  Buffer gate;                   // [H] FP32 sigmoid gate of a gated shared expert, else empty
  size_t bytes_from_source = 0;  // of gate_up and down filled from the source (not reused)
  size_t bytes() const { return gate_up.bytes() + down.bytes() + gate.bytes(); }
};
// Which FFN kernels run these weights, uploaded through `rt`, for logs and benchmark output:
// "tensor cores" (", wgmma" added where rt.wgmma()), "bf16 amx tiles" (the dot kernels where
// rt.bf16_amx()), "bf16 dot products" or "fp32 fma".
const char* FfnKernelsName(const Runtime& rt, const ExpertWeights& w);

// With `reuse` (an upload of the same layer of the same weights): the experts it holds, in
// the same layout, are copied from it on the device instead of read from the source.
absl::StatusOr<ExpertWeights> UploadExperts(Runtime& rt, const model::WeightSource& source,
                                            int layer, std::span<const int> experts,
                                            common::ElementType dtype = common::ElementType::kFp32,
                                            const ExpertWeights* reuse = nullptr);
absl::StatusOr<ExpertWeights> UploadExperts(Runtime& rt, const model::WeightSource& source,
                                            int layer, int first_expert, int num_experts,
                                            common::ElementType dtype = common::ElementType::kFp32);
// The FFN plans of the expert shapes (hidden, each of ffn_sizes; weights of `dtype`) that
// uploads through `rt` will ask for (those not on the tensor-core kernels), chosen before the
// uploads and all at once (Runtime::ChooseFfnPlans), so that the workers of a host tune
// different shapes at the same time; an upload then finds its shape's plan made.
absl::Status ChooseExpertFfnPlans(Runtime& rt, int64_t hidden, std::span<const int64_t> ffn_sizes,
                                  common::ElementType dtype);
// The shared expert of the layer (config().layer.shared_ffn_size > 0).
absl::StatusOr<ExpertWeights> UploadSharedExpert(
    Runtime& rt, const model::WeightSource& source, int layer,
    common::ElementType dtype = common::ElementType::kFp32);

// ---- route ----

// x [n, H] float -> ids [n, k] int32 (global expert ids), weights [n, k] float, with the
// semantics of model::ReferenceRoute for every RoutingKind.
absl::Status Route(Runtime& rt, const RouterWeights& w, const Buffer& x, int64_t n, Buffer& ids,
                   Buffer& weights);

// ---- expert FFN ----

// How the rows of an activation buffer are stored: element type (one of kKernelTypes; others
// are INVALID_ARGUMENT), and the distance from one row to the next in elements (0: the row
// length, i.e. packed rows). BF16 values are widened to FP32 exactly.
struct RowFormat {
  common::ElementType dtype = common::ElementType::kFp32;
  int64_t row_stride = 0;
};

// Grouped SwiGLU FFN over rows of x [*, H] picked by row_index (int32): the rows of local
// expert e are row_index[expert_offsets[e] .. expert_offsets[e+1]) (host array of
// w.num_experts + 1 ascending offsets, empty experts allowed). For each p in [0, P),
// P = expert_offsets.back():  y[p, :] = down_e(silu(gate_e x) * up_e x), x = x[row_index[p]].
// x is stored as x_format says; h_scratch (at least P * w.ffn floats) and y are FP32, and so
// is every sum, whatever the weights' and x's dtypes. The rows of x may first be gathered into
// y (widened to FP32 for BF16 x on the FP32 kernels, rounded to BF16 on the tensor-core and
// dot-product kernels), which the FFN then overwrites, so x and y must not overlap.
absl::Status ExpertFfn(Runtime& rt, const ExpertWeights& w, const Buffer& x,
                       const Buffer& row_index, std::span<const int64_t> expert_offsets,
                       Buffer& h_scratch, Buffer& y, RowFormat x_format = {});

// ExpertFfn through form `form` rather than the one w.plan picks for the rows: a form of
// w's layout (SameFfnLayout with w.blocking) that serves the call's largest expert's rows
// (FfnFormServes), else INVALID_ARGUMENT; not on tensor-core weights. For the tuner, tests
// and benchmarks.
absl::Status ExpertFfnAs(Runtime& rt, const ExpertWeights& w, const FfnBlocking& form,
                         const Buffer& x, const Buffer& row_index,
                         std::span<const int64_t> expert_offsets, Buffer& h_scratch, Buffer& y,
                         RowFormat x_format = {});

// Rows of one expert at which ExpertFfn runs each distinct form of w.plan (the first row count
// of each row class whose form no earlier class has; {1} on tensor cores): a warm-up runs
// every count, so that no request builds a kernel.
std::vector<int64_t> ExpertFfnWarmUpRows(const ExpertWeights& w);

// The shared expert on x [n, H]: y[i, :] = g_i * FFN(x[i, :]), with g_i = sigmoid(x[i] . gate)
// when w.gate is set, else 1. h_scratch holds at least n * w.ffn floats; x and y must not
// overlap (as for ExpertFfn).
absl::Status SharedExpertFfn(Runtime& rt, const ExpertWeights& w, const Buffer& x, int64_t n,
                             Buffer& h_scratch, Buffer& y);

// ---- combine ----

// out[i, :] = sum over j < k with pair_index[i*k + j] >= 0 of
//             pair_weight[i*k + j] * y[pair_index[i*k + j], :], summed in order of j.
// pair_index int32 [n, k], pair_weight float [n, k], y [*, hidden], out [n, hidden].
absl::Status WeightedCombine(Runtime& rt, const Buffer& y, const Buffer& pair_index,
                             const Buffer& pair_weight, int64_t n, int k, int64_t hidden,
                             Buffer& out);

// dst[0, count) += src[0, count), FP32.
absl::Status AddInto(Runtime& rt, const Buffer& src, int64_t count, Buffer& dst);

// The owner's sum of its tokens' rows on the device, with the arithmetic of the exchange's sum
// on the host (worker::WeightedSumRows: products rounded, then added in order, never fused),
// so that a token has the same bits whichever of the two sums it. For token i < n:
//   out[i, :] = start + sum over j < k, in order of j, of pair_weight[i*k + j] * r(y[pair_index[i*k
//   + j], :])
// with start = 0 (kZero), base[i, :] (kOnto: the row is added onto, e.g. the shared expert's
// output), or 0 + 1 * r(base[i, :]) (kAsPart: a row part, e.g. a split shared expert's), and r
// the identity, or rounding to BF16 when `round_bf16` (the rows' values after a BF16 combine
// payload). With kAsPart, base may hold num_parts blocks of n rows, added as parts in order
// (0 + 1 * r(part 0) + 1 * r(part 1) ...: each worker's slice of a split shared expert, in
// worker order). A pair_index entry that is not a row of y makes its token's values NaN.
// out may be base.
enum class SumStart { kZero, kOnto, kAsPart };
absl::Status SumPairRows(Runtime& rt, const Buffer& y, const Buffer& pair_index,
                         const Buffer& pair_weight, int64_t n, int k, int64_t hidden,
                         const Buffer* base, SumStart start, bool round_bf16, Buffer& out,
                         int num_parts = 1);

// The exchange's row moves between devices' memory: for i < count, the (source row,
// destination row) pair at moves[2 (first + i)] (int32 pairs) copies src's row into dst's, rows
// of `hidden` FP32 values, rounded to BF16 (kept as FP32, as RoundToBf16) when round_bf16. A
// move naming a row outside either buffer writes nothing (dst may be a peer's memory; callers
// check their moves). src and dst must be distinct.
// Rows of a multiple of 4 values move 4 values per work-item and access. `groups` picks the
// form: 0 the device's (on GPUs, work-groups of up to kCopyRowLanes work-items move whole
// rows, kCopyGroupsPerUnit groups per compute unit, as many as stay resident: CopyRowRuns'
// form; on CPUs, a work-item per 4 values of a row: copy_rows4), > 0 the grouped form with
// that many groups on any device, -1 the per-value form on any device.
inline constexpr int64_t kCopyRowLanes = 256;
inline constexpr int64_t kCopyGroupsPerUnit = 8;
absl::Status CopyRows(Runtime& rt, const Buffer& src, const Buffer& moves, int64_t first,
                      int64_t count, int64_t hidden, bool round_bf16, const Buffer& dst,
                      int64_t groups = 0);

// Several CopyRows at once, each run of moves from its own source into its own destination
// (every destination distinct from every source and from the other runs' destinations). Rows
// of a multiple of 4 values on GPUs with `groups` 0, or anywhere with `groups` > 0: one
// grouped launch per kRunsPerLaunch runs (kCopyGroupsPerUnit groups per compute unit, or
// `groups`), so that moves within the device's memory run beside moves into a peer's;
// otherwise one CopyRows per run. A run whose block_src >= 0 is a block: source rows
// [block_src, block_src + count) into destination rows [block_dst, block_dst + count), with no
// moves to upload or read; outside the grouped form a block is one buffer copy (rows past
// either buffer's end are left out, as the kernels leave them), so it cannot round to BF16:
// RowRunsTakeBlocks says where blocks are taken, INVALID_ARGUMENT elsewhere.
struct RowRun {
  const Buffer* src = nullptr;
  const Buffer* dst = nullptr;
  int64_t first = 0;  // the run's first move in `moves`
  int64_t count = 0;
  int64_t block_src = -1;
  int64_t block_dst = 0;
};
inline constexpr size_t kRunsPerLaunch = 4;
bool RowRunsTakeBlocks(const Runtime& rt, int64_t hidden, bool round_bf16, int64_t groups = 0);
absl::Status CopyRowRuns(Runtime& rt, std::span<const RowRun> runs, const Buffer& moves,
                         int64_t hidden, bool round_bf16, int64_t groups = 0);

// The combine's return of worker::DeviceExchange on the device, from the receiver's pair
// table: pair i's row of pair_rows goes into pairs_to[s] at pair_home[i], s the sender of
// received row pair_row[i] (source_begin[s] <= it < source_begin[s + 1]); with row_parts,
// received row r's row goes into parts_to[s] at me * tokens[s] + token[r]. `tables` holds
// pair_row [pairs], pair_home [pairs], token [rows] (int32). One launch per kRunsPerLaunch
// senders, in CopyRows' forms (`groups`: 0 the device's, whole rows per work-group on GPUs
// and a work-item per 4 values on CPUs; > 0 the grouped form with that many groups, -1 the
// per-value form, on any device). A move outside either buffer, or naming no sender or a
// token past tokens[s], writes nothing. Destinations are distinct from each other and from
// the sources.
struct ReturnRowsArgs {
  const Buffer* pair_rows = nullptr;
  const Buffer* row_parts = nullptr;        // nullptr: no parts (rows = 0)
  std::span<const Buffer* const> pairs_to;  // [senders]
  std::span<const Buffer* const> parts_to;  // [senders] with row_parts
  std::span<const int64_t> source_begin;    // [senders + 1]
  std::span<const int64_t> tokens;          // [senders]
  const Buffer* tables = nullptr;
  int64_t pairs = 0;
  int64_t rows = 0;
  int me = 0;
  int64_t hidden = 0;
  int64_t groups = 0;
};
absl::Status ReturnRows(Runtime& rt, const ReturnRowsArgs& a);

// dst[i] = src[i] rounded to BF16 (nearest even, as common::FloatToBf16), kept as FP32, for
// i < count: rows as a BF16 exchange payload delivers them. dst may be src.
absl::Status RoundToBf16(Runtime& rt, const Buffer& src, int64_t count, Buffer& dst);

// Values between FP32 and a request's element type (FP32, BF16 or FP16; the host's
// conversions, common/half.h, bit for bit): `count` values of src from element src_at into
// dst from element dst_at. src and dst must be distinct.
absl::Status WidenToFp32(Runtime& rt, const Buffer& src, int64_t src_at,
                         common::ElementType src_type, int64_t count, Buffer& dst, int64_t dst_at);
absl::Status NarrowFromFp32(Runtime& rt, const Buffer& src, int64_t src_at, int64_t count,
                            common::ElementType dst_type, Buffer& dst, int64_t dst_at);

// ---- the pairs grouped by expert on the device ----

// A batch's layout made on the device by GroupPairs, for up to max_pairs pairs of one
// ExpertWeights' experts (AllocatePairGroups): what a worker's layout makes on the host, with no
// wait for the router's results.
struct PairGroups {
  Buffer row_index;       // int32 [max_pairs]: the token of each expert-major position
  Buffer pair_of_choice;  // int32 [max_pairs]: each choice's position (-1: a bad expert id)
  Buffer groups;          // int4 [MaxPairGroups(max_pairs)]: the FFN's work tiles
  Buffer counts;          // int32 [experts + 1]: pairs per local expert, then bad ids
  int64_t max_pairs = 0;
  int num_experts = 0;    // local experts
  size_t work_group = 1;  // group_pairs' work-items on this device
  int64_t pairs = 0;      // of the last GroupPairs
  int64_t tokens = 0;     // of the last GroupPairs: the most pairs one expert may have
  int num_groups = 0;     // tiles of the last GroupPairs (the empty ones at the end included)
};
// The most pairs GroupPairs groups at the speed it is for (it keeps them in local memory);
// larger batches (prefill) group faster on the host.
inline constexpr int64_t kDeviceGroupingMaxPairs = 4096;
// The most work tiles `pairs` pairs over `num_experts` experts need, in tiles of `chunk`.
int64_t MaxPairGroups(int64_t pairs, int num_experts, int64_t chunk);
absl::StatusOr<PairGroups> AllocatePairGroups(Runtime& rt, const ExpertWeights& w,
                                              int64_t max_pairs);

// ids [n, k] (global expert ids, as Route writes them) grouped by w's local experts on the
// device: expert-major, in order of token * k + choice within an expert (the order of
// worker::Worker::RunLocal's host layout, so that results are the same bits). local_of:
// int32 [num_global], each global expert's local index (-1: not held here). Waits for nothing.
absl::Status GroupPairs(Runtime& rt, const ExpertWeights& w, const Buffer& ids, int64_t n, int k,
                        const Buffer& local_of, int num_global, PairGroups& g);

// ExpertFfn over the pairs of the last GroupPairs: y[p, :] = FFN_e(x[row_index[p], :]). With
// tensor-core weights the tiles come from the device and nothing waits; the other forms read
// the counts first (one wait) and run ExpertFfn.
absl::Status ExpertFfnGrouped(Runtime& rt, const ExpertWeights& w, const Buffer& x,
                              const PairGroups& g, Buffer& h_scratch, Buffer& y,
                              RowFormat x_format = {});

// The last GroupPairs' pairs per local expert, read back (waits for the device); INTERNAL
// naming the count when a pair's expert id was not one of w's, or an expert had more pairs
// than the batch's tokens (a token that chose it twice; ExpertFfnGrouped's launches then held
// no tile of that size).
absl::StatusOr<std::vector<int64_t>> ReadPairCounts(Runtime& rt, const PairGroups& g);
// The same in two steps, so that the read shares a wait with others: QueuePairCountsRead
// queues the read of g.num_experts + 1 counts into `counts`, pinned memory of rt's
// (Runtime::ReadAsync); PairCountsOf checks and returns them once the queue has run it.
absl::Status QueuePairCountsRead(Runtime& rt, const PairGroups& g, int32_t* counts);
absl::StatusOr<std::vector<int64_t>> PairCountsOf(const PairGroups& g, const int32_t* counts);

}  // namespace epserve::kernels
