// InferenceService's RPCs other than inference: liveness, readiness and metadata, the model
// configuration and statistics, the model repository (unload, load, weight swaps), and shared
// memory. Inference (Submit, ModelInfer, ModelStreamInfer) and the reaper are in service.cc.
#include "server/service.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "model/synthetic.h"
#include "server/clip.h"
#include "server/grpc_status.h"

namespace epserve::server {

void InferenceService::BuildModelConfig() {
  const ModelSignature& sig = signature_;
  const BatchingOptions& batching = batcher_.options();
  inference::ModelConfig& c = model_config_;
  c.set_name(sig.name);
  c.set_platform("epserve_moe");
  c.set_backend("epserve");
  c.mutable_version_policy()->mutable_latest()->set_num_versions(1);
  // No implicit batch dimension: the token dimension is explicit (-1) and the dynamic
  // batcher packs token rows.
  c.set_max_batch_size(0);
  inference::ModelInput* in = c.add_input();
  in->set_name(kInputName);
  in->set_data_type(inference::TYPE_FP32);
  in->add_dims(-1);
  in->add_dims(sig.hidden_size);
  in->set_allow_ragged_batch(true);
  inference::ModelOutput* out = c.add_output();
  out->set_name(kOutputName);
  out->set_data_type(inference::TYPE_FP32);
  out->add_dims(-1);
  out->add_dims(sig.hidden_size);
  for (const auto& [name, type] :
       {std::pair{kTopkIdsName, inference::TYPE_INT32}, {kTopkWeightsName, inference::TYPE_FP32}}) {
    inference::ModelOutput* routing = c.add_output();
    routing->set_name(name);
    routing->set_data_type(type);
    routing->add_dims(-1);
    routing->add_dims(sig.top_k);
  }
  inference::ModelInstanceGroup* group = c.add_instance_group();
  group->set_name("expert_workers");
  group->set_count(model_.num_workers);
  group->set_kind(model_.device == "gpu" ? inference::ModelInstanceGroup::KIND_GPU
                                         : inference::ModelInstanceGroup::KIND_CPU);
  inference::ModelDynamicBatching* db = c.mutable_dynamic_batching();
  db->add_preferred_batch_size(static_cast<int32_t>(batching.max_batch_tokens));
  db->set_max_queue_delay_microseconds(static_cast<uint64_t>(batching.max_queue_delay_us));
  db->set_preserve_ordering(false);
  db->set_priority_levels(sig.priority_levels);
  db->set_default_priority_level(sig.default_priority);
  inference::ModelQueuePolicy* policy = db->mutable_default_queue_policy();
  policy->set_timeout_action(inference::ModelQueuePolicy::REJECT);
  policy->set_allow_timeout_override(true);
  auto& params = *c.mutable_parameters();
  params["max_batch_tokens"].set_string_value(absl::StrCat(batching.max_batch_tokens));
  params["max_queue_tokens"].set_string_value(absl::StrCat(batching.max_queue_tokens));
  params["max_request_tokens"].set_string_value(absl::StrCat(sig.max_request_tokens));
  params["input_datatypes"].set_string_value("FP32,BF16,FP16");
  params["served_layers"].set_string_value(absl::StrJoin(sig.layers, ","));
}

absl::Status InferenceService::CheckModel(const std::string& name,
                                          const std::string& version) const {
  if (name != signature_.name) {
    return absl::NotFoundError(absl::StrCat("unknown model '", Clip(name),
                                            "'; this server serves '", signature_.name, "'"));
  }
  if (!version.empty() && version != "1") {
    return absl::NotFoundError(absl::StrCat("unknown version '", Clip(version), "' of model '",
                                            Clip(name), "'; versions: 1"));
  }
  return absl::OkStatus();
}

absl::Status InferenceService::CheckRepository(const std::string& repository,
                                               const std::string& model) const {
  if (!repository.empty()) {
    return absl::NotFoundError(
        absl::StrCat("unknown repository '", Clip(repository), "'; this server has one, named ''"));
  }
  return CheckModel(model, "");
}

grpc::ServerUnaryReactor* InferenceService::RepositoryIndex(
    grpc::CallbackServerContext* ctx, const inference::RepositoryIndexRequest* req,
    inference::RepositoryIndexResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  if (!req->repository_name().empty()) {
    return Reply(ctx, CheckRepository(req->repository_name(), signature_.name));
  }
  const bool model_ready = ready() && !unloaded_.load();
  if (req->ready() && !model_ready) return Reply(ctx, absl::OkStatus());
  inference::RepositoryIndexResponse::ModelIndex* m = resp->add_models();
  m->set_name(signature_.name);
  m->set_version("1");
  m->set_state(model_ready ? "READY" : "UNAVAILABLE");
  if (unloaded_.load()) {
    m->set_reason("unloaded by RepositoryModelUnload");
  } else if (!ready()) {
    m->set_reason("the server is not ready (starting, stopping or unhealthy)");
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::RepositoryModelLoad(
    grpc::CallbackServerContext* ctx, const inference::RepositoryModelLoadRequest* req,
    inference::RepositoryModelLoadResponse*) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  if (absl::Status s = CheckRepository(req->repository_name(), req->model_name()); !s.ok()) {
    return Reply(ctx, s);
  }
  if (req->parameters().empty()) {
    if (unloaded_.exchange(false)) {
      common::LogInfo(
          absl::StrCat("model '", signature_.name, "' loaded again (RepositoryModelLoad)"));
    }
    return Reply(ctx, absl::OkStatus());
  }
  // New weights: `model` (+ `seed`), or Triton's `config` holding them as JSON.
  model::ModelSpec spec;
  for (const auto& [key, value] : req->parameters()) {
    absl::Status bad;
    if (key == "model" &&
        value.parameter_choice_case() == inference::ModelRepositoryParameter::kStringParam) {
      spec.model = value.string_param();
    } else if (key == "seed" &&
               value.parameter_choice_case() == inference::ModelRepositoryParameter::kInt64Param &&
               value.int64_param() >= 0) {
      spec.seed = static_cast<uint64_t>(value.int64_param());
    } else if (key == "config" &&
               value.parameter_choice_case() == inference::ModelRepositoryParameter::kStringParam) {
      absl::StatusOr<model::ModelSpec> parsed = model::ParseModelSpecJson(value.string_param());
      if (!parsed.ok()) {
        return Reply(
            ctx, absl::InvalidArgumentError(absl::StrCat("RepositoryModelLoad parameter 'config': ",
                                                         parsed.status().message())));
      }
      spec = *std::move(parsed);
    } else if (key == "model" || key == "seed" || key == "config") {
      return Reply(ctx, absl::InvalidArgumentError(
                            absl::StrCat("RepositoryModelLoad parameter '", key, "' must be ",
                                         key == "seed" ? "an int64 >= 0" : "a string")));
    } else {
      return Reply(ctx, absl::UnimplementedError(absl::StrCat(
                            "RepositoryModelLoad parameter '", Clip(key),
                            "' is not supported (parameters: model, seed, config); name a "
                            "checkpoint folder on the server's host with 'model'")));
    }
  }
  if (spec.model.empty()) {
    return Reply(ctx, absl::InvalidArgumentError(
                          "RepositoryModelLoad: 'seed' without 'model' (the weights to load)"));
  }
  if (!weight_loader_) {
    return Reply(ctx,
                 absl::UnimplementedError("this server cannot replace its weights while serving"));
  }
  std::lock_guard<std::mutex> lock(load_mu_);
  if (loading_) {
    return Reply(ctx, absl::AbortedError("another RepositoryModelLoad is replacing the weights; "
                                         "retry when it has answered"));
  }
  loading_ = true;
  if (load_thread_.joinable()) load_thread_.join();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  load_thread_ = std::thread([this, reactor, spec = std::move(spec)] {
    absl::Status s = weight_loader_(spec.model, spec.seed);
    if (s.ok()) unloaded_.store(false);
    {
      std::lock_guard<std::mutex> done(load_mu_);
      loading_ = false;
    }
    reactor->Finish(ToGrpcStatus(s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* InferenceService::RepositoryModelUnload(
    grpc::CallbackServerContext* ctx, const inference::RepositoryModelUnloadRequest* req,
    inference::RepositoryModelUnloadResponse*) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  if (absl::Status s = CheckRepository(req->repository_name(), req->model_name()); !s.ok()) {
    return Reply(ctx, s);
  }
  if (!unloaded_.exchange(true)) {
    common::LogInfo(
        absl::StrCat("model '", signature_.name,
                     "' unloaded (RepositoryModelUnload); requests already accepted are "
                     "answered, new ones get NOT_FOUND"));
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryStatusRequest* req,
    inference::CudaSharedMemoryStatusResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  absl::StatusOr<std::vector<CudaRegionStatus>> regions = cuda_shm_.Status(req->name());
  if (!regions.ok()) return Reply(ctx, regions.status());
  for (const CudaRegionStatus& r : *regions) {
    auto& out = (*resp->mutable_regions())[r.name];
    out.set_name(r.name);
    out.set_device_id(static_cast<uint64_t>(r.device_id));
    out.set_byte_size(r.byte_size);
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::CudaSharedMemoryRegister(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryRegisterRequest* req,
    inference::CudaSharedMemoryRegisterResponse*) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  // One name space for both kinds of region, as in Triton.
  std::lock_guard<std::mutex> names(region_names_mu_);
  if (cuda_shm_.available() && shm_.Find(req->name()).ok()) {
    return Reply(ctx, absl::AlreadyExistsError(
                          absl::StrCat("a shared memory region '", Clip(req->name()),
                                       "' is registered already (system shared memory)")));
  }
  return Reply(
      ctx, cuda_shm_.Register(req->name(), req->raw_handle(), req->device_id(), req->byte_size()));
}

grpc::ServerUnaryReactor* InferenceService::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* ctx, const inference::CudaSharedMemoryUnregisterRequest* req,
    inference::CudaSharedMemoryUnregisterResponse*) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  return Reply(ctx, cuda_shm_.Unregister(req->name()));
}

grpc::ServerUnaryReactor* InferenceService::Unimplemented(grpc::CallbackServerContext* ctx,
                                                          const char* rpc) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  return Reply(ctx, absl::UnimplementedError(absl::StrCat(rpc, " is not implemented by epserve")));
}

grpc::ServerUnaryReactor* InferenceService::ServerLive(grpc::CallbackServerContext* ctx,
                                                       const inference::ServerLiveRequest*,
                                                       inference::ServerLiveResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  resp->set_live(true);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ServerReady(grpc::CallbackServerContext* ctx,
                                                        const inference::ServerReadyRequest*,
                                                        inference::ServerReadyResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  resp->set_ready(ready());
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelReady(grpc::CallbackServerContext* ctx,
                                                       const inference::ModelReadyRequest* req,
                                                       inference::ModelReadyResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  absl::Status s = CheckModel(req->name(), req->version());
  if (s.ok()) resp->set_ready(ready() && !unloaded_.load());
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* InferenceService::ServerMetadata(
    grpc::CallbackServerContext* ctx, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  resp->set_name("epserve");
  resp->set_version(EPSERVE_VERSION);
  for (const char* ext : {"model_configuration", "model_repository", "statistics",
                          "schedule_policy", "system_shared_memory"}) {
    resp->add_extensions(ext);
  }
  if (cuda_shm_.available()) resp->add_extensions("cuda_shared_memory");
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryStatusRequest* req,
    inference::SystemSharedMemoryStatusResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  absl::StatusOr<std::vector<SharedMemoryStatus>> regions = shm_.Status(req->name());
  if (!regions.ok()) return Reply(ctx, regions.status());
  for (const SharedMemoryStatus& r : *regions) {
    auto& out = (*resp->mutable_regions())[r.name];
    out.set_name(r.name);
    out.set_key(r.key);
    out.set_offset(r.offset);
    out.set_byte_size(r.byte_size);
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryRegisterRequest* req,
    inference::SystemSharedMemoryRegisterResponse*) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  std::lock_guard<std::mutex> names(region_names_mu_);
  if (cuda_shm_.Find(req->name()).ok()) {
    return Reply(ctx, absl::AlreadyExistsError(
                          absl::StrCat("a shared memory region '", Clip(req->name()),
                                       "' is registered already (CUDA shared memory)")));
  }
  return Reply(ctx, shm_.Register(req->name(), req->key(), req->offset(), req->byte_size()));
}

grpc::ServerUnaryReactor* InferenceService::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* ctx, const inference::SystemSharedMemoryUnregisterRequest* req,
    inference::SystemSharedMemoryUnregisterResponse*) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  return Reply(ctx, shm_.Unregister(req->name()));
}

grpc::ServerUnaryReactor* InferenceService::ModelMetadata(
    grpc::CallbackServerContext* ctx, const inference::ModelMetadataRequest* req,
    inference::ModelMetadataResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  absl::Status s = CheckModel(req->name(), req->version());
  if (!s.ok()) return Reply(ctx, s);
  resp->set_name(signature_.name);
  resp->add_versions("1");
  resp->set_platform("epserve_moe");
  for (auto* t : {resp->add_inputs(), resp->add_outputs()}) {
    t->set_datatype("FP32");
    t->add_shape(-1);
    t->add_shape(signature_.hidden_size);
  }
  resp->mutable_inputs(0)->set_name(kInputName);
  resp->mutable_outputs(0)->set_name(kOutputName);
  for (const auto& [name, datatype] :
       {std::pair{kTopkIdsName, "INT32"}, {kTopkWeightsName, "FP32"}}) {
    auto* t = resp->add_outputs();
    t->set_name(name);
    t->set_datatype(datatype);
    t->add_shape(-1);
    t->add_shape(signature_.top_k);
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelConfig(grpc::CallbackServerContext* ctx,
                                                        const inference::ModelConfigRequest* req,
                                                        inference::ModelConfigResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  absl::Status s = CheckModel(req->name(), req->version());
  if (s.ok()) *resp->mutable_config() = model_config_;
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* InferenceService::ModelStatistics(
    grpc::CallbackServerContext* ctx, const inference::ModelStatisticsRequest* req,
    inference::ModelStatisticsResponse* resp) {
  if (absl::Status s = auth_->Check(*ctx); !s.ok()) return Reply(ctx, s);
  if (!req->name().empty()) {
    if (absl::Status s = CheckModel(req->name(), req->version()); !s.ok()) return Reply(ctx, s);
  }
  inference::ModelStatistics* stats = resp->add_model_stats();
  stats->set_name(signature_.name);
  stats->set_version("1");
  statistics_.Fill(stats);
  return Reply(ctx, absl::OkStatus());
}

}  // namespace epserve::server
