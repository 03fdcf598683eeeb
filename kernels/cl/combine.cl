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

// dst[i] += src[i] for i < count: adds the shared expert's rows to the combined ones on the
// device. One work-item per value.
__kernel void add_into(__global const float* restrict src, long count,
                       __global float* restrict dst) {
  const size_t i = get_global_id(0);
  if (i < (size_t)count) dst[i] += src[i];
}
