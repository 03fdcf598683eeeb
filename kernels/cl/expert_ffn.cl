// Expert FFN as grouped GEMMs over expert-major rows. Weight layout: kernels/detail/ffn_layout.h
// (column panels of 32 floats per k-step).
//
// One work-item (= one work-group of size 1) per (panel, tile), a tile being up to
// kFfnRowChunk rows of one expert. It walks its rows in register blocks of FFN_ROWS rows
// (blocks of 8 or 4 for the remainder) times the 32 panel columns, so that the panel is read
// from memory once per tile and then from cache, and the tile's rows of x stay in cache
// while consecutive work-items walk the other panels. Every output element is written by
// exactly one work-item with a fixed summation order: results are bit-identical run to run.

#ifndef FFN_PANEL_VECS
#define FFN_PANEL_VECS 2
#endif
#ifndef FFN_ROWS
#define FFN_ROWS 12
#endif
#if FFN_PANEL_VECS != 2
#error "expert_ffn.cl is written for FFN_PANEL_VECS == 2 (32-float panel rows)"
#endif
#if FFN_ROWS != 12 && FFN_ROWS != 8
#error "FFN_ROWS must be 8 or 12"
#endif
#define NV FFN_PANEL_VECS
#ifndef FFN_PREFETCH_VECS
#define FFN_PREFETCH_VECS 128
#endif

// The register block is spelled out row by row (REPn) so that its accumulators are plain
// variables the compiler keeps in vector registers.
#define REP4(M) M(0) M(1) M(2) M(3)
#define REP8(M) REP4(M) M(4) M(5) M(6) M(7)
#define REP12(M) REP8(M) M(8) M(9) M(10) M(11)

// Stores v[0, 16) to dst[0, min(16, limit)).
inline void StorePartial16(float16 v, __global float* dst, int limit) {
  if (limit >= 16) {
    vstore16(v, 0, dst);
    return;
  }
  float tmp[16];
  vstore16(v, 0, tmp);
  for (int l = 0; l < limit; ++l) dst[l] = tmp[l];
}

inline size_t SourceRow(__global const int* row_index, int gather, int p, long x_rows) {
  long row = gather ? (long)row_index[p] : (long)p;
  row = row < 0 ? 0 : (row >= x_rows ? x_rows - 1 : row);  // stay inside x whatever we get
  return (size_t)row;
}

// Row r of the block: its A pointer and two accumulators (16 outputs each).
#define ACC_DECL_GATHER(r)                                                                \
  const __global float* a##r =                                                            \
      x + SourceRow(row_index, gather, min(p + (r), end - 1), x_rows) * (size_t)hidden;   \
  float16 acc##r##_0 = (float16)(0.0f);                                                   \
  float16 acc##r##_1 = (float16)(0.0f);
#define ACC_DECL_DIRECT(r)                                                                \
  const __global float* a##r = h + (size_t)min(p + (r), end - 1) * (size_t)ffn;           \
  float16 acc##r##_0 = (float16)(0.0f);                                                   \
  float16 acc##r##_1 = (float16)(0.0f);
#define ACC_FMA(r)                                                                        \
  {                                                                                       \
    const float16 av = (float16)(a##r[k]);                                                \
    acc##r##_0 = fma(av, b0, acc##r##_0);                                                 \
    acc##r##_1 = fma(av, b1, acc##r##_1);                                                 \
  }
// gate_up: acc_0 holds gate, acc_1 up of 16 consecutive f.
#define GATE_UP_STORE(r)                                                                  \
  if ((r) < valid) {                                                                      \
    const float16 act = acc##r##_0 / (1.0f + exp(-acc##r##_0)) * acc##r##_1;              \
    StorePartial16(act, h + (size_t)(p + (r)) * ffn + f0, ffn - f0);                      \
  }
#define DOWN_STORE(r)                                                                     \
  if ((r) < valid) {                                                                      \
    __global float* out = y + (size_t)(p + (r)) * hidden + c0;                            \
    StorePartial16(acc##r##_0, out, hidden - c0);                                         \
    StorePartial16(acc##r##_1, out + 16, hidden - c0 - 16);                               \
  }

// Rows [p, p + R) of the expert (clamped to end - 1; only rows < end are stored):
// h[p', f0 .. f0 + 16) = silu(x . gate) * (x . up).
#define DEFINE_GATE_UP_BLOCK(R)                                                          \
  inline void GateUpBlock##R(const __global float* restrict x, long x_rows,              \
                             __global const int* restrict row_index, int gather, int p,  \
                             int end, const __global float16* restrict b, int hidden,    \
                             int ffn, int f0, __global float* restrict h) {              \
    REP##R(ACC_DECL_GATHER)                                                              \
    for (int k = 0; k < hidden; ++k) {                                                   \
      __builtin_prefetch(b + 2 * k + FFN_PREFETCH_VECS);                                 \
      __builtin_prefetch(b + 2 * k + FFN_PREFETCH_VECS + 1);                             \
      const float16 b0 = b[2 * k];                                                       \
      const float16 b1 = b[2 * k + 1];                                                   \
      REP##R(ACC_FMA)                                                                    \
    }                                                                                    \
    const int valid = min((R), end - p);                                                 \
    REP##R(GATE_UP_STORE)                                                                \
  }

// Rows [p, p + R) of h (clamped to end - 1; only rows < end are stored):
// y[p', c0 .. c0 + 32) = h[p'] . down.
#define DEFINE_DOWN_BLOCK(R)                                                             \
  inline void DownBlock##R(const __global float* restrict h, int p, int end,             \
                           const __global float16* restrict b, int hidden, int ffn,      \
                           int c0, __global float* restrict y) {                         \
    REP##R(ACC_DECL_DIRECT)                                                              \
    for (int k = 0; k < ffn; ++k) {                                                      \
      __builtin_prefetch(b + 2 * k + FFN_PREFETCH_VECS);                                 \
      __builtin_prefetch(b + 2 * k + FFN_PREFETCH_VECS + 1);                             \
      const float16 b0 = b[2 * k];                                                       \
      const float16 b1 = b[2 * k + 1];                                                   \
      REP##R(ACC_FMA)                                                                    \
    }                                                                                    \
    const int valid = min((R), end - p);                                                 \
    REP##R(DOWN_STORE)                                                                   \
  }

#define DEFINE_BLOCKS(R) \
  DEFINE_GATE_UP_BLOCK(R) \
  DEFINE_DOWN_BLOCK(R)
#define DEFINE_BLOCKS_EXPANDED(R) DEFINE_BLOCKS(R)

DEFINE_BLOCKS(4)
DEFINE_BLOCKS(8)
#if FFN_ROWS != 8
DEFINE_BLOCKS_EXPANDED(FFN_ROWS)
#endif

#define GLUE(a, b) GLUE_(a, b)
#define GLUE_(a, b) a##b
#define GateUpBlockMain GLUE(GateUpBlock, FFN_ROWS)
#define DownBlockMain GLUE(DownBlock, FFN_ROWS)

// groups[g] = (local expert, first row, end row, unused) of the g-th non-empty expert.
// x [x_rows, hidden]; rows p of the expert read x[row_index[p]] (gather != 0) or x[p].
// w: the gate_up panels; h [*, ffn].
__kernel __attribute__((reqd_work_group_size(1, 1, 1))) void ffn_gate_up(
    __global const float* restrict x, long x_rows, __global const int* restrict row_index,
    int gather, __global const int4* restrict groups, __global const float16* restrict w,
    int hidden, int ffn, int num_panels, __global float* restrict h) {
  const int panel = get_group_id(0);
  const int4 g = groups[get_group_id(1)];
  const __global float16* b = w + ((size_t)g.x * num_panels + panel) * (size_t)hidden * NV;
  const int f0 = panel * NV * 8;
  const int end = g.z;
  int p = g.y;
  for (; p + FFN_ROWS <= end; p += FFN_ROWS) {
    GateUpBlockMain(x, x_rows, row_index, gather, p, end, b, hidden, ffn, f0, h);
  }
  const int rest = end - p;
  if (rest > 8) {
    GateUpBlockMain(x, x_rows, row_index, gather, p, end, b, hidden, ffn, f0, h);
  } else if (rest > 4) {
    GateUpBlock8(x, x_rows, row_index, gather, p, end, b, hidden, ffn, f0, h);
  } else if (rest > 0) {
    GateUpBlock4(x, x_rows, row_index, gather, p, end, b, hidden, ffn, f0, h);
  }
}

// h [*, ffn] rows of each group -> y [*, hidden]; w: the down panels.
__kernel __attribute__((reqd_work_group_size(1, 1, 1))) void ffn_down(
    __global const float* restrict h, __global const int4* restrict groups,
    __global const float16* restrict w, int hidden, int ffn, int num_panels,
    __global float* restrict y) {
  const int panel = get_group_id(0);
  const int4 g = groups[get_group_id(1)];
  const __global float16* b = w + ((size_t)g.x * num_panels + panel) * (size_t)ffn * NV;
  const int c0 = panel * NV * 16;
  const int end = g.z;
  int p = g.y;
  for (; p + FFN_ROWS <= end; p += FFN_ROWS) DownBlockMain(h, p, end, b, hidden, ffn, c0, y);
  const int rest = end - p;
  if (rest > 8) {
    DownBlockMain(h, p, end, b, hidden, ffn, c0, y);
  } else if (rest > 4) {
    DownBlock8(h, p, end, b, hidden, ffn, c0, y);
  } else if (rest > 0) {
    DownBlock4(h, p, end, b, hidden, ffn, c0, y);
  }
}
