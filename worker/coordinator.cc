#include "worker/coordinator.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace epserve::worker {

absl::Status Coordinator::WaitForWorkers(absl::Time deadline) {
  for (int w = 0; w < layout_.shape.num_workers; ++w) {
    absl::Status s = shmem::WaitAtLeast(layout_.Signal(heap_, 0, layout_.ready, w), 1, deadline,
                                        absl::StrCat("worker ", w, " to load its weights"),
                                        absl::Milliseconds(5));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Coordinator::Post(BatchOp op, int layer_pos, int64_t total_rows, absl::Time deadline) {
  const int num_workers = layout_.shape.num_workers;
  ++seq_;
  for (int w = 0; w < num_workers; ++w) {
    const int64_t begin = total_rows * w / num_workers;
    const int64_t end = total_rows * (w + 1) / num_workers;
    BatchDescriptor* desc = heap_.As<BatchDescriptor>(w + 1, layout_.descriptor);
    desc->op = op;
    desc->layer_pos = layer_pos;
    desc->row_start = begin;
    desc->num_rows = end - begin;
    desc->deadline_unix_us = absl::ToUnixMicros(deadline);
    shmem::SignalStore(heap_.As<uint64_t>(w + 1, layout_.batch_seq), seq_);
  }
  return absl::OkStatus();
}

absl::Status Coordinator::WaitDone(absl::Time deadline) {
  for (int w = 0; w < layout_.shape.num_workers; ++w) {
    absl::Status s = shmem::WaitAtLeast(
        layout_.Signal(heap_, 0, layout_.done_seq, w), seq_, deadline,
        absl::StrCat("worker ", w, " to finish batch ", seq_), absl::Microseconds(50), &abort_);
    if (!s.ok()) {
      healthy_ = false;
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<BatchTrace> Coordinator::Run(int layer_pos, std::span<const RowChunk> chunks,
                                            absl::Time deadline) {
  if (!healthy_) {
    return absl::UnavailableError(
        "the expert workers stopped answering; the service needs a restart");
  }
  const ExchangeShape& shape = layout_.shape;
  const int num_workers = shape.num_workers;
  const size_t row_bytes = static_cast<size_t>(shape.hidden) * sizeof(float);
  int64_t total = 0;
  for (const RowChunk& c : chunks) total += c.rows;
  if (total < 1 || total > shape.max_batch_tokens) {
    return absl::InternalError(
        absl::StrCat("batch of ", total, " rows outside [1, ", shape.max_batch_tokens, "]"));
  }
  BatchTrace trace;

  // Scatter: batch row r goes to worker w with begin(w) <= r < end(w).
  absl::Time t0 = absl::Now();
  int64_t row = 0;
  int w = 0;
  for (const RowChunk& c : chunks) {
    for (int64_t done = 0; done < c.rows;) {
      while (row >= total * (w + 1) / num_workers) ++w;
      const int64_t begin = total * w / num_workers;
      const int64_t end = total * (w + 1) / num_workers;
      const int64_t take = std::min(c.rows - done, end - row);
      std::memcpy(heap_.As<float>(w + 1, layout_.input) + (row - begin) * shape.hidden,
                  c.input + done * shape.hidden, take * row_bytes);
      row += take;
      done += take;
    }
  }
  trace.scatter_ns = absl::ToInt64Nanoseconds(absl::Now() - t0);

  absl::Status s = Post(BatchOp::kRun, layer_pos, total, deadline);
  if (s.ok()) s = WaitDone(deadline);
  if (!s.ok()) return s;
  trace.stage_ns.resize(num_workers);
  for (int i = 0; i < num_workers; ++i) {
    const WorkerReport& report = heap_.As<WorkerReport>(0, layout_.reports)[i];
    if (report.status_code != 0) {
      return absl::Status(
          static_cast<absl::StatusCode>(report.status_code),
          std::string(report.message, strnlen(report.message, sizeof(report.message))));
    }
    std::copy(std::begin(report.stage_ns), std::end(report.stage_ns), trace.stage_ns[i].begin());
  }
  const int64_t* expert_tokens = heap_.As<int64_t>(0, layout_.expert_tokens);
  trace.expert_tokens.assign(expert_tokens, expert_tokens + shape.num_experts);

  // Gather.
  t0 = absl::Now();
  const float* out = heap_.As<float>(0, layout_.output);
  for (const RowChunk& c : chunks) {
    std::memcpy(c.output, out, c.rows * row_bytes);
    out += c.rows * shape.hidden;
  }
  trace.gather_ns = absl::ToInt64Nanoseconds(absl::Now() - t0);
  return trace;
}

absl::Status Coordinator::Stop(absl::Time deadline) {
  // Workers still finishing an aborted batch see the stop right after it.
  abort_.store(false);
  absl::Status s = Post(BatchOp::kStop, 0, 0, deadline);
  if (s.ok()) s = WaitDone(deadline);
  return s;
}

}  // namespace epserve::worker
