// A worker's weights: loading its experts of every served layer onto its device, the warm-up
// of every kernel of the batch path, and a weight swap's staged second copy (kStage, kSwitch,
// kDiscard). The serve loop is in worker.cc.
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/parallel.h"
#include "common/status.h"
#include "model/layers.h"
#include "worker/worker.h"

namespace epserve::worker {

absl::StatusOr<std::vector<Worker::Layer>> Worker::LoadLayers(
    const model::WeightSource& source, const std::vector<ExpertPlacement>& placements,
    const std::vector<Layer>* reuse) {
  // The shared expert's slice is the same in every layer (its columns of this worker).
  std::unique_ptr<model::WeightSource> slice;
  if (cfg_.shared_ffn_size > 0 && regions_.plan.shared_expert_split()) {
    EPSERVE_ASSIGN_OR_RETURN(
        slice, model::SharedExpertSlice(source, me_, regions_.plan.shape().num_workers));
  }
  // The FFN plans of the routed experts' shape and the shared expert's, chosen before the
  // uploads and at once, so that the workers of a host tune the two at the same time.
  std::vector<int64_t> ffn_sizes = {source.config().layer.expert_ffn_size};
  if (cfg_.shared_ffn_size > 0) {
    ffn_sizes.push_back((slice != nullptr ? *slice : source).config().layer.shared_ffn_size);
  }
  EPSERVE_RETURN_IF_ERROR(kernels::ChooseExpertFfnPlans(*rt_, source.config().layer.hidden_size,
                                                        ffn_sizes, options_.weight_dtype));
  std::vector<Layer> layers;
  for (size_t pos = 0; pos < source.config().moe_layers.size(); ++pos) {
    const int layer = source.config().moe_layers[pos];
    Layer l;
    l.placement = &placements[pos];
    EPSERVE_ASSIGN_OR_RETURN(l.router, kernels::UploadRouter(*rt_, source, layer));
    const kernels::ExpertWeights* have =
        reuse != nullptr && pos < reuse->size() ? &(*reuse)[pos].experts : nullptr;
    EPSERVE_ASSIGN_OR_RETURN(l.experts,
                             kernels::UploadExperts(*rt_, source, layer, l.placement->experts(me_),
                                                    options_.weight_dtype, have));
    if (cfg_.shared_ffn_size > 0) {
      // Split: this worker's slice of the shared expert's intermediate columns.
      EPSERVE_ASSIGN_OR_RETURN(
          l.shared, kernels::UploadSharedExpert(*rt_, slice != nullptr ? *slice : source, layer,
                                                options_.weight_dtype));
    }
    layers.push_back(std::move(l));
  }
  return layers;
}

absl::Status Worker::CheckRoomForSecondCopy() const {
  if (!rt_->device_info().is_cpu) return absl::OkStatus();  // device memory: the upload says
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = -1;
  while (meminfo >> key) {
    if (key == "MemAvailable:") {
      meminfo >> kib;
      break;
    }
    meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  if (kib < 0) return absl::OkStatus();  // not Linux: the upload says
  const int64_t need = static_cast<int64_t>(weight_bytes());
  const int64_t have = kib * 1024;
  // Every worker of the host stages at the same time, each about as much as this one: all
  // their second copies must fit, with a quarter to spare.
  const int64_t all = need * std::max(options_.workers_on_host, 1);
  if (all * 5 / 4 > have) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a second copy of the weights of this host's ", options_.workers_on_host, " worker(s) (",
        all, " bytes, +25%) does not fit in the host's available memory (", have,
        " bytes); the served weights stay"));
  }
  return absl::OkStatus();
}

absl::Status Worker::Stage(uint64_t seq) {
  EPSERVE_RETURN_IF_ERROR(EndStage(false));  // a swap rank 0 gave up on
  if (!options_.open_model) {
    return absl::UnimplementedError("this worker was started without a model loader");
  }
  const ControlMessage& msg = *heap_.LocalAs<ControlMessage>(regions_.control);
  const std::string spec(msg.model, std::min<size_t>(msg.model_bytes, ControlMessage::kMaxModel));
  const uint64_t seed = msg.seed;
  // New placements (a rebalance) come in the input region, free between batches; else the
  // serving ones stay.
  staged_placements_ = placements_;
  const bool rebalance = msg.placement_words > 0;
  if (rebalance) {
    const size_t words = msg.placement_words;
    if (words * sizeof(int32_t) > regions_.InputBytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a placement table of ", words, " words does not fit the input region"));
    }
    absl::StatusOr<std::vector<ExpertPlacement>> placements =
        DecodePlacements(std::span<const int32_t>(heap_.LocalAs<int32_t>(regions_.input), words),
                         cfg_.num_experts, regions_.plan.shape().num_workers);
    if (!placements.ok()) return placements.status();
    EPSERVE_RETURN_IF_ERROR(CheckPlacements(*placements));
    staged_placements_ = *std::move(placements);
  }
  absl::StatusOr<std::unique_ptr<model::WeightSource>> source = options_.open_model(spec, seed);
  if (!source.ok()) return source.status();
  EPSERVE_RETURN_IF_ERROR(model::CheckSameShape(model_, (*source)->config()));
  EPSERVE_RETURN_IF_ERROR(CheckRoomForSecondCopy());
  stage_seq_ = seq;
  stage_published_ = false;
  load_done_.store(false);
  loader_ = std::thread([this, spec, seed, rebalance, src = *std::move(source)] {
    common::NameThisThread("ep-stage-weights");
    const absl::Time start = absl::Now();
    // A rebalance keeps the weights: the experts this worker holds are copied on its device,
    // only its new copies come from the source (the serving layers change only at kSwitch,
    // after this thread has ended).
    absl::StatusOr<std::vector<Layer>> layers =
        LoadLayers(*src, staged_placements_, rebalance ? &layers_ : nullptr);
    if (layers.ok()) {
      staged_ = *std::move(layers);
      staged_model_ = src->config();
      common::LogInfo(absl::StrCat(
          "worker ", me_, ": loaded the weights of ", spec.substr(0, 128), " (seed ", seed, ") in ",
          absl::FormatDuration(absl::Now() - start), " beside the serving ones"));
    } else {
      load_status_ = absl::Status(
          layers.status().code(),
          absl::StrCat("loading ", spec.substr(0, 128), ": ", layers.status().message()));
    }
    load_done_.store(true, std::memory_order_release);
  });
  return absl::OkStatus();
}

absl::Status Worker::PublishStage() {
  if (stage_seq_ == 0 || stage_published_ || !load_done_.load(std::memory_order_acquire)) {
    return absl::OkStatus();
  }
  WorkerReport report;
  std::memset(&report, 0, sizeof(report));
  if (!load_status_.ok()) {
    report.status_code = static_cast<int32_t>(load_status_.code());
    const std::string msg =
        absl::StrCat("worker ", me_, " (rank ", rank_, "): ", load_status_.message());
    std::strncpy(report.message, msg.c_str(), sizeof(report.message) - 1);
  } else {
    for (const Layer& l : staged_) {
      report.weight_bytes += static_cast<int64_t>(
          l.router.router.bytes() + l.router.bias.bytes() + l.experts.bytes_from_source +
          l.shared.bytes_from_source + l.shared.gate.bytes());
    }
  }
  EPSERVE_RETURN_IF_ERROR(
      heap_.Put(0, regions_.stage_reports + static_cast<size_t>(me_) * sizeof(WorkerReport),
                &report, sizeof(report)));
  EPSERVE_RETURN_IF_ERROR(
      heap_.SignalSet(0, HeapRegions::Signal(regions_.staged, me_), stage_seq_));
  stage_published_ = true;
  return absl::OkStatus();
}

absl::Status Worker::EndStage(bool use_new) {
  if (use_new && (stage_seq_ == 0 || !load_done_.load(std::memory_order_acquire))) {
    return absl::FailedPreconditionError("kSwitch before the new weights were loaded");
  }
  if (loader_.joinable()) loader_.join();
  absl::Status status = load_status_;
  if (use_new && status.ok()) {
    // Each layer points at its placement: both move together.
    layers_.swap(staged_);
    placements_.swap(staged_placements_);
    survivor_placements_.clear();
    model_ = staged_model_;
    common::LogInfo(
        absl::StrCat("worker ", me_, ": serving the weights of ", model_.source.substr(0, 128)));
  }
  staged_.clear();  // the old weights' device buffers, or the unused new ones
  staged_placements_.clear();
  stage_seq_ = 0;
  stage_published_ = false;
  load_status_ = absl::OkStatus();
  malloc_trim(0);
  return use_new ? status : absl::OkStatus();
}

absl::Status Worker::WarmUp() {
  const int64_t hidden = cfg_.hidden_size;
  const std::vector<float> zeros(static_cast<size_t>(hidden), 0.0f);
  // The FFN runs on 1 row of the first expert, then, where its form changes with the row
  // class, on as many rows as take each other form, if the buffers hold them; every row reads
  // row 0 of x.
  const int64_t capacity = static_cast<int64_t>(row_index_.bytes() / sizeof(int32_t));
  auto row_counts = [&](const Layer& layer) {
    std::vector<int64_t> counts;
    for (int64_t rows : kernels::ExpertFfnWarmUpRows(layer.experts)) {
      if (rows <= capacity) counts.push_back(rows);
    }
    return counts;
  };
  int64_t most_rows = 1;
  for (const Layer& layer : layers_) most_rows = std::max(most_rows, row_counts(layer).back());
  const std::vector<int32_t> row0(static_cast<size_t>(most_rows), 0);
  EPSERVE_RETURN_IF_ERROR(rt_->Write(x_local_, 0, zeros.data(), zeros.size() * sizeof(float)));
  EPSERVE_RETURN_IF_ERROR(rt_->Write(x_recv_, 0, zeros.data(), zeros.size() * sizeof(float)));
  EPSERVE_RETURN_IF_ERROR(rt_->Write(row_index_, 0, row0.data(), row0.size() * sizeof(int32_t)));
  // Rows reach the expert FFN as FP32, or as BF16 where they are dispatched so and the shared
  // expert's slice does not need them widened (RunBatch's expert step).
  const bool bf16_rows = regions_.plan.dispatch_dtype() == common::ElementType::kBf16;
  for (const Layer& layer : layers_) {
    EPSERVE_RETURN_IF_ERROR(kernels::Route(*rt_, layer.router, x_local_, 1, ids_, weights_));
    for (const int64_t rows : row_counts(layer)) {
      if (layer.experts.num_experts == 0) break;
      // All `rows` rows in the first expert.
      std::vector<int64_t> offsets(static_cast<size_t>(layer.experts.num_experts) + 1, rows);
      offsets[0] = 0;
      EPSERVE_RETURN_IF_ERROR(
          kernels::ExpertFfn(*rt_, layer.experts, x_recv_, row_index_, offsets, h_, y_));
      if (bf16_rows) {
        const kernels::RowFormat bf16 = {common::ElementType::kBf16, hidden};
        EPSERVE_RETURN_IF_ERROR(
            kernels::ExpertFfn(*rt_, layer.experts, x_recv_, row_index_, offsets, h_, y_, bf16));
      }
    }
    if (layer.shared.num_experts == 0) continue;
    // The shared expert (its slice) on as many rows of x_local_ as take each of its forms.
    const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
    const int64_t shared_capacity =
        static_cast<int64_t>(std::min(x_local_.bytes(), shared_y_.bytes()) / row_bytes);
    for (const int64_t rows : kernels::ExpertFfnWarmUpRows(layer.shared)) {
      if (rows > shared_capacity) break;
      EPSERVE_RETURN_IF_ERROR(
          kernels::SharedExpertFfn(*rt_, layer.shared, x_local_, rows, shared_h_, shared_y_));
    }
  }
  if (device_exchange_ != nullptr) EPSERVE_RETURN_IF_ERROR(device_exchange_->WarmUp());
  return rt_->Finish();
}

size_t Worker::LayerBytes(const Layer& l) {
  return l.router.router.bytes() + l.router.bias.bytes() + l.experts.bytes() + l.shared.bytes();
}

}  // namespace epserve::worker
