#include "model/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace epserve::model {
namespace {

double Dot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

double Sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// Indices of the k largest of `score` among those with allowed[i], descending, ties to the
// lower index; `margin` gets the gap between the k-th chosen and the best unchosen.
std::vector<int> TopK(const std::vector<double>& score, const std::vector<bool>& allowed, int k,
                      double* margin) {
  std::vector<int> idx;
  for (int i = 0; i < static_cast<int>(score.size()); ++i)
    if (allowed[i]) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return score[a] > score[b]; });
  if (margin != nullptr) {
    *margin = static_cast<int>(idx.size()) > k ? score[idx[k - 1]] - score[idx[k]]
                                               : std::numeric_limits<double>::infinity();
  }
  idx.resize(k);
  return idx;
}

// The experts of the `topk_group` best of the groups scored by `group_score` (groups of
// `per_group` consecutive experts); `margin` the gap between the last kept and first dropped.
std::vector<bool> BestGroups(const std::vector<double>& group_score, int topk_group, int per_group,
                             double* margin) {
  const int n_group = static_cast<int>(group_score.size());
  std::vector<bool> allowed(static_cast<size_t>(n_group) * per_group, false);
  for (int g : TopK(group_score, std::vector<bool>(n_group, true), topk_group, margin))
    for (int e = g * per_group; e < (g + 1) * per_group; ++e) allowed[e] = true;
  return allowed;
}

// One token's k experts from its router `logits` under c's routing kind; `weight` gets each
// expert's weight if chosen (before the norm and scale), `margin` the choice's margin.
std::vector<int> ChooseExperts(const MoeLayerConfig& c, const LayerWeights& w,
                               const std::vector<double>& logits, std::vector<double>& weight,
                               double* margin) {
  const int e_count = c.num_experts;
  const int per_group = e_count / c.n_group;
  std::vector<bool> allowed(e_count, true);
  std::vector<double> group_score(c.n_group);
  double group_margin = std::numeric_limits<double>::infinity();
  std::vector<int> chosen;
  switch (c.routing) {
    case RoutingKind::kSoftmaxTopK: {
      const double mx = *std::max_element(logits.begin(), logits.end());
      double sum = 0.0;
      for (int e = 0; e < e_count; ++e) sum += (weight[e] = std::exp(logits[e] - mx));
      for (int e = 0; e < e_count; ++e) weight[e] /= sum;
      if (c.n_group > 1) {  // group_limited_greedy: groups scored by their best probability
        for (int g = 0; g < c.n_group; ++g)
          group_score[g] = *std::max_element(weight.begin() + g * per_group,
                                             weight.begin() + (g + 1) * per_group);
        allowed = BestGroups(group_score, c.topk_group, per_group, &group_margin);
      }
      chosen = TopK(weight, allowed, c.top_k, margin);
      break;
    }
    case RoutingKind::kSigmoidGroupedTopK: {
      std::vector<double> choose(e_count);
      for (int e = 0; e < e_count; ++e) {
        weight[e] = Sigmoid(logits[e]);
        choose[e] = weight[e] + w.router_bias[e];
      }
      for (int g = 0; g < c.n_group; ++g) {  // groups scored by their two best
        std::vector<double> members(choose.begin() + g * per_group,
                                    choose.begin() + (g + 1) * per_group);
        std::partial_sort(members.begin(), members.begin() + 2, members.end(),
                          std::greater<double>());
        group_score[g] = members[0] + members[1];
      }
      allowed = BestGroups(group_score, c.topk_group, per_group, &group_margin);
      chosen = TopK(choose, allowed, c.top_k, margin);
      break;
    }
    case RoutingKind::kTopKSoftmax: {
      chosen = TopK(logits, allowed, c.top_k, margin);
      const double mx = logits[chosen[0]];
      double sum = 0.0;
      for (int e : chosen) sum += (weight[e] = std::exp(logits[e] - mx));
      for (int e : chosen) weight[e] /= sum;
      break;
    }
  }
  *margin = std::min(*margin, group_margin);
  return chosen;
}

}  // namespace

Routing ReferenceRoute(const MoeLayerConfig& c, const LayerWeights& w, const float* x,
                       int64_t num_tokens) {
  const int e_count = c.num_experts;
  const int k = c.top_k;
  Routing r;
  r.ids.resize(num_tokens * k);
  r.weights.resize(num_tokens * k);
  r.margins.resize(num_tokens);
  std::vector<double> logits(e_count), weight(e_count);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = x + t * c.hidden_size;
    for (int e = 0; e < e_count; ++e)
      logits[e] = Dot(row, &w.router[e * c.hidden_size], c.hidden_size);
    double margin = 0.0;
    const std::vector<int> chosen = ChooseExperts(c, w, logits, weight, &margin);
    double norm = 1.0;
    if (c.norm_topk_prob && c.routing != RoutingKind::kTopKSoftmax) {
      double sum = 0.0;
      for (int e : chosen) sum += weight[e];
      norm = 1.0 / (sum + 1e-20);
    }
    for (int j = 0; j < k; ++j) {
      r.ids[t * k + j] = chosen[j];
      r.weights[t * k + j] = static_cast<float>(weight[chosen[j]] * norm * c.routed_scaling_factor);
    }
    r.margins[t] = margin;
  }
  return r;
}

void ReferenceExpert(const float* gate, const float* up, const float* down, int64_t hidden,
                     int64_t ffn, const float* x, double* y_accum, double scale) {
  std::vector<double> act(ffn);
  for (int64_t f = 0; f < ffn; ++f) {
    const double g = Dot(x, gate + f * hidden, hidden);
    const double u = Dot(x, up + f * hidden, hidden);
    act[f] = g * Sigmoid(g) * u;
  }
  for (int64_t h = 0; h < hidden; ++h) {
    const float* d = down + h * ffn;
    double s = 0.0;
    for (int64_t f = 0; f < ffn; ++f) s += act[f] * d[f];
    y_accum[h] += scale * s;
  }
}

void ReferenceForward(const MoeLayerConfig& c, const LayerWeights& w, const float* x,
                      int64_t num_tokens, float* y, Routing* routing) {
  Routing r = ReferenceRoute(c, w, x, num_tokens);
  const int64_t h = c.hidden_size;
  std::vector<double> acc(h);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = x + t * h;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < c.top_k; ++j) {
      const int e = r.ids[t * c.top_k + j];
      ReferenceExpert(w.gate[e].data(), w.up[e].data(), w.down[e].data(), h, c.expert_ffn_size, row,
                      acc.data(), r.weights[t * c.top_k + j]);
    }
    if (c.shared_ffn_size > 0) {
      const double scale =
          c.shared_expert_gate ? Sigmoid(Dot(row, w.shared_expert_gate.data(), h)) : 1.0;
      ReferenceExpert(w.shared_gate.data(), w.shared_up.data(), w.shared_down.data(), h,
                      c.shared_ffn_size, row, acc.data(), scale);
    }
    for (int64_t i = 0; i < h; ++i) y[t * h + i] = static_cast<float>(acc[i]);
  }
  if (routing != nullptr) *routing = std::move(r);
}

}  // namespace epserve::model
