// Router: logits = x . router^T, then the k experts of each token and their weights, with
// the semantics of model::ReferenceRoute. One work-item (= one work-group of size 1) per
// block of ROUTER_TOKENS tokens: it computes the block's logits ROUTER_EXPERTS experts at a
// time with 16-wide vector FMAs over H (each router row read once per block, from cache),
// then selects each token's experts. Ties go to the lower expert (or group) index because
// candidates are scanned in ascending order and only a strictly greater score replaces the
// best so far. Summation order is fixed: results are bit-identical run to run.

#ifndef ROUTER_MAX_EXPERTS
#define ROUTER_MAX_EXPERTS 512
#endif

// Values of model::RoutingKind.
#define ROUTING_SOFTMAX_TOPK 0
#define ROUTING_SIGMOID_GROUPED_TOPK 1
#define ROUTING_TOPK_SOFTMAX 2

#ifndef ROUTER_TOKENS
#define ROUTER_TOKENS 4
#endif
#define ROUTER_EXPERTS 4
#if ROUTER_TOKENS != 4
#error "router.cl is written for ROUTER_TOKENS == 4"
#endif

#define MASK_WORDS ((ROUTER_MAX_EXPERTS + 31) / 32)

inline bool BitTest(const uint* mask, int i) { return (mask[i >> 5] >> (i & 31)) & 1u; }
inline void BitSet(uint* mask, int i) { mask[i >> 5] |= 1u << (i & 31); }

// Index of the best score among [0, count) that is `allowed` and not yet `taken`; -1 if none.
inline int ArgMax(const float* score, int count, const uint* allowed, const uint* taken) {
  int best = -1;
  for (int i = 0; i < count; ++i) {
    if (!BitTest(allowed, i) || BitTest(taken, i)) continue;
    if (best < 0 || score[i] > score[best]) best = i;
  }
  return best;
}

// `allowed` = the experts of the `topk_group` best-scoring of `n_group` groups of `per_group`
// consecutive experts (ties to the lower group).
inline void AllowBestGroups(const float* group_score, int n_group, int per_group, int topk_group,
                            uint* allowed) {
  uint all_groups[MASK_WORDS];
  uint groups_taken[MASK_WORDS];
  for (int w = 0; w < MASK_WORDS; ++w) {
    all_groups[w] = 0xffffffffu;
    groups_taken[w] = 0u;
    allowed[w] = 0u;
  }
  for (int j = 0; j < topk_group; ++j) {
    const int g = ArgMax(group_score, n_group, all_groups, groups_taken);
    BitSet(groups_taken, g);
    for (int e = g * per_group; e < (g + 1) * per_group; ++e) BitSet(allowed, e);
  }
}

// Lanes of v summed in a fixed tree order.
inline float Sum16(float16 v) {
  const float8 a = v.lo + v.hi;
  const float4 b = a.lo + a.hi;
  const float2 c = b.lo + b.hi;
  return c.x + c.y;
}

#define REP4(M) M(0) M(1) M(2) M(3)
#define REP4_2(M, a) M(a, 0) M(a, 1) M(a, 2) M(a, 3)
#define ACC_DECL(t, e) float16 acc##t##e = (float16)(0.0f);
#define ACC_DECL_ROW(t) REP4_2(ACC_DECL, t)
#define ACC_FMA(t, e) acc##t##e = fma(xv##t, rv##e, acc##t##e);
#define ACC_FMA_ROW(t) REP4_2(ACC_FMA, t)
#define X_LOAD(t) const float16 xv##t = vload16(0, xr##t + h);
#define R_LOAD(e) const float16 rv##e = vload16(0, rr##e + h);
#define X_PTR(t) const __global float* xr##t = x + (size_t)min(t0 + (t), n - 1) * hidden;
#define R_PTR(e) const __global float* rr##e = router + (size_t)min(e0 + (e), num_experts - 1) * hidden;
// The tail of H (hidden % 16 values) goes into lane 0, after the vector part.
#define TAIL_FMA(t, e) acc##t##e.s0 = fma(xr##t[h], rr##e[h], acc##t##e.s0);
#define TAIL_FMA_ROW(t) REP4_2(TAIL_FMA, t)
#define ACC_STORE(t, e) \
  if (e0 + (e) < num_experts) logit[(t) * ROUTER_MAX_EXPERTS + e0 + (e)] = Sum16(acc##t##e);
#define ACC_STORE_ROW(t) REP4_2(ACC_STORE, t)

// logit[t * ROUTER_MAX_EXPERTS + e] = x[t0 + t] . router[e] for the block's 4 tokens (rows past
// n repeat row n - 1).
inline void BlockLogits(const __global float* restrict x, const __global float* restrict router,
                        int t0, int n, int hidden, int num_experts, float* logit) {
  REP4(X_PTR)
  for (int e0 = 0; e0 < num_experts; e0 += ROUTER_EXPERTS) {
    REP4(R_PTR)
    REP4(ACC_DECL_ROW)
    int h = 0;
    for (; h + 16 <= hidden; h += 16) {
      REP4(X_LOAD)
      REP4(R_LOAD)
      REP4(ACC_FMA_ROW)
    }
    for (; h < hidden; ++h) {
      REP4(TAIL_FMA_ROW)
    }
    REP4(ACC_STORE_ROW)
  }
}

// The k experts of one token from its logits [num_experts]: ids [k], weights [k].
inline void SelectExperts(const float* logit, const __global float* restrict bias,
                          int num_experts, int k, int kind, int norm_topk_prob, int n_group,
                          int topk_group, float routed_scaling_factor, __global int* restrict ids,
                          __global float* restrict weights) {
  float weight[ROUTER_MAX_EXPERTS];  // the weight an expert gets if chosen (before norm)
  float choose[ROUTER_MAX_EXPERTS];  // the score experts are chosen by
  uint allowed[MASK_WORDS];
  uint taken[MASK_WORDS];
  int chosen[ROUTER_MAX_EXPERTS];
  for (int w = 0; w < MASK_WORDS; ++w) {
    allowed[w] = 0xffffffffu;
    taken[w] = 0u;
  }

  if (kind == ROUTING_SOFTMAX_TOPK) {
    float mx = logit[0];
    for (int e = 1; e < num_experts; ++e) mx = fmax(mx, logit[e]);
    float sum = 0.0f;
    for (int e = 0; e < num_experts; ++e) {
      weight[e] = exp(logit[e] - mx);
      sum += weight[e];
    }
    for (int e = 0; e < num_experts; ++e) {
      weight[e] /= sum;
      choose[e] = weight[e];
    }
    if (n_group > 1) {  // group_limited_greedy: groups scored by their best probability
      const int per_group = num_experts / n_group;
      float group_score[ROUTER_MAX_EXPERTS / 2];  // groups hold >= 2 experts (Validate)
      for (int g = 0; g < n_group; ++g) {
        float best = choose[g * per_group];
        for (int e = g * per_group + 1; e < (g + 1) * per_group; ++e) best = fmax(best, choose[e]);
        group_score[g] = best;
      }
      AllowBestGroups(group_score, n_group, per_group, topk_group, allowed);
    }
  } else if (kind == ROUTING_SIGMOID_GROUPED_TOPK) {
    for (int e = 0; e < num_experts; ++e) {
      weight[e] = 1.0f / (1.0f + exp(-logit[e]));
      choose[e] = weight[e] + bias[e];
    }
    // Group score: the sum of the group's two best choosing scores.
    const int per_group = num_experts / n_group;
    float group_score[ROUTER_MAX_EXPERTS / 2];
    for (int g = 0; g < n_group; ++g) {
      float first = -INFINITY;
      float second = -INFINITY;
      for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
        const float v = choose[e];
        if (v > first) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      group_score[g] = first + second;
    }
    AllowBestGroups(group_score, n_group, per_group, topk_group, allowed);
  } else {  // ROUTING_TOPK_SOFTMAX: choose on the raw logits
    for (int e = 0; e < num_experts; ++e) choose[e] = logit[e];
  }

  for (int j = 0; j < k; ++j) {
    const int e = ArgMax(choose, num_experts, allowed, taken);
    BitSet(taken, e);
    chosen[j] = e;
  }

  if (kind == ROUTING_TOPK_SOFTMAX) {
    const float mx = logit[chosen[0]];
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      weight[chosen[j]] = exp(logit[chosen[j]] - mx);
      sum += weight[chosen[j]];
    }
    for (int j = 0; j < k; ++j) weight[chosen[j]] /= sum;
  }
  float norm = 1.0f;
  if (norm_topk_prob && kind != ROUTING_TOPK_SOFTMAX) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += weight[chosen[j]];
    norm = 1.0f / (sum + 1e-20f);
  }
  for (int j = 0; j < k; ++j) {
    ids[j] = chosen[j];
    weights[j] = weight[chosen[j]] * norm * routed_scaling_factor;
  }
}

// x [n, H], router [E, H], bias [E] (kind 1 only) -> ids [n, k], weights [n, k].
// Global size: ceil(n / ROUTER_TOKENS).
__kernel __attribute__((reqd_work_group_size(1, 1, 1))) void route_tokens(
    __global const float* restrict x, __global const float* restrict router,
    __global const float* restrict bias, int n, int hidden, int num_experts, int k, int kind,
    int norm_topk_prob, int n_group, int topk_group, float routed_scaling_factor,
    __global int* restrict ids, __global float* restrict weights) {
  const int t0 = get_group_id(0) * ROUTER_TOKENS;
  if (t0 >= n) return;
  float logit[ROUTER_TOKENS * ROUTER_MAX_EXPERTS];
  BlockLogits(x, router, t0, n, hidden, num_experts, logit);
  for (int t = 0; t < ROUTER_TOKENS && t0 + t < n; ++t) {
    SelectExperts(logit + t * ROUTER_MAX_EXPERTS, bias, num_experts, k, kind, norm_topk_prob,
                  n_group, topk_group, routed_scaling_factor, ids + (size_t)(t0 + t) * k,
                  weights + (size_t)(t0 + t) * k);
  }
}

// The same routing for GPUs, in two launches: route_logits_wg computes logits [n, E] in
// work-groups of ROUTER_WG items over (ROUTER_LG_EXPERTS experts, ROUTER_WG_TOKENS tokens)
// each, so that a few tokens still spread over many multiprocessors: item (expert el, slice s)
// sums k = 4 s + 4 * slices * j (+ 0..3) for the group's tokens at once (each router row read
// once per group, the tokens' x rows at the same addresses by all), the slices are added in a
// fixed order; route_select then selects each token's experts (one work-item per token).
// Results are the same run to run. Global size of route_logits_wg: (ROUTER_WG *
// ceil(E / ROUTER_LG_EXPERTS), ceil(n / ROUTER_WG_TOKENS)).
#ifndef ROUTER_WG
#define ROUTER_WG 256
#endif
#ifndef ROUTER_WG_TOKENS
#define ROUTER_WG_TOKENS 8
#endif
#if ROUTER_WG_TOKENS != 8
#error "route_logits_wg is written for ROUTER_WG_TOKENS == 8"
#endif
#define REP8(M) REP4(M) M(4) M(5) M(6) M(7)
#define WG_X_PTR(t) const __global float* xr##t = x + (size_t)min(t0 + (t), n - 1) * hidden;
#define WG_ACC_DECL(t) \
  float4 acc##t = (float4)(0.0f); \
  float tail##t = 0.0f;
#define WG_ACC_FMA(t) acc##t = fma(vload4(0, xr##t + h), rv, acc##t);
#define WG_TAIL_FMA(t) tail##t = fma(xr##t[h], rr[h], tail##t);

#define ROUTER_LG_EXPERTS 8
#define LG_SLICES (ROUTER_WG / ROUTER_LG_EXPERTS)
#define LG_PART(t) part[(t) * ROUTER_WG + lid] = ((acc##t.x + acc##t.y) + (acc##t.z + acc##t.w)) + tail##t;
__kernel __attribute__((reqd_work_group_size(ROUTER_WG, 1, 1))) void route_logits_wg(
    __global const float* restrict x, __global const float* restrict router, int n, int hidden,
    int num_experts, __global float* restrict logits) {
  __local float part[ROUTER_WG_TOKENS * ROUTER_WG];  // [token][expert of the group][slice]
  const int lid = get_local_id(0);
  const int el = lid / LG_SLICES, s = lid % LG_SLICES;
  const int e0 = get_group_id(0) * ROUTER_LG_EXPERTS;
  const int t0 = get_group_id(1) * ROUTER_WG_TOKENS;
  const int e = min(e0 + el, num_experts - 1);  // past the last expert: computed, not kept
  const __global float* rr = router + (size_t)e * hidden;
  const int hidden4 = hidden & ~3;
  REP8(WG_X_PTR)
  REP8(WG_ACC_DECL)
  for (int h = 4 * s; h < hidden4; h += 4 * LG_SLICES) {
    const float4 rv = vload4(0, rr + h);
    REP8(WG_ACC_FMA)
  }
  for (int h = hidden4 + s; h < hidden; h += LG_SLICES) {
    REP8(WG_TAIL_FMA)
  }
  REP8(LG_PART)
  barrier(CLK_LOCAL_MEM_FENCE);
  if (lid < ROUTER_WG_TOKENS * ROUTER_LG_EXPERTS) {
    const int t = lid / ROUTER_LG_EXPERTS, ei = lid % ROUTER_LG_EXPERTS;
    if (t0 + t < n && e0 + ei < num_experts) {
      const __local float* p = part + t * ROUTER_WG + ei * LG_SLICES;
      float sum = 0.0f;
      for (int q = 0; q < LG_SLICES; ++q) sum += p[q];
      logits[(size_t)(t0 + t) * num_experts + e0 + ei] = sum;
    }
  }
}

// The logits of a large batch (kernels/moe_kernels.cc chooses it where the batch has enough
// token tiles to give the device's compute units work and the router more than one of
// route_logits_wg's expert groups): a register-blocked product in work-groups of RT_WG items
// over tiles of RT_TOKENS tokens x RT_EXPERTS experts, K in slices of RT_K staged in local
// memory, so that each x row is read once per 64 experts and each router row once per 32 tokens
// (route_logits_wg: per 8 and 8). Work-item (tt, te) sums tokens 2 tt + {0, 1} with experts
// te + 16 j (j < 4) over k in ascending order, one fma each: results are the same run to run
// (not route_logits_wg's bits, whose slices are added in another order). qwen1.5-moe-a2.7b at
// 4096 tokens on an H200: route_logits_wg took 0.605 ms. Global size (RT_WG * ceil(E /
// RT_EXPERTS), ceil(n / RT_TOKENS)).
#define RT_WG 256       // kernels::detail::kRouterTileGroupSize
#define RT_TOKENS 32    // kernels::detail::kRouterTileTokens
#define RT_EXPERTS 64   // kernels::detail::kRouterTileExperts
#define RT_K 32
__kernel __attribute__((reqd_work_group_size(RT_WG, 1, 1))) void route_logits_tiled(
    __global const float* restrict x, __global const float* restrict router, int n, int hidden,
    int num_experts, __global float* restrict logits) {
  // Slices transposed, [k / 4][token or expert], so that the 16 experts a warp reads at once
  // are 16 consecutive float4.
  __local float4 xs[(RT_K / 4) * RT_TOKENS];
  __local float4 rs[(RT_K / 4) * RT_EXPERTS];
  const int lid = get_local_id(0);
  const int tt = lid / 16, te = lid % 16;
  const int e0 = get_group_id(0) * RT_EXPERTS;
  const int t0 = get_group_id(1) * RT_TOKENS;
  float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
  for (int k0 = 0; k0 < hidden; k0 += RT_K) {
    // One float4 of x and two of the router a work-item: (row, k quad) = (c / 8, c % 8).
    for (int c = lid; c < (RT_K / 4) * (RT_TOKENS + RT_EXPERTS); c += RT_WG) {
      const bool is_x = c < (RT_K / 4) * RT_TOKENS;
      const int cc = is_x ? c : c - (RT_K / 4) * RT_TOKENS;
      const int row = cc / (RT_K / 4), q = cc % (RT_K / 4);
      const int k = k0 + 4 * q;
      const __global float* src =
          is_x ? x + (size_t)min(t0 + row, n - 1) * hidden
               : router + (size_t)min(e0 + row, num_experts - 1) * hidden;
      float4 v;
      if (k + 4 <= hidden) {
        v = vload4(0, src + k);
      } else {
        v.x = k < hidden ? src[k] : 0.0f;
        v.y = k + 1 < hidden ? src[k + 1] : 0.0f;
        v.z = k + 2 < hidden ? src[k + 2] : 0.0f;
        v.w = 0.0f;
      }
      if (is_x) {
        xs[q * RT_TOKENS + row] = v;
      } else {
        rs[q * RT_EXPERTS + row] = v;
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int q = 0; q < RT_K / 4; ++q) {
      const float4 x0 = xs[q * RT_TOKENS + 2 * tt], x1 = xs[q * RT_TOKENS + 2 * tt + 1];
      for (int j = 0; j < 4; ++j) {
        const float4 r = rs[q * RT_EXPERTS + te + 16 * j];
        acc[0][j] = fma(x0.w, r.w, fma(x0.z, r.z, fma(x0.y, r.y, fma(x0.x, r.x, acc[0][j]))));
        acc[1][j] = fma(x1.w, r.w, fma(x1.z, r.z, fma(x1.y, r.y, fma(x1.x, r.x, acc[1][j]))));
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  for (int i = 0; i < 2; ++i) {
    const int t = t0 + 2 * tt + i;
    if (t >= n) continue;
    for (int j = 0; j < 4; ++j) {
      const int e = e0 + te + 16 * j;
      if (e < num_experts) logits[(size_t)t * num_experts + e] = acc[i][j];
    }
  }
}

__kernel void route_select(__global const float* restrict logits, __global const float* restrict bias,
                           int n, int num_experts, int k, int kind, int norm_topk_prob,
                           int n_group, int topk_group, float routed_scaling_factor,
                           __global int* restrict ids, __global float* restrict weights) {
  const int t = get_global_id(0);
  if (t >= n) return;
  float logit[ROUTER_MAX_EXPERTS];
  for (int e = 0; e < num_experts; ++e) logit[e] = logits[(size_t)t * num_experts + e];
  SelectExperts(logit, bias, num_experts, k, kind, norm_topk_prob, n_group, topk_group,
                routed_scaling_factor, ids + (size_t)t * k, weights + (size_t)t * k);
}

// route_select for softmax routing without expert groups (ROUTING_SOFTMAX_TOPK, n_group <= 1:
// Mixtral, Qwen-MoE, OLMoE): a work-group of SELECT_WG work-items per token instead of one
// work-item, with SelectExperts' bits. The max and the arg-max are exact; each exp and
// quotient is one expert's; the sums (of the exps, of the chosen weights) run in SelectExperts'
// order on one work-item; the arg-max takes the lowest index among equal scores, as ArgMax's
// loop does (scores with a NaN among them: that loop itself, on one work-item). One work-item
// walking the experts in private arrays took about 30 us for 16 tokens of 60 experts on an
// H200. Global size: n * SELECT_WG.
#ifndef SELECT_WG
#define SELECT_WG 32
#endif
__kernel __attribute__((reqd_work_group_size(SELECT_WG, 1, 1))) void route_select_softmax_wg(
    __global const float* restrict logits, int n, int num_experts, int k, int norm_topk_prob,
    float routed_scaling_factor, __global int* restrict ids, __global float* restrict weights) {
  __local float w[ROUTER_MAX_EXPERTS];
  __local float best_v[SELECT_WG];
  __local int best_i[SELECT_WG];
  __local uint taken[MASK_WORDS];
  __local int chosen[ROUTER_MAX_EXPERTS];
  __local float total;
  __local int any_nan;
  const int t = get_group_id(0), lid = get_local_id(0);
  if (t >= n) return;  // the whole work-group
  const __global float* lg = logits + (size_t)t * num_experts;
  float m = NAN;  // fmax passes over NaN, as SelectExperts' max does
  for (int e = lid; e < num_experts; e += SELECT_WG) m = fmax(m, lg[e]);
  best_v[lid] = m;
  for (int i = lid; i < MASK_WORDS; i += SELECT_WG) taken[i] = 0u;
  if (lid == 0) any_nan = 0;
  barrier(CLK_LOCAL_MEM_FENCE);
  float mx = best_v[0];
  for (int i = 1; i < SELECT_WG; ++i) mx = fmax(mx, best_v[i]);
  for (int e = lid; e < num_experts; e += SELECT_WG) w[e] = exp(lg[e] - mx);
  barrier(CLK_LOCAL_MEM_FENCE);
  if (lid == 0) {
    float sum = 0.0f;
    for (int e = 0; e < num_experts; ++e) sum += w[e];
    total = sum;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  const float sum = total;
  for (int e = lid; e < num_experts; e += SELECT_WG) {
    const float v = w[e] / sum;
    w[e] = v;
    if (isnan(v)) atomic_or(&any_nan, 1);
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  const bool serial = any_nan != 0;
  for (int j = 0; j < k; ++j) {
    if (!serial) {
      float bv = 0.0f;
      int bi = -1;
      for (int e = lid; e < num_experts; e += SELECT_WG) {
        if ((taken[e >> 5] >> (e & 31)) & 1u) continue;
        if (bi < 0 || w[e] > bv) {
          bv = w[e];
          bi = e;
        }
      }
      best_v[lid] = bv;
      best_i[lid] = bi;
      barrier(CLK_LOCAL_MEM_FENCE);
      for (int step = SELECT_WG / 2; step > 0; step >>= 1) {
        if (lid < step) {
          const int oi = best_i[lid + step], mi = best_i[lid];
          const float ov = best_v[lid + step], mv = best_v[lid];
          if (oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi))) {
            best_v[lid] = ov;
            best_i[lid] = oi;
          }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
      }
    }
    if (lid == 0) {
      int e = best_i[0];
      if (serial) {
        e = -1;
        for (int i = 0; i < num_experts; ++i) {
          if ((taken[i >> 5] >> (i & 31)) & 1u) continue;
          if (e < 0 || w[i] > w[e]) e = i;
        }
      }
      taken[e >> 5] |= 1u << (e & 31);
      chosen[j] = e;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lid == 0) {
    float norm = 1.0f;
    if (norm_topk_prob) {
      float chosen_sum = 0.0f;
      for (int j = 0; j < k; ++j) chosen_sum += w[chosen[j]];
      norm = 1.0f / (chosen_sum + 1e-20f);
    }
    for (int j = 0; j < k; ++j) {
      ids[(size_t)t * k + j] = chosen[j];
      weights[(size_t)t * k + j] = w[chosen[j]] * norm * routed_scaling_factor;
    }
  }
}

// The routed pairs grouped by local expert on the device, as a worker's layout does on the host
// (worker::Worker::RunLocal): expert-major, pairs in order of i = token * k + choice within
// an expert. For i < pairs, e = local_of[ids[i]] (ids outside [0, num_global) or mapped
// outside [0, num_local): `bad`, counted in counts[num_local]):
//   row_index[offset(e) + r] = i / k   (r: how many earlier pairs share e)
//   pair_of_choice[i]        = offset(e) + r   (-1 for a bad pair)
//   counts[e] = pairs of e, counts[num_local] = bad pairs
//   groups[g] = (e, first, end, w): tiles of at most `chunk` rows of one expert: first each
//               expert's short last tile (fewer than `chunk` rows), in expert order, then the
//               full tiles, then (0, 0, 0, 0) up to max_groups (the FFN's launch; empty tiles do
//               nothing). With tails_with_full, the short tile of an expert that has full
//               tiles follows them, with w = 1 (the tensor-core FFN's 128-row kernels take it);
//               w = 0 elsewhere.
// Pairs beyond max_count of one expert (a token that chose it twice) count as bad as well.
// One work-group of any size up to GROUP_WG_MAX. Work-item (expert el, slice s) counts, then
// places, the pairs of its slice of i for experts el, el + E2, ...: every expert's pairs are
// placed in order of i with no atomics, so the result is the same run to run. Between the two,
// a scan over the experts (a few work-items each) gives each expert its first pair and its
// groups' places.
#ifndef GROUP_WG_MAX
#define GROUP_WG_MAX 1024
#endif
// Batches of up to this many pairs keep each pair's local expert in local memory for the scans.
#define GROUP_LOCAL_PAIRS 4096  // kernels::kDeviceGroupingMaxPairs
// The experts' scan of group_pairs runs over at most this many work-items.
#define GROUP_SCAN 256
// What an expert of `count` pairs adds to the scan: (pairs, its short tile among those that lead
// the groups (0 or 1), its other tiles).
inline int4 GroupCounts(int count, int chunk, int tails_with_full) {
  const int tail = count % chunk != 0;
  const int follows = tails_with_full && count > chunk;
  return (int4)(count, tail && !follows, count / chunk + (tail && follows), 0);
}
inline int LocalExpertOf(__global const int* ids, __global const int* local_of, int num_global,
                         int num_local, int i) {
  const int id = ids[i];
  const int e = id >= 0 && id < num_global ? local_of[id] : -1;
  return e >= 0 && e < num_local ? e : -1;
}

__kernel void group_pairs(__global const int* restrict ids, int pairs, int k,
                          __global const int* restrict local_of, int num_global, int num_local,
                          int chunk, int max_groups, int tails_with_full, int max_count,
                          __global int* restrict row_index,
                          __global int* restrict pair_of_choice, __global int4* restrict groups,
                          __global int* restrict counts) {
  __local int before[GROUP_WG_MAX > ROUTER_MAX_EXPERTS ? GROUP_WG_MAX : ROUTER_MAX_EXPERTS];
  __local int offset[ROUTER_MAX_EXPERTS];    // each expert's first pair
  __local int count_of[ROUTER_MAX_EXPERTS];  // and its pairs
  __local int staged[GROUP_LOCAL_PAIRS];  // each pair's local expert (-1: bad)
  __local int4 scan[GROUP_SCAN];  // the experts' scan: (pairs, short tiles first, the others)
  __local int bad;
  __local int num_groups;
  const int lid = get_local_id(0), wg = get_local_size(0);
  const bool in_local = pairs <= GROUP_LOCAL_PAIRS;
  if (in_local) {
    for (int i = lid; i < pairs; i += wg) {
      staged[i] = LocalExpertOf(ids, local_of, num_global, num_local, i);
    }
  }
#define EXPERT_OF(i) \
  (in_local ? staged[i] : LocalExpertOf(ids, local_of, num_global, num_local, (i)))
  int e2 = 1;
  while (e2 < num_local && e2 < wg) e2 *= 2;
  const int slices = wg / e2;
  const int el = lid % e2, s = lid / e2;
  const int span = (pairs + slices - 1) / slices;
  const int begin = min(s * span, pairs), end = min(begin + span, pairs);
  if (lid == 0) bad = 0;
  barrier(CLK_LOCAL_MEM_FENCE);
  // Each (expert, slice)'s count, at before[s * num_local + e]; bad pairs by the el == 0 items.
  if (s < slices) {
    for (int e = el; e < num_local; e += e2) {
      int c = 0;
      for (int i = begin; i < end; ++i) c += EXPERT_OF(i) == e;
      before[s * num_local + e] = c;
    }
    if (el == 0) {
      int b = 0;
      for (int i = begin; i < end; ++i) b += EXPERT_OF(i) < 0;
      if (b > 0) atomic_add(&bad, b);
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  // Per expert: the slices' counts become the pairs of e before each slice. An expert with
  // more pairs than max_count (the batch's tokens: a token chose it twice) makes its excess
  // bad, so that the batch fails: the FFN's launches hold no larger tiles.
  for (int e = lid; e < num_local; e += wg) {
    int total = 0;
    for (int q = 0; q < slices; ++q) {
      const int c = before[q * num_local + e];
      before[q * num_local + e] = total;
      total += c;
    }
    count_of[e] = total;
    counts[e] = total;
    if (total > max_count) atomic_add(&bad, total - max_count);
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  // The experts' offsets and group indices, a scan over work-items: item lid < sw takes experts
  // [lid * per, lid * per + per). The short tiles lead the groups (so that the decode forms'
  // launches cover only the first min(num_local, pairs) groups), then the full tiles in
  // expert order; with tails_with_full, an expert's short tile that has full ones follows them
  // instead, marked for the 128-row kernels (w = 1).
  int sw = 1;
  while (sw < num_local && sw < min(wg, GROUP_SCAN)) sw *= 2;
  const int per = (num_local + sw - 1) / sw;
  const int e_begin = min(lid * per, num_local), e_end = min(e_begin + per, num_local);
  int4 mine = (int4)(0);
  for (int e = e_begin; e < e_end; ++e) mine += GroupCounts(count_of[e], chunk, tails_with_full);
  if (lid < sw) scan[lid] = mine;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int d = 1; d < sw; d *= 2) {
    const int4 add = lid < sw && lid >= d ? scan[lid - d] : (int4)(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < sw) scan[lid] += add;
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const int4 total = scan[sw - 1];
  int4 at = lid < sw ? scan[lid] - mine : (int4)(0);  // before this item's first expert
  for (int e = e_begin; e < e_end; ++e) {
    const int count = count_of[e];
    const int4 c = GroupCounts(count, chunk, tails_with_full);
    offset[e] = at.x;
    const int end = at.x + count, full_end = end - count % chunk;
    if (c.y > 0 && at.y < max_groups) groups[at.y] = (int4)(e, full_end, end, 0);
    int g = total.y + at.z;
    for (int first = at.x; first < full_end; first += chunk, ++g) {
      if (g < max_groups) groups[g] = (int4)(e, first, first + chunk, 0);
    }
    // A short tile that does not lead (c.y == 0) follows the full ones, for the 128-row kernels.
    if (c.y == 0 && count % chunk != 0 && g < max_groups) groups[g] = (int4)(e, full_end, end, 1);
    at += c;
  }
  if (lid == 0) {
    num_groups = min(total.y + total.z, max_groups);
    counts[num_local] = bad;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int g = num_groups + lid; g < max_groups; g += wg) groups[g] = (int4)(0);
  if (s < slices) {
    for (int e = el; e < num_local; e += e2) {
      int at = offset[e] + before[s * num_local + e];
      for (int i = begin; i < end; ++i) {
        if (EXPERT_OF(i) != e) continue;
        row_index[at] = i / k;
        pair_of_choice[i] = at;
        ++at;
      }
    }
    if (el == 0) {
      for (int i = begin; i < end; ++i) {
        if (EXPERT_OF(i) < 0) pair_of_choice[i] = -1;
      }
    }
  }
}
#undef EXPERT_OF
