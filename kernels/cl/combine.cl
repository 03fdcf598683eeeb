// Combine: out[i, :] = sum over j of pair_weight[i, j] * y[pair_index[i, j], :], in order of
// j, skipping pairs whose index is negative or not a row of y (y_rows rows). One work-item
// per output element; no atomics, so results are bit-identical run to run.
__kernel void weighted_combine(__global const float* restrict y, long y_rows,
                               __global const int* restrict pair_index,
                               __global const float* restrict pair_weight, int n, int k,
                               long hidden, __global float* restrict out) {
  const size_t c = get_global_id(0);
  const int i = get_global_id(1);
  if (c >= (size_t)hidden || i >= n) return;
  float acc = 0.0f;
  for (int j = 0; j < k; ++j) {
    const int p = pair_index[(size_t)i * k + j];
    if (p < 0 || p >= y_rows) continue;
    acc = fma(pair_weight[(size_t)i * k + j], y[(size_t)p * hidden + c], acc);
  }
  out[(size_t)i * hidden + c] = acc;
}

// The gated shared expert's scale, in place: y[i, :] *= sigmoid(x[i, :] . gate).
__kernel void scale_rows_by_sigmoid_gate(__global const float* restrict x,
                                         __global const float* restrict gate, int n, long hidden,
                                         __global float* restrict y) {
  const int i = get_global_id(0);
  if (i >= n) return;
  const __global float* row = x + (size_t)i * hidden;
  float s = 0.0f;
  for (long h = 0; h < hidden; ++h) s = fma(row[h], gate[h], s);
  const float g = 1.0f / (1.0f + exp(-s));
  __global float* out = y + (size_t)i * hidden;
  for (long h = 0; h < hidden; ++h) out[h] *= g;
}

// scale_rows_by_sigmoid_gate for devices of many work-items (GPUs): a work-group of GATE_WG
// items per row, the dot product's slices added in a fixed tree order. Every work-item reaches
// every barrier (PoCL, which the tests run it on too, crashed on a return before them).
#define GATE_WG 256
__kernel __attribute__((reqd_work_group_size(GATE_WG, 1, 1))) void scale_rows_by_sigmoid_gate_wg(
    __global const float* restrict x, __global const float* restrict gate, int n, long hidden,
    __global float* restrict y) {
  __local float part[GATE_WG];
  const int i = get_group_id(0);
  const int lid = get_local_id(0);
  const __global float* row = x + (size_t)min(i, n - 1) * hidden;
  float s = 0.0f;
  for (int h = lid; h < hidden; h += GATE_WG) s = fma(row[h], gate[h], s);
  part[lid] = s;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int w = GATE_WG / 2; w > 0; w >>= 1) {
    if (lid < w) part[lid] += part[lid + w];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float g = 1.0f / (1.0f + exp(-part[0]));
  if (i >= n) return;
  __global float* out = y + (size_t)i * hidden;
  for (int h = lid; h < hidden; h += GATE_WG) out[h] *= g;
}

// dst[i] += src[i] for i < count: adds the shared expert's rows to the combined ones on the
// device. One work-item per value.
__kernel void add_into(__global const float* restrict src, long count,
                       __global float* restrict dst) {
  const size_t i = get_global_id(0);
  if (i < (size_t)count) dst[i] += src[i];
}

// FP32 -> BF16 -> FP32, rounded to nearest, ties to even, as common::FloatToBf16 rounds (NaN
// stays NaN, made quiet; finite values past the largest BF16 become infinite).
inline float round_to_bf16_value(float v) {
  const uint b = as_uint(v);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return as_float(((b >> 16) | 0x40u) << 16);
  return as_float(((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) << 16);
}

// dst[i] = src[i] rounded to BF16 (kept as FP32) for i < count: the values a row has after a
// BF16 exchange payload. One work-item per value; dst may be src.
__kernel void round_to_bf16(__global const float* src, long count, __global float* dst) {
  const size_t i = get_global_id(0);
  if (i < (size_t)count) dst[i] = round_to_bf16_value(src[i]);
}

// The owner's sum of a token's rows, with the host's arithmetic (worker::WeightedSumRows):
// each product rounded, then added, never fused, so that a token summed here has the bits it
// has when the exchange sums it on the host. For token i and column c:
//   start 0: acc = 0;  1: acc = base[i, c];
//   start 2: acc = 0, then for p < num_parts in order: acc = acc + 1 * r(base[p*n + i, c])
//            (row parts, e.g. each worker's slice of a split shared expert);
//   then for j < k in order: acc = acc + pair_weight[i, j] * r(y[pair_index[i, j], c]),
// r being the identity, or rounding to BF16 (round_bf16: a BF16 combine payload). A pair
// index that is not a row of y (y_rows rows) makes the value NaN: a caller's bug, never
// silent. out may be base (each work-item reads its element before it writes it).
__kernel void sum_pair_rows(__global const float* restrict y, long y_rows,
                            __global const int* restrict pair_index,
                            __global const float* restrict pair_weight, int n, int k,
                            long hidden, __global const float* base, int start,
                            int num_parts, int round_bf16, __global float* out) {
#pragma OPENCL FP_CONTRACT OFF
  const size_t c = get_global_id(0);
  const int i = get_global_id(1);
  if (c >= (size_t)hidden || i >= n) return;
  const size_t at = (size_t)i * hidden + c;
  float acc = 0.0f;
  if (start == 1) {
    acc = base[at];
  } else if (start == 2) {
    for (int p = 0; p < num_parts; ++p) {
      const float b = base[(size_t)p * n * hidden + at];
      const float v = round_bf16 ? round_to_bf16_value(b) : b;
      const float part = 1.0f * v;
      acc = acc + part;
    }
  }
  for (int j = 0; j < k; ++j) {
    const int p = pair_index[(size_t)i * k + j];
    if (p < 0 || p >= y_rows) {
      acc = NAN;
      continue;
    }
    const float v = y[(size_t)p * hidden + c];
    const float r = round_bf16 ? round_to_bf16_value(v) : v;
    const float product = pair_weight[(size_t)i * k + j] * r;
    acc = acc + product;
  }
  out[at] = acc;
}

// The exchange's row moves between devices: for i < count, with (s, d) = moves[2 (first + i)]
// and moves[2 (first + i) + 1], dst row d = r(src row s), r rounding to BF16 (kept as FP32)
// when round_bf16. A move naming a row outside src (src_rows) or dst (dst_rows) writes nothing:
// dst may be another process's memory. src and dst are distinct buffers.
__kernel void copy_rows(__global const float* restrict src, long src_rows,
                        __global const int* restrict moves, long first, int count, long hidden,
                        int round_bf16, __global float* restrict dst, long dst_rows) {
  const size_t c = get_global_id(0);
  const int i = get_global_id(1);
  if (c >= (size_t)hidden || i >= count) return;
  const size_t m = (size_t)(first + i) * 2;
  const int s = moves[m];
  const int d = moves[m + 1];
  if (s < 0 || s >= src_rows || d < 0 || d >= dst_rows) return;
  const float v = src[(size_t)s * hidden + c];
  dst[(size_t)d * hidden + c] = round_bf16 ? round_to_bf16_value(v) : v;
}

// copy_rows for rows of a multiple of 4 values, 4 per work-item (quarter = hidden / 4): wider
// loads, which peer memory read over a link needs to reach the link's speed.
__kernel void copy_rows4(__global const float4* restrict src, long src_rows,
                         __global const int* restrict moves, long first, int count, long quarter,
                         int round_bf16, __global float4* restrict dst, long dst_rows) {
  const size_t c = get_global_id(0);
  const int i = get_global_id(1);
  if (c >= (size_t)quarter || i >= count) return;
  const size_t m = (size_t)(first + i) * 2;
  const int s = moves[m];
  const int d = moves[m + 1];
  if (s < 0 || s >= src_rows || d < 0 || d >= dst_rows) return;
  float4 v = src[(size_t)s * quarter + c];
  if (round_bf16) {
    v = (float4)(round_to_bf16_value(v.x), round_to_bf16_value(v.y), round_to_bf16_value(v.z),
                 round_to_bf16_value(v.w));
  }
  dst[(size_t)d * quarter + c] = v;
}

// Element s (0 to 3) of a vector argument: a run's or a sender's.
inline int pick_int(int s, int4 v) { return s == 0 ? v.s0 : s == 1 ? v.s1 : s == 2 ? v.s2 : v.s3; }
inline long pick_long(int s, long4 v) { return s == 0 ? v.s0 : s == 1 ? v.s1 : s == 2 ? v.s2 : v.s3; }

inline int run_of_row(int i, int4 ends) {
  return (i >= ends.s0) + (i >= ends.s1) + (i >= ends.s2);
}

// Row i's move (source row, destination row) in run r, or (-1, -1) where either is outside its
// buffer.
inline int2 run_move(int i, int r, int4 starts, int4 ends, __global const int* moves,
                     long4 src_rows, long4 dst_rows, long4 block_src, long4 block_dst) {
  const int begin = r == 0 ? 0 : pick_int(r - 1, ends);
  const int start = pick_int(r, starts);
  const long sr = pick_long(r, src_rows);
  const long dr = pick_long(r, dst_rows);
  long s, d;
  if (start < 0) {
    s = pick_long(r, block_src) + (i - begin);
    d = pick_long(r, block_dst) + (i - begin);
  } else {
    const size_t m = (size_t)(start + (i - begin)) * 2;
    s = moves[m];
    d = moves[m + 1];
  }
  if (s < 0 || s >= sr || d < 0 || d >= dr) return (int2)(-1, -1);
  return (int2)((int)s, (int)d);
}

inline __global const float4* run_source(int r, __global const float4* s0,
                                         __global const float4* s1, __global const float4* s2,
                                         __global const float4* s3) {
  return r == 0 ? s0 : r == 1 ? s1 : r == 2 ? s2 : s3;
}

inline __global float4* run_destination(int r, __global float4* d0, __global float4* d1,
                                        __global float4* d2, __global float4* d3) {
  return r == 0 ? d0 : r == 1 ? d1 : r == 2 ? d2 : d3;
}

// copy_rows4 on GPUs, over up to four runs in one launch, each from its own source into its
// own destination: the launch's rows [ends[r-1], ends[r]) (ends[-1] = 0) are run r's, its
// moves from starts[r], or, where starts[r] < 0, a block: source rows from block_src[r] on into
// destination rows from block_dst[r] on, no moves read; unused runs have count 0 (and may have
// null buffers). A work-group moves whole rows, 16 bytes per work-item and access, the rows
// dealt out over the launch's groups in turn (rows i, i + groups, ...) across the runs, so that
// moves within a device's memory run beside moves into a peer's instead of after them. Each
// work-item loads its values of two rows before it stores either, so that a link to a peer's
// memory has many stores in flight from few resident groups.
__kernel void copy_runs_grouped(__global const float4* s0, __global const float4* s1,
                                __global const float4* s2, __global const float4* s3,
                                __global float4* d0, __global float4* d1, __global float4* d2,
                                __global float4* d3, long4 src_rows, long4 dst_rows, int4 starts,
                                int4 ends, long4 block_src, long4 block_dst,
                                __global const int* restrict moves, long quarter, int round_bf16) {
  const int groups = (int)get_num_groups(0);
  const size_t lanes = get_local_size(0);
  const int count = ends.s3;
  for (int i = (int)get_group_id(0); i < count; i += 2 * groups) {
    const int j = i + groups;
    const int qa = run_of_row(i, ends);
    const int2 ma = run_move(i, qa, starts, ends, moves, src_rows, dst_rows, block_src, block_dst);
    const int qb = j < count ? run_of_row(j, ends) : 0;
    const int2 mb = j < count ? run_move(j, qb, starts, ends, moves, src_rows, dst_rows, block_src,
                                              block_dst)
                              : (int2)(-1, -1);
    const bool a = ma.x >= 0;
    const bool b = mb.x >= 0;
    __global const float4* ra = run_source(qa, s0, s1, s2, s3) + (size_t)(a ? ma.x : 0) * quarter;
    __global float4* wa = run_destination(qa, d0, d1, d2, d3) + (size_t)(a ? ma.y : 0) * quarter;
    __global const float4* rb = run_source(qb, s0, s1, s2, s3) + (size_t)(b ? mb.x : 0) * quarter;
    __global float4* wb = run_destination(qb, d0, d1, d2, d3) + (size_t)(b ? mb.y : 0) * quarter;
#pragma unroll 2
    for (size_t c = get_local_id(0); c < (size_t)quarter; c += lanes) {
      float4 va = a ? ra[c] : (float4)(0.0f);
      float4 vb = b ? rb[c] : (float4)(0.0f);
      if (round_bf16) {
        va = (float4)(round_to_bf16_value(va.x), round_to_bf16_value(va.y),
                      round_to_bf16_value(va.z), round_to_bf16_value(va.w));
        vb = (float4)(round_to_bf16_value(vb.x), round_to_bf16_value(vb.y),
                      round_to_bf16_value(vb.z), round_to_bf16_value(vb.w));
      }
      if (a) wa[c] = va;
      if (b) wb[c] = vb;
    }
  }
}

// The sender of received row `row`: rows [begin.s[s], begin.s[s + 1]) of sender s, begin.s3's
// up to end (unused senders' begin is end); -1 outside [begin.s0, end).
inline int sender_of_row(int row, int4 begin, int end) {
  if (row < begin.s0 || row >= end) return -1;
  return (row >= begin.s1) + (row >= begin.s2) + (row >= begin.s3);
}

// The combine's return on the device, from the receiver's pair table, for senders s of a
// group of up to four (received rows [begin.s[s], begin.s[s + 1]) are sender s's, the last
// ones' up to end; unused senders' begin is end): launch row i < pairs moves pair i's output
// row into its sender's pairs (pd[s]) at pair_home[i], s the sender of received row
// pair_row[i]; launch row pairs + r (r < rows) moves received row r's part into its sender's
// parts (qd[s]) at me * tokens[s] + token[r]. tables holds pair_row [pairs], pair_home
// [pairs], token [rows]. Rows of senders outside the group, and moves outside either buffer
// (or to a token past tokens[s]), write nothing. Rows of `hidden` values, 4 at a time where
// hidden is a multiple of 4; rows dealt out over the groups as in copy_runs_grouped.
// Launch row i's move of return_rows: (sender in the group, source row, destination row), the
// sender -1 where the row moves nothing.
inline int3 return_move(int i, __global const int* tables, int pairs, int4 begin, int end,
                        int4 tokens, int me, long pair_src_rows, long part_src_rows,
                        long4 pair_dst_rows, long4 part_dst_rows) {
  if (i < pairs) {
    const int s = sender_of_row(tables[i], begin, end);
    const int home = tables[pairs + i];
    if (s >= 0 && i < pair_src_rows && home >= 0 && home < pick_long(s, pair_dst_rows)) {
      return (int3)(s, i, home);
    }
    return (int3)(-1, 0, 0);
  }
  const int r = i - pairs;
  const int s = sender_of_row(r, begin, end);
  const int t = tables[2 * pairs + r];
  const int n = s < 0 ? 0 : pick_int(s, tokens);
  const long at = (long)me * n + t;
  if (s >= 0 && t >= 0 && t < n && r < part_src_rows && at < pick_long(s, part_dst_rows)) {
    return (int3)(s, r, (int)at);
  }
  return (int3)(-1, 0, 0);
}

#define RETURN_ROWS_ARGS                                                                      \
  __global const float *pair_rows, long pair_src_rows, __global const float *row_parts,       \
      long part_src_rows, __global float *pd0, __global float *pd1, __global float *pd2,      \
      __global float *pd3, __global float *qd0, __global float *qd1, __global float *qd2,     \
      __global float *qd3, long4 pair_dst_rows, long4 part_dst_rows, int4 begin, int end,     \
      int4 tokens, int me, __global const int *restrict tables, int pairs, int rows, long hidden

// Where launch row i's move reads and writes (m from return_move, its sender >= 0).
#define RETURN_ROW_POINTERS(i, m)                                                             \
  __global const float* from = ((i) < pairs ? pair_rows : row_parts) + (size_t)(m).y * hidden; \
  __global float* to = ((i) < pairs ? run_dst((m).x, pd0, pd1, pd2, pd3)                       \
                                    : run_dst((m).x, qd0, qd1, qd2, qd3)) +                    \
                       (size_t)(m).z * hidden

// run_destination for rows of single floats.
inline __global float* run_dst(int r, __global float* d0, __global float* d1, __global float* d2,
                               __global float* d3) {
  return r == 0 ? d0 : r == 1 ? d1 : r == 2 ? d2 : d3;
}

__kernel void return_rows(RETURN_ROWS_ARGS) {
  const int groups = (int)get_num_groups(0);
  const size_t lanes = get_local_size(0);
  const int count = pairs + rows;
  for (int i = (int)get_group_id(0); i < count; i += groups) {
    const int3 m = return_move(i, tables, pairs, begin, end, tokens, me, pair_src_rows,
                               part_src_rows, pair_dst_rows, part_dst_rows);
    if (m.x < 0) continue;
    RETURN_ROW_POINTERS(i, m);
    if (hidden % 4 == 0) {
      __global const float4* from4 = (__global const float4*)from;
      __global float4* to4 = (__global float4*)to;
#pragma unroll 2
      for (size_t c = get_local_id(0); c < (size_t)(hidden / 4); c += lanes) to4[c] = from4[c];
    } else {
      for (size_t c = get_local_id(0); c < (size_t)hidden; c += lanes) to[c] = from[c];
    }
  }
}

// return_rows with a work-item per 4 values of a row (per value where hidden is not a multiple
// of 4): (c, i) over (width, pairs + rows), as copy_rows4 on CPU devices.
__kernel void return_rows_values(RETURN_ROWS_ARGS) {
  const size_t c = get_global_id(0);
  const int i = get_global_id(1);
  const bool by4 = hidden % 4 == 0;
  if (c >= (size_t)(by4 ? hidden / 4 : hidden) || i >= pairs + rows) return;
  const int3 m = return_move(i, tables, pairs, begin, end, tokens, me, pair_src_rows,
                             part_src_rows, pair_dst_rows, part_dst_rows);
  if (m.x < 0) return;
  RETURN_ROW_POINTERS(i, m);
  if (by4) {
    ((__global float4*)to)[c] = ((__global const float4*)from)[c];
  } else {
    to[c] = from[c];
  }
}

// FP32 <-> IEEE FP16 with common/half.h's arithmetic (FloatToFp16, Fp16ToFloat), bit for bit.
inline ushort fp32_to_fp16_bits(float value) {
  const uint bits = as_uint(value);
  const ushort sign = (ushort)((bits >> 16) & 0x8000u);
  const uint a = bits & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return (ushort)(sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u));
  if (a >= 0x477FF000u) return (ushort)(sign | 0x7C00u);
  if (a < 0x38800000u) return (ushort)(sign | (ushort)rint(as_float(a) * 16777216.0f));
  uint h = a - 0x38000000u;
  h += 0xFFFu + ((h >> 13) & 1u);
  return (ushort)(sign | (h >> 13));
}

inline float fp16_bits_to_fp32(ushort h) {
  const uint sign = (uint)(h & 0x8000u) << 16;
  const uint e = (h >> 10) & 0x1Fu;
  const uint mant = h & 0x3FFu;
  if (e == 0) return as_float(as_uint((float)mant * (1.0f / 16777216.0f)) | sign);
  if (e == 31) return as_float(sign | 0x7F800000u | (mant << 13));
  return as_float(sign | ((e + 112) << 23) | (mant << 13));
}

// Row values between FP32 and a request's element type (`type`: 0 FP32, 1 BF16, 2 FP16,
// little-endian), as the host converts them (common/half.h), bit for bit: values
// [src_at, src_at + count) of src into dst from dst_at. One work-item per value; src and dst are distinct buffers.
__kernel void widen_to_fp32(__global const uchar* restrict src, long src_at, int type, long count,
                            __global float* restrict dst, long dst_at) {
  const size_t i = get_global_id(0);
  if (i >= (size_t)count) return;
  const size_t at = (size_t)src_at + i;
  float v;
  if (type == 1) {
    v = as_float((uint)((__global const ushort*)src)[at] << 16);
  } else if (type == 2) {
    v = fp16_bits_to_fp32(((__global const ushort*)src)[at]);
  } else {
    v = ((__global const float*)src)[at];
  }
  dst[(size_t)dst_at + i] = v;
}

__kernel void narrow_from_fp32(__global const float* restrict src, long src_at, long count,
                               int type, __global uchar* restrict dst, long dst_at) {
  const size_t i = get_global_id(0);
  if (i >= (size_t)count) return;
  const float v = src[(size_t)src_at + i];
  const size_t at = (size_t)dst_at + i;
  if (type == 1) {
    ((__global ushort*)dst)[at] = (ushort)(as_uint(round_to_bf16_value(v)) >> 16);
  } else if (type == 2) {
    ((__global ushort*)dst)[at] = fp32_to_fp16_bits(v);
  } else {
    ((__global float*)dst)[at] = v;
  }
}
