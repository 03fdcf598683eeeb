// The exchange's way back: each receiver makes its output rows available to their owners
// (Combine), and each owner reads them where they are, or pulls them where the heap has no
// load/store access, and sums them per token (Reduce). Count, notify and dispatch are in
// exchange.cc.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/parallel.h"
#include "common/status.h"
#include "worker/exchange.h"

namespace epserve::worker {

absl::Status Exchange::WaitForCombined(absl::Time deadline) {
  for (int d = 0; d < plan_.shape().num_workers; ++d) {
    if (live_.Has(d))
      EPSERVE_RETURN_IF_ERROR(
          WaitFor(regions_.combine_flag, d, deadline, "combined rows from worker"));
  }
  return absl::OkStatus();
}

bool Exchange::OutputInHeap() const {
  return plan_.combine_dtype() == common::ElementType::kFp32 &&
         plan_.combine_row_bytes() == static_cast<size_t>(plan_.shape().hidden) * sizeof(float);
}

float* Exchange::PairOutput() {
  return OutputInHeap() ? heap_.LocalAs<float>(regions_.combine_rows) : out_.data();
}

float* Exchange::RowOutput() {
  if (!plan_.shared_expert_split()) return nullptr;
  return PairOutput() + plan_.recv_pair_capacity() * plan_.shape().hidden;
}

void Exchange::ComputeRuns() {
  const int num_workers = plan_.shape().num_workers;
  run_base_.assign(static_cast<size_t>(num_workers) * num_local_max_ + 1, 0);
  for (int d = 0, i = 0; d < num_workers; ++d) {
    for (int e = 0; e < num_local_max_; ++e, ++i) {
      run_base_[i + 1] = run_base_[i] + my_counts_[d * count_stride_ + 2 + e];
    }
  }
}

absl::Status Exchange::Combine(const float* pair_out, const float* row_out) {
  const int num_workers = plan_.shape().num_workers;
  const int64_t hidden = plan_.shape().hidden;
  const size_t row_bytes = plan_.combine_row_bytes();
  // The output rows go into this worker's own segment, pairs then rows; each owner reads its
  // rows from there in Reduce. An expert step that wrote into PairOutput() and RowOutput()
  // (fp32) costs no copy here.
  char* region = heap_.LocalAs<char>(regions_.combine_rows);
  char* row_region = region + plan_.recv_pair_capacity() * row_bytes;
  auto place = [&](const float* src, int64_t rows, char* dst) {
    if (rows == 0 || src == nullptr) return;
    if (OutputInHeap()) {
      if (src != reinterpret_cast<const float*>(dst)) {
        std::memcpy(dst, src, static_cast<size_t>(rows) * row_bytes);
      }
      return;
    }
    for (int64_t r = 0; r < rows; ++r) {
      EncodeRow(plan_.combine_dtype(), src + r * hidden, hidden, dst + r * row_bytes);
    }
  };
  place(pair_out, received_.pairs, region);
  if (plan_.shared_expert_split()) place(row_out, received_.rows, row_region);
  for (int s = 0; s < num_workers; ++s) {
    if (!live_.Has(s)) continue;
    EPSERVE_RETURN_IF_ERROR(
        heap_.SignalSet(rank_of(s), signal(regions_.combine_flag, me_), epoch_));
  }
  return absl::OkStatus();
}

absl::Status Exchange::PullCombined(std::vector<int64_t>& pulled_at) {
  const int num_workers = plan_.shape().num_workers;
  const size_t row_bytes = plan_.combine_row_bytes();
  const bool split = plan_.shared_expert_split();
  const size_t pair_region = static_cast<size_t>(plan_.recv_pair_capacity()) * row_bytes;
  ComputeRuns();
  const int64_t my_pairs = run_base_.back();
  const int64_t my_rows = split ? combine_base_[num_workers] : 0;
  pulled_.resize(std::max(pulled_.size(), static_cast<size_t>(my_pairs + my_rows) * row_bytes));
  for (int d = 0; d < num_workers; ++d) {
    for (int e = 0; e < placement_->count(d); ++e) {
      const int i = d * num_local_max_ + e;
      const int64_t len = run_base_[i + 1] - run_base_[i];
      if (len == 0) continue;
      EPSERVE_RETURN_IF_ERROR(heap_.Get(
          rank_of(d), regions_.combine_rows + static_cast<size_t>(pair_base_[i]) * row_bytes,
          pulled_.data() + run_base_[i] * row_bytes, static_cast<size_t>(len) * row_bytes));
    }
    char* rows_dst = pulled_.data() + (my_pairs + combine_base_[d]) * row_bytes;
    const int64_t rows = combine_base_[d + 1] - combine_base_[d];
    if (split && rows > 0) {
      EPSERVE_RETURN_IF_ERROR(
          heap_.Get(rank_of(d), regions_.combine_rows + pair_region + row_base_[d] * row_bytes,
                    rows_dst, static_cast<size_t>(rows) * row_bytes));
    }
    pair_base_at_[d] = pulled_.data();
    row_base_at_[d] = rows_dst;
  }
  pulled_at.resize(pair_at_.size());
  for (size_t i = 0; i < pair_at_.size(); ++i) {
    pulled_at[i] = run_base_[dest_[i] * num_local_max_ + local_[i]] + pair_local_[i];
  }
  return absl::OkStatus();
}

absl::Status Exchange::Reduce(const float* weights, float* y, bool accumulate,
                              absl::Time deadline) {
  const int num_workers = plan_.shape().num_workers;
  const int k = plan_.shape().top_k;
  const int64_t hidden = plan_.shape().hidden;
  const common::ElementType dtype = plan_.combine_dtype();
  const size_t row_bytes = plan_.combine_row_bytes();
  const bool split = plan_.shared_expert_split();
  EPSERVE_RETURN_IF_ERROR(WaitForCombined(deadline));
  // Where my rows at worker d are: its pair table's rows (pair_at_ indexes them) and, split,
  // its row parts [row_base_[d], + rows I sent d). Read in place when d's segment is
  // load/store; else fetched into pulled_, my pairs in runs per (d, local expert) (run_base_),
  // then my row parts per d (combine_base_), and pair_at_ re-based to the runs.
  pair_base_at_.assign(num_workers, nullptr);
  row_base_at_.assign(num_workers, nullptr);
  bool direct = true;
  for (int d = 0; d < num_workers && direct; ++d) {
    pair_base_at_[d] = static_cast<const char*>(heap_.Direct(rank_of(d), regions_.combine_rows));
    direct = pair_base_at_[d] != nullptr;
  }
  std::vector<int64_t> pulled_at;  // rma: pair_at_ within pulled_
  if (direct) {
    const size_t pair_region = static_cast<size_t>(plan_.recv_pair_capacity()) * row_bytes;
    for (int d = 0; d < num_workers; ++d) {
      row_base_at_[d] = pair_base_at_[d] + pair_region + row_base_[d] * row_bytes;
    }
  } else {
    EPSERVE_RETURN_IF_ERROR(PullCombined(pulled_at));
  }
  const std::vector<int64_t>& at = direct ? pair_at_ : pulled_at;
  // Per token: the row parts in destination order, then each choice's row times its weight in
  // the order of j (WeightedSumRows: no fused multiply-adds, the same on every host). Tokens
  // are independent: ranges of them on reduce_threads_ threads give the same bits.
  common::ParallelFor(reduce_threads_, n_, reduce_grain_, [&](int64_t begin, int64_t end) {
    std::vector<const void*> parts(num_workers + k);
    std::vector<float> scale(num_workers + k);
    for (int64_t t = begin; t < end; ++t) {
      int count = 0;
      if (split) {
        const int64_t* slot = &slot_[t * num_workers];
        for (int d = 0; d < num_workers; ++d) {
          if (slot[d] < 0) continue;
          scale[count] = 1.0f;
          parts[count++] = row_base_at_[d] + slot[d] * row_bytes;
        }
      }
      for (int j = 0; j < k; ++j) {
        const int64_t i = t * k + j;
        scale[count] = weights[i];
        parts[count++] = pair_base_at_[dest_[i]] + at[i] * row_bytes;
      }
      WeightedSumRows(dtype, parts.data(), scale.data(), count, hidden, y + t * hidden, accumulate);
    }
  });
  return absl::OkStatus();
}

}  // namespace epserve::worker
