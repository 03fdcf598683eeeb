#include "app/job.h"

#include <mpi.h>

#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "model/layers.h"
#include "model/load_profile.h"
#include "model/memory.h"
#include "model/synthetic.h"
#include "server/eplb_profile.h"
#include "shmem/host.h"
#include "worker/heap_regions.h"

namespace epserve::app {
namespace {

// model::CheckHostMemory on every host at once: every rank learns whether any host refused
// (allreduce), so that all leave together.
absl::Status AdmitHosts(const Job& job, const Flags& flags, std::span<const int> ranks_on_host) {
  std::vector<model::HostRank> ranks;
  for (int r : ranks_on_host) {
    ranks.push_back(
        {.rank = r, .worker = r < worker::kFirstWorkerRank ? -1 : worker::WorkerOfRank(r)});
  }
  absl::Status status = model::CheckHostMemory({.config = &job.config(),
                                                .num_workers = job.plan.shape().num_workers,
                                                .redundant = flags.redundant_experts,
                                                .shared_split = job.plan.shared_expert_split(),
                                                .weight_dtype = flags.worker.weight_dtype,
                                                .heap_bytes = static_cast<int64_t>(job.heap_bytes),
                                                .limit_bytes = flags.memory_limit_bytes},
                                               ranks);
  int bad = status.ok() ? 0 : 1, any_bad = 0;
  EPSERVE_MPI_CHECK(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  if (status.ok() && any_bad) {
    return absl::ResourceExhaustedError("another host's ranks would exceed --memory-limit");
  }
  return status;
}

}  // namespace

ModelOpener MakeModelOpener(const std::string& layers) {
  return [layers](const std::string& spec,
                  uint64_t seed) -> absl::StatusOr<std::unique_ptr<model::WeightSource>> {
    absl::StatusOr<std::unique_ptr<model::WeightSource>> source = model::OpenModel(spec, seed);
    if (source.ok() && layers != "all") {
      source = model::ServeLayers(*std::move(source), layers);
    }
    return source;
  };
}

absl::StatusOr<Job> PlanJob(int rank, int num_ranks, const Flags& flags) {
  Job job;
  job.open_model = MakeModelOpener(flags.layers);
  EPSERVE_ASSIGN_OR_RETURN(job.source,
                           job.open_model(flags.model, static_cast<uint64_t>(flags.seed)));
  const model::MoeLayerConfig& layer = job.config().layer;
  EPSERVE_RETURN_IF_ERROR(flags.Validate());
  const int num_workers = worker::NumWorkers(num_ranks);
  EPSERVE_RETURN_IF_ERROR(worker::CheckWorkerCount(num_workers, layer.num_experts));
  EPSERVE_ASSIGN_OR_RETURN(
      job.plan, worker::ExchangePlan::Make({.num_workers = num_workers,
                                            .num_experts = layer.num_experts,
                                            .top_k = layer.top_k,
                                            .hidden = layer.hidden_size,
                                            .max_batch_tokens = flags.fe.batching.max_batch_tokens,
                                            .has_shared_expert = layer.shared_ffn_size > 0,
                                            .redundant_experts = flags.redundant_experts},
                                           flags.exchange));
  job.heap_bytes = worker::HeapRegions::BytesNeeded(job.plan);
  EPSERVE_ASSIGN_OR_RETURN(const std::vector<int> ranks_on_host,
                           shmem::RanksOnThisHost(MPI_COMM_WORLD));
  EPSERVE_RETURN_IF_ERROR(AdmitHosts(job, flags, ranks_on_host));
  // Every rank places the experts from the same flags and profile, so all agree.
  std::optional<model::ExpertLoadProfile> profile;
  if (!flags.eplb_profile.empty()) {
    EPSERVE_ASSIGN_OR_RETURN(profile, model::ReadExpertLoadProfile(flags.eplb_profile));
  }
  EPSERVE_ASSIGN_OR_RETURN(
      job.placements,
      server::PlaceExperts(job.config(), num_workers, flags.redundant_experts,
                           profile ? &*profile : nullptr, flags.fe.eplb.min_copies));
  job.host_workers = worker::WorkersOnHost(ranks_on_host, rank);
  job.ranks_on_host = static_cast<int>(ranks_on_host.size());
  return job;
}

void LogJob(const Job& job, const shmem::SymmetricHeap& heap) {
  const model::ModelConfig& config = job.config();
  const std::vector<worker::ExpertPlacement>& placements = job.placements;
  common::LogInfo(absl::StrCat("heap ", shmem::HeapBackendName(heap.backend()), ": ",
                               worker::ExchangeRegions::Describe(job.plan)));
  common::LogInfo(absl::StrCat(
      "model ", config.source, ": H=", config.layer.hidden_size,
      " F=", config.layer.expert_ffn_size, " E=", config.layer.num_experts,
      " k=", config.layer.top_k, " shared F=", config.layer.shared_ffn_size,
      job.plan.shared_expert_split() ? " (split over the workers)" : "", ", ", config.architecture,
      " MoE layers ", model::FormatLayers(config.moe_layers), ", ", job.plan.shape().num_workers,
      " worker(s); heap ", heap.bytes_per_rank(), " bytes per rank"));
  for (size_t i = 0; i < placements.size(); ++i) {
    if (i > 0 && placements[i] == placements[i - 1]) continue;
    common::LogInfo(
        absl::StrCat("placement of layer ", config.moe_layers[i], ": ", placements[i].Describe(),
                     "; ", placements[i].redundant(), " redundant copies",
                     i + 1 < placements.size() ? " (next layers: the same unless logged)" : ""));
  }
}

}  // namespace epserve::app
