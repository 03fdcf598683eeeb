// epserve: one MPI program. Rank 0 is the gRPC front-end; ranks 1..W are expert workers.
//   mpirun -np 3 epserve --model=synthetic:qwen1.5-moe-a2.7b
#include <malloc.h>
#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/element_type.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/status.h"
#include "model/layers.h"
#include "model/memory.h"
#include "model/synthetic.h"
#include "server/eplb_profile.h"
#include "server/front_end.h"
#include "server/main_flags.h"
#include "shmem/heap.h"
#include "worker/coordinator.h"
#include "worker/heap_regions.h"
#include "worker/placement.h"
#include "worker/worker.h"

namespace {

std::atomic<bool> g_stop{false};
// The stop signal came from this rank's parent: mpirun (or its orted), ending the job.
std::atomic<bool> g_stopped_by_launcher{false};
// A rank of the job died and this one served on without it: MPI's collective teardown (the
// heap's free, MPI_Finalize) would wait for the dead rank, so the job's ranks leave without.
std::atomic<bool> g_peer_died{false};
void OnSignal(int, siginfo_t* info, void*) {
  if (info != nullptr && info->si_pid == getppid()) g_stopped_by_launcher.store(true);
  g_stop.store(true);
}

using epserve::server::Flags;

// Opens a model as --model and --layers name it: at start, and for weight swaps
// (RepositoryModelLoad), on rank 0 to check it and on every worker to load it.
using ModelOpener = epserve::server::FrontEnd::ModelOpener;
ModelOpener MakeModelOpener(const std::string& layers) {
  return [layers](const std::string& spec,
                  uint64_t seed) -> absl::StatusOr<std::unique_ptr<epserve::model::WeightSource>> {
    absl::StatusOr<std::unique_ptr<epserve::model::WeightSource>> source =
        epserve::model::OpenModel(spec, seed);
    if (source.ok() && layers != "all") {
      source = epserve::model::ServeLayers(*std::move(source), layers);
    }
    return source;
  };
}

// The workers on this rank's host: its index among them (0 for the first), which picks its
// GPU with --device=gpu, and how many there are, who share the host's memory when a weight
// swap stages a second copy. Collective over MPI_COMM_WORLD: every rank calls it.
struct HostWorkers {
  int index = 0;
  int count = 1;
};
absl::StatusOr<HostWorkers> WorkersOnThisHost(int rank) {
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm workers = MPI_COMM_NULL;
  EPSERVE_MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  EPSERVE_MPI_CHECK(MPI_Comm_split(node, rank > 0 ? 1 : 0, rank, &workers));
  HostWorkers out;
  EPSERVE_MPI_CHECK(MPI_Comm_rank(workers, &out.index));
  EPSERVE_MPI_CHECK(MPI_Comm_size(workers, &out.count));
  EPSERVE_MPI_CHECK(MPI_Comm_free(&workers));
  EPSERVE_MPI_CHECK(MPI_Comm_free(&node));
  return out;
}

// Lines of main() go through the library's seam (common/log.h), which knows the rank.
void Log(int /*rank*/, const std::string& line) { epserve::common::LogInfo(line); }

// Every rank reaches the same verdict on the flags, so all leave together.
int Fail(int rank, const absl::Status& s) {
  Log(rank, absl::StrCat("error: ", s.ToString()));
  return 1;
}

// This process's resident set size (VmRSS), or -1 where /proc does not tell.
int64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

// "64G", "512M", "1048576": bytes, with binary K/M/G/T suffixes; "" or "0": this machine's.
absl::StatusOr<int64_t> ParseMemoryLimit(const std::string& text) {
  if (text.empty() || text == "0") {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    while (meminfo >> key >> kib) {
      if (key == "MemTotal:") return kib * 1024;
      meminfo.ignore(1 << 10, '\n');
    }
    return absl::FailedPreconditionError(
        "cannot read MemTotal from /proc/meminfo; set --memory-limit");
  }
  // A binary suffix K, M, G or T (either case) scales by 2^10, 2^20, 2^30 or 2^40.
  int64_t scale = 1;
  std::string digits = text;
  if (const size_t unit = absl::string_view("KMGT").find(absl::ascii_toupper(text.back()));
      unit != absl::string_view::npos) {
    scale = int64_t{1} << (10 * (unit + 1));
  }
  if (scale != 1) digits.pop_back();
  double value = 0;
  if (!absl::SimpleAtod(digits, &value) || value <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--memory-limit must be bytes with an optional K/M/G/T suffix, got '", text, "'"));
  }
  return static_cast<int64_t>(value * static_cast<double>(scale));
}

// Refuses, before anything is loaded, a cluster whose ranks on this host would need more
// than --memory-limit: each worker's weights (model::EstimateRankBytes) plus every local
// rank's heap segment. All ranks reach the same verdict (allreduce), so all leave together.
absl::Status CheckMemory(const epserve::model::ModelConfig& config, int num_workers, int redundant,
                         size_t heap_bytes, int64_t limit, bool bf16_weights, bool shared_split) {
  MPI_Comm node;
  EPSERVE_MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int node_size = 0, world_rank = 0;
  EPSERVE_MPI_CHECK(MPI_Comm_size(node, &node_size));
  EPSERVE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  std::vector<int> local(node_size);
  EPSERVE_MPI_CHECK(MPI_Allgather(&world_rank, 1, MPI_INT, local.data(), 1, MPI_INT, node));
  EPSERVE_MPI_CHECK(MPI_Comm_free(&node));
  int64_t need = static_cast<int64_t>(heap_bytes) * node_size;
  std::string parts;
  absl::Status status;
  for (int r : local) {
    if (r == 0) continue;  // the front-end holds no expert weights
    absl::StatusOr<epserve::model::RankMemory> m = epserve::model::EstimateRankBytes(
        config, num_workers, epserve::worker::WorkerOfRank(r), shared_split, redundant);
    if (!m.ok()) {
      status = m.status();
      break;
    }
    // With --weight-dtype=bf16 the router stays FP32: 2 more bytes per router parameter.
    const int64_t weight_bytes =
        bf16_weights ? m->bf16_bytes() + 2 * m->router_params : m->fp32_bytes();
    need += weight_bytes;
    absl::StrAppend(&parts, parts.empty() ? "" : ", ", "rank ", r, " ",
                    epserve::model::FormatBytes(weight_bytes));
  }
  if (status.ok() && need > limit) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("the ranks on this host need ", epserve::model::FormatBytes(need), " (",
                     bf16_weights ? "BF16" : "FP32", " weights: ", parts, "; heap ",
                     epserve::model::FormatBytes(static_cast<int64_t>(heap_bytes)), " per rank x ",
                     node_size, ") but --memory-limit is ", epserve::model::FormatBytes(limit),
                     ": use more workers or hosts, fewer --layers, or a larger limit"));
  }
  int bad = status.ok() ? 0 : 1, any_bad = 0;
  EPSERVE_MPI_CHECK(MPI_Allreduce(&bad, &any_bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  if (status.ok() && any_bad) {
    return absl::ResourceExhaustedError("another host's ranks would exceed --memory-limit");
  }
  return status;
}

// The exchange's plan for this model and these flags, checked: every rank computes the
// same one, so all reach the same verdict.
absl::StatusOr<epserve::worker::ExchangePlan> PlanExchange(
    const epserve::model::ModelConfig& config, int num_workers, const Flags& flags) {
  if (num_workers < 1) {
    return absl::InvalidArgumentError(
        "epserve needs at least 2 ranks (rank 0 front-end + workers): "
        "mpirun -np 1+W epserve ...");
  }
  if (num_workers > config.layer.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(num_workers, " workers but the model has only ", config.layer.num_experts,
                     " experts: launch with mpirun -np <= ", config.layer.num_experts + 1));
  }
  return epserve::worker::ExchangePlan::Make(
      {.num_workers = num_workers,
       .num_experts = config.layer.num_experts,
       .top_k = config.layer.top_k,
       .hidden = config.layer.hidden_size,
       .max_batch_tokens = flags.fe.batching.max_batch_tokens,
       .has_shared_expert = config.layer.shared_ffn_size > 0,
       .redundant_experts = flags.redundant_experts},
      flags.exchange);
}

void LogModel(const epserve::model::ModelConfig& config, const epserve::worker::ExchangePlan& plan,
              const epserve::shmem::SymmetricHeap& heap) {
  using namespace epserve;
  Log(0, absl::StrCat("heap ", shmem::HeapBackendName(heap.backend()), ": ",
                      worker::ExchangeRegions::Describe(plan)));
  Log(0, absl::StrCat("model ", config.source, ": H=", config.layer.hidden_size,
                      " F=", config.layer.expert_ffn_size, " E=", config.layer.num_experts,
                      " k=", config.layer.top_k, " shared F=", config.layer.shared_ffn_size,
                      plan.shared_expert_split() ? " (split over the workers)" : "", ", ",
                      config.architecture, " MoE layers ", model::FormatLayers(config.moe_layers),
                      ", ", plan.shape().num_workers, " worker(s); heap ", heap.bytes_per_rank(),
                      " bytes per rank"));
}

// Rank 0: waits for the workers, serves until a stop signal, then drains. The front-end
// comes back through `front_end` (its teardown is slow and must not hold up the heap's).
int ServeFrontEnd(const Flags& flags, const epserve::model::ModelConfig& config,
                  epserve::worker::Coordinator& coordinator, size_t heap_bytes,
                  ModelOpener open_model, std::unique_ptr<epserve::server::FrontEnd>& front_end) {
  using namespace epserve;
  // A worker's death the survivors cannot serve through ends the job, as mpirun does
  // without --enable-recovery, so that the supervisor starts a new one.
  coordinator.set_on_fatal_death([](const std::string& why) {
    Log(0, absl::StrCat("error: a worker died and the service cannot go on without it (", why,
                        "); ending the job"));
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  });
  absl::Status s = coordinator.WaitForWorkers(absl::Now() + flags.startup_timeout);
  if (!s.ok()) {
    Log(0, absl::StrCat("error: ", s.ToString()));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  absl::StatusOr<std::unique_ptr<server::FrontEnd>> fe = server::FrontEnd::Start(
      flags.fe, config, flags.runtime.device, coordinator, static_cast<int64_t>(heap_bytes),
      std::move(open_model), static_cast<uint64_t>(flags.seed));
  if (!fe.ok()) {
    Log(0, absl::StrCat("error: ", fe.status().ToString()));
    coordinator.Stop(absl::Now() + absl::Seconds(5)).IgnoreError();
    return 1;
  }
  Log(0,
      absl::StrCat("serving model '", flags.fe.requests.model_name, "' on ", (*fe)->grpc_address(),
                   ", metrics on http://", (*fe)->metrics_address(), "/metrics"));
  while (!g_stop.load()) absl::SleepFor(absl::Milliseconds(20));
  Log(0, "stopping: answering requests in flight");
  const absl::Time stop_start = absl::Now();
  s = (*fe)->Shutdown();
  if (!s.ok()) Log(0, absl::StrCat("workers did not stop cleanly: ", s.ToString()));
  Log(0, absl::StrCat("stopped serving in ", absl::FormatDuration(absl::Now() - stop_start)));
  front_end = *std::move(fe);
  if (coordinator.lost_workers() > 0) g_peer_died.store(true);
  return 0;
}

// A worker rank: loads its experts onto its device and serves batches until rank 0 stops it.
int ServeWorker(int rank, const Flags& flags, epserve::shmem::SymmetricHeap& heap,
                const epserve::worker::HeapRegions& regions,
                const epserve::model::WeightSource& source,
                epserve::common::ElementType weight_dtype, HostWorkers host_workers,
                ModelOpener open_model, std::vector<epserve::worker::ExpertPlacement> placements) {
  using namespace epserve;
  worker::WorkerOptions options;
  options.device = flags.runtime;
  options.device.local_rank = host_workers.index;
  options.workers_on_host = host_workers.count;
  options.host_threads = flags.worker_host_threads;
  options.local_pass = flags.worker_local_pass;
  options.device_exchange = *worker::ParseDeviceExchangeMode(flags.device_exchange);
  options.upload_ahead = flags.upload_ahead == "on"    ? worker::WorkerOptions::UploadAhead::kOn
                         : flags.upload_ahead == "off" ? worker::WorkerOptions::UploadAhead::kOff
                                                       : worker::WorkerOptions::UploadAhead::kAuto;
  if (!flags.pinned_transfers) options.device.staging = kernels::RuntimeOptions::Staging::kOff;
  options.weight_dtype = weight_dtype;
  options.open_model = std::move(open_model);
  options.placements = std::move(placements);
  absl::StatusOr<std::unique_ptr<worker::Worker>> w =
      worker::Worker::Create(heap, regions, source, options);
  if (!w.ok()) {
    Log(rank, absl::StrCat("error: ", w.status().ToString()));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  const int me = worker::WorkerOfRank(rank);
  Log(rank, absl::StrCat("worker ", me, " on ", (*w)->device().Describe(), ": ",
                         (*w)->weight_bytes(), " weight bytes (expert FFN on ", (*w)->ffn_kernels(),
                         "), resident ", ResidentBytes(), " bytes"));
  Log(rank,
      absl::StrCat(
          "worker ", me, " FFN blocking: ", (*w)->ffn_blocking(), "; combine on ",
          (*w)->host_threads(), " host thread(s)",
          flags.worker_host_threads > 0 ? " (--worker-host-threads)" : "",
          (*w)->stages_transfers() ? "; large host<->device copies through pinned staging on them"
                                   : "",
          flags.worker_local_pass ? "; a batch with one live worker runs on its device alone" : "",
          "; rows between workers go ", (*w)->exchange_path(),
          (*w)->uploads_ahead() ? "; the next batch's rows uploaded while a batch computes" : "",
          "; kernels warmed up in ", absl::FormatDuration(absl::Seconds((*w)->warmup_seconds()))));
  absl::Status s = (*w)->Serve(g_stop);
  if ((*w)->uploads_ahead()) {
    Log(rank, absl::StrCat("worker ", me, ": the rows of ", (*w)->batches_uploaded_ahead(), " of ",
                           (*w)->batches_served(),
                           " batches were on the device before their batch began"));
  }
  if ((*w)->peers_lost()) g_peer_died.store(true);
  if (!s.ok()) {
    Log(rank, s.ToString());
    return 1;
  }
  return 0;
}

// Every rank: the model, the front-end's options, the exchange's plan and the memory check
// (all ranks reach the same verdict), the heap, then the front-end on rank 0 or a worker on
// the others.
int Run(int rank, int num_ranks, const Flags& flags) {
  using namespace epserve;
  const ModelOpener open_model = MakeModelOpener(flags.layers);
  absl::StatusOr<std::unique_ptr<model::WeightSource>> source =
      open_model(flags.model, static_cast<uint64_t>(flags.seed));
  if (!source.ok()) return Fail(rank, source.status());
  const model::ModelConfig& config = (*source)->config();
  if (absl::Status s = flags.fe.Validate(); !s.ok()) return Fail(rank, s);
  absl::StatusOr<worker::ExchangePlan> plan =
      PlanExchange(config, worker::NumWorkers(num_ranks), flags);
  if (!plan.ok()) return Fail(rank, plan.status());
  const size_t heap_bytes = worker::HeapRegions::BytesNeeded(*plan);
  if (flags.worker_host_threads < 0 || flags.worker_host_threads > 256) {
    return Fail(rank,
                absl::InvalidArgumentError(absl::StrCat(
                    "--worker-host-threads must be in [0, 256], got ", flags.worker_host_threads)));
  }
  if (absl::Status s = worker::ParseDeviceExchangeMode(flags.device_exchange).status(); !s.ok()) {
    return Fail(rank, s);
  }
  if (flags.upload_ahead != "auto" && flags.upload_ahead != "on" && flags.upload_ahead != "off") {
    return Fail(rank,
                absl::InvalidArgumentError(absl::StrCat(
                    "--upload-ahead must be auto, on or off; got '", flags.upload_ahead, "'")));
  }
  absl::StatusOr<int64_t> memory_limit = ParseMemoryLimit(flags.memory_limit);
  if (!memory_limit.ok()) return Fail(rank, memory_limit.status());
  absl::StatusOr<common::ElementType> weight_dtype =
      common::ParseFlagName(flags.weight_dtype, "--weight-dtype", kernels::kKernelTypes);
  if (!weight_dtype.ok()) return Fail(rank, weight_dtype.status());
  if (absl::Status s = CheckMemory(
          config, plan->shape().num_workers, flags.redundant_experts, heap_bytes, *memory_limit,
          *weight_dtype == common::ElementType::kBf16, plan->shared_expert_split());
      !s.ok()) {
    return Fail(rank, s);
  }
  // Every rank places the experts from the same flags and profile, so all agree.
  std::optional<model::ExpertLoadProfile> profile;
  if (!flags.eplb_profile.empty()) {
    absl::StatusOr<model::ExpertLoadProfile> p = model::ReadExpertLoadProfile(flags.eplb_profile);
    if (!p.ok()) return Fail(rank, p.status());
    profile = *std::move(p);
  }
  absl::StatusOr<std::vector<worker::ExpertPlacement>> placements =
      server::PlaceExperts(config, plan->shape().num_workers, flags.redundant_experts,
                           profile ? &*profile : nullptr, flags.fe.eplb.min_copies);
  if (!placements.ok()) return Fail(rank, placements.status());

  const absl::StatusOr<HostWorkers> host_workers = WorkersOnThisHost(rank);
  if (!host_workers.ok()) return Fail(rank, host_workers.status());
  absl::StatusOr<std::unique_ptr<shmem::SymmetricHeap>> heap =
      shmem::SymmetricHeap::Create(MPI_COMM_WORLD, heap_bytes, plan->heap_backend());
  if (!heap.ok()) return Fail(rank, heap.status());
  absl::StatusOr<worker::HeapRegions> regions = worker::HeapRegions::Allocate(**heap, *plan);
  if (!regions.ok()) return Fail(rank, regions.status());
  if (rank == 0) {
    LogModel(config, *plan, **heap);
    for (size_t i = 0; i < placements->size(); ++i) {
      if (i > 0 && (*placements)[i] == (*placements)[i - 1]) continue;
      Log(0, absl::StrCat(
                 "placement of layer ", config.moe_layers[i], ": ", (*placements)[i].Describe(),
                 "; ", (*placements)[i].redundant(), " redundant copies",
                 i + 1 < placements->size() ? " (next layers: the same unless logged)" : ""));
    }
  }

  // Teardown order: a worker is gone (ServeWorker returned) before the heap; rank 0's
  // front-end after it (its teardown, the metrics server's threads, is slow, and the heap's
  // collective free must not wait for it); the coordinator holds nothing of its own.
  int code = 0;
  std::optional<worker::Coordinator> coordinator;
  std::unique_ptr<server::FrontEnd> front_end;
  if (rank == 0) {
    coordinator.emplace(**heap, *regions, *placements);
    code = ServeFrontEnd(flags, config, *coordinator, heap_bytes, open_model, front_end);
  } else {
    code = ServeWorker(rank, flags, **heap, *regions, **source, *weight_dtype, *host_workers,
                       open_model, *std::move(placements));
  }
  if (g_peer_died.load()) {
    // Every answer is sent; the heap's free and MPI_Finalize would wait for the dead rank.
    Log(rank, "a rank of this job died earlier: leaving without MPI's collective teardown");
    std::fflush(nullptr);
    std::_Exit(code);
  }
  // Leaving: if a peer is gone the collective free below could block; never hang.
  std::thread([rank] {
    absl::SleepFor(absl::Seconds(5));
    Log(rank, "teardown did not finish within 5 s; exiting");
    std::_Exit(2);
  }).detach();
  heap->reset();
  Log(rank, "left the heap");
  front_end.reset();
  return code;
}

void InstallStopHandlers() {
  struct sigaction sa {};
  sa.sa_sigaction = OnSignal;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

// Starts MPI: the thread level it `provided`, this process's rank and the job's ranks.
// Rank 0's batcher thread makes the MPI calls of the rma heap, and a weight swap's thread
// only while it holds the lock the batches run under (FrontEnd's exec_mu_), as does the
// main thread's final stop; the workers' loader threads make none: calls never overlap,
// so SERIALIZED is enough.
absl::Status StartMpi(int& argc, char**& argv, int& provided, int& rank, int& num_ranks) {
  EPSERVE_MPI_CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided));
  EPSERVE_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  EPSERVE_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &num_ranks));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  // Buffers of 1 MiB and more (large requests and answers, weights being loaded) come from
  // mmap and go back to the system when freed. A fixed threshold also turns off glibc's
  // adaptive one, which after the first such free serves them from the heap, where a burst
  // of them stays resident. --keep-request-buffers changes this on rank 0 (below).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  Flags flags;
  epserve::common::FlagSet fs(
      "epserve",
      "Serves MoE layers over gRPC (KServe v2). Launch as one MPI job:\n"
      "  mpirun -np 1+W epserve [flags]   (rank 0 front-end, W expert workers)");
  epserve::server::RegisterFlags(fs, flags);
  absl::Status parsed = fs.Parse(argc, argv);
  const char* env_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const bool first = env_rank == nullptr || absl::string_view(env_rank) == "0";
  if (fs.help_requested()) {
    if (first) std::fputs(fs.Usage().c_str(), stdout);
    return 0;
  }
  if (!parsed.ok()) {
    if (first) std::fprintf(stderr, "epserve: %s\n", std::string(parsed.message()).c_str());
    return 2;
  }
  InstallStopHandlers();

  int provided = 0, rank = 0, num_ranks = 0;
  if (absl::Status s = StartMpi(argc, argv, provided, rank, num_ranks); !s.ok()) {
    std::fprintf(stderr, "epserve: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  epserve::common::SetLogRank(rank);
  if (rank == 0 && flags.fe.service.keep_request_buffers) {
    // Requests and answers up to 32 MiB (glibc's largest threshold; a 4096-token FP32 batch
    // of hidden 2048) come from the arenas, and free() gives no pages back on its own: the
    // next request reuses them, where an mmapped buffer faults every page in again
    // (thousands of faults per 16 MiB, several buffers per inline request). The service's
    // reaper gives them back once the load ends (InferenceService::Reap).
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    if (rank == 0) std::fprintf(stderr, "epserve: this MPI library lacks MPI_THREAD_SERIALIZED\n");
    EPSERVE_MPI_CHECK_LOG(MPI_Finalize());
    return 1;
  }
  const int code = Run(rank, num_ranks, flags);
  if (g_stopped_by_launcher.load()) {
    // mpirun forwarded a SIGTERM: it is ending the job and SIGKILLs every rank 1 s later.
    // Busy with that, it does not answer MPI_Finalize's handshake, which would block until
    // the SIGKILL. Every answer is sent and the heap is left: exit now.
    std::fflush(nullptr);
    std::_Exit(code);
  }
  EPSERVE_MPI_CHECK_LOG(MPI_Finalize());
  return code;
}
