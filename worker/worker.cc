#include "worker/worker.h"

#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace epserve::worker {
namespace {

int64_t NanosSince(absl::Time start) { return absl::ToInt64Nanoseconds(absl::Now() - start); }

}  // namespace

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(shmem::SymmetricHeap& heap,
                                                       const ExchangeLayout& layout,
                                                       const model::WeightSource& source,
                                                       const WorkerOptions& options) {
  const model::MoeLayerConfig& cfg = source.config().layer;
  absl::StatusOr<ExpertPlacement> placement =
      ExpertPlacement::Contiguous(cfg.num_experts, layout.shape.num_workers);
  if (!placement.ok()) return placement.status();
  std::unique_ptr<Worker> w(new Worker(heap, layout, *std::move(placement), cfg));
  w->rank_ = heap.rank();
  w->me_ = heap.rank() - 1;
  absl::StatusOr<std::unique_ptr<kernels::Runtime>> rt = kernels::Runtime::Create(options.device);
  if (!rt.ok()) return rt.status();
  w->rt_ = *std::move(rt);
  for (int layer : source.config().moe_layers) {
    Layer l;
    absl::StatusOr<kernels::RouterWeights> router = kernels::UploadRouter(*w->rt_, source, layer);
    if (!router.ok()) return router.status();
    l.router = *std::move(router);
    absl::StatusOr<kernels::ExpertWeights> experts = kernels::UploadExperts(
        *w->rt_, source, layer, w->placement_.first(w->me_), w->placement_.count(w->me_));
    if (!experts.ok()) return experts.status();
    l.experts = *std::move(experts);
    if (cfg.shared_ffn_size > 0) {
      absl::StatusOr<kernels::ExpertWeights> shared =
          kernels::UploadSharedExpert(*w->rt_, source, layer);
      if (!shared.ok()) return shared.status();
      l.shared = *std::move(shared);
    }
    w->layers_.push_back(std::move(l));
  }
  EPSERVE_RETURN_IF_ERROR(w->AllocateBuffers());
  return w;
}

size_t Worker::weight_bytes() const {
  size_t bytes = 0;
  for (const Layer& l : layers_) {
    bytes += l.router.router.bytes() + l.router.bias.bytes() + l.experts.bytes() + l.shared.bytes();
  }
  return bytes;
}

absl::Status Worker::AllocateBuffers() {
  const ExchangeShape& s = layout_.shape;
  const size_t f = sizeof(float);
  const size_t h = static_cast<size_t>(cfg_.hidden_size);
  const size_t k = static_cast<size_t>(cfg_.top_k);
  const size_t n = static_cast<size_t>(s.max_rows_per_worker());
  const size_t r = static_cast<size_t>(s.max_recv_rows());
  const size_t pairs = r * k;
  struct Item {
    kernels::Buffer* buffer;
    size_t bytes;
  };
  const Item items[] = {
      {&x_local_, n * h * f},
      {&ids_, n * k * sizeof(int32_t)},
      {&weights_, n * k * f},
      {&shared_h_, n * std::max<size_t>(cfg_.shared_ffn_size, 1) * f},
      {&shared_y_, n * h * f},
      {&x_recv_, r * h * f},
      {&row_index_, pairs * sizeof(int32_t)},
      {&h_, pairs * static_cast<size_t>(cfg_.expert_ffn_size) * f},
      {&y_, pairs * h * f},
      {&pair_index_, r * k * sizeof(int32_t)},
      {&pair_weight_, r * k * f},
      {&out_recv_, r * h * f},
  };
  for (const Item& item : items) {
    absl::StatusOr<kernels::Buffer> b = rt_->Allocate(std::max<size_t>(item.bytes, 64));
    if (!b.ok()) return b.status();
    *item.buffer = *std::move(b);
  }
  ids_host_.resize(n * k);
  weights_host_.resize(n * k);
  shared_y_host_.resize(n * h);
  slot_.resize(n * static_cast<size_t>(s.num_workers));
  row_index_host_.resize(pairs);
  pair_index_host_.resize(r * k);
  pair_weight_host_.resize(r * k);
  expert_offsets_.resize(placement_.count(me_) + 1);
  return absl::OkStatus();
}

absl::Status Worker::Serve(const std::atomic<bool>& stop) {
  shmem::SignalStore(layout_.Signal(heap_, 0, layout_.ready, me_), 1);
  uint64_t seq = 0;
  absl::Time stop_seen = absl::InfiniteFuture();
  uint64_t* batch_seq = heap_.As<uint64_t>(rank_, layout_.batch_seq);
  while (true) {
    absl::Status wait =
        shmem::WaitAtLeast(batch_seq, seq + 1, absl::Now() + absl::Milliseconds(250), "next batch",
                           absl::Microseconds(200));
    if (absl::IsDeadlineExceeded(wait)) {
      if (stop.load()) {
        if (stop_seen == absl::InfiniteFuture()) stop_seen = absl::Now();
        if (absl::Now() - stop_seen > absl::Seconds(3)) {
          return absl::AbortedError("stop requested and rank 0 sent no batch; leaving");
        }
      }
      continue;
    }
    seq = shmem::SignalLoad(batch_seq);
    const BatchDescriptor desc = *heap_.As<BatchDescriptor>(rank_, layout_.descriptor);
    WorkerReport* report = heap_.As<WorkerReport>(0, layout_.reports) + me_;
    std::memset(report, 0, sizeof(*report));
    if (desc.op == BatchOp::kStop) {
      shmem::SignalStore(layout_.Signal(heap_, 0, layout_.done_seq, me_), seq);
      return absl::OkStatus();
    }
    absl::Status s = RunBatch(desc, seq, *report);
    if (!s.ok()) {
      report->status_code = static_cast<int32_t>(s.code());
      const std::string msg = absl::StrCat("worker ", me_, " (rank ", rank_, "): ", s.message());
      std::strncpy(report->message, msg.c_str(), sizeof(report->message) - 1);
    }
    shmem::SignalStore(layout_.Signal(heap_, 0, layout_.done_seq, me_), seq);
  }
}

absl::Status Worker::RunBatch(const BatchDescriptor& desc, uint64_t seq, WorkerReport& report) {
  const int num_workers = layout_.shape.num_workers;
  const int k = cfg_.top_k;
  const int64_t hidden = cfg_.hidden_size;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  const int64_t n = desc.num_rows;
  if (desc.layer_pos < 0 || desc.layer_pos >= static_cast<int>(layers_.size()) || n < 0 ||
      n > layout_.shape.max_rows_per_worker()) {
    return absl::InternalError(
        absl::StrCat("bad batch descriptor: layer_pos ", desc.layer_pos, ", rows ", n));
  }
  const Layer& layer = layers_[desc.layer_pos];
  const absl::Time deadline = absl::FromUnixMicros(desc.deadline_unix_us);
  const float* x_in = heap_.As<float>(rank_, layout_.input);

  // ---- route ----
  absl::Time t0 = absl::Now();
  if (n > 0) {
    EPSERVE_RETURN_IF_ERROR(rt_->Write(x_local_, 0, x_in, n * row_bytes));
    EPSERVE_RETURN_IF_ERROR(kernels::Route(*rt_, layer.router, x_local_, n, ids_, weights_));
    EPSERVE_RETURN_IF_ERROR(rt_->Read(ids_, 0, ids_host_.data(), n * k * sizeof(int32_t)));
    EPSERVE_RETURN_IF_ERROR(rt_->Read(weights_, 0, weights_host_.data(), n * k * sizeof(float)));
  }
  report.stage_ns[kRoute] = NanosSince(t0);

  // ---- layout and notify: rows I send to each worker, exchanged with everyone ----
  t0 = absl::Now();
  std::vector<int64_t> send_count(num_workers, 0);
  for (int64_t t = 0; t < n; ++t) {
    int64_t* slot = &slot_[t * num_workers];
    std::fill(slot, slot + num_workers, -1);
    for (int j = 0; j < k; ++j) {
      const int32_t e = ids_host_[t * k + j];
      if (e < 0 || e >= cfg_.num_experts) {
        return absl::InternalError(absl::StrCat("router produced expert id ", e));
      }
      const int d = placement_.owner(e);
      if (slot[d] < 0) slot[d] = send_count[d]++;  // index within the stream to d, for now
    }
  }
  int64_t* my_counts = heap_.As<int64_t>(rank_, layout_.counts);
  for (int d = 0; d < num_workers; ++d) {
    int64_t* row = heap_.As<int64_t>(d + 1, layout_.counts) + me_ * num_workers;
    std::memcpy(row, send_count.data(), num_workers * sizeof(int64_t));
    shmem::SignalStore(layout_.Signal(heap_, d + 1, layout_.count_flag, me_), seq);
  }
  for (int s = 0; s < num_workers; ++s) {
    EPSERVE_RETURN_IF_ERROR(
        shmem::WaitAtLeast(layout_.Signal(heap_, rank_, layout_.count_flag, s), seq, deadline,
                           absl::StrCat("counts from worker ", s), absl::Microseconds(20)));
  }
  auto count = [&](int src, int dst) { return my_counts[src * num_workers + dst]; };
  report.stage_ns[kLayout] = NanosSince(t0);

  // ---- dispatch: each token row once per destination worker ----
  t0 = absl::Now();
  const int64_t stride = layout_.shape.recv_meta_stride();
  std::vector<int64_t> recv_base(num_workers);     // where my rows start in d's receive buffer
  std::vector<int64_t> combine_base(num_workers);  // where d's answers start in my combine region
  int64_t combine_rows = 0;
  for (int d = 0; d < num_workers; ++d) {
    recv_base[d] = 0;
    for (int s = 0; s < me_; ++s) recv_base[d] += count(s, d);
    combine_base[d] = combine_rows;
    combine_rows += send_count[d];
  }
  for (int64_t t = 0; t < n; ++t) {
    int64_t* slot = &slot_[t * num_workers];
    for (int d = 0; d < num_workers; ++d) {
      if (slot[d] < 0) continue;
      const int64_t row = recv_base[d] + slot[d];
      std::memcpy(heap_.As<float>(d + 1, layout_.recv) + row * hidden, x_in + t * hidden,
                  row_bytes);
      int32_t* meta = heap_.As<int32_t>(d + 1, layout_.recv_meta) + row * stride;
      meta[0] = static_cast<int32_t>(t);
      const int first = placement_.first(d);
      for (int j = 0; j < k; ++j) {
        const int32_t e = ids_host_[t * k + j];
        meta[1 + j] = placement_.owner(e) == d ? e - first : -1;
        std::memcpy(&meta[1 + k + j], &weights_host_[t * k + j], sizeof(float));
      }
      slot[d] += combine_base[d];  // now: row of my combine region
    }
  }
  for (int d = 0; d < num_workers; ++d) {
    shmem::SignalStore(layout_.Signal(heap_, d + 1, layout_.dispatch_flag, me_), seq);
  }
  report.stage_ns[kDispatch] = NanosSince(t0);

  // The shared expert runs on the owner's own rows while peers finish dispatching.
  t0 = absl::Now();
  const bool has_shared = layer.shared.num_experts > 0;
  if (has_shared && n > 0) {
    EPSERVE_RETURN_IF_ERROR(
        kernels::SharedExpertFfn(*rt_, layer.shared, x_local_, n, shared_h_, shared_y_));
    EPSERVE_RETURN_IF_ERROR(rt_->Read(shared_y_, 0, shared_y_host_.data(), n * row_bytes));
  }
  int64_t ffn_ns = NanosSince(t0);

  t0 = absl::Now();
  for (int s = 0; s < num_workers; ++s) {
    EPSERVE_RETURN_IF_ERROR(
        shmem::WaitAtLeast(layout_.Signal(heap_, rank_, layout_.dispatch_flag, s), seq, deadline,
                           absl::StrCat("dispatch from worker ", s), absl::Microseconds(20)));
  }
  report.stage_ns[kDispatch] += NanosSince(t0);

  // ---- expert FFN over the received rows, grouped by local expert ----
  t0 = absl::Now();
  int64_t recv_rows = 0;
  for (int s = 0; s < num_workers; ++s) recv_rows += count(s, me_);
  const int num_local = placement_.count(me_);
  const int32_t* meta_in = heap_.As<int32_t>(rank_, layout_.recv_meta);
  std::fill(expert_offsets_.begin(), expert_offsets_.end(), 0);
  for (int64_t i = 0; i < recv_rows; ++i) {
    for (int j = 0; j < k; ++j) {
      const int32_t local = meta_in[i * stride + 1 + j];
      if (local >= num_local) return absl::InternalError("local expert id out of range");
      if (local >= 0) ++expert_offsets_[local + 1];
    }
  }
  std::partial_sum(expert_offsets_.begin(), expert_offsets_.end(), expert_offsets_.begin());
  const int64_t pairs = expert_offsets_.back();
  int64_t* expert_tokens = heap_.As<int64_t>(0, layout_.expert_tokens) + placement_.first(me_);
  std::vector<int64_t> fill(expert_offsets_.begin(), expert_offsets_.end() - 1);
  for (int64_t i = 0; i < recv_rows; ++i) {
    for (int j = 0; j < k; ++j) {
      const int32_t local = meta_in[i * stride + 1 + j];
      if (local < 0) {
        pair_index_host_[i * k + j] = -1;
        pair_weight_host_[i * k + j] = 0.0f;
        continue;
      }
      const int64_t p = fill[local]++;
      row_index_host_[p] = static_cast<int32_t>(i);
      pair_index_host_[i * k + j] = static_cast<int32_t>(p);
      std::memcpy(&pair_weight_host_[i * k + j], &meta_in[i * stride + 1 + k + j], sizeof(float));
    }
  }
  for (int e = 0; e < num_local; ++e)
    expert_tokens[e] = expert_offsets_[e + 1] - expert_offsets_[e];
  if (recv_rows > 0) {
    EPSERVE_RETURN_IF_ERROR(
        rt_->Write(x_recv_, 0, heap_.Ptr(rank_, layout_.recv), recv_rows * row_bytes));
    EPSERVE_RETURN_IF_ERROR(
        rt_->Write(row_index_, 0, row_index_host_.data(), pairs * sizeof(int32_t)));
    EPSERVE_RETURN_IF_ERROR(
        rt_->Write(pair_index_, 0, pair_index_host_.data(), recv_rows * k * sizeof(int32_t)));
    EPSERVE_RETURN_IF_ERROR(
        rt_->Write(pair_weight_, 0, pair_weight_host_.data(), recv_rows * k * sizeof(float)));
    EPSERVE_RETURN_IF_ERROR(
        kernels::ExpertFfn(*rt_, layer.experts, x_recv_, row_index_, expert_offsets_, h_, y_));
    EPSERVE_RETURN_IF_ERROR(kernels::WeightedCombine(*rt_, y_, pair_index_, pair_weight_, recv_rows,
                                                     k, hidden, out_recv_));
    // Kernels run asynchronously: finish them here so the stage times what it computes.
    EPSERVE_RETURN_IF_ERROR(rt_->Finish());
  }
  report.stage_ns[kExpertFfn] = ffn_ns + NanosSince(t0);
  report.rows_received = recv_rows;
  report.pairs = pairs;

  // ---- combine: weighted rows back to their owners, owners sum their parts ----
  t0 = absl::Now();
  int64_t offset = 0;
  for (int s = 0; s < num_workers; ++s) {
    const int64_t rows = count(s, me_);
    if (rows > 0) {
      int64_t dst_row = 0;  // s's combine region holds its streams in destination order
      for (int d = 0; d < me_; ++d) dst_row += count(s, d);
      EPSERVE_RETURN_IF_ERROR(rt_->Read(out_recv_, offset * row_bytes,
                                        heap_.As<float>(s + 1, layout_.combine) + dst_row * hidden,
                                        rows * row_bytes));
    }
    offset += rows;
    shmem::SignalStore(layout_.Signal(heap_, s + 1, layout_.combine_flag, me_), seq);
  }
  for (int d = 0; d < num_workers; ++d) {
    EPSERVE_RETURN_IF_ERROR(
        shmem::WaitAtLeast(layout_.Signal(heap_, rank_, layout_.combine_flag, d), seq, deadline,
                           absl::StrCat("combine from worker ", d), absl::Microseconds(20)));
  }
  const float* parts = heap_.As<float>(rank_, layout_.combine);
  float* out = heap_.As<float>(0, layout_.output) + desc.row_start * hidden;
  for (int64_t t = 0; t < n; ++t) {
    float* dst = out + t * hidden;
    if (has_shared) {
      std::memcpy(dst, &shared_y_host_[t * hidden], row_bytes);
    } else {
      std::memset(dst, 0, row_bytes);
    }
    const int64_t* slot = &slot_[t * num_workers];
    for (int d = 0; d < num_workers; ++d) {
      if (slot[d] < 0) continue;
      const float* part = parts + slot[d] * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] += part[i];
    }
  }
  report.stage_ns[kCombine] = NanosSince(t0);
  return absl::OkStatus();
}

}  // namespace epserve::worker
