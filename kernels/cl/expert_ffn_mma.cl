// Expert FFN on NVIDIA tensor cores: BF16 x BF16 -> FP32 grouped GEMMs through inline PTX
// (mma.sync.m16n8k16, sm_80 and later). Built only for NVIDIA devices of compute capability
// 8.0 or more (kernels/runtime.cc); elsewhere expert_ffn.cl runs. Layouts: see
// kernels/detail/ffn_layout.h (the "tensor-core layout"):
//   a   BF16 activations, rows of lda values (K rounded up to MMA_BK, zero beyond K), in the
//       slice-major layout (ActChunk) that makes one K slice of a 128-row tile one or two
//       contiguous copies, as a weight tile's is;
//   w   per expert, BF16 [N, K] (the "col" operand of mma) in tiles of MMA_BN rows x MMA_BK
//       columns, each tile's 16-byte chunks in local-memory order (Swz), so that one K slice
//       of a tile is one contiguous 8 KiB copy;
//   gate_up: N = 2 * f_pad rows, in blocks of 16: 8 gate rows then the 8 up rows of the
//            same 8 outputs f, so that one thread holds gate and up of its f and applies
//            silu(gate) * up before anything leaves registers; h is written as BF16, slice-
//            major as a is (the down GEMM's activations).
//   down:    N = hidden rounded up to MMA_BN; y is written as FP32, columns < hidden.
//
// One work-group of 128 work-items (4 warps as 2 x 2) computes a 128 x 128 tile of one
// expert's rows (a group of at most MMA_BM rows) times 128 weight rows. Each warp owns 64 x 64
// outputs: 4 x 8 mma tiles of 16 x 8, 128 FP32 accumulators a work-item (about 240 registers,
// so two work-groups share a multiprocessor). K advances 32 at a time through MMA_STAGES
// local-memory stages that cp.async fills straight from global memory, so the next slices are
// in flight while the tensor cores work; fragments reach registers through ldmatrix from a
// swizzled, unpadded layout, each warp fetching its next k16 fragments before it multiplies
// the current ones. The copies go through L1 (cp.async.ca, not .cg): the two work-groups on
// a multiprocessor often read the same activation or weight rows, and on an H200 that alone
// was worth +27% (210 -> 273 TFLOP/s at 4 x 2048 rows of qwen1.5-moe-a2.7b), the tiled
// weight layout (contiguous copies) a further +8%.
// Every output is summed by one work-item in a fixed order: results are bit-identical run to
// run. On Hopper the 128-row tiles take Hopper's warpgroup MMA instead (MMA_WGMMA, below): the
// same tiles, stages and layout, the tensor cores reading both operands from local memory.

// Tile sizes come from the build options (kernels/detail/ffn_layout.h). 256 work-items (warps
// of 64 x 32) and 256 weight rows compiled before the decode forms, which are written for 128
// of each (and stop the build otherwise); on an H200 both were slower.
#ifndef MMA_BM
#define MMA_BM 128
#define MMA_BN 128
#define MMA_BK 32
#define MMA_THREADS 128
#define MMA_STAGES 3
#endif
#if MMA_BM != 128 || (MMA_BN != 128 && MMA_BN != 256) || MMA_BK != 32
#error "expert_ffn_mma.cl is written for tiles of 128 rows, 128 or 256 weight rows, K 32"
#endif
#if MMA_STAGES < 2
#error "MMA_STAGES must be at least 2"
#endif
// Warps: 2 along the rows (64 rows each) times WARPS_N along the weight rows.
#define WARPS_N (MMA_THREADS / 64)
#define WARP_COLS (MMA_BN / WARPS_N)  // 32 or 64
#define NJ (WARP_COLS / 8)            // mma tiles of 8 columns per warp
#if WARPS_N < 1 || WARP_COLS % 16 != 0
#error "MMA_THREADS does not divide the tile into warps of 64 rows and 16k columns"
#endif
// A row of one stage holds MMA_BK BF16 values: CPR 16-byte chunks. Stages are stored
// swizzled (Swz) so that the eight rows one ldmatrix phase reads fall in distinct banks
// without padding.
#define CPR (MMA_BK / 8)
#define STAGE_A (MMA_BM * CPR)  // chunks of one A stage
#define STAGE_B (MMA_BN * CPR)  // chunks of one weight stage
// Chunks a work-item copies per stage: rows ROW_STEP apart, chunk tid % CPR.
#define A_LOADS (STAGE_A / MMA_THREADS)
#define B_LOADS (STAGE_B / MMA_THREADS)
#define ROW_STEP (MMA_THREADS / CPR)
#if ROW_STEP % 8 != 0
#error "A's rows of one work-item must lie a multiple of 8 apart (StageCopies)"
#endif
// Stages start on 1024-byte boundaries (the wgmma descriptors' swizzle is of address bits).
#define STAGE_ALIGN __attribute__((aligned(1024)))
// The same order as detail::MmaSwizzle, which lays out the weight tiles.
inline int Swz(int r, int c) { return r * 4 + (c ^ ((r >> 1) & 3)); }

// The activations' layout (a and h), "slice-major": a matrix of `rows` rows of ld 16-byte chunks
// is stored in blocks of MMA_BM rows, each block (rows b0 .. b0 + nb, nb = min(MMA_BM, rows -
// b0)) at chunk b0 * ld, K slice by K slice: the CPR chunks of slice s of row b0 + r at chunk
// (s * nb + r) * CPR of the block. A tile's K slice is thus one contiguous 8 KiB copy (two where
// its rows cross a block), as a weight tile's is, where row-major rows made it 128 pieces of 64
// bytes 2 * K apart. On an H200 the layer ran 1.5-10% faster so (mixtral-8x7b at 1024 tokens
// the most), the FFN alone on whole blocks within noise (docs/ARCHITECTURE.md). The matrix takes
// rows * ld chunks, as row-major rows would. Chunk c of row p:
inline size_t ActChunk(int p, int c, int ld, int rows) {
  const int b0 = p & -MMA_BM;
  const int nb = min(MMA_BM, rows - b0);
  return (size_t)b0 * ld + ((size_t)(c / CPR) * nb + (p - b0)) * CPR + c % CPR;
}
// Chunks from K slice s of row p to slice s + 1.
inline int ActSliceStride(int p, int rows) { return min(MMA_BM, rows - (p & -MMA_BM)) * CPR; }

// Rounds to the nearest even BF16 (finite values; kernels never see NaN here).
inline uint Bf16Bits(float v) {
  const uint u = as_uint(v);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// silu(gate) * up of two neighbouring outputs (gate[0..1], up[0..1]) as two BF16 values in one
// word, the first in the low half: h as the gate_up kernels store it.
inline uint SwiGluBf16Pair(const float* gate, const float* up) {
  const float v0 = gate[0] / (1.0f + exp(-gate[0])) * up[0];
  const float v1 = gate[1] / (1.0f + exp(-gate[1])) * up[1];
  return Bf16Bits(v0) | (Bf16Bits(v1) << 16);
}

inline __attribute__((always_inline)) void Mma(float* c, const uint* a, const uint* b) {
  __asm__ __volatile__(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The shared-memory address PTX expects of a local-memory pointer (NVIDIA's OpenCL keeps
// __local pointers in the shared state space, so the value is the offset itself).
inline uint SharedAddress(const __local void* p) { return (uint)(size_t)p; }

// 16 bytes global -> local without passing through registers (cp.async, sm_80), cached in L1.
inline __attribute__((always_inline)) void CopyAsync16(__local uint4* dst,
                                                       const __global uint4* src) {
  __asm__ __volatile__("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(SharedAddress(dst)),
                       "l"(src)
                       : "memory");
}
// The 128-row tiles' copies: through L1 for mma.sync (see the header), around it (cp.async.cg,
// L2 only) for wgmma, whose tiles ran 25-32% faster so on an H200 (mixtral-8x7b 4 x 2048
// rows: 407 -> 536 TFLOP/s), where L1 gave mma.sync +27%.
#ifdef MMA_WGMMA
#define TILE_COPY "cp.async.cg.shared.global"
#else
#define TILE_COPY "cp.async.ca.shared.global"
#endif
inline __attribute__((always_inline)) void CopyTile16(__local uint4* dst,
                                                      const __global uint4* src) {
  __asm__ __volatile__(TILE_COPY " [%0], [%1], 16;" ::"r"(SharedAddress(dst)), "l"(src) : "memory");
}
inline __attribute__((always_inline)) void CopyAsyncCommit(void) {
  __asm__ __volatile__("cp.async.commit_group;" ::: "memory");
}
// Waits until at most MMA_STAGES - 2 committed groups are still in flight.
inline __attribute__((always_inline)) void CopyAsyncWaitAllButNewest(void) {
  __asm__ __volatile__("cp.async.wait_group %0;" ::"n"(MMA_STAGES - 2) : "memory");
}

// Four 8 x 8 BF16 matrices from local memory, one row address per lane (ldmatrix, sm_75).
inline __attribute__((always_inline)) void LoadMatrix4(const __local uint4* row, uint* r) {
  __asm__ __volatile__("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                       : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                       : "r"(SharedAddress(row))
                       : "memory");
}

// This work-item's share of one stage: A_LOADS chunks of A and B_LOADS of the weights, each
// a 16-byte chunk of one row, and where each lands in a stage; and the rows of the tile's
// group (at most MMA_BM). Chunk l lands MMA_THREADS chunks after chunk l - 1 in both (A's rows
// are ROW_STEP apart, a multiple of 8, which leaves Swz's XOR as it is), and the weights' chunk l
// is MMA_THREADS chunks after chunk l - 1 in w too: one pointer and two offsets, not one each, so
// that the wgmma tile stays within its registers.
typedef struct {
  const __global uint4* a[A_LOADS];
  const __global uint4* w;  // the first weight chunk
  int a_step[A_LOADS];      // chunks from one K slice of the row to the next (ActSliceStride)
  int a_dst;                // where A's first chunk lands
  int w_dst;                // and the weights'
  int rows;
} StageCopies;

// Copies K slice `step` (MMA_BK values) of this work-item's rows into local-memory stage `st`:
// the first a_loads of its A chunks (a constant: the rows below a_loads * ROW_STEP) and all
// its weight chunks.
inline __attribute__((always_inline)) void LoadStage(const StageCopies* c, int step, int st,
                                                     __local uint4* lds_a, __local uint4* lds_b,
                                                     const int a_loads) {
#pragma unroll
  for (int l = 0; l < A_LOADS; ++l) {
    if (l < a_loads) {
      CopyTile16(lds_a + st * STAGE_A + c->a_dst + l * MMA_THREADS, c->a[l] + step * c->a_step[l]);
    }
  }
#pragma unroll
  for (int l = 0; l < B_LOADS; ++l) {
    CopyTile16(lds_b + st * STAGE_B + c->w_dst + l * MMA_THREADS,
               c->w + step * STAGE_B + l * MMA_THREADS);
  }
}

// The A and weight fragments of one k16 slice of a warp's 64 x WARP_COLS tile (ldmatrix: A,
// m16 x k16 per mma: lanes 0-15 rows 0-15 at k 0-7, lanes 16-31 the same rows at k 8-15 ->
// a0..a3; weights, two n8 x k16 per x4: lanes 0-7 rows 0-7 at k 0-7, 8-15 rows 0-7 at
// k 8-15, 16-23 rows 8-15 at k 0-7, 24-31 rows 8-15 at k 8-15 -> b0, b1 of column tiles j
// and j + 1).
inline __attribute__((always_inline)) void LoadFragments(const __local uint4* sa,
                                                         const __local uint4* sb, int a_row,
                                                         int b_row, int kk, uint af[4][4],
                                                         uint bf[NJ / 2][4]) {
  const int lane = get_local_id(0) & 31;
#pragma unroll
  for (int i = 0; i < 4; ++i) LoadMatrix4(sa + Swz(a_row + i * 16, kk * 2 + (lane >> 4)), af[i]);
#pragma unroll
  for (int j = 0; j < NJ / 2; ++j) {
    LoadMatrix4(sb + Swz(b_row + j * 16, kk * 2 + ((lane >> 3) & 1)), bf[j]);
  }
}

#ifdef MMA_WGMMA
// ---- Hopper's warpgroup MMA (sm_90a) for the 128-row tiles ----
// NVIDIA's OpenCL compiler writes PTX for `.target sm_90`, where wgmma does not assemble. Each
// wgmma instruction is therefore written as an inline-assembly comment marked WGMMA_MARK (the
// compiler still fills in its operand registers); the runtime takes the program's PTX,
// removes the marks and builds it for sm_90a (kernels/detail/ptx_patch.h). Built that way
// only with MMA_WGMMA (Runtime::wgmma()); elsewhere the mma.sync tile below runs.
//
// The one warpgroup of the work-group (4 warps) multiplies the 128 x 128 tile as two
// m64n128k16 products per k16 (rows 0-63 and 64-127), both operands read by the tensor cores
// straight from the local-memory stages through matrix descriptors: the stages' layout (Swz,
// rows of 64 bytes, 16-byte chunks XORed with bits 1-2 of the row) is the hardware's 64-byte
// swizzle of a K-major operand, 8-row groups 512 bytes apart. The sums stay in registers across
// the K loop: acc[(i * ACC_NJ + j) * 4 + hi * 2 + c] is row i * 64 + warp * 16 + g + 8 hi,
// column j * 8 + 2t + c (wgmma's accumulator layout). Each output is still summed by one
// work-item in ascending k: bits are the same run to run (not the same as mma.sync's, whose
// k16 products are added in another order inside the tensor core).
#define WGMMA_MARK "// @W@ "
#define ACC_MI 2
#define ACC_NJ (MMA_BN / 8)
#define ACC_ROW_STEP 64
#if MMA_BN != 128 || MMA_THREADS != 128
#error "the wgmma tile is written for 128 weight rows and one warpgroup"
#endif

// A K-major operand's descriptor: start address / 16, leading offset 1 (unused with a
// swizzle), 8-row groups 512 bytes apart, 64-byte swizzle (layout type 2). The stages are
// 1024-byte aligned, so the base offset is 0.
#define WG_LAYOUT 2  // 64-byte swizzle
#define WG_LBO 1
#define WG_SBO 512
inline ulong WgDescriptor(const __local uint4* p) {
  return (((ulong)SharedAddress(p) & 0x3FFFF) >> 4) | ((ulong)WG_LBO << 16) |
         ((ulong)(WG_SBO >> 4) << 32) | ((ulong)WG_LAYOUT << 62);
}

// acc[0..63] += A (64 rows at desc_a) . B (128 rows at desc_b)^T over one k16.
inline __attribute__((always_inline)) void WgMma(float* d, ulong desc_a, ulong desc_b) {
  __asm__ __volatile__(
      WGMMA_MARK
      "{ .reg .pred p; setp.ne.b32 p, %66, 0; "
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0; }"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

// acc[(i * ACC_NJ + j) * 4 + r] += A[64 * m64s rows] . W[128 rows]^T over k < 8 * ld, through
// MMA_STAGES local-memory stages filled by cp.async MMA_STAGES - 1 slices ahead. A stage is
// refilled only after every warp has waited for the products that read it (wait_group 1
// leaves the newest slice's products running beside the next copies). m64s is a constant
// where it is called: a branch among the wgmma instructions makes the assembler wait for each
// product before the next.
inline __attribute__((always_inline)) void MmaTileRows(const StageCopies* copies, int ld,
                                                       __local uint4* restrict lds_a,
                                                       __local uint4* restrict lds_b, float* acc,
                                                       const int m64s) {
  const int steps = ld / CPR;
#pragma unroll
  for (int s = 0; s < MMA_STAGES - 1; ++s) {
    if (s < steps) LoadStage(copies, s, s, lds_a, lds_b, m64s * A_LOADS / ACC_MI);
    CopyAsyncCommit();
  }
  int read = 0;                // stage being multiplied
  int write = MMA_STAGES - 1;  // stage the next copies fill
  for (int s = 0; s < steps; ++s) {
    CopyAsyncWaitAllButNewest();
    // This work-item's copies become visible to the tensor cores' reads (the async proxy),
    // then everyone's.
    __asm__ __volatile__("fence.proxy.async.shared::cta;" ::: "memory");
    barrier(CLK_LOCAL_MEM_FENCE);
    __asm__ __volatile__(WGMMA_MARK "wgmma.fence.sync.aligned;" ::: "memory");
    const ulong da = WgDescriptor(lds_a + read * STAGE_A);
    const ulong db = WgDescriptor(lds_b + read * STAGE_B);
#pragma unroll
    for (int kk = 0; kk < MMA_BK / 16; ++kk) {
      // k16 slice kk starts 32 bytes further into each 64-byte row (start address in 16 bytes).
#pragma unroll
      for (int i = 0; i < ACC_MI; ++i) {
        if (i < m64s) {
          WgMma(acc + i * ACC_NJ * 4, da + (ulong)(i * 64 * 64 / 16 + kk * 2),
                db + (ulong)(kk * 2));
        }
      }
    }
    __asm__ __volatile__(WGMMA_MARK "wgmma.commit_group.sync.aligned;" ::: "memory");
    __asm__ __volatile__(WGMMA_MARK "wgmma.wait_group.sync.aligned 1;" ::: "memory");
    // Every warp's products of slice s - 1 are done: its stage (`write`) takes new copies.
    barrier(CLK_LOCAL_MEM_FENCE);
    if (s + MMA_STAGES - 1 < steps) {
      LoadStage(copies, s + MMA_STAGES - 1, write, lds_a, lds_b, m64s * A_LOADS / ACC_MI);
    }
    CopyAsyncCommit();
    write = write + 1 == MMA_STAGES ? 0 : write + 1;
    read = read + 1 == MMA_STAGES ? 0 : read + 1;
  }
  __asm__ __volatile__(WGMMA_MARK "wgmma.wait_group.sync.aligned 0;" ::: "memory");
  // The sums are final only now: no read of acc may move above the wait.
#pragma unroll
  for (int i = 0; i < ACC_MI * ACC_NJ * 4; ++i) __asm__ __volatile__("" : "+f"(acc[i])::"memory");
  __asm__ __volatile__("cp.async.wait_all;" ::: "memory");
}
// A tile of at most 64 rows (an expert's short last tile) copies and multiplies its first half
// only: each output row depends on its own row of A alone, and rows past the group's end are
// not stored.
inline __attribute__((always_inline)) void MmaTile(const StageCopies* copies, int ld,
                                                   __local uint4* restrict lds_a,
                                                   __local uint4* restrict lds_b, float* acc) {
  if (copies->rows > ACC_ROW_STEP) {  // the rows of one m64 product
    MmaTileRows(copies, ld, lds_a, lds_b, acc, ACC_MI);
  } else {
    MmaTileRows(copies, ld, lds_a, lds_b, acc, 1);
  }
}
#else  // MMA_WGMMA
#define ACC_MI 4
#define ACC_NJ NJ
#define ACC_ROW_STEP 16
// acc[(i * NJ + j) * 4 + r] += A[128 rows] . W[128 rows]^T over k < 8 * ld, through
// MMA_STAGES local-memory stages filled by cp.async. Software-pipelined in two ways: the
// copies of slice s + MMA_STAGES - 1 are issued while slice s is multiplied, and each warp
// loads the fragments of its next k16 (from the next stage, across the barrier) before it
// multiplies the current ones, so the tensor cores do not wait for ldmatrix or the barrier.
inline __attribute__((always_inline)) void MmaTile(const StageCopies* copies, int ld,
                                                   __local uint4* restrict lds_a,
                                                   __local uint4* restrict lds_b, float* acc) {
  const int tid = get_local_id(0);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int a_row = (warp / WARPS_N) * 64 + (lane & 15);
  const int b_row = (warp % WARPS_N) * WARP_COLS + (lane & 7) + ((lane >> 4) << 3);
  const int steps = ld / CPR;

#pragma unroll
  for (int s = 0; s < MMA_STAGES - 1; ++s) {
    if (s < steps) LoadStage(copies, s, s, lds_a, lds_b, A_LOADS);
    CopyAsyncCommit();
  }
  CopyAsyncWaitAllButNewest();
  barrier(CLK_LOCAL_MEM_FENCE);
  uint af[2][4][4];
  uint bf[2][NJ / 2][4];
  LoadFragments(lds_a, lds_b, a_row, b_row, 0, af[0], bf[0]);
  int read = 0;                // stage being multiplied
  int write = MMA_STAGES - 1;  // stage the next copies fill
  for (int s = 0; s < steps; ++s) {
#pragma unroll
    for (int kk = 0; kk < MMA_BK / 16; ++kk) {
      if (kk == 0) {
        // Every warp finished reading `write` (slice s - 1) before the last barrier.
        if (s + MMA_STAGES - 1 < steps) {
          LoadStage(copies, s + MMA_STAGES - 1, write, lds_a, lds_b, A_LOADS);
        }
        CopyAsyncCommit();
        write = write + 1 == MMA_STAGES ? 0 : write + 1;
      }
      if (kk == MMA_BK / 16 - 1) {
        // Slice s + 1 has landed for every work-item: fetch its first fragments now.
        CopyAsyncWaitAllButNewest();
        barrier(CLK_LOCAL_MEM_FENCE);
        read = read + 1 == MMA_STAGES ? 0 : read + 1;
        if (s + 1 < steps) {
          LoadFragments(lds_a + read * STAGE_A, lds_b + read * STAGE_B, a_row, b_row, 0,
                        af[(kk + 1) & 1], bf[(kk + 1) & 1]);
        }
      } else {
        LoadFragments(lds_a + read * STAGE_A, lds_b + read * STAGE_B, a_row, b_row, kk + 1,
                      af[(kk + 1) & 1], bf[(kk + 1) & 1]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          Mma(acc + (i * NJ + j) * 4, af[kk & 1][i], bf[kk & 1][j >> 1] + (j & 1) * 2);
        }
      }
    }
  }
  // No copy may still target local memory when the work-group leaves.
  __asm__ __volatile__("cp.async.wait_all;" ::: "memory");
}
#endif  // MMA_WGMMA

// The tile of this work-group: (weight-row tile, row group). The launch grid is (weight-row
// tiles, row groups); work-groups are renumbered so that MMA_RASTER consecutive ones take the
// same weight tile for MMA_RASTER row groups, then the next weight tile: the work-groups in
// flight read each weight tile from L2 for about 1000 rows instead of one group's 128. On an
// H100, mixtral-8x7b 335 -> 355 TFLOP/s at 4 x 2048 rows, +5-6% from 512 to 8192 rows
// (qwen1.5-moe-a2.7b, whose four experts' weights stay in L2: unchanged).
#define MMA_RASTER 8
inline int2 ThisTile(void) {
  const int nx = get_num_groups(0), ny = get_num_groups(1);
  const int b = get_group_id(1) * nx + get_group_id(0);
  const int first = (b / (MMA_RASTER * nx)) * MMA_RASTER;
  const int span = min(MMA_RASTER, ny - first);
  const int at = b - first * nx;
  return (int2)(at / span, first + at % span);
}

// This work-item's copies for a tile whose A rows are [p0, end) of `a` (`rows` rows of ld
// 16-byte chunks, slice-major; rows clamped to end - 1, whose results are not stored) and whose
// weights start at w (tiles of MMA_BN rows x MMA_BK columns, each in local-memory order, K
// slices one after the other).
inline __attribute__((always_inline)) StageCopies TileCopies(const __global uint4* a, int rows,
                                                             int p0, int end,
                                                             const __global uint4* w, int ld) {
  const int tid = get_local_id(0);
  StageCopies c;
#pragma unroll
  for (int l = 0; l < A_LOADS; ++l) {
    const int r = tid / CPR + l * ROW_STEP;
    const int p = min(p0 + r, end - 1);
    c.a[l] = a + ActChunk(p, tid % CPR, ld, rows);
    c.a_step[l] = ActSliceStride(p, rows);
  }
  c.a_dst = Swz(tid / CPR, tid % CPR);
  c.w = w + tid;
  c.w_dst = tid;
  c.rows = end - p0;
  return c;
}

// The product tile of this work-group: rows group.y .. group.z of a (BF16, `rows` rows of k_pad
// values, slice-major) times weight rows n0 .. n0 + MMA_BN of expert group.x, whose matrix in w
// has n_rows rows of k_pad values (tiled). Returns the group; acc as MmaTile leaves it.
inline __attribute__((always_inline)) int4 TileProduct(const __global ushort* restrict a, int rows,
                                                       const __global int4* restrict groups,
                                                       const __global ushort* restrict w,
                                                       int n_rows, int k_pad, int n0,
                                                       __local uint4* lds_a, __local uint4* lds_b,
                                                       float* acc) {
  const int4 grp = groups[ThisTile().y];
  const __global ushort* wt = w + ((size_t)grp.x * n_rows + n0) * (size_t)k_pad;
  const StageCopies copies =
      TileCopies((const __global uint4*)a, rows, grp.y, grp.z, (const __global uint4*)wt,
                 k_pad / 8);
#pragma unroll
  for (int i = 0; i < ACC_MI * ACC_NJ * 4; ++i) acc[i] = 0.0f;
  MmaTile(&copies, k_pad / 8, lds_a, lds_b, acc);
  return grp;
}

// Tiles of at most DEC_BM rows take the decode form below (ffn_dec_*): a multiple of 16, from
// the build options (kernels/detail/ffn_layout.h, kMmaDecodeRows).
#ifndef MMA_DEC_BM
#define MMA_DEC_BM 32
#endif
#define DEC_BM MMA_DEC_BM
#define DEC_MT (DEC_BM / 16)  // m16 row tiles
#if DEC_BM % 16 != 0 || DEC_BM < 16 || DEC_BM > 64
#error "MMA_DEC_BM must be 16, 32, 48 or 64"
#endif
// Tiles of more than MMA_DEC_MIN rows (and at most DEC_BM) take this program's decode form,
// tiles of more than MMA_LARGE_MIN rows the 128-row kernels. One decode form: 0 and DEC_BM.
// Two (kernels/runtime.cc, Runtime::mma_decode_rows() 64): this program's form of 32 rows
// (0, 32; MMA_LARGE_MIN 64) beside a wide one of 64 in a program of its own (MMA_DEC_WIDE:
// 32, 64; its kernels named *_wide), so that each tile takes the smaller form that holds it.
#ifndef MMA_DEC_MIN
#define MMA_DEC_MIN 0
#endif
#ifndef MMA_LARGE_MIN
#define MMA_LARGE_MIN DEC_BM
#endif
#ifdef MMA_DEC_WIDE
#define DEC_KERNEL(name) name##_wide
#else
#define DEC_KERNEL(name) name
#endif
// Whether the 128-row kernels skip this work-group's tile: it has no rows (the launch may
// cover more tiles than a batch has: groups made on the device, kernels/moe_grouped.cc, the
// rest being (0, 0, 0, 0)), or few enough for the decode form, unless the group says the
// 128-row kernels take it whatever its rows (w = 1: an expert's short last tile that follows
// its full tiles, whose weights are in L2 then; kernels/detail/ffn_mma.h).
inline bool SkipTile(const __global int4* groups) {
  const int4 grp = groups[ThisTile().y];
  return grp.w == 0 && grp.z - grp.y <= MMA_LARGE_MIN;
}

// Where this work-item's accumulators lie in the tile: acc[(i * ACC_NJ + j) * 4 + hi * 2 +
// {0, 1}] is row row0 + i * ACC_ROW_STEP + g + hi * 8, columns col0 + j * 8 + 2t + {0, 1}
// (mma.sync: warps of 64 x WARP_COLS; wgmma: warp w holds rows w * 16 of each m64).
typedef struct {
  int row0, col0, g, t;
} AccPlace;
inline AccPlace ThisAccPlace(void) {
  const int lane = get_local_id(0) & 31, warp = get_local_id(0) >> 5;
#ifdef MMA_WGMMA
  AccPlace q = {warp * 16, 0, lane >> 2, lane & 3};
#else
  AccPlace q = {(warp / WARPS_N) * 64, (warp % WARPS_N) * WARP_COLS, lane >> 2, lane & 3};
#endif
  return q;
}

// This work-item's outputs of the tile (rows [p0, end), columns from n0) from acc, as FP32 into out
// (rows of ld values, columns below cols). Its two neighbouring columns go out as one 8-byte store
// where rows are 8-byte aligned (even ld; out is a buffer's start, or an even number of values into
// one, as ffn_mma_partial's parts are): a warp's store then fills whole 32-byte sectors (8 rows x 4
// work-items x 8 bytes) where two 4-byte stores filled half of one each. On an H200,
// qwen1.5-moe-a2.7b's FFN at 4 x 2048 rows: 400-413 -> 442-444 TFLOP/s (mixtral-8x7b's, whose
// longer K leaves the stores a smaller share: within 1%); staging the tile through local memory for
// 16-byte stores, or 16-byte stores from work-items swapping halves, was slower
// (docs/ARCHITECTURE.md).
inline void MmaStore(const float* acc, int p0, int end, int n0, __global float* out, int ld,
                     int cols) {
  const AccPlace q = ThisAccPlace();
  const bool pairs = (ld & 1) == 0;
#pragma unroll
  for (int i = 0; i < ACC_MI; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int p = p0 + q.row0 + i * ACC_ROW_STEP + q.g + hi * 8;
      if (p >= end) continue;
      __global float* row = out + (size_t)p * ld;
#pragma unroll
      for (int j = 0; j < ACC_NJ; ++j) {
        const int c = n0 + q.col0 + j * 8 + 2 * q.t;
        const float* v = acc + (i * ACC_NJ + j) * 4 + hi * 2;
        if (pairs && c + 1 < cols) {
          *(__global float2*)(row + c) = (float2)(v[0], v[1]);
        } else {
          if (c < cols) row[c] = v[0];
          if (c + 1 < cols) row[c + 1] = v[1];
        }
      }
    }
  }
}

#ifndef MMA_DEC_WIDE  // the wide decode form's program holds its three kernels alone
// Both GEMM kernels run in work-groups of MMA_THREADS work-items. They do not declare it
// (reqd_work_group_size): with it NVIDIA's assembler ignores the register cap the runtime
// passes (kernels/runtime.cc).
//
// groups[g] = (local expert, first row, end row, 0), at most MMA_BM rows each.
// a [rows, k_pad] BF16; w [experts][2 * f_pad, k_pad] BF16; h [rows, f_pad] BF16 (a and h
// slice-major).
__kernel void ffn_mma_gate_up(__global const ushort* restrict a,
                              __global const int4* restrict groups,
                              __global const ushort* restrict w, int k_pad, int f_pad, int rows,
                              __global ushort* restrict h) {
  __local uint4 lds_a[MMA_STAGES * STAGE_A] STAGE_ALIGN;
  __local uint4 lds_b[MMA_STAGES * STAGE_B] STAGE_ALIGN;
  if (SkipTile(groups)) return;
  const int n0 = ThisTile().x * MMA_BN;  // first weight row of the tile
  float acc[ACC_MI * ACC_NJ * 4];
  const int4 grp = TileProduct(a, rows, groups, w, 2 * f_pad, k_pad, n0, lds_a, lds_b, acc);

  // Tile columns j = 0, 2, ... of a work-item are gate, j = 1, 3, ... up, of outputs
  // f = n0 / 2 + col0 / 2 + (j / 2) * 8 + 2t + {0, 1}.
  const AccPlace q = ThisAccPlace();
#pragma unroll
  for (int i = 0; i < ACC_MI; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int p = grp.y + q.row0 + i * ACC_ROW_STEP + q.g + hi * 8;
      if (p >= grp.z) continue;
#pragma unroll
      for (int jj = 0; jj < ACC_NJ / 2; ++jj) {
        const float* gate = acc + (i * ACC_NJ + 2 * jj) * 4 + hi * 2;
        const float* up = acc + (i * ACC_NJ + 2 * jj + 1) * 4 + hi * 2;
        const int f = n0 / 2 + q.col0 / 2 + jj * 8 + 2 * q.t;
        ((__global uint*)(h + ActChunk(p, f / 8, f_pad / 8, rows) * 8 + f % 8))[0] =
            SwiGluBf16Pair(gate, up);
      }
    }
  }
}

// h [rows, f_pad] BF16 (slice-major); w [experts][n_pad, f_pad] BF16 (n_pad = hidden rounded
// up to MMA_BN); y [rows, hidden] FP32.
__kernel void ffn_mma_down(__global const ushort* restrict h, __global const int4* restrict groups,
                           __global const ushort* restrict w, int f_pad, int n_pad, int hidden,
                           int rows, __global float* restrict y) {
  __local uint4 lds_a[MMA_STAGES * STAGE_A] STAGE_ALIGN;
  __local uint4 lds_b[MMA_STAGES * STAGE_B] STAGE_ALIGN;
  if (SkipTile(groups)) return;
  const int n0 = ThisTile().x * MMA_BN;
  float acc[ACC_MI * ACC_NJ * 4];
  const int4 grp = TileProduct(h, rows, groups, w, n_pad, f_pad, n0, lds_a, lds_b, acc);

  MmaStore(acc, grp.y, grp.z, n0, y, hidden, hidden);
}

// out[p, 0 .. k_pad) = BF16 of x[row_index[p] (gather) or p, 0 .. hidden), zero beyond
// hidden, for p < num_rows (out slice-major: ActChunk). x is FP32 (x_bf16 == 0) or BF16, rows
// x_stride values apart. One work-item per 8 output values (one 16-byte store; k_pad is a
// multiple of 8).
__kernel void gather_rows_to_bf16(__global const void* restrict x, int x_bf16, long x_rows,
                                  long x_stride, __global const int* restrict row_index, int gather,
                                  int num_rows, int hidden, int k_pad,
                                  __global uint4* restrict out) {
  const int c = 8 * get_global_id(0);
  const int p = get_global_id(1);
  if (c >= k_pad || p >= num_rows) return;
  long row = gather ? (long)row_index[p] : (long)p;
  row = row < 0 ? 0 : (row >= x_rows ? x_rows - 1 : row);
  uint v[8];
#pragma unroll
  for (int l = 0; l < 8; ++l) {
    const int col = c + l;
    if (col >= hidden) {
      v[l] = 0;
    } else if (x_bf16) {
      v[l] = ((const __global ushort*)x)[row * x_stride + col];
    } else {
      v[l] = Bf16Bits(((const __global float*)x)[row * x_stride + col]);
    }
  }
  out[ActChunk(p, c / 8, k_pad / 8, num_rows)] =
      (uint4)(v[0] | (v[1] << 16), v[2] | (v[3] << 16), v[4] | (v[5] << 16), v[6] | (v[7] << 16));
}

// ---- split K: launches of few tiles ----
// A launch of fewer tiles than the device has multiprocessors for (a shared expert, or a few
// experts, at decode sizes) reads its weights through too few work-groups; these split K into
// parts (kernels/moe_kernels.cc, LaunchSplitK): work-group (weight tile, row group, part s)
// multiplies K slices [s * per_split, (s + 1) * per_split) of its tile into FP32 partial sums
// partial[s][p][n] (rows p < rows of the launch, weight rows n < n_rows), and a reduce kernel
// adds the parts in order of s, then finishes as ffn_mma_gate_up or ffn_mma_down does.
__kernel void ffn_mma_partial(__global const ushort* restrict a,
                              __global const int4* restrict groups,
                              __global const ushort* restrict w, int n_rows, int k_pad,
                              int per_split, int rows, __global float* restrict partial) {
  __local uint4 lds_a[MMA_STAGES * STAGE_A] STAGE_ALIGN;
  __local uint4 lds_b[MMA_STAGES * STAGE_B] STAGE_ALIGN;
  if (SkipTile(groups)) return;
  const int n0 = ThisTile().x * MMA_BN;
  const int s = get_group_id(2);
  const int ks0 = s * per_split;
  const int count = min(per_split, k_pad / MMA_BK - ks0);
  const int4 grp = groups[ThisTile().y];
  const __global ushort* wt = w + ((size_t)grp.x * n_rows + n0) * (size_t)k_pad;
  StageCopies copies =
      TileCopies((const __global uint4*)a, rows, grp.y, grp.z, (const __global uint4*)wt,
                 k_pad / 8);
#pragma unroll
  for (int l = 0; l < A_LOADS; ++l) copies.a[l] += ks0 * copies.a_step[l];
  copies.w += ks0 * STAGE_B;
  float acc[ACC_MI * ACC_NJ * 4];
#pragma unroll
  for (int i = 0; i < ACC_MI * ACC_NJ * 4; ++i) acc[i] = 0.0f;
  MmaTile(&copies, count * CPR, lds_a, lds_b, acc);

  MmaStore(acc, grp.y, grp.z, n0, partial + (size_t)s * rows * n_rows, n_rows, n_rows);
}

// The parts' sum of weight row n for row p.
inline float SumParts(const __global float* partial, int splits, int rows, int n_rows, int p,
                      int n) {
  float v = 0.0f;
  for (int s = 0; s < splits; ++s) v += partial[((size_t)s * rows + p) * n_rows + n];
  return v;
}

// h[p, f] = BF16(silu(gate) * up) for f < f_pad (n_rows = 2 * f_pad, blocks of 8 gate rows
// then 8 up rows). Global (f_pad, rows).
__kernel void ffn_reduce_gate_up(__global const float* restrict partial, int splits, int rows,
                                 int n_rows, int f_pad, __global ushort* restrict h) {
  const int f = get_global_id(0), p = get_global_id(1);
  if (f >= f_pad || p >= rows) return;
  const int n = (f / 8) * 16 + (f & 7);
  const float g = SumParts(partial, splits, rows, n_rows, p, n);
  const float u = SumParts(partial, splits, rows, n_rows, p, n + 8);
  const float v = g / (1.0f + exp(-g)) * u;
  h[ActChunk(p, f / 8, f_pad / 8, rows) * 8 + f % 8] = (ushort)Bf16Bits(v);
}

// y[p, c] for c < hidden. Global (hidden, rows).
__kernel void ffn_reduce_down(__global const float* restrict partial, int splits, int rows,
                              int n_rows, int hidden, __global float* restrict y) {
  const int c = get_global_id(0), p = get_global_id(1);
  if (c >= hidden || p >= rows) return;
  y[(size_t)p * hidden + c] = SumParts(partial, splits, rows, n_rows, p, c);
}
#endif  // MMA_DEC_WIDE

// ---- the decode form: tiles of at most DEC_BM rows ----
// At decode sizes a tile has a few rows, and the 128-row tiles above hold 48 KiB of local
// memory and about 240 registers a work-item for them: two work-groups a multiprocessor, too
// few weight bytes in flight to read the weights at the speed of memory. Tiles of at most
// DEC_BM rows take these kernels instead: the same 128 weight rows of the same layout, DEC_MT
// m16 row tiles (A stages of DEC_BM x 64 bytes), four warps of DEC_BM x 32 outputs, DEC_STAGES
// stages in flight, so that several work-groups share a multiprocessor. Each output is still
// summed by one work-item over k in ascending order. Launched over every tile beside the
// 128-row kernels, each skipping the other's tiles (SkipTile skips tiles of at most DEC_BM
// rows). Global size (weight rows / MMA_BN * MMA_THREADS, tiles, parts of K).
#define DEC_STAGES 4
#define DEC_STAGE_A (DEC_BM * CPR)
#if MMA_BN != 128 || MMA_THREADS != 128
#error "the decode form is written for 128 weight rows and 128 work-items"
#endif

// Whether this decode form runs this work-group's tile (MMA_DEC_MIN + 1 to DEC_BM rows).
inline bool DecodeTile(const __global int4* groups) {
  const int4 grp = groups[ThisTile().y];
  return grp.w == 0 && grp.z - grp.y > MMA_DEC_MIN && grp.z > grp.y && grp.z - grp.y <= DEC_BM;
}

// Copies K slice `step` (of the part from slice ks0) of the tile into local-memory stage `st`:
// the A rows' chunks (rows [p0, end) of `rows` rows of lda chunks from a, slice-major, clamped
// to end - 1), MMA_THREADS apart over the work-items, and 4 weight chunks a work-item (w_src:
// this work-item's first of the part).
inline __attribute__((always_inline)) void DecodeLoad(const __global uint4* a, int lda, int rows,
                                                      int p0, int end, int ks0,
                                                      const __global uint4* w_src, int step,
                                                      int st, __local uint4* lds_a,
                                                      __local uint4* lds_b) {
  const int tid = get_local_id(0);
#pragma unroll
  for (int l = 0; l < (DEC_STAGE_A + MMA_THREADS - 1) / MMA_THREADS; ++l) {
    const int c = tid + l * MMA_THREADS;
    if (c >= DEC_STAGE_A) break;
    const int r = c / CPR;
    CopyAsync16(lds_a + st * DEC_STAGE_A + Swz(r, c % CPR),
                a + ActChunk(min(p0 + r, end - 1), (ks0 + step) * CPR + c % CPR, lda, rows));
  }
#pragma unroll
  for (int l = 0; l < 4; ++l) {
    CopyAsync16(lds_b + st * STAGE_B + tid + l * MMA_THREADS,
                w_src + (size_t)step * STAGE_B + l * MMA_THREADS);
  }
}

// acc[(i * 4 + j) * 4 + r] += A[DEC_BM rows] . W[128 rows]^T over K slices [ks0, ks0 + count)
// for this warp's 32 weight rows (m16 tiles i, n8 tiles j): a rows [p0, end) of `rows` rows of
// lda chunks (slice-major; clamped to end - 1), wt the tile's weight rows (slices of MMA_BN x
// MMA_BK in local-memory order).
inline __attribute__((always_inline)) void DecodeProduct(const __global uint4* restrict a, int lda,
                                                         int rows, int p0, int end,
                                                         const __global uint4* restrict wt, int ks0,
                                                         int count, __local uint4* lds_a,
                                                         __local uint4* lds_b, float* acc) {
  const int tid = get_local_id(0);
  const int lane = tid & 31, warp = tid >> 5;
  const __global uint4* w_src = wt + (size_t)ks0 * STAGE_B + tid;
  const int b_row = warp * 32 + (lane & 7) + ((lane >> 4) << 3);
#pragma unroll
  for (int j = 0; j < DEC_MT * 16; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int s = 0; s < DEC_STAGES - 1; ++s) {
    if (s < count) DecodeLoad(a, lda, rows, p0, end, ks0, w_src, s, s, lds_a, lds_b);
    CopyAsyncCommit();
  }
  for (int s = 0; s < count; ++s) {
    __asm__ __volatile__("cp.async.wait_group %0;" ::"n"(DEC_STAGES - 2) : "memory");
    barrier(CLK_LOCAL_MEM_FENCE);
    // Every warp is past slice s - 1: its stage takes slice s + DEC_STAGES - 1.
    const int next = s + DEC_STAGES - 1;
    if (next < count) {
      DecodeLoad(a, lda, rows, p0, end, ks0, w_src, next, next % DEC_STAGES, lds_a, lds_b);
    }
    CopyAsyncCommit();
    const int st = s % DEC_STAGES;
    const __local uint4* sa = lds_a + st * DEC_STAGE_A;
    const __local uint4* sb = lds_b + st * STAGE_B;
#pragma unroll
    for (int kk = 0; kk < MMA_BK / 16; ++kk) {
      uint af[DEC_MT][4], bf[2][4];
#pragma unroll
      for (int i = 0; i < DEC_MT; ++i) {
        LoadMatrix4(sa + Swz(i * 16 + (lane & 15), kk * 2 + (lane >> 4)), af[i]);
      }
      LoadMatrix4(sb + Swz(b_row, kk * 2 + ((lane >> 3) & 1)), bf[0]);
      LoadMatrix4(sb + Swz(b_row + 16, kk * 2 + ((lane >> 3) & 1)), bf[1]);
#pragma unroll
      for (int i = 0; i < DEC_MT; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) Mma(acc + (i * 4 + j) * 4, af[i], bf[j >> 1] + (j & 1) * 2);
      }
    }
  }
  __asm__ __volatile__("cp.async.wait_all;" ::: "memory");
}

// Parts of K of the launch: part get_group_id(2) of per_split slices (all of K with one part).
inline int2 DecodeSlices(int k_slices, int per_split) {
  const int ks0 = get_group_id(2) * per_split;
  return (int2)(ks0, min(per_split, k_slices - ks0));
}

// ffn_mma_gate_up's tiles of at most DEC_BM rows (one part of K).
__kernel void DEC_KERNEL(ffn_dec_gate_up)(__global const ushort* restrict a,
                                          __global const int4* restrict groups,
                                          __global const ushort* restrict w, int k_pad, int f_pad,
                                          int rows, __global ushort* restrict h) {
  __local uint4 lds_a[DEC_STAGES * DEC_STAGE_A];
  __local uint4 lds_b[DEC_STAGES * STAGE_B];
  if (!DecodeTile(groups)) return;
  const int4 grp = groups[ThisTile().y];
  const int n0 = ThisTile().x * MMA_BN;
  const __global ushort* wt = w + ((size_t)grp.x * 2 * f_pad + n0) * (size_t)k_pad;
  float acc[DEC_MT * 16];
  DecodeProduct((const __global uint4*)a, k_pad / 8, rows, grp.y, grp.z,
                (const __global uint4*)wt, 0, k_pad / MMA_BK, lds_a, lds_b, acc);
  // Tiles j = 0, 2 of a warp are gate, j = 1, 3 up, of outputs
  // f = n0 / 2 + warp * 16 + (j / 2) * 8 + 2t + {0, 1}; rows i * 16 + g and i * 16 + g + 8.
  const int lane = get_local_id(0) & 31, warp = get_local_id(0) >> 5;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < DEC_MT; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int p = grp.y + i * 16 + g + hi * 8;
      if (p >= grp.z) continue;
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const float* gate = acc + (i * 4 + 2 * jj) * 4 + hi * 2;
        const float* up = acc + (i * 4 + 2 * jj + 1) * 4 + hi * 2;
        const int f = n0 / 2 + warp * 16 + jj * 8 + 2 * t;
        ((__global uint*)(h + ActChunk(p, f / 8, f_pad / 8, rows) * 8 + f % 8))[0] =
            SwiGluBf16Pair(gate, up);
      }
    }
  }
}

// Columns c = n0 + warp * 32 + j * 8 + 2t + {0, 1} of rows i * 16 + g (+ 8) from acc, for rows
// below end: into out (rows of ld values, columns below cols).
inline void DecodeStore(const float* acc, int p0, int end, int n0, __global float* out, int ld,
                        int cols) {
  const int lane = get_local_id(0) & 31, warp = get_local_id(0) >> 5;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < DEC_MT; ++i) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int p = p0 + i * 16 + g + hi * 8;
      if (p >= end) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = n0 + warp * 32 + j * 8 + 2 * t;
        const float* v = acc + (i * 4 + j) * 4 + hi * 2;
        if (c < cols) out[(size_t)p * ld + c] = v[0];
        if (c + 1 < cols) out[(size_t)p * ld + c + 1] = v[1];
      }
    }
  }
}

// ffn_mma_down's tiles of at most DEC_BM rows (one part of K).
__kernel void DEC_KERNEL(ffn_dec_down)(__global const ushort* restrict h,
                                       __global const int4* restrict groups,
                                       __global const ushort* restrict w, int f_pad, int n_pad,
                                       int hidden, int rows, __global float* restrict y) {
  __local uint4 lds_a[DEC_STAGES * DEC_STAGE_A];
  __local uint4 lds_b[DEC_STAGES * STAGE_B];
  if (!DecodeTile(groups)) return;
  const int4 grp = groups[ThisTile().y];
  const int n0 = ThisTile().x * MMA_BN;
  const __global ushort* wt = w + ((size_t)grp.x * n_pad + n0) * (size_t)f_pad;
  float acc[DEC_MT * 16];
  DecodeProduct((const __global uint4*)h, f_pad / 8, rows, grp.y, grp.z,
                (const __global uint4*)wt, 0, f_pad / MMA_BK, lds_a, lds_b, acc);
  DecodeStore(acc, grp.y, grp.z, n0, y, hidden, hidden);
}

// ffn_mma_partial's tiles of at most DEC_BM rows.
__kernel void DEC_KERNEL(ffn_dec_partial)(__global const ushort* restrict a,
                                          __global const int4* restrict groups,
                                          __global const ushort* restrict w, int n_rows, int k_pad,
                                          int per_split, int rows,
                                          __global float* restrict partial) {
  __local uint4 lds_a[DEC_STAGES * DEC_STAGE_A];
  __local uint4 lds_b[DEC_STAGES * STAGE_B];
  if (!DecodeTile(groups)) return;
  const int4 grp = groups[ThisTile().y];
  const int n0 = ThisTile().x * MMA_BN;
  const int2 part = DecodeSlices(k_pad / MMA_BK, per_split);
  const __global ushort* wt = w + ((size_t)grp.x * n_rows + n0) * (size_t)k_pad;
  float acc[DEC_MT * 16];
  DecodeProduct((const __global uint4*)a, k_pad / 8, rows, grp.y, grp.z,
                (const __global uint4*)wt, part.x, part.y, lds_a, lds_b, acc);
  DecodeStore(acc, grp.y, grp.z, n0, partial + (size_t)get_group_id(2) * rows * n_rows, n_rows,
              n_rows);
}
