// Expert FFN as grouped GEMMs over expert-major rows. Weight layout: kernels/detail/ffn_layout.h
// (column panels of 2 * FFN_VEC values per k-step), FP32 or BF16; x, h, y and every accumulator
// FP32 (BF16 activations are widened beforehand by gather_bf16_rows).
//
// One work-item (= one work-group of size 1) per (panel, tile), a tile being up to the
// blocking's row chunk of one expert. It walks its rows in register blocks of FFN_ROWS rows
// (then one block of FFN_ROWS, FFN_ROWS_HALF, FFN_ROWS_QUARTER or 1 rows for the remainder)
// times the panel's two vectors of FFN_VEC columns, so that the panel is read from memory once
// per tile and then from cache, and the tile's rows of x stay in cache while consecutive
// work-items walk the other panels. Every output element is written by exactly one work-item
// with a fixed summation order: results are bit-identical run to run.
//
// The blocking (FFN_VEC, FFN_ROWS, FFN_ROWS_HALF, FFN_ROWS_QUARTER, FFN_PREFETCH_STEPS) is a
// per-device choice made on the host (kernels/ffn_blocking.h); the defaults below are the
// AVX-512 one.
//
// Kernels, one per weight type: ffn_gate_up_w{f32,bf16}, ffn_down_w{f32,bf16}.
//
// FFN_FAMILY picks the kernels a program holds: 0 all of them; 1 the FP32-weight kernels;
// 2 the BF16-weight ones and gather_bf16_rows; 3 the BF16 dot-product kernels and
// gather_rows_to_bf16_pairs. The runtime builds one program per family (and blocking), so
// that a build compiles only what it runs (kernels/runtime.cc FfnFamily).
#ifndef FFN_FAMILY
#define FFN_FAMILY 0
#endif
#define FFN_HAS(f) (FFN_FAMILY == 0 || FFN_FAMILY == (f))

#ifndef FFN_VEC
#define FFN_VEC 16
#endif
#ifndef FFN_ROWS
#define FFN_ROWS 12
#endif
#ifndef FFN_ROWS_HALF
#define FFN_ROWS_HALF 8
#endif
#ifndef FFN_ROWS_QUARTER
#define FFN_ROWS_QUARTER 4
#endif
#ifndef FFN_PREFETCH_STEPS
#define FFN_PREFETCH_STEPS 64
#endif
#if FFN_VEC != 8 && FFN_VEC != 16
#error "FFN_VEC must be 8 or 16"
#endif
#if FFN_ROWS < 1 || FFN_ROWS > 16 || FFN_ROWS_HALF >= FFN_ROWS || FFN_ROWS_QUARTER > FFN_ROWS_HALF
#error "row blocks must satisfy 16 >= FFN_ROWS > FFN_ROWS_HALF >= FFN_ROWS_QUARTER >= 1"
#endif
#if FFN_ROWS_QUARTER < 1
#error "FFN_ROWS_QUARTER must be at least 1"
#endif

#define OVERLOAD __attribute__((overloadable))

#define GLUE(a, b) GLUE_(a, b)
#define GLUE_(a, b) a##b
#define GLUE3(a, b, c) GLUE3_(a, b, c)
#define GLUE3_(a, b, c) a##b##c

// The accumulator and panel vector types of the blocking.
#define floatV GLUE(float, FFN_VEC)
#define ushortV GLUE(ushort, FFN_VEC)
#define uintV GLUE(uint, FFN_VEC)
#define as_floatV GLUE(as_float, FFN_VEC)

// Software prefetch of weight panels, on CPU devices only (-DFFN_PREFETCH=1).
#if FFN_PREFETCH
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p)
#endif

// The two vectors of panel row k: FFN_VEC columns of the first half (LoadW0) and of the
// second (LoadW1). A BF16 value is the upper half of the FP32 with the same bits, so widening
// is exact; a BF16 panel row pairs column c of each half in one 32-bit word (kernels/detail/
// ffn_layout.h), so one load yields both vectors, the first shifted into place, the second
// masked: two instructions per 2 * FFN_VEC weights.
inline floatV OVERLOAD LoadW0(const __global floatV* restrict b, int k) { return b[2 * k]; }
inline floatV OVERLOAD LoadW1(const __global floatV* restrict b, int k) { return b[2 * k + 1]; }
inline floatV OVERLOAD LoadW0(const __global ushortV* restrict b, int k) {
  return as_floatV(((const __global uintV*)b)[k] << 16);
}
inline floatV OVERLOAD LoadW1(const __global ushortV* restrict b, int k) {
  return as_floatV(((const __global uintV*)b)[k] & (uintV)(0xffff0000u));
}

// The register block is spelled out row by row (REPn) so that its accumulators are plain
// variables the compiler keeps in vector registers.
#define REP1(M) M(0)
#define REP2(M) REP1(M) M(1)
#define REP3(M) REP2(M) M(2)
#define REP4(M) REP3(M) M(3)
#define REP5(M) REP4(M) M(4)
#define REP6(M) REP5(M) M(5)
#define REP7(M) REP6(M) M(6)
#define REP8(M) REP7(M) M(7)
#define REP9(M) REP8(M) M(8)
#define REP10(M) REP9(M) M(9)
#define REP11(M) REP10(M) M(10)
#define REP12(M) REP11(M) M(11)
#define REP13(M) REP12(M) M(12)
#define REP14(M) REP13(M) M(13)
#define REP15(M) REP14(M) M(14)
#define REP16(M) REP15(M) M(15)

// Stores v[0, N) to dst[0, min(N, limit)), for FP32 (float) and BF16 (ushort) values.
#define DEFINE_STORE_PARTIAL(T, N)                                                     \
  inline void OVERLOAD StorePartial(GLUE(T, N) v, __global T* dst, int limit) {        \
    if (limit >= N) {                                                                  \
      GLUE(vstore, N)(v, 0, dst);                                                      \
      return;                                                                          \
    }                                                                                  \
    T tmp[N];                                                                          \
    GLUE(vstore, N)(v, 0, tmp);                                                        \
    for (int l = 0; l < limit; ++l) dst[l] = tmp[l];                                   \
  }
DEFINE_STORE_PARTIAL(float, 8)
DEFINE_STORE_PARTIAL(float, 16)
DEFINE_STORE_PARTIAL(ushort, 16)

// Rows [g.y, end) of a work tile through the register blocks PREFIX<R>SUFFIX ARGS (ARGS a
// parenthesised argument list: OpenCL C 1.2 has no variadic macros): blocks of FFN_ROWS rows,
// then one block of FFN_ROWS, FFN_ROWS_HALF, FFN_ROWS_QUARTER or 1 rows for the rest (a
// block's loads clamp to the last row and its stores stop there). Declares p, the block's
// first row.
#define ROW_BLOCKS(PREFIX, SUFFIX, ARGS)                                              \
  int p = g.y;                                                                        \
  for (; p + FFN_ROWS <= end; p += FFN_ROWS) GLUE3(PREFIX, FFN_ROWS, SUFFIX) ARGS;    \
  const int rest = end - p;                                                           \
  if (rest > FFN_ROWS_HALF) {                                                         \
    GLUE3(PREFIX, FFN_ROWS, SUFFIX) ARGS;                                             \
  } else if (rest > FFN_ROWS_QUARTER) {                                               \
    GLUE3(PREFIX, FFN_ROWS_HALF, SUFFIX) ARGS;                                        \
  } else if (rest > 1) {                                                              \
    GLUE3(PREFIX, FFN_ROWS_QUARTER, SUFFIX) ARGS;                                     \
  } else if (rest == 1) {                                                             \
    GLUE3(PREFIX, 1, SUFFIX) ARGS;                                                    \
  }

inline size_t SourceRow(__global const int* row_index, int gather, int p, long x_rows) {
  long row = gather ? (long)row_index[p] : (long)p;
  row = row < 0 ? 0 : (row >= x_rows ? x_rows - 1 : row);  // stay inside x whatever we get
  return (size_t)row;
}

// Row r of the block: its A pointer and two accumulators (FFN_VEC outputs each).
#define ACC_DECL_GATHER(r)                                                                \
  const __typeof__(x) a##r =                                                              \
      x + SourceRow(row_index, gather, min(p + (r), end - 1), x_rows) * (size_t)x_stride; \
  floatV acc##r##_0 = (floatV)(0.0f);                                                     \
  floatV acc##r##_1 = (floatV)(0.0f);
#define ACC_DECL_DIRECT(r)                                                                \
  const __global float* a##r = h + (size_t)min(p + (r), end - 1) * (size_t)ffn;           \
  floatV acc##r##_0 = (floatV)(0.0f);                                                     \
  floatV acc##r##_1 = (floatV)(0.0f);
#define ACC_FMA(r)                                                                        \
  {                                                                                       \
    const floatV av = (floatV)(a##r[ku]);                                                 \
    acc##r##_0 = fma(av, b0, acc##r##_0);                                                 \
    acc##r##_1 = fma(av, b1, acc##r##_1);                                                 \
  }
// gate_up: acc_0 holds gate, acc_1 up of FFN_VEC consecutive f.
#define GATE_UP_STORE(r)                                                                  \
  if ((r) < valid) {                                                                      \
    const floatV act = acc##r##_0 / (1.0f + exp(-acc##r##_0)) * acc##r##_1;               \
    StorePartial(act, h + (size_t)(p + (r)) * ffn + f0, ffn - f0);                        \
  }
#define DOWN_STORE(r)                                                                     \
  if ((r) < valid) {                                                                      \
    __global float* out = y + (size_t)(p + (r)) * hidden + c0;                            \
    StorePartial(acc##r##_0, out, hidden - c0);                                           \
    StorePartial(acc##r##_1, out + FFN_VEC, hidden - c0 - FFN_VEC);                       \
  }
// Panel row ku = k + U (2 * FFN_VEC values) as two vectors, bk pointing at panel row k.
#define PANEL_STEP(R, U)                                                                  \
  {                                                                                       \
    const int ku = k + (U);                                                               \
    const floatV b0 = LoadW0(bk, (U));                                                    \
    const floatV b1 = LoadW1(bk, (U));                                                    \
    REP##R(ACC_FMA)                                                                       \
  }
// The n-th 64-byte line from `ahead` when the panel rows of four k-steps span more than n
// lines (FP32: 2 or 4 lines a k-step for FFN_VEC 8 or 16; BF16: half that). Constant
// conditions: one prefetch instruction per line, no loop.
#define PANEL_LINES_PER_4 ((int)(8 * sizeof(*b)) / 64)
#define PREFETCH_LINE(ahead, n) \
  if (PANEL_LINES_PER_4 > (n)) PREFETCH((ahead) + 64 * (n));
#define PREFETCH_HALF_LINE(ahead, n) \
  if (PANEL_LINES_PER_4 / 2 > (n)) PREFETCH((ahead) + 64 * (n));
// The K loop of a register block (next_part 1 or 2: also prefetch the first or second half of
// the panel after this one, which the next work-item of the kernel's order reads, half a
// k-step's lines a k-step; 0: not). Multi-row blocks take four k-steps an iteration through a
// pointer that walks the panel (constant offsets from it and from k), and prefetch each line
// of the panel once, FFN_PREFETCH_STEPS ahead: the loop of one k-step with its index
// arithmetic and two prefetches per step issued about as many instructions as the 6-row
// block's 12 FMAs, which left AVX2 hosts' FMA pipes a fifth idle (bench/kernels/RESULTS.md
// run 11). The 1-row block, which streams the panel from memory, keeps the loop of one step
// (unrolled, it lost about a tenth of its streaming rate on the same host). The summation
// order is k ascending in every block, whatever the blocking.
// Four k-steps an iteration while four remain; NEXT (0 or 1, a constant: each form is its own
// loop, so the one without the next panel's prefetches is the plain loop) adds them.
#define K_LOOP4(R, KEND, NEXT)                                                            \
  for (; k + 4 <= (KEND); k += 4, bk += 8) {                                              \
    if (FFN_PREFETCH_STEPS > 0) {                                                         \
      const __global char* ahead = (const __global char*)(bk + 2 * FFN_PREFETCH_STEPS);   \
      PREFETCH_LINE(ahead, 0) PREFETCH_LINE(ahead, 1) PREFETCH_LINE(ahead, 2)             \
      PREFETCH_LINE(ahead, 3) PREFETCH_LINE(ahead, 4) PREFETCH_LINE(ahead, 5)             \
      PREFETCH_LINE(ahead, 6) PREFETCH_LINE(ahead, 7)                                     \
      if (NEXT) {                                                                         \
        const __global char* next = next_half + k * sizeof(*b);                           \
        PREFETCH_HALF_LINE(next, 0) PREFETCH_HALF_LINE(next, 1)                           \
        PREFETCH_HALF_LINE(next, 2) PREFETCH_HALF_LINE(next, 3)                           \
      }                                                                                   \
    }                                                                                     \
    PANEL_STEP(R, 0) PANEL_STEP(R, 1) PANEL_STEP(R, 2) PANEL_STEP(R, 3)                   \
  }
#define K_LOOP(R, KEND)                                                                   \
  __typeof__(b) bk = b;                                                                   \
  int k = 0;                                                                              \
  if ((R) == 1) {                                                                         \
    for (; k < (KEND); ++k, bk += 2) {                                                    \
      if (FFN_PREFETCH_STEPS > 0) {                                                       \
        PREFETCH(bk + 2 * FFN_PREFETCH_STEPS);                                            \
        PREFETCH(bk + 2 * FFN_PREFETCH_STEPS + 1);                                        \
      }                                                                                   \
      PANEL_STEP(R, 0)                                                                    \
    }                                                                                     \
  }                                                                                       \
  /* half of the next panel: the first block of the tile its first half, the second the    \
     other, half a k-step's lines a k-step */                                             \
  const __global char* next_half = (const __global char*)(b + 2 * (KEND)) +                \
                                   (next_part == 2 ? (KEND) / 2 * 2 * sizeof(*b) : 0);    \
  if (next_part) {                                                                        \
    K_LOOP4(R, KEND, 1)                                                                   \
  } else {                                                                                \
    K_LOOP4(R, KEND, 0)                                                                   \
  }                                                                                       \
  for (; k < (KEND); ++k, bk += 2) PANEL_STEP(R, 0)

// Rows [p, p + R) of the expert (clamped to end - 1; only rows < end are stored):
// h[p', f0 .. f0 + FFN_VEC) = silu(x . gate) * (x . up). x rows are x_stride elements apart.
#define DEFINE_GATE_UP_BLOCK(R, S, XT, WT)                                                 \
  inline void GLUE3(GateUpBlock, R, S)(                                                    \
      const __global XT* restrict x, long x_rows, long x_stride,                           \
      __global const int* restrict row_index, int gather, int p, int end,                  \
      const __global WT* restrict b, int hidden, int ffn, int f0, __global float* restrict h, \
      int few) {                                                                           \
    REP##R(ACC_DECL_GATHER)                                                                \
    const int next_part = few ? (p + (R) >= end ? 2 : 1) : 0;                              \
    K_LOOP(R, hidden)                                                                      \
    const int valid = min((R), end - p);                                                   \
    REP##R(GATE_UP_STORE)                                                                  \
  }

// Rows [p, p + R) of h (clamped to end - 1; only rows < end are stored):
// y[p', c0 .. c0 + 2 * FFN_VEC) = h[p'] . down.
#define DEFINE_DOWN_BLOCK(R, S, WT)                                                        \
  inline void GLUE3(DownBlock, R, S)(const __global float* restrict h, int p, int end,     \
                                     const __global WT* restrict b, int hidden, int ffn,   \
                                     int c0, __global float* restrict y, int few) {        \
    REP##R(ACC_DECL_DIRECT)                                                                \
    const int next_part = few ? (p + (R) >= end ? 2 : 1) : 0;                              \
    K_LOOP(R, ffn)                                                                         \
    const int valid = min((R), end - p);                                                   \
    REP##R(DOWN_STORE)                                                                     \
  }

// The blocks of every size ROW_BLOCKS can call (1 and the blocking's three); a size is
// defined once even where two of them coincide.
#define NEED_ROWS(n) \
  ((n) == 1 || (n) == FFN_ROWS || (n) == FFN_ROWS_HALF || (n) == FFN_ROWS_QUARTER)

// A tile of two register blocks at most (few rows per expert): its first block streams the
// panel and its second reads it from cache, so each block also prefetches half of the next
// panel (the next work-item's in the kernels' order), the first block the first half: memory
// stays busy through both blocks. With the whole next panel prefetched by the second block
// (run 11: 2-15% faster at 8 rows than none), the next work-item's first block found its panel
// in cache and memory idled while it ran: the halves took FP32 weights at 8 rows per expert on
// AVX2 code from 0.52-0.67x to 0.83-0.87x memcpy (bench/kernels/RESULTS.md run 15). Tiles of
// one block, where the only block streams, and of many, where the prefetch would be a small
// share, do not.
#define FEW_ROW_TILE(g) ((g).z - (g).y > FFN_ROWS && (g).z - (g).y <= 2 * FFN_ROWS)

// groups[g] = (local expert, first row, end row, unused) of the g-th tile.
// x [x_rows, x_stride] of XT; rows p of the expert read x[row_index[p]] (gather != 0) or
// x[p]. w: the gate_up panels of WT; h [*, ffn].
#define DEFINE_GATE_UP_KERNEL(S, XT, WT)                                                   \
  __kernel __attribute__((reqd_work_group_size(1, 1, 1))) void GLUE(ffn_gate_up, S)(       \
      __global const XT* restrict x, long x_rows, long x_stride,                           \
      __global const int* restrict row_index, int gather, __global const int4* restrict groups, \
      __global const WT* restrict w, int hidden, int ffn, int num_panels,                  \
      __global float* restrict h) {                                                        \
    const int panel = get_group_id(0);                                                     \
    const int4 g = groups[get_group_id(1)];                                                \
    const __global WT* b = w + ((size_t)g.x * num_panels + panel) * (size_t)hidden * 2;    \
    const int f0 = panel * FFN_VEC;                                                        \
    const int end = g.z;                                                                   \
    const int few = FEW_ROW_TILE(g);                                                       \
    ROW_BLOCKS(GateUpBlock, S,                                                             \
               (x, x_rows, x_stride, row_index, gather, p, end, b, hidden, ffn, f0, h, few))  \
  }

// h [*, ffn] rows of each group -> y [*, hidden]; w: the down panels of WT.
#define DEFINE_DOWN_KERNEL(S, WT)                                                          \
  __kernel __attribute__((reqd_work_group_size(1, 1, 1))) void GLUE(ffn_down, S)(          \
      __global const float* restrict h, __global const int4* restrict groups,              \
      __global const WT* restrict w, int hidden, int ffn, int num_panels,                  \
      __global float* restrict y) {                                                        \
    const int panel = get_group_id(0);                                                     \
    const int4 g = groups[get_group_id(1)];                                                \
    const __global WT* b = w + ((size_t)g.x * num_panels + panel) * (size_t)ffn * 2;       \
    const int c0 = panel * 2 * FFN_VEC;                                                    \
    const int end = g.z;                                                                   \
    const int few = FEW_ROW_TILE(g);                                                       \
    ROW_BLOCKS(DownBlock, S, (h, p, end, b, hidden, ffn, c0, y, few))                      \
  }

// Every block size of the program's weight types (FP32 panel rows are two floatV, BF16 ones
// two ushortV).
#define DEFINE_BLOCKS(R, S, WT) DEFINE_GATE_UP_BLOCK(R, S, float, WT) DEFINE_DOWN_BLOCK(R, S, WT)
#if FFN_HAS(1)
#define DEFINE_BLOCKS_WF32(R) DEFINE_BLOCKS(R, _wf32, floatV)
#else
#define DEFINE_BLOCKS_WF32(R)
#endif
#if FFN_HAS(2)
#define DEFINE_BLOCKS_WBF16(R) DEFINE_BLOCKS(R, _wbf16, ushortV)
#else
#define DEFINE_BLOCKS_WBF16(R)
#endif
#define DEFINE_ALL_BLOCKS(R) DEFINE_BLOCKS_WF32(R) DEFINE_BLOCKS_WBF16(R)
#if NEED_ROWS(1)
DEFINE_ALL_BLOCKS(1)
#endif
#if NEED_ROWS(2)
DEFINE_ALL_BLOCKS(2)
#endif
#if NEED_ROWS(3)
DEFINE_ALL_BLOCKS(3)
#endif
#if NEED_ROWS(4)
DEFINE_ALL_BLOCKS(4)
#endif
#if NEED_ROWS(5)
DEFINE_ALL_BLOCKS(5)
#endif
#if NEED_ROWS(6)
DEFINE_ALL_BLOCKS(6)
#endif
#if NEED_ROWS(7)
DEFINE_ALL_BLOCKS(7)
#endif
#if NEED_ROWS(8)
DEFINE_ALL_BLOCKS(8)
#endif
#if NEED_ROWS(9)
DEFINE_ALL_BLOCKS(9)
#endif
#if NEED_ROWS(10)
DEFINE_ALL_BLOCKS(10)
#endif
#if NEED_ROWS(11)
DEFINE_ALL_BLOCKS(11)
#endif
#if NEED_ROWS(12)
DEFINE_ALL_BLOCKS(12)
#endif
#if NEED_ROWS(13)
DEFINE_ALL_BLOCKS(13)
#endif
#if NEED_ROWS(14)
DEFINE_ALL_BLOCKS(14)
#endif
#if NEED_ROWS(15)
DEFINE_ALL_BLOCKS(15)
#endif
#if NEED_ROWS(16)
DEFINE_ALL_BLOCKS(16)
#endif

#if FFN_HAS(1)
DEFINE_GATE_UP_KERNEL(_wf32, float, floatV)
DEFINE_DOWN_KERNEL(_wf32, floatV)
#endif
#if FFN_HAS(2)
DEFINE_GATE_UP_KERNEL(_wbf16, float, ushortV)
DEFINE_DOWN_KERNEL(_wbf16, ushortV)

// out[p, :] = x[row_index[p], :] widened from BF16 (exact), for p < num_rows; x rows are
// x_stride values apart, out rows hidden. One work-item per row.
__kernel void gather_bf16_rows(__global const ushort* restrict x, long x_rows, long x_stride,
                               __global const int* restrict row_index, int num_rows, int hidden,
                               __global float* restrict out) {
  const int p = get_global_id(0);
  if (p >= num_rows) return;
  const __global ushort* src = x + SourceRow(row_index, 1, p, x_rows) * (size_t)x_stride;
  __global float* dst = out + (size_t)p * hidden;
  int c = 0;
  for (; c + 16 <= hidden; c += 16) {
    vstore16(as_float16(convert_uint16(vload16(0, src + c)) << 16), 0, dst + c);
  }
  for (; c < hidden; ++c) dst[c] = as_float((uint)src[c] << 16);
}
#endif  // FFN_HAS(2)

// ---- BF16 dot products on x86 CPUs with AVX512-BF16 (-DFFN_BF16_DOT=1) ----
//
// vdpbf16ps multiplies 32 pairs of BF16 values and adds each pair's two products to one of
// 16 FP32 sums: twice the multiply-adds of an FP32 FMA per instruction, with no widening of
// the weights. Both operands are BF16, so x and h = silu(gate x) * up x are rounded to BF16
// (nearest even) before their GEMM, as BF16 GEMM libraries do; every sum stays FP32.
//
// Weight layout (kernels/detail/ffn_layout.h, "pair panels"): the panels of the FP32 layout
// over K in steps of two: for each k pair (2j, 2j + 1) a panel row holds 64 BF16 values, two
// vectors of 16 columns, each column's two values adjacent (K odd: a zero value pads the last
// pair). Activations: BF16 rows of an even number of values (zero padded), each k pair one
// 32-bit word that is broadcast to all 16 lanes.
//
// The block functions carry the target feature and are called from the kernels (a function
// built for a feature the caller lacks is not inlined into it); each call runs a whole
// K loop, so the call costs nothing that shows.
//
// FFN_DOT_OP says how the products of a pair are made (kernels/ffn_blocking.h, DotOp): 0 as
// the program's options say (AMX tiles under FFN_BF16_AMX, else vdpbf16ps), 1 vdpbf16ps, 2
// FP32 FMAs on the pair's two values widened (a shift and a mask each), the same weights and
// BF16 activations: at one row, where the weights' stream bounds every form, FMAs have run
// faster than the dot products on some CPUs. The runtime times the three per row class.
#if FFN_BF16_DOT && FFN_HAS(3)
#ifndef FFN_DOT_OP
#define FFN_DOT_OP 0
#endif
#if FFN_DOT_OP != 0
#undef FFN_BF16_AMX
#define FFN_BF16_AMX 0
#endif
#define DOT_TARGET __attribute__((target("avx512bf16")))

inline uint16 Bf16Round16(float16 v) {
  const uint16 u = as_uint16(v);
  return (u + (uint16)(0x7fffu) + ((u >> 16) & (uint16)(1u))) >> 16;
}
inline uint Bf16Round(float v) {
  const uint u = as_uint(v);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

#define DOT_ACC_DECL(r)                                                 \
  const __global uint* a##r = x + (size_t)min(p + (r), end - 1) * kp2; \
  float16 acc##r##_0 = (float16)(0.0f);                                 \
  float16 acc##r##_1 = (float16)(0.0f);
// acc + the pair products of a and b (16 FP32 sums of 32 BF16 pairs). clang 16 and later
// take the builtin's operands as 32 __bf16 rather than 16 ints; for them the instruction is
// written out (FFN_BF16_DOT_ASM, chosen by the runtime's probe, kernels/device.cc).
DOT_TARGET inline float16 Dpbf16(float16 acc, int16 a, int16 b) {
#if FFN_DOT_OP == 2
  const uint16 ua = as_uint16(a), ub = as_uint16(b);
  const uint16 high = (uint16)(0xffff0000u);
  acc = fma(as_float16(ua << 16), as_float16(ub << 16), acc);
  return fma(as_float16(ua & high), as_float16(ub & high), acc);
#elif FFN_BF16_DOT_ASM
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#else
  return __builtin_ia32_dpbf16ps_512(acc, a, b);
#endif
}
#define DOT_FMA(r)                                                      \
  {                                                                     \
    const int16 av = (int16)(as_int(a##r[k]));                          \
    acc##r##_0 = Dpbf16(acc##r##_0, av, b0);                            \
    acc##r##_1 = Dpbf16(acc##r##_1, av, b1);                            \
  }
// One k pair of the panel (b0, b1: its two halves) into R rows' sums, each row's pair
// broadcast by FMA(r).
#define DOT_STEP_OF(R, FMA)                                             \
  PREFETCH(b + 2 * (k + 64));                                           \
  PREFETCH(b + 2 * (k + 64) + 1);                                       \
  const int16 b0 = b[2 * k];                                            \
  const int16 b1 = b[2 * k + 1];                                        \
  REP##R(FMA)
#define DOT_STEP(R) DOT_STEP_OF(R, DOT_FMA)
// The dot kernels' own row blocks: 12 rows, then 12, 8 or 4 for the rest (their blocking is
// fixed: they run only on AVX-512 hosts, whose 32 vector registers hold 12 x 2 sums).
#if FFN_BF16_AMX
// With AMX tiles every row goes through them, 16 rows a tile (fewer for the last).
#define DOT_ROW_BLOCKS(PREFIX, ARGS)                                                  \
  for (int p = g.y; p < end; p += 16) GLUE(PREFIX, _amx) ARGS;
#else
#define DOT_ROW_BLOCKS(PREFIX, ARGS)                                                  \
  int p = g.y;                                                                        \
  for (; p + 12 <= end; p += 12) GLUE3(PREFIX, 12, _dot) ARGS;                        \
  const int rest = end - p;                                                           \
  if (rest > 8) {                                                                     \
    GLUE3(PREFIX, 12, _dot) ARGS;                                                     \
  } else if (rest > 4) {                                                              \
    GLUE3(PREFIX, 8, _dot) ARGS;                                                      \
  } else if (rest > 0) {                                                              \
    GLUE3(PREFIX, 4, _dot) ARGS;                                                      \
  }
#endif
#define DOT_DOWN_STORE(r)                                                             \
  if ((r) < valid) {                                                                  \
    __global float* out = y + (size_t)(p + (r)) * hidden + c0;                        \
    StorePartial(acc##r##_0, out, hidden - c0);                                       \
    StorePartial(acc##r##_1, out + 16, hidden - c0 - 16);                             \
  }
// h[row, f0 .. f0 + 16) = BF16(silu(gate) * up), rows h_stride values apart (only the
// columns before h_stride).
inline void StoreSwiGlu(float16 gate, float16 up, __global ushort* restrict h, int row,
                        int h_stride, int f0) {
  const float16 act = gate / (1.0f + exp(-gate)) * up;
  StorePartial(convert_ushort16(Bf16Round16(act)), h + (size_t)row * h_stride + f0,
               h_stride - f0);
}
#define DOT_GATE_UP_STORE(r) \
  if ((r) < valid) StoreSwiGlu(acc##r##_0, acc##r##_1, h, p + (r), h_stride, f0);

// x: BF16 rows of 2 * kp2 values (kp2 k pairs, as uint); b: the panel, int16 per half row.
// h[p', f0 .. f0 + 16) = BF16(silu(x . gate) * (x . up)), rows h_stride values apart (the
// columns past F come out 0: their weights are zero).
#define DEFINE_DOT_GATE_UP_BLOCK(R)                                                        \
  DOT_TARGET void GLUE3(GateUpBlock, R, _dot)(const __global uint* restrict x, int kp2, int p, \
                                          int end, const __global int16* restrict b,       \
                                          int f0, __global ushort* restrict h,             \
                                          int h_stride) {                                  \
    REP##R(DOT_ACC_DECL)                                                                   \
    for (int k = 0; k < kp2; ++k) {                                                        \
      DOT_STEP(R)                                                                          \
    }                                                                                      \
    const int valid = min((R), end - p);                                                   \
    REP##R(DOT_GATE_UP_STORE)                                                              \
  }
// h: BF16 rows of 2 * kp2 values; y[p', c0 .. c0 + 32) = h[p'] . down (FP32).
#define DEFINE_DOT_DOWN_BLOCK(R)                                                           \
  DOT_TARGET void GLUE3(DownBlock, R, _dot)(const __global uint* restrict x, int kp2, int p,   \
                                        int end, const __global int16* restrict b,         \
                                        int hidden, int c0, __global float* restrict y) {  \
    REP##R(DOT_ACC_DECL)                                                                   \
    for (int k = 0; k < kp2; ++k) {                                                        \
      DOT_STEP(R)                                                                          \
    }                                                                                      \
    const int valid = min((R), end - p);                                                   \
    REP##R(DOT_DOWN_STORE)                                                                     \
  }
DEFINE_DOT_GATE_UP_BLOCK(4)
DEFINE_DOT_GATE_UP_BLOCK(8)
DEFINE_DOT_GATE_UP_BLOCK(12)
DEFINE_DOT_DOWN_BLOCK(4)
DEFINE_DOT_DOWN_BLOCK(8)
DEFINE_DOT_DOWN_BLOCK(12)

// ---- The gate_up dot kernel straight from x's rows (tiles of at most DOT_DIRECT_ROWS rows) ----
//
// The staged form costs a launch of its own (gather_rows_to_bf16_pairs) before gate_up, and a
// launch on a CPU driver costs tens of microseconds whatever it does: 50-100 us of a 1-row
// FFN call's 0.7-0.8 ms on a 16-thread Sapphire Rapids (bench/kernels/RESULTS.md run 16). With
// few rows per tile each work-item rounds its own rows instead, 16 k pairs at a time into
// private memory, and broadcasts from there as the staged form does from the gathered rows
// (with AMX tiles: loads its x tile from there). Every panel rounds the rows again, which
// costs nothing that shows while the panel's stream is what bounds the block, and would at
// many rows (then the staged form runs).
#if DOT_DIRECT_ROWS != 8
#error "the direct dot blocks are 1, 4 and 8 rows: DOT_DIRECT_ROWS must be 8"
#endif

// out[0, 16) = BF16 pairs k0 .. k0 + 16 of x's row at `row` (an offset in values): FP32
// rounded to nearest even, or BF16 as is; values at or past `hidden` are zero.
inline void StagePairs(const __global void* restrict x, int x_bf16, size_t row, int hidden,
                       int k0, __private uint* restrict out) {
  const int c = 2 * k0;
  const __global float* xf = (const __global float*)x + row;
  const __global ushort* xh = (const __global ushort*)x + row;
  if (c + 32 <= hidden) {
    uint16 lo, hi;
    if (x_bf16) {
      lo = convert_uint16(vload16(0, xh + c));
      hi = convert_uint16(vload16(0, xh + c + 16));
    } else {
      lo = Bf16Round16(vload16(0, xf + c));
      hi = Bf16Round16(vload16(0, xf + c + 16));
    }
    vstore8(lo.even | (lo.odd << 16), 0, out);
    vstore8(hi.even | (hi.odd << 16), 0, out + 8);
    return;
  }
  for (int j = 0; j < 16; ++j) {
    const int c0 = c + 2 * j, c1 = c0 + 1;
    const uint v0 = c0 >= hidden ? 0u : x_bf16 ? (uint)xh[c0] : Bf16Round(xf[c0]);
    const uint v1 = c1 >= hidden ? 0u : x_bf16 ? (uint)xh[c1] : Bf16Round(xf[c1]);
    out[j] = v0 | (v1 << 16);
  }
}

#define XDOT_ROW_DECL(r)                                                                   \
  const size_t src##r =                                                                     \
      SourceRow(row_index, gather, min(p + (r), end - 1), x_rows) * (size_t)x_stride;       \
  float16 acc##r##_0 = (float16)(0.0f);                                                     \
  float16 acc##r##_1 = (float16)(0.0f);
#define XDOT_STAGE(r) StagePairs(x, x_bf16, src##r, hidden, k0, xs + (r) * 16);
#define XDOT_FMA(r)                                                                        \
  {                                                                                        \
    const int16 av = (int16)(as_int(xs[(r) * 16 + kk]));                                   \
    acc##r##_0 = Dpbf16(acc##r##_0, av, b0);                                               \
    acc##r##_1 = Dpbf16(acc##r##_1, av, b1);                                               \
  }
// The gate_up block of DEFINE_DOT_GATE_UP_BLOCK over rows [p, min(p + R, end)) read from x
// (through row_index when `gather`) rather than from staged BF16 rows.
#define DEFINE_XDOT_GATE_UP_BLOCK(R)                                                        \
  DOT_TARGET void GLUE3(GateUpXBlock, R, _dot)(                                             \
      const __global void* restrict x, int x_bf16, long x_rows, long x_stride,              \
      const __global int* restrict row_index, int gather, int hidden, int kp2, int p,       \
      int end, const __global int16* restrict b, int f0, __global ushort* restrict h,       \
      int h_stride) {                                                                       \
    REP##R(XDOT_ROW_DECL)                                                                   \
    __private uint xs[(R) * 16] __attribute__((aligned(64)));                               \
    for (int k0 = 0; k0 < kp2; k0 += 16) {                                                  \
      REP##R(XDOT_STAGE)                                                                    \
      const int steps = min(16, kp2 - k0);                                                  \
      for (int kk = 0; kk < steps; ++kk) {                                                  \
        const int k = k0 + kk;                                                              \
        DOT_STEP_OF(R, XDOT_FMA)                                                            \
      }                                                                                     \
    }                                                                                       \
    const int valid = min((R), end - p);                                                    \
    REP##R(DOT_GATE_UP_STORE)                                                               \
  }
#if !FFN_BF16_AMX
DEFINE_XDOT_GATE_UP_BLOCK(1)
DEFINE_XDOT_GATE_UP_BLOCK(4)
DEFINE_XDOT_GATE_UP_BLOCK(8)
#endif

#if FFN_BF16_AMX
// ---- AMX tiles (-DFFN_BF16_AMX=1: x86 CPUs with AMX-BF16 whose process holds the tile
// state, kernels/device.cc HostRunsAmx) ----
//
// tdpbf16ps multiplies a tile of up to 16 rows x 16 k pairs of x by a tile of 16 k pairs x 16
// columns of weights (each column's pair adjacent: one pair-panel half row is one tile row)
// into 16 x 16 FP32 sums, 8192 multiply-adds an instruction. A block of up to 16 rows keeps
// two sum tiles (the panel's two halves: gate and up, or its two 16-column groups of down),
// walks K 16 pairs a step (tile 2: x's rows, kp2 pairs apart; tiles 3 and 4: the panel's two
// halves, rows 128 bytes apart), stores the sums to private memory and finishes there: the
// pairs past the last whole step through vdpbf16ps, then the same activation and stores as
// the dot blocks. OpenCL C has no tile types, so the instructions are spelled out; the sums
// are FP32 as with the dot products (AMX rounds each product pair's sum its own way, so the
// bits differ from vdpbf16ps's; the tests compare both with the reference at BF16's bound).
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

// Tiles 0-4 of `rows` rows (sums and x) or 16 (weights), 64 bytes each.
inline void AmxConfig(__private uchar* cfg, int rows) {
  for (int i = 0; i < 64; ++i) cfg[i] = 0;
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 5; ++t) {
    cfg[16 + 2 * t] = 64;                       // bytes a row
    cfg[48 + t] = (uchar)(t >= 3 ? 16 : rows);  // rows
  }
}

// The steps of a block's tile sums, each its own statement (the compiler allocates no tile
// registers, so the tiles keep their state from one to the next): AmxBegin loads the
// configuration and zeroes the sums (tiles 0 and 1); AmxStep loads x's tile (2, rows x_stride
// bytes apart) and the panel's two halves of one step (3, 4) and adds their products;
// AmxEnd stores the sums (64 bytes a row) and releases the tiles.
AMX_TARGET inline void AmxBegin(const __private uchar* cfg) {
  __asm__ volatile("ldtilecfg (%0)\n\ttilezero %%tmm0\n\ttilezero %%tmm1" ::"r"((ulong)cfg)
                   : "memory");
}
AMX_TARGET inline void AmxStep(ulong xk, ulong x_stride, ulong bk) {
  __asm__ volatile(
      "tileloadd (%0,%1,1), %%tmm2\n\t"
      "tileloadd (%2,%3,1), %%tmm3\n\t"
      "tileloadd 64(%2,%3,1), %%tmm4\n\t"
      "tdpbf16ps %%tmm3, %%tmm2, %%tmm0\n\t"
      "tdpbf16ps %%tmm4, %%tmm2, %%tmm1" ::"r"(xk),
      "r"(x_stride), "r"(bk), "r"((ulong)128)
      : "memory");
}
AMX_TARGET inline void AmxEnd(ulong s0, ulong s1) {
  __asm__ volatile(
      "tilestored %%tmm0, (%0,%2,1)\n\t"
      "tilestored %%tmm1, (%1,%2,1)\n\t"
      "tilerelease" ::"r"(s0),
      "r"(s1), "r"((ulong)64)
      : "memory");
}

// A streamed panel (the last tile of a work tile; the others find it in cache) is prefetched
// AMX_PREFETCH_STEPS steps (of 2 KiB) ahead: a tile load's sixteen 64-byte rows 128 bytes
// apart are no pattern the hardware prefetchers follow far.
#define AMX_PREFETCH_STEPS 4
inline void AmxPrefetch(const __global char* b, int step) {
  const __global char* ahead = b + (size_t)(step + AMX_PREFETCH_STEPS) * 2048;
  for (int l = 0; l < 2048; l += 64) PREFETCH(ahead + l);
}

// s0/s1 [rows][16] = x[rows][0, 16 * steps) pairs . the panel's halves; `stream`: the panel
// comes from memory.
AMX_TARGET void AmxSums(const __private uchar* cfg, ulong x, ulong x_stride,
                        const __global char* b, int steps, int stream, ulong s0, ulong s1) {
  AmxBegin(cfg);
  for (int i = 0; i < steps; ++i) {
    if (stream) AmxPrefetch(b, i);
    AmxStep(x + (ulong)i * 64, x_stride, (ulong)b + (ulong)i * 2048);
  }
  AmxEnd(s0, s1);
}

// Row r's two sum vectors: the tiles' sums plus the pairs [kt, kp2) through vdpbf16ps.
#define AMX_ROW_SUMS(r)                                                                   \
  float16 acc0 = vload16(r, s0), acc1 = vload16(r, s1);                                    \
  for (int k = kt; k < kp2; ++k) {                                                         \
    const int16 av = (int16)(as_int(x[(size_t)(p + (r)) * kp2 + k]));                      \
    acc0 = Dpbf16(acc0, av, b[2 * k]);                                                     \
    acc1 = Dpbf16(acc1, av, b[2 * k + 1]);                                                 \
  }

// A block's rows (up to 16 from p) through the tiles: rows, kt (the pairs the tiles took) and
// the sums s0, s1 [rows][16] of the panel's two halves.
#define AMX_BLOCK_SUMS                                                                     \
  const int rows = min(16, end - p);                                                       \
  __private uchar cfg[64] __attribute__((aligned(64)));                                    \
  __private float s0[256] __attribute__((aligned(64)));                                    \
  __private float s1[256] __attribute__((aligned(64)));                                    \
  AmxConfig(cfg, rows);                                                                    \
  const int kt = kp2 & ~15;                                                                \
  AmxSums(cfg, (ulong)(x + (size_t)p * kp2), (ulong)kp2 * 4, (const __global char*)b, kt / 16, \
          p + 16 >= end, (ulong)s0, (ulong)s1);

AMX_TARGET void GateUpBlock_amx(const __global uint* restrict x, int kp2, int p, int end,
                                const __global int16* restrict b, int f0,
                                __global ushort* restrict h, int h_stride) {
  AMX_BLOCK_SUMS
  for (int r = 0; r < rows; ++r) {
    AMX_ROW_SUMS(r)
    StoreSwiGlu(acc0, acc1, h, p + r, h_stride, f0);
  }
}

AMX_TARGET void DownBlock_amx(const __global uint* restrict x, int kp2, int p, int end,
                              const __global int16* restrict b, int hidden, int c0,
                              __global float* restrict y) {
  AMX_BLOCK_SUMS
  for (int r = 0; r < rows; ++r) {
    AMX_ROW_SUMS(r)
    __global float* out = y + (size_t)(p + r) * hidden + c0;
    StorePartial(acc0, out, hidden - c0);
    StorePartial(acc1, out + 16, hidden - c0 - 16);
  }
}

// AmxSums with x's tile rounded from x's rows (offsets src[0, rows), in values) into private
// memory at each step (StagePairs) rather than loaded from staged BF16 rows; the panel
// streams (one tile of rows is the whole work tile).
AMX_TARGET void AmxSumsX(const __private uchar* cfg, const __global void* restrict x, int x_bf16,
                         const __private size_t* src, int rows, int hidden,
                         const __global char* b, int steps, ulong s0, ulong s1) {
  __private uint xt[16 * 16] __attribute__((aligned(64)));
  AmxBegin(cfg);
  for (int i = 0; i < steps; ++i) {
    AmxPrefetch(b, i);
    for (int r = 0; r < rows; ++r) StagePairs(x, x_bf16, src[r], hidden, i * 16, xt + r * 16);
    AmxStep((ulong)xt, 64, (ulong)b + (ulong)i * 2048);
  }
  AmxEnd(s0, s1);
}

// GateUpBlock_amx over rows [p, end) (at most 16) read from x as ffn_gate_up_x_dot takes it.
AMX_TARGET void GateUpXBlock_amx(const __global void* restrict x, int x_bf16, long x_rows,
                                 long x_stride, const __global int* restrict row_index,
                                 int gather, int hidden, int kp2, int p, int end,
                                 const __global int16* restrict b, int f0,
                                 __global ushort* restrict h, int h_stride) {
  const int rows = min(16, end - p);
  __private size_t src[16];
  for (int r = 0; r < rows; ++r) {
    src[r] = SourceRow(row_index, gather, p + r, x_rows) * (size_t)x_stride;
  }
  __private uchar cfg[64] __attribute__((aligned(64)));
  __private float s0[256] __attribute__((aligned(64)));
  __private float s1[256] __attribute__((aligned(64)));
  AmxConfig(cfg, rows);
  const int kt = kp2 & ~15;
  AmxSumsX(cfg, x, x_bf16, src, rows, hidden, (const __global char*)b, kt / 16, (ulong)s0,
           (ulong)s1);
  __private uint rest[16] __attribute__((aligned(64)));
  for (int r = 0; r < rows; ++r) {
    float16 acc0 = vload16(r, s0), acc1 = vload16(r, s1);
    if (kt < kp2) StagePairs(x, x_bf16, src[r], hidden, kt, rest);
    for (int k = kt; k < kp2; ++k) {
      const int16 av = (int16)(as_int(rest[k - kt]));
      acc0 = Dpbf16(acc0, av, b[2 * k]);
      acc1 = Dpbf16(acc1, av, b[2 * k + 1]);
    }
    StoreSwiGlu(acc0, acc1, h, p + r, h_stride, f0);
  }
}
#endif  // FFN_BF16_AMX

// xb: the BF16 rows of x in group order [*, 2 * kp_hidden]; h: BF16 [*, 2 * kp_ffn].
__kernel __attribute__((reqd_work_group_size(1, 1, 1))) void ffn_gate_up_dot(
    __global const uint* restrict xb, int kp_hidden, __global const int4* restrict groups,
    __global const int16* restrict w, int num_panels, __global ushort* restrict h, int kp_ffn) {
  const int panel = get_group_id(0);
  const int4 g = groups[get_group_id(1)];
  const __global int16* b = w + ((size_t)g.x * num_panels + panel) * (size_t)kp_hidden * 2;
  const int f0 = panel * 16;
  const int end = g.z;
  DOT_ROW_BLOCKS(GateUpBlock, (xb, kp_hidden, p, end, b, f0, h, 2 * kp_ffn))
}

// ffn_gate_up_dot on tiles of at most DOT_DIRECT_ROWS rows, reading x itself: FP32
// (x_bf16 == 0) or BF16 rows x_stride values apart, row p of the tiles at row_index[p] when
// `gather` (else p), clamped to x's x_rows rows.
__kernel __attribute__((reqd_work_group_size(1, 1, 1))) void ffn_gate_up_x_dot(
    __global const void* restrict x, int x_bf16, long x_rows, long x_stride,
    __global const int* restrict row_index, int gather, int hidden, int kp_hidden,
    __global const int4* restrict groups, __global const int16* restrict w, int num_panels,
    __global ushort* restrict h, int kp_ffn) {
  const int panel = get_group_id(0);
  const int4 g = groups[get_group_id(1)];
  const __global int16* b = w + ((size_t)g.x * num_panels + panel) * (size_t)kp_hidden * 2;
  const int f0 = panel * 16;
  const int p = g.y, end = g.z;
  const int rows = end - p;
#define XDOT_ARGS (x, x_bf16, x_rows, x_stride, row_index, gather, hidden, kp_hidden, p, end, b, \
                   f0, h, 2 * kp_ffn)
#if FFN_BF16_AMX
  if (rows > 0) GateUpXBlock_amx XDOT_ARGS;
#else
  if (rows > 4) {
    GateUpXBlock8_dot XDOT_ARGS;
  } else if (rows > 1) {
    GateUpXBlock4_dot XDOT_ARGS;
  } else if (rows == 1) {
    GateUpXBlock1_dot XDOT_ARGS;
  }
#endif
#undef XDOT_ARGS
}

__kernel __attribute__((reqd_work_group_size(1, 1, 1))) void ffn_down_dot(
    __global const uint* restrict h, int kp_ffn, __global const int4* restrict groups,
    __global const int16* restrict w, int hidden, int num_panels, __global float* restrict y) {
  const int panel = get_group_id(0);
  const int4 g = groups[get_group_id(1)];
  const __global int16* b = w + ((size_t)g.x * num_panels + panel) * (size_t)kp_ffn * 2;
  const int c0 = panel * 32;
  const int end = g.z;
  DOT_ROW_BLOCKS(DownBlock, (h, kp_ffn, p, end, b, hidden, c0, y))
}

// out[p, 0 .. k_pad) = BF16 of x[row_index[p] (gather) or p, 0 .. hidden), zero beyond
// hidden, for p < num_rows. x is FP32 (x_bf16 == 0) or BF16, rows x_stride values apart.
// One work-item per row (the arguments of gather_rows_to_bf16 in expert_ffn_mma.cl).
__kernel void gather_rows_to_bf16_pairs(__global const void* restrict x, int x_bf16, long x_rows,
                                        long x_stride, __global const int* restrict row_index,
                                        int gather, int num_rows, int hidden, int k_pad,
                                        __global ushort* restrict out) {
  const int p = get_global_id(0);
  if (p >= num_rows) return;
  const size_t row = SourceRow(row_index, gather, p, x_rows);
  __global ushort* dst = out + (size_t)p * k_pad;
  int c = 0;
  if (x_bf16) {
    const __global ushort* src = (const __global ushort*)x + row * (size_t)x_stride;
    for (; c + 16 <= hidden; c += 16) vstore16(vload16(0, src + c), 0, dst + c);
    for (; c < hidden; ++c) dst[c] = src[c];
  } else {
    const __global float* src = (const __global float*)x + row * (size_t)x_stride;
    for (; c + 16 <= hidden; c += 16) {
      vstore16(convert_ushort16(Bf16Round16(vload16(0, src + c))), 0, dst + c);
    }
    for (; c < hidden; ++c) dst[c] = (ushort)Bf16Round(src[c]);
  }
  for (; c < k_pad; ++c) dst[c] = 0;
}
#endif  // FFN_BF16_DOT && FFN_HAS(3)
