// epserve: one MPI program. Rank 0 is the gRPC front-end; ranks 1..W are expert workers.
//   mpirun -np 3 epserve --model=synthetic:qwen1.5-moe-a2.7b
#include <malloc.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
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
#include "server/front_end.h"
#include "shmem/heap.h"
#include "worker/coordinator.h"
#include "worker/heap_regions.h"
#include "worker/placement.h"
#include "worker/worker.h"

namespace {

std::atomic<bool> g_stop{false};
// The stop signal came from this rank's parent: mpirun (or its orted), ending the job.
std::atomic<bool> g_stopped_by_launcher{false};
void OnSignal(int, siginfo_t* info, void*) {
  if (info != nullptr && info->si_pid == getppid()) g_stopped_by_launcher.store(true);
  g_stop.store(true);
}

struct Flags {
  std::string model = "synthetic:qwen1.5-moe-a2.7b";
  int64_t seed = 0;
  std::string device = "cpu";
  epserve::server::FrontEndOptions fe;
  absl::Duration startup_timeout = absl::Minutes(10);
  std::string layers = "all";
  std::string memory_limit;
  epserve::worker::ExchangeFlags exchange;
  std::string weight_dtype = "fp32";
  bool tensor_cores = true;
  bool bf16_dot = true;
  std::string ffn_blocking;
  bool ffn_tune = true;
  // Parsed as integers, then converted into fe (ApplyParsedFlags).
  int64_t queue_delay_us = 0;
  int64_t priority_levels = 0;
  int64_t default_priority = 0;
};

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

// This worker's index among the workers on its host (0 for the first), which picks its GPU
// with --device=gpu. Collective over MPI_COMM_WORLD: every rank calls it.
absl::StatusOr<int> NodeLocalWorkerIndex(int rank) {
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm workers = MPI_COMM_NULL;
  EPSERVE_MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
  EPSERVE_MPI_CHECK(MPI_Comm_split(node, rank > 0 ? 1 : 0, rank, &workers));
  int index = 0;
  EPSERVE_MPI_CHECK(MPI_Comm_rank(workers, &index));
  EPSERVE_MPI_CHECK(MPI_Comm_free(&workers));
  EPSERVE_MPI_CHECK(MPI_Comm_free(&node));
  return index;
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
absl::Status CheckMemory(const epserve::model::ModelConfig& config, int num_workers,
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
        config, num_workers, epserve::worker::WorkerOfRank(r), shared_split);
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

// The exchange's shape for this model and these flags, checked: every rank computes the
// same one, so all reach the same verdict.
absl::StatusOr<epserve::worker::ExchangeShape> PlanExchange(
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
  if (flags.fe.max_batch_tokens < 1) {
    return absl::InvalidArgumentError("--max-batch-tokens must be >= 1");
  }
  epserve::worker::ExchangeShape shape;
  shape.num_workers = num_workers;
  shape.num_experts = config.layer.num_experts;
  shape.top_k = config.layer.top_k;
  shape.hidden = config.layer.hidden_size;
  shape.max_batch_tokens = flags.fe.max_batch_tokens;
  EPSERVE_RETURN_IF_ERROR(flags.exchange.Apply(shape));
  if (config.layer.shared_ffn_size == 0) shape.shared_expert_split = false;  // nothing to split
  return shape;
}

void LogModel(const epserve::model::ModelConfig& config,
              const epserve::worker::ExchangeShape& shape,
              const epserve::shmem::SymmetricHeap& heap) {
  using namespace epserve;
  Log(0, absl::StrCat("heap ", shmem::HeapBackendName(heap.backend()), ": ",
                      worker::ExchangeRegions::Describe(shape.exchange())));
  Log(0, absl::StrCat("model ", config.source, ": H=", config.layer.hidden_size,
                      " F=", config.layer.expert_ffn_size, " E=", config.layer.num_experts,
                      " k=", config.layer.top_k, " shared F=", config.layer.shared_ffn_size,
                      shape.shared_expert_split ? " (split over the workers)" : "", ", ",
                      config.architecture, " MoE layers ", model::FormatLayers(config.moe_layers),
                      ", ", shape.num_workers, " worker(s); heap ", heap.bytes_per_rank(),
                      " bytes per rank"));
}

// Rank 0: waits for the workers, serves until a stop signal, then drains. The front-end
// comes back through `front_end` (its teardown is slow and must not hold up the heap's).
int ServeFrontEnd(const Flags& flags, const epserve::model::ModelConfig& config,
                  epserve::worker::Coordinator& coordinator, size_t heap_bytes,
                  ModelOpener open_model, std::unique_ptr<epserve::server::FrontEnd>& front_end) {
  using namespace epserve;
  absl::Status s = coordinator.WaitForWorkers(absl::Now() + flags.startup_timeout);
  if (!s.ok()) {
    Log(0, absl::StrCat("error: ", s.ToString()));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  absl::StatusOr<std::unique_ptr<server::FrontEnd>> fe =
      server::FrontEnd::Start(flags.fe, config, coordinator, static_cast<int64_t>(heap_bytes),
                              std::move(open_model), static_cast<uint64_t>(flags.seed));
  if (!fe.ok()) {
    Log(0, absl::StrCat("error: ", fe.status().ToString()));
    coordinator.Stop(absl::Now() + absl::Seconds(5)).IgnoreError();
    return 1;
  }
  Log(0, absl::StrCat("serving model '", flags.fe.model_name, "' on ", (*fe)->grpc_address(),
                      ", metrics on http://", (*fe)->metrics_address(), "/metrics"));
  while (!g_stop.load()) absl::SleepFor(absl::Milliseconds(20));
  Log(0, "stopping: answering requests in flight");
  const absl::Time stop_start = absl::Now();
  s = (*fe)->Shutdown();
  if (!s.ok()) Log(0, absl::StrCat("workers did not stop cleanly: ", s.ToString()));
  Log(0, absl::StrCat("stopped serving in ", absl::FormatDuration(absl::Now() - stop_start)));
  front_end = *std::move(fe);
  return 0;
}

// A worker rank: loads its experts onto its device and serves batches until rank 0 stops it.
int ServeWorker(int rank, const Flags& flags, epserve::shmem::SymmetricHeap& heap,
                const epserve::worker::HeapRegions& regions,
                const epserve::model::WeightSource& source,
                epserve::common::ElementType weight_dtype, int local_worker,
                ModelOpener open_model) {
  using namespace epserve;
  worker::WorkerOptions options;
  options.device.device = flags.device;
  options.device.local_rank = local_worker;
  options.device.tensor_cores = flags.tensor_cores;
  options.device.bf16_dot = flags.bf16_dot;
  options.device.ffn_blocking = flags.ffn_blocking;
  options.device.tune_ffn = flags.ffn_tune;
  options.weight_dtype = weight_dtype;
  options.open_model = std::move(open_model);
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
  Log(rank, absl::StrCat("worker ", me, " FFN blocking: ", (*w)->ffn_blocking(),
                         "; kernels warmed up in ",
                         absl::FormatDuration(absl::Seconds((*w)->warmup_seconds()))));
  absl::Status s = (*w)->Serve(g_stop);
  if (!s.ok()) {
    Log(rank, s.ToString());
    return 1;
  }
  return 0;
}

// Every rank: the model, the exchange's plan and the memory check (all ranks reach the same
// verdict), the heap, then the front-end on rank 0 or a worker on the others.
int Run(int rank, int num_ranks, const Flags& flags) {
  using namespace epserve;
  const ModelOpener open_model = MakeModelOpener(flags.layers);
  absl::StatusOr<std::unique_ptr<model::WeightSource>> source =
      open_model(flags.model, static_cast<uint64_t>(flags.seed));
  if (!source.ok()) return Fail(rank, source.status());
  const model::ModelConfig& config = (*source)->config();
  absl::StatusOr<worker::ExchangeShape> shape =
      PlanExchange(config, worker::NumWorkers(num_ranks), flags);
  if (!shape.ok()) return Fail(rank, shape.status());
  absl::StatusOr<shmem::HeapBackend> backend = shmem::ParseHeapBackend(flags.exchange.heap);
  if (!backend.ok()) return Fail(rank, backend.status());
  const size_t heap_bytes = worker::HeapRegions::BytesNeeded(*shape);
  absl::StatusOr<int64_t> memory_limit = ParseMemoryLimit(flags.memory_limit);
  if (!memory_limit.ok()) return Fail(rank, memory_limit.status());
  absl::StatusOr<common::ElementType> weight_dtype =
      common::ParseFlagName(flags.weight_dtype, "--weight-dtype", kernels::kKernelTypes);
  if (!weight_dtype.ok()) return Fail(rank, weight_dtype.status());
  if (absl::Status s =
          CheckMemory(config, shape->num_workers, heap_bytes, *memory_limit,
                      *weight_dtype == common::ElementType::kBf16, shape->shared_expert_split);
      !s.ok()) {
    return Fail(rank, s);
  }

  const absl::StatusOr<int> local_worker = NodeLocalWorkerIndex(rank);
  if (!local_worker.ok()) return Fail(rank, local_worker.status());
  absl::StatusOr<std::unique_ptr<shmem::SymmetricHeap>> heap =
      shmem::SymmetricHeap::Create(MPI_COMM_WORLD, heap_bytes, *backend);
  if (!heap.ok()) return Fail(rank, heap.status());
  absl::StatusOr<worker::HeapRegions> regions = worker::HeapRegions::Allocate(**heap, *shape);
  if (!regions.ok()) return Fail(rank, regions.status());
  if (rank == 0) LogModel(config, *shape, **heap);

  // Teardown order: a worker is gone (ServeWorker returned) before the heap; rank 0's
  // front-end after it (its teardown, the metrics server's threads, is slow, and the heap's
  // collective free must not wait for it); the coordinator holds nothing of its own.
  int code = 0;
  std::optional<worker::Coordinator> coordinator;
  std::unique_ptr<server::FrontEnd> front_end;
  if (rank == 0) {
    coordinator.emplace(**heap, *regions);
    code = ServeFrontEnd(flags, config, *coordinator, heap_bytes, open_model, front_end);
  } else {
    code = ServeWorker(rank, flags, **heap, *regions, **source, *weight_dtype, *local_worker,
                       open_model);
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

// The job's flags: model, addresses, batching, timeouts, device.
void RegisterServingFlags(epserve::common::FlagSet& fs, Flags& flags) {
  fs.Add("model", &flags.model,
         "The model: a Hugging Face checkpoint folder (config.json + *.safetensors of Mixtral, "
         "Qwen2/Qwen3-MoE, DeepSeek-V2/V3 or OLMoE) or synthetic:<preset> (tiny, "
         "qwen1.5-moe-a2.7b, mixtral-8x7b, ...)");
  fs.Add("seed", &flags.seed, "Seed of synthetic weights");
  fs.Add("layers", &flags.layers,
         "MoE layers to serve, by the model's layer index: all, 3, 1,5, 2-7 or a mix");
  fs.Add("memory-limit", &flags.memory_limit,
         "Memory the ranks on one host may use (bytes, K/M/G/T suffixes); empty: the "
         "machine's. A configuration needing more is refused before loading");
  fs.Add("model-name", &flags.fe.model_name, "Name clients use for the model");
  fs.Add("grpc-address", &flags.fe.grpc_address,
         "gRPC listen address host:port (port 0 picks a free port)");
  fs.Add("metrics-address", &flags.fe.metrics_address,
         "Prometheus /metrics listen address host:port (port 0: free port)");
  fs.Add("metrics-max-connections", &flags.fe.metrics_http.max_connections,
         "Connections the /metrics endpoint holds at once; beyond, the oldest that has not "
         "sent a whole request is closed (idle or slow clients cannot crowd out a scraper)");
  fs.Add("metrics-header-timeout", &flags.fe.metrics_http.header_timeout,
         "A /metrics request's headers must arrive within this of its first byte (or of the "
         "connection's opening)");
  fs.Add("metrics-idle-timeout", &flags.fe.metrics_http.idle_timeout,
         "How long a kept-alive /metrics connection may wait for its next request");
  fs.Add("metrics-write-timeout", &flags.fe.metrics_http.write_timeout,
         "A /metrics response must be taken by the client within this");
  fs.Add("ready-file", &flags.fe.ready_file,
         "When set, written once serving: {\"grpc\": host:port, \"metrics\": host:port}");
  fs.Add("max-batch-tokens", &flags.fe.max_batch_tokens,
         "Most token rows in one batch; larger requests are split");
  flags.queue_delay_us = absl::ToInt64Microseconds(flags.fe.max_queue_delay);
  fs.Add("max-queue-delay-us", &flags.queue_delay_us,
         "Longest a request waits for more rows to fill its batch, in microseconds");
  fs.Add("max-queue-tokens", &flags.fe.max_queue_tokens,
         "Most token rows queued; beyond it requests get RESOURCE_EXHAUSTED");
  fs.Add("max-request-bytes", &flags.fe.max_request_bytes,
         "Largest gRPC message accepted, in bytes; 0: the largest valid request of the model "
         "(--max-request-tokens x H x 4 bytes + 64 KiB)");
  fs.Add("batch-timeout", &flags.fe.batch_timeout,
         "Deadline of every cross-rank wait of one batch");
  fs.Add("drain-timeout", &flags.fe.drain_timeout,
         "On SIGTERM, how long a running batch may take before its requests get UNAVAILABLE");
  fs.Add("startup-timeout", &flags.startup_timeout,
         "How long rank 0 waits for the workers to load their weights");
  fs.Add("device", &flags.device,
         "OpenCL device of each worker: cpu, gpu (with several GPUs on a host, its workers take "
         "them in turn by their order on the host), or <platform>:<device>");
}

// The front-end's flags (server/: protocol, security, limits).
void RegisterFrontEndFlags(epserve::common::FlagSet& fs, Flags& flags) {
  epserve::server::FrontEndOptions& fe = flags.fe;
  fs.Add("max-request-tokens", &fe.max_request_tokens,
         "Most token rows in one request; larger ones get INVALID_ARGUMENT");
  fs.Add("max-response-bytes", &fe.max_response_bytes,
         "Largest gRPC message sent, in bytes; 0: derived as --max-request-bytes is");
  fs.Add("worker-stall-timeout", &fe.worker_stall_timeout,
         "A worker whose heartbeat stops this long (stopped, wedged) makes the server not ready "
         "(health NOT_SERVING) until it beats again; shm heap only");
  fs.Add("grpc-max-connection-idle", &fe.max_connection_idle,
         "A gRPC connection without a call for this long is closed");
  fs.Add("grpc-max-connection-age", &fe.max_connection_age,
         "A gRPC connection older than this is closed once its calls finish (0: no limit)");
  flags.priority_levels = fe.priority_levels;
  fs.Add("priority-levels", &flags.priority_levels,
         "Request priority levels (request parameter `priority`, 1 is served first)");
  flags.default_priority = fe.default_priority;
  fs.Add("default-priority", &flags.default_priority,
         "Priority level of a request that names none (or priority 0)");
  fs.Add("max-stream-inflight", &fe.max_stream_inflight,
         "Requests of one ModelStreamInfer stream read but not yet answered; beyond it the "
         "server stops reading the stream");
  fs.Add("max-concurrent-streams", &fe.max_concurrent_streams,
         "Most concurrent RPCs on one client connection (HTTP/2 streams)");
  fs.Add("grpc-max-connections", &fe.max_connections,
         "gRPC connections open at once; beyond it the newest without a call are closed");
  fs.Add("max-inflight-bytes", &fe.max_inflight_bytes,
         "Bytes of requests and answers rank 0 holds for all calls together; beyond it requests "
         "get RESOURCE_EXHAUSTED. 0: twice the rows the pipeline holds at its fullest "
         "((--max-queue-tokens + 3 x --max-batch-tokens + --max-request-tokens) x H x 16 "
         "bytes), at least 16 MiB");
  fs.Add("answer-timeout", &fe.answer_timeout,
         "An answer its client has not taken within this closes the call (CANCELLED); while "
         "--max-inflight-bytes is short, calls whose answer waited 1 s are closed first");
  fs.Add("grpc-memory-quota", &fe.grpc_memory_quota,
         "Bytes gRPC itself may use for buffers, calls and connections (a resource quota; under "
         "pressure it closes idle connections, then cancels calls). 0: --max-inflight-bytes "
         "plus 16 largest requests");
  fs.Add("grpc-handshake-timeout", &fe.grpc_handshake_timeout,
         "A new gRPC connection must send HTTP/2's preface and SETTINGS (and finish TLS) within "
         "this");
  fs.Add("keepalive-time", &fe.keepalive_time,
         "Interval of the server's keepalive pings on an idle connection");
  fs.Add("keepalive-timeout", &fe.keepalive_timeout,
         "How long the server waits for a keepalive ping's answer before closing");
  fs.Add("keepalive-permit-without-calls", &fe.keepalive_permit_without_calls,
         "Allow client keepalive pings on connections without RPCs in flight");
  fs.Add("http2-min-recv-ping-interval", &fe.http2_min_recv_ping_interval,
         "Shortest interval between client pings without data the server tolerates");
  fs.Add("http2-max-ping-strikes", &fe.http2_max_ping_strikes,
         "Pings too early before the server closes the connection (0: unlimited)");
  fs.Add("tls-cert", &fe.tls_cert, "PEM certificate chain of the server; with --tls-key: TLS");
  fs.Add("tls-key", &fe.tls_key, "PEM private key of --tls-cert");
  fs.Add("tls-client-ca", &fe.tls_client_ca,
         "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)");
  fs.Add("auth-token-file", &fe.auth_token_file,
         "File holding a bearer token; when set, every RPC but health needs the metadata "
         "'authorization: Bearer <token>'");
  fs.Add("grpc-reflection", &fe.reflection, "Serve gRPC server reflection");
}

// The kernels' flags (weights on the device, FFN kernels).
void RegisterKernelFlags(epserve::common::FlagSet& fs, Flags& flags) {
  fs.Add("weight-dtype", &flags.weight_dtype,
         "Expert weights (routed and shared) on the workers' devices: fp32 or bf16 (rounded to "
         "nearest even once at load; the router stays fp32, sums are fp32 either way)");
  fs.Add("tensor-cores", &flags.tensor_cores,
         "With --weight-dtype=bf16 on NVIDIA GPUs of compute capability 8.0 or more, run the "
         "expert FFN on the tensor cores (activations and the intermediate also rounded to "
         "bf16); --no-tensor-cores keeps the portable kernels");
  fs.Add("bf16-dot", &flags.bf16_dot,
         "With --weight-dtype=bf16 on CPU devices whose x86 CPU has AVX512-BF16, run the expert "
         "FFN on its bf16 dot products (vdpbf16ps, twice the multiply-adds of an fp32 FMA; "
         "activations and the intermediate also rounded to bf16); --no-bf16-dot keeps fp32 FMAs");
  fs.Add("ffn-blocking", &flags.ffn_blocking,
         "Force the portable expert FFN kernels' blocking, e.g. 'vec=8 rows=6 prefetch=64 "
         "chunk=96' (keys: vec 8|16, rows 2-16, prefetch k-steps 0-1024, chunk rows); default: "
         "chosen per device and expert shape, from the tuning cache beside the kernel cache or "
         "timed on the device at first start (also $EPSERVE_FFN_BLOCKING)");
  fs.Add("ffn-tune", &flags.ffn_tune,
         "Time the FFN blocking's candidates on the device when the tuning cache has no entry "
         "for the shape (a few seconds, once per device, driver and shape); --no-ffn-tune takes "
         "the device's default blocking instead");
}

// The exchange's flags (shmem/, worker/: heap backend, payload dtypes, capacity).
void RegisterExchangeFlags(epserve::common::FlagSet& fs, Flags& flags) {
  fs.Add("heap", &flags.exchange.heap,
         "Symmetric heap backend: shm (shared-memory window, all ranks on one host), rma (MPI "
         "one-sided RMA, any hosts) or auto (shm when every rank shares a host)");
  fs.Add("dispatch-dtype", &flags.exchange.dispatch_dtype,
         "Token rows sent to experts: fp32, bf16 or fp8 (e4m3, one fp32 scale per 128 values)");
  fs.Add("combine-dtype", &flags.exchange.combine_dtype,
         "Expert output rows sent back to their owners: fp32 or bf16");
  fs.Add("max-recv-tokens-per-rank", &flags.exchange.max_recv_tokens_per_rank,
         "Receive capacity of each worker in token rows per batch (bounds the heap); 0: "
         "--max-batch-tokens, which never overflows");
  fs.Add("recv-overflow", &flags.exchange.recv_overflow,
         "When a batch exceeds a receive capacity: fail (RESOURCE_EXHAUSTED) or split (run "
         "it in rounds)");
  fs.Add("exchange-timeout-ms", &flags.exchange.exchange_timeout_ms,
         "Every cross-rank wait of a batch ends within this many milliseconds (or "
         "--batch-timeout, if shorter); a peer that stops taking part fails the batch with "
         "UNAVAILABLE");
  fs.Add("shared-expert", &flags.exchange.shared_expert,
         "Where the shared expert runs: owner (each worker holds all of it and runs it on its "
         "own tokens) or split (each worker holds 1/W of its intermediate columns and runs "
         "them on every token of the batch, which then goes to every worker: balanced and "
         "lighter on weight reads for small batches, more rows exchanged for large ones)");
}

// Every flag of epserve, bound to its field of `flags`.
void RegisterFlags(epserve::common::FlagSet& fs, Flags& flags) {
  RegisterServingFlags(fs, flags);
  RegisterFrontEndFlags(fs, flags);
  RegisterKernelFlags(fs, flags);
  RegisterExchangeFlags(fs, flags);
}

// The fields parsed in another form than FrontEndOptions keeps them.
void ApplyParsedFlags(Flags& flags) {
  flags.fe.max_queue_delay = absl::Microseconds(flags.queue_delay_us);
  // Out-of-range values stay out of range (FrontEnd::Start names the bound).
  flags.fe.priority_levels =
      static_cast<uint32_t>(std::clamp<int64_t>(flags.priority_levels, 0, 1001));
  flags.fe.default_priority =
      static_cast<uint32_t>(std::clamp<int64_t>(flags.default_priority, 0, 1002));
  flags.fe.device = flags.device;
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
  // Buffers of 1 MiB and more (large requests and answers) come from mmap and go back to the
  // system when freed. A fixed threshold also turns off glibc's adaptive one, which after the
  // first such free serves them from the heap, where a burst of them stays resident.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  Flags flags;
  epserve::common::FlagSet fs(
      "epserve",
      "Serves MoE layers over gRPC (KServe v2). Launch as one MPI job:\n"
      "  mpirun -np 1+W epserve [flags]   (rank 0 front-end, W expert workers)");
  RegisterFlags(fs, flags);
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
  ApplyParsedFlags(flags);
  InstallStopHandlers();

  int provided = 0, rank = 0, num_ranks = 0;
  if (absl::Status s = StartMpi(argc, argv, provided, rank, num_ranks); !s.ok()) {
    std::fprintf(stderr, "epserve: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  epserve::common::SetLogRank(rank);
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
