// Router: logits = x . router^T, then the k experts of each token and their weights, with
// the semantics of model::ReferenceRoute. One work-item per token; ties go to the lower
// expert (or group) index because candidates are scanned in ascending order and only a
// strictly greater score replaces the best so far.

#ifndef ROUTER_MAX_EXPERTS
#define ROUTER_MAX_EXPERTS 512
#endif

// Values of model::RoutingKind.
#define ROUTING_SOFTMAX_TOPK 0
#define ROUTING_SIGMOID_GROUPED_TOPK 1
#define ROUTING_TOPK_SOFTMAX 2

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

// x [n, H], router [E, H], bias [E] (kind 1 only) -> ids [n, k], weights [n, k].
__kernel void route_tokens(__global const float* restrict x, __global const float* restrict router,
                           __global const float* restrict bias, int n, int hidden,
                           int num_experts, int k, int kind, int norm_topk_prob, int n_group,
                           int topk_group, float routed_scaling_factor,
                           __global int* restrict ids, __global float* restrict weights) {
  const int t = get_global_id(0);
  if (t >= n) return;
  float logit[ROUTER_MAX_EXPERTS];
  float weight[ROUTER_MAX_EXPERTS];  // the weight an expert gets if chosen (before norm)
  float choose[ROUTER_MAX_EXPERTS];  // the score experts are chosen by
  uint allowed[MASK_WORDS];
  uint taken[MASK_WORDS];
  int chosen[ROUTER_MAX_EXPERTS];

  const __global float* row = x + (size_t)t * hidden;
  for (int e = 0; e < num_experts; ++e) {
    const __global float* r = router + (size_t)e * hidden;
    float s = 0.0f;
    for (int h = 0; h < hidden; ++h) s = fma(row[h], r[h], s);
    logit[e] = s;
  }
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
    ids[(size_t)t * k + j] = chosen[j];
    weights[(size_t)t * k + j] = weight[chosen[j]] * norm * routed_scaling_factor;
  }
}
