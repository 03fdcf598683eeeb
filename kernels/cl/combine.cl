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
