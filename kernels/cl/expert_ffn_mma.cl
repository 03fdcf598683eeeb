// Expert FFN on NVIDIA tensor cores: BF16 x BF16 -> FP32 grouped GEMMs through inline PTX
// (mma.sync.m16n8k16, sm_80 and later). Built only for NVIDIA devices of compute capability
// 8.0 or more (kernels/runtime.cc); elsewhere expert_ffn.cl runs. Layouts: see
// kernels/detail/ffn_layout.h (the "tensor-core layout"):
//   a   BF16 activations [rows, lda], lda = K rounded up to MMA_BK, zero beyond K;
//   w   per expert, BF16 [N, K] row-major (the "col" operand of mma: K contiguous);
//   gate_up: N = 2 * f_pad rows, in blocks of 16: 8 gate rows then the 8 up rows of the
//            same 8 outputs f, so that one thread holds gate and up of its f and applies
//            silu(gate) * up before anything leaves registers; h is written as BF16.
//   down:    N = hidden rounded up to MMA_BN; y is written as FP32, columns < hidden.
//
// One work-group of 256 work-items (8 warps as 2 x 4) computes a 128 x 128 tile of one
// expert's rows (a group of ffn_layout's kFfnMmaRowChunk rows) times 128 weight rows. Each
// warp owns 64 x 32 outputs: 4 x 4 mma tiles of 16 x 8, 64 FP32 accumulators a work-item.
// K advances 32 at a time through two local-memory buffers: the next slice is loaded from
// global memory into registers while the tensor cores work on the current one. Every output
// is summed by one work-item in a fixed order: results are bit-identical run to run.

// Tile sizes come from the build options (kernels/detail/ffn_layout.h); the code below is
// written for these values.
#ifndef MMA_BM
#define MMA_BM 128
#define MMA_BN 128
#define MMA_BK 32
#define MMA_THREADS 256
#endif
#if MMA_BM != 128 || MMA_BN != 128 || MMA_BK != 32 || MMA_THREADS != 256
#error "expert_ffn_mma.cl is written for 128 x 128 x 32 tiles of 256 work-items"
#endif
// Local-memory row stride in 32-bit words: 16 words of data + 4 of padding, so that the
// eight rows a fragment load touches fall in distinct banks.
#define LDS_WORDS 20

// Rounds to the nearest even BF16 (finite values; kernels never see NaN here).
inline uint Bf16Bits(float v) {
  const uint u = as_uint(v);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

inline __attribute__((always_inline)) void Mma(float* c, uint a0, uint a1, uint a2, uint a3, uint b0, uint b1) {
  __asm__ __volatile__(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// acc[(i * 4 + j) * 4 + r] += A[128 rows from a_rows] . W[128 rows from w]^T over k < k_pad.
// a_row[s] is the global row of A that tile row (tid >> 2) + 64 * s reads (s = 0, 1).
inline __attribute__((always_inline)) void MmaTile(const __global uint4* restrict a0_src, const __global uint4* restrict a1_src,
                    const __global uint4* restrict b0_src, const __global uint4* restrict b1_src,
                    int k_pad, __local uint4* restrict lds_a, __local uint4* restrict lds_b,
                    float* acc) {
  const int tid = get_local_id(0);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp >> 2;  // 0..1: rows wm * 64
  const int wn = warp & 3;   // 0..3: columns wn * 32
  const int g = lane >> 2;
  const int t = lane & 3;
  // This work-item's two 16-byte pieces of each 128 x 32 slice: rows (tid >> 2) and
  // (tid >> 2) + 64, piece (tid & 3); in local memory at row * LDS_WORDS / 4 + piece.
  const int st0 = (tid >> 2) * (LDS_WORDS / 4) + (tid & 3);
  const int st1 = st0 + 64 * (LDS_WORDS / 4);
  const int slice_words = MMA_BM * LDS_WORDS / 4;  // uint4 per buffer
  const int steps = k_pad / MMA_BK;

  uint4 ra0 = a0_src[0], ra1 = a1_src[0], rb0 = b0_src[0], rb1 = b1_src[0];
  lds_a[st0] = ra0;
  lds_a[st1] = ra1;
  lds_b[st0] = rb0;
  lds_b[st1] = rb1;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = 0; s < steps; ++s) {
    const int cur = (s & 1) * slice_words;
    if (s + 1 < steps) {
      const int next = (s + 1) * (MMA_BK / 8);  // uint4 per row per slice: 4
      ra0 = a0_src[next];
      ra1 = a1_src[next];
      rb0 = b0_src[next];
      rb1 = b1_src[next];
    }
    const __local uint* wa = (const __local uint*)(lds_a + cur);
    const __local uint* wb = (const __local uint*)(lds_b + cur);
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint af[4][4];
      uint bf[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = wm * 64 + i * 16 + g;
        af[i][0] = wa[row * LDS_WORDS + kk * 8 + t];
        af[i][1] = wa[(row + 8) * LDS_WORDS + kk * 8 + t];
        af[i][2] = wa[row * LDS_WORDS + kk * 8 + 4 + t];
        af[i][3] = wa[(row + 8) * LDS_WORDS + kk * 8 + 4 + t];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = wn * 32 + j * 8 + g;
        bf[j][0] = wb[col * LDS_WORDS + kk * 8 + t];
        bf[j][1] = wb[col * LDS_WORDS + kk * 8 + 4 + t];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Mma(acc + (i * 4 + j) * 4, af[i][0], af[i][1], af[i][2], af[i][3], bf[j][0], bf[j][1]);
        }
      }
    }
    if (s + 1 < steps) {
      const int nxt = ((s + 1) & 1) * slice_words;
      lds_a[nxt + st0] = ra0;
      lds_a[nxt + st1] = ra1;
      lds_b[nxt + st0] = rb0;
      lds_b[nxt + st1] = rb1;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
}

// The A rows a work-item loads: tile rows (tid >> 2) and + 64 of [p0, end), clamped to
// end - 1 (their results are not stored).
#define A_SOURCES(a, lda, p0, end)                                                        \
  const int tid = get_local_id(0);                                                         \
  const int r0 = min((p0) + (tid >> 2), (end) - 1);                                        \
  const int r1 = min((p0) + (tid >> 2) + 64, (end) - 1);                                   \
  const __global uint4* a0_src = (const __global uint4*)((a) + (size_t)r0 * (lda)) + (tid & 3); \
  const __global uint4* a1_src = (const __global uint4*)((a) + (size_t)r1 * (lda)) + (tid & 3);

// Both GEMM kernels run in work-groups of MMA_THREADS work-items. They do not declare it
// (reqd_work_group_size): with it NVIDIA's assembler ignores the register cap the runtime
// passes (kernels/runtime.cc).
//
// groups[g] = (local expert, first row, end row, 0), at most MMA_BM rows each.
// a [rows, k_pad] BF16; w [experts][2 * f_pad, k_pad] BF16; h [rows, f_pad] BF16.
__kernel void ffn_mma_gate_up(
    __global const ushort* restrict a, __global const int4* restrict groups,
    __global const ushort* restrict w, int k_pad, int f_pad, __global ushort* restrict h) {
  __local uint4 lds_a[2 * MMA_BM * LDS_WORDS / 4];
  __local uint4 lds_b[2 * MMA_BN * LDS_WORDS / 4];
  const int4 grp = groups[get_group_id(1)];
  const int n0 = get_group_id(0) * MMA_BN;  // first weight row of the tile
  A_SOURCES(a, k_pad, grp.y, grp.z)
  const __global ushort* wt = w + ((size_t)grp.x * 2 * f_pad + n0) * (size_t)k_pad;
  const __global uint4* b0_src = (const __global uint4*)(wt + (size_t)(tid >> 2) * k_pad) + (tid & 3);
  const __global uint4* b1_src =
      (const __global uint4*)(wt + (size_t)((tid >> 2) + 64) * k_pad) + (tid & 3);
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  MmaTile(a0_src, a1_src, b0_src, b1_src, k_pad, lds_a, lds_b, acc);

  // Tile columns j = 0, 2 of a warp are gate, j = 1, 3 up, of outputs
  // f = n0 / 2 + wn * 16 + (j / 2) * 8 + 2t + {0, 1}.
  const int lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int p = grp.y + wm * 64 + i * 16 + g + hi * 8;
      if (p >= grp.z) continue;
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const float* gate = acc + (i * 4 + 2 * jj) * 4 + hi * 2;
        const float* up = acc + (i * 4 + 2 * jj + 1) * 4 + hi * 2;
        const float v0 = gate[0] / (1.0f + exp(-gate[0])) * up[0];
        const float v1 = gate[1] / (1.0f + exp(-gate[1])) * up[1];
        const int f = n0 / 2 + wn * 16 + jj * 8 + 2 * t;
        ((__global uint*)(h + (size_t)p * f_pad + f))[0] = Bf16Bits(v0) | (Bf16Bits(v1) << 16);
      }
    }
  }
}

// h [rows, f_pad] BF16; w [experts][n_pad, f_pad] BF16 (n_pad = hidden rounded up to
// MMA_BN); y [rows, hidden] FP32.
__kernel void ffn_mma_down(
    __global const ushort* restrict h, __global const int4* restrict groups,
    __global const ushort* restrict w, int f_pad, int n_pad, int hidden,
    __global float* restrict y) {
  __local uint4 lds_a[2 * MMA_BM * LDS_WORDS / 4];
  __local uint4 lds_b[2 * MMA_BN * LDS_WORDS / 4];
  const int4 grp = groups[get_group_id(1)];
  const int n0 = get_group_id(0) * MMA_BN;
  A_SOURCES(h, f_pad, grp.y, grp.z)
  const __global ushort* wt = w + ((size_t)grp.x * n_pad + n0) * (size_t)f_pad;
  const __global uint4* b0_src = (const __global uint4*)(wt + (size_t)(tid >> 2) * f_pad) + (tid & 3);
  const __global uint4* b1_src =
      (const __global uint4*)(wt + (size_t)((tid >> 2) + 64) * f_pad) + (tid & 3);
  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  MmaTile(a0_src, a1_src, b0_src, b1_src, f_pad, lds_a, lds_b, acc);

  const int lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int p = grp.y + wm * 64 + i * 16 + g + hi * 8;
      if (p >= grp.z) continue;
      __global float* out = y + (size_t)p * hidden;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = n0 + wn * 32 + j * 8 + 2 * t;
        const float* v = acc + (i * 4 + j) * 4 + hi * 2;
        if (c < hidden) out[c] = v[0];
        if (c + 1 < hidden) out[c + 1] = v[1];
      }
    }
  }
}

// out[p, 0 .. k_pad) = BF16 of x[row_index[p] (gather) or p, 0 .. hidden), zero beyond
// hidden, for p < num_rows. x is FP32 (x_bf16 == 0) or BF16, rows x_stride values apart.
// One work-item per pair of output values.
__kernel void gather_rows_to_bf16(__global const void* restrict x, int x_bf16, long x_rows,
                                  long x_stride, __global const int* restrict row_index,
                                  int gather, int num_rows, int hidden, int k_pad,
                                  __global uint* restrict out) {
  const int c = 2 * get_global_id(0);
  const int p = get_global_id(1);
  if (c >= k_pad || p >= num_rows) return;
  long row = gather ? (long)row_index[p] : (long)p;
  row = row < 0 ? 0 : (row >= x_rows ? x_rows - 1 : row);
  uint v[2];
  for (int l = 0; l < 2; ++l) {
    const int col = c + l;
    if (col >= hidden) {
      v[l] = 0;
    } else if (x_bf16) {
      v[l] = ((const __global ushort*)x)[row * x_stride + col];
    } else {
      v[l] = Bf16Bits(((const __global float*)x)[row * x_stride + col]);
    }
  }
  out[((size_t)p * k_pad + c) / 2] = v[0] | (v[1] << 16);
}
