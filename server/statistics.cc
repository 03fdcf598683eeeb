#include "server/statistics.h"

namespace epserve::server {

void Statistics::ObserveRequest(const absl::Status& status, absl::Duration total,
                                const TaskTimes& times) {
  const uint64_t now_ms = static_cast<uint64_t>(absl::ToUnixMillis(absl::Now()));
  std::lock_guard<std::mutex> lock(mu_);
  last_inference_ms_ = now_ms;
  if (!status.ok()) {
    fail_.Add(total);
    return;
  }
  ++inference_count_;
  success_.Add(total);
  queue_.Add(times.queue);
  input_.Add(times.compute_input);
  infer_.Add(times.compute_infer);
  output_.Add(times.compute_output);
}

void Statistics::ObserveBatch(int64_t rows, absl::Duration input, absl::Duration infer,
                              absl::Duration output) {
  std::lock_guard<std::mutex> lock(mu_);
  ++execution_count_;
  BatchStats& b = batches_[rows];
  b.input.Add(input);
  b.infer.Add(infer);
  b.output.Add(output);
}

void Statistics::Fill(inference::ModelStatistics* out) const {
  auto set = [](inference::StatisticDuration* d, const Duration& v) {
    d->set_count(v.count);
    d->set_ns(v.ns);
  };
  std::lock_guard<std::mutex> lock(mu_);
  out->set_last_inference(last_inference_ms_);
  out->set_inference_count(inference_count_);
  out->set_execution_count(execution_count_);
  inference::InferStatistics* s = out->mutable_inference_stats();
  set(s->mutable_success(), success_);
  set(s->mutable_fail(), fail_);
  set(s->mutable_queue(), queue_);
  set(s->mutable_compute_input(), input_);
  set(s->mutable_compute_infer(), infer_);
  set(s->mutable_compute_output(), output_);
  s->mutable_cache_hit();
  s->mutable_cache_miss();
  for (const auto& [rows, b] : batches_) {
    inference::InferBatchStatistics* bs = out->add_batch_stats();
    bs->set_batch_size(static_cast<uint64_t>(rows));
    set(bs->mutable_compute_input(), b.input);
    set(bs->mutable_compute_infer(), b.infer);
    set(bs->mutable_compute_output(), b.output);
  }
}

}  // namespace epserve::server
