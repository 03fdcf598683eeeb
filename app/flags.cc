#include "app/flags.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/element_type.h"
#include "kernels/dtype.h"
#include "shmem/heap.h"

namespace epserve::app {
namespace {

// A default shown as the string flag it was: "auto".
std::string Quoted(absl::string_view name) { return absl::StrCat("\"", name, "\""); }

// The job's flags: model, addresses, batching, timeouts, device.
void RegisterServingFlags(common::FlagSet& fs, Flags& flags) {
  fs.Add("model", &flags.model,
         "The model: a Hugging Face checkpoint folder (config.json + *.safetensors of Mixtral, "
         "Qwen2/Qwen3-MoE, DeepSeek-V2/V3 or OLMoE) or synthetic:<preset> (tiny, "
         "qwen1.5-moe-a2.7b, mixtral-8x7b, ...)");
  fs.Add("seed", &flags.seed, "Seed of synthetic weights");
  fs.Add("layers", &flags.layers,
         "MoE layers to serve, by the model's layer index: all, 3, 1,5, 2-7 or a mix");
  fs.AddBytes("memory-limit", &flags.memory_limit_bytes,
              "Memory the ranks on one host may use (bytes, K/M/G/T suffixes); empty: the "
              "machine's. A configuration needing more is refused before loading");
  fs.Add("model-name", &flags.fe.requests.model_name, "Name clients use for the model");
  fs.Add("grpc-address", &flags.fe.grpc_address,
         "gRPC listen address host:port (port 0 picks a free port)");
  fs.Add("metrics-address", &flags.fe.metrics.address,
         "Prometheus /metrics listen address host:port (port 0: free port)");
  fs.Add("metrics-max-connections", &flags.fe.metrics.max_connections,
         "Connections the /metrics endpoint holds at once; beyond, the oldest that has not "
         "sent a whole request is closed (idle or slow clients cannot crowd out a scraper)");
  fs.Add("metrics-header-timeout", &flags.fe.metrics.header_timeout,
         "A /metrics request's headers must arrive within this of its first byte (or of the "
         "connection's opening)");
  fs.Add("metrics-idle-timeout", &flags.fe.metrics.idle_timeout,
         "How long a kept-alive /metrics connection may wait for its next request");
  fs.Add("metrics-write-timeout", &flags.fe.metrics.write_timeout,
         "A /metrics response must be taken by the client within this");
  fs.Add("ready-file", &flags.fe.ready_file,
         "When set, written once serving: {\"grpc\": host:port, \"metrics\": host:port}");
  fs.Add("max-batch-tokens", &flags.fe.batching.max_batch_tokens,
         "Most token rows in one batch; larger requests are split");
  fs.Add("max-queue-delay-us", &flags.fe.batching.max_queue_delay_us,
         "Longest a request waits for more rows to fill its batch, in microseconds");
  fs.Add("max-queue-tokens", &flags.fe.batching.max_queue_tokens,
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
  fs.Add("device", &flags.worker.device.device,
         "OpenCL device of each worker: cpu, gpu (with several GPUs on a host, its workers take "
         "them in turn by their order on the host), or <platform>:<device>");
}

// The front-end's request limits (server/).
void RegisterFrontEndFlags(common::FlagSet& fs, Flags& flags) {
  server::FrontEndOptions& fe = flags.fe;
  fs.Add("max-request-tokens", &fe.requests.max_request_tokens,
         "Most token rows in one request; larger ones get INVALID_ARGUMENT");
  fs.Add("max-response-bytes", &fe.max_response_bytes,
         "Largest gRPC message sent, in bytes; 0: derived as --max-request-bytes is");
}

// The workers' host threads and paths (worker/worker_options.h).
void RegisterWorkerFlags(common::FlagSet& fs, Flags& flags) {
  worker::WorkerOptions& w = flags.worker;
  fs.Add("worker-host-threads", &w.host_threads,
         "Each worker's host threads for its combine (summing its tokens' returned rows); 0: "
         "the host's hardware threads over its workers and rank 0, 1 to 8");
  fs.Add("worker-idle-poll", &w.idle_poll,
         "Longest sleep of an idle worker between two looks for the next batch, e.g. 20us; 0: "
         "20us where the host has 4 hardware threads for each rank on it, else 200us");
  fs.Add("worker-local-pass", &w.local_pass,
         "A batch with one live worker (a one-worker job, or the last survivor) runs on that "
         "worker's device alone: its rows go up once, the output comes down once, the owner's "
         "sum runs on the device, with the bits the exchange gives; --no-worker-local-pass "
         "runs it through the heap exchange (for comparison)");
  fs.AddTyped<worker::DeviceExchangeMode>(
      "device-exchange", &w.device_exchange,
      "How the exchange moves rows between workers: auto (device to device where every "
      "worker is a GPU that imports CUDA memory into OpenCL and the heap is shm, else "
      "through the heap), off (through the heap), cuda (device to device, required), host "
      "(CPU workers: kernels move rows through shared host memory, required)",
      worker::ParseDeviceExchangeMode, [](const worker::DeviceExchangeMode& m) {
        return Quoted(worker::DeviceExchangeModeName(m));
      });
  fs.AddTyped<worker::AutoSwitch>(
      "upload-ahead", &w.upload_ahead,
      "Whether a worker uploads the next batch's rows (copied in by rank 0 while the "
      "workers compute, --batches-in-flight=2) to its device while it computes the current "
      "batch's experts: auto (on devices with memory of their own), on, off",
      [](absl::string_view t) { return worker::ParseAutoSwitch("upload-ahead", t); },
      [](const worker::AutoSwitch& u) { return Quoted(worker::AutoSwitchName(u)); });
  fs.AddTyped<worker::AutoSwitch>(
      "workers-read-shm", &w.reads_shm,
      "Whether the workers read the rows of requests in clients' system shared memory, and "
      "write their answers, themselves (in the requests' element types, converted on their "
      "devices), so that rank 0 copies none of them: auto (where every worker's device has "
      "memory of its own and every rank is on one host), on (every rank on one host), off",
      [](absl::string_view t) { return worker::ParseAutoSwitch("workers-read-shm", t); },
      [](const worker::AutoSwitch& u) { return Quoted(worker::AutoSwitchName(u)); });
}

// Rank 0's pipeline: batches in flight, its threads, priorities (server/).
void RegisterPipelineFlags(common::FlagSet& fs, Flags& flags) {
  server::FrontEndOptions& fe = flags.fe;
  fs.Add("batches-in-flight", &fe.batches_in_flight,
         "Batches between rank 0 and the workers at once: 2 copies the next batch's rows into "
         "the workers' second input slot while they compute, and the last batch's output out "
         "while they compute the next; 1 runs them one after the other");
  fs.Add("direct-batch-tokens", &fe.batching.direct_batch_tokens,
         "A request of at most this many tokens that finds rank 0's pipeline idle starts on the "
         "gRPC thread that received it (its rows' copy into the heap, the workers' signal), "
         "and a batch of at most this many tokens is answered by the thread that saw it end, "
         "without waking another thread for each step; 0: never");
  fs.Add("host-copy-threads", &fe.host_copy_threads,
         "Rank 0's threads for a batch's row copies into and out of the shared heap and its "
         "dtype conversions; 0: a quarter of the host's hardware threads, 1 to 8");
  fs.Add("respond-threads", &fe.respond_threads,
         "Rank 0's threads that hand finished requests' answers to gRPC, which serialises each "
         "there (milliseconds for a large answer), while the completion thread goes on with "
         "the next batch; 0: as many as --host-copy-threads; 1: the completion thread answers");
  fs.Add("worker-stall-timeout", &fe.worker_stall_timeout,
         "A worker whose heartbeat stops this long (stopped, wedged) makes the server not ready "
         "(health NOT_SERVING) until it beats again; shm heap only");
  fs.Add("grpc-max-connection-idle", &fe.max_connection_idle,
         "A gRPC connection without a call for this long is closed");
  fs.Add("grpc-max-connection-age", &fe.max_connection_age,
         "A gRPC connection older than this is closed once its calls finish (0: no limit)");
  fs.Add("priority-levels", &fe.requests.priority_levels,
         "Request priority levels (request parameter `priority`, 1 is served first)");
  fs.Add("default-priority", &fe.requests.default_priority,
         "Priority level of a request that names none (or priority 0)");
}

// The front-end's connections and calls: streams, memory, keepalive, security (server/).
void RegisterConnectionFlags(common::FlagSet& fs, Flags& flags) {
  server::FrontEndOptions& fe = flags.fe;
  fs.Add("max-stream-inflight", &fe.service.max_stream_inflight,
         "Requests of one ModelStreamInfer stream read but not yet answered; beyond it the "
         "server stops reading the stream");
  fs.Add("max-concurrent-streams", &fe.streams.max_streams,
         "Most concurrent RPCs on one client connection (HTTP/2 streams)");
  fs.Add("grpc-max-connections", &fe.streams.max_connections,
         "gRPC connections open at once; beyond it the newest without a call are closed");
  fs.Add("max-inflight-bytes", &fe.service.max_inflight_bytes,
         "Bytes of requests and answers rank 0 holds for all calls together; beyond it requests "
         "get RESOURCE_EXHAUSTED. 0: twice the rows the pipeline holds at its fullest "
         "((--max-queue-tokens + 3 x --max-batch-tokens + --max-request-tokens) x H x 16 "
         "bytes), at least 16 MiB");
  fs.Add("answer-timeout", &fe.service.answer_timeout,
         "An answer its client has not taken within this closes the call (CANCELLED); while "
         "--max-inflight-bytes is short, calls whose answer waited 1 s are closed first");
  fs.Add("keep-request-buffers", &fe.service.keep_request_buffers,
         "Rank 0 keeps freed request and answer buffers (up to 32 MiB each) for the next "
         "requests instead of giving them back to the system at once: large inline requests no "
         "longer fault their pages in afresh (4096-token BF16 requests on an H100 host: "
         "1.2-1.6x the tokens/s), at the cost of free memory held beside the calls' own, up to "
         "twice what they hold (at least 128 MiB), given back once the load ends. For trusted "
         "clients; off, rank 0's memory returns within a second of a burst");
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

// A switch over one of the runtime's kAuto / kOff options (true: kAuto, the device decides).
template <typename Mode>
void AddAutoSwitch(common::FlagSet& fs, const char* name, Mode* mode, const char* help) {
  fs.AddTyped<Mode>(
      name, mode, help,
      [](absl::string_view text) -> absl::StatusOr<Mode> {
        bool on = true;
        if (!absl::SimpleAtob(text, &on)) return absl::InvalidArgumentError("");
        return on ? Mode::kAuto : Mode::kOff;
      },
      [](const Mode& m) { return m == Mode::kOff ? "false" : "true"; },
      /*switch_flag=*/true);
}

// The kernels' flags (weights on the device, FFN kernels).
void RegisterKernelFlags(common::FlagSet& fs, Flags& flags) {
  kernels::RuntimeOptions& runtime = flags.worker.device;
  fs.AddTyped<common::ElementType>(
      "weight-dtype", &flags.worker.weight_dtype,
      "Expert weights (routed and shared) on the workers' devices: fp32 or bf16 (rounded to "
      "nearest even once at load; the router stays fp32, sums are fp32 either way)",
      [](absl::string_view text) {
        return common::ParseFlagName(text, "--weight-dtype", kernels::kKernelTypes);
      },
      [](const common::ElementType& t) { return Quoted(common::FlagName(t)); });
  fs.Add("tensor-cores", &runtime.tensor_cores,
         "With --weight-dtype=bf16 on NVIDIA GPUs of compute capability 8.0 or more, run the "
         "expert FFN on the tensor cores (activations and the intermediate also rounded to "
         "bf16); --no-tensor-cores keeps the portable kernels");
  fs.Add("bf16-dot", &runtime.bf16_dot,
         "With --weight-dtype=bf16 on CPU devices whose x86 CPU has AVX512-BF16, let the expert "
         "FFN run on its bf16 dot products (vdpbf16ps; activations and the intermediate also "
         "rounded to bf16) where timing on the device shows them faster than fp32 FMAs (see "
         "--ffn-blocking); --no-bf16-dot keeps fp32 FMAs");
  fs.Add("bf16-amx", &runtime.bf16_amx,
         "Where the bf16 dot-product kernels run and the CPU has AMX-BF16 (Intel Sapphire Rapids "
         "and later), run their rows through AMX tiles (tdpbf16ps); --no-bf16-amx keeps "
         "vdpbf16ps");
  fs.Add("ffn-blocking", &runtime.ffn_blocking,
         "Force the CPU expert FFN's form: one for every row class, e.g. 'vec=8 rows=6 "
         "prefetch=64 chunk=96' (keys: vec 8|16, rows 2-16, prefetch k-steps 0-1024, chunk "
         "rows) or 'dot' (bf16 weights on the bf16 dot products; also dot-vdp, pair-fma, "
         "-direct forms), or one per class of rows per expert, e.g. '1: pair-fma-direct; 2-8: "
         "dot-direct; 9-64: dot; 65+: dot' (forms of one weight layout); default: chosen per "
         "device, expert shape and row class, from the tuning cache beside the kernel cache or "
         "timed on the device at first start (also $EPSERVE_FFN_BLOCKING)");
  AddAutoSwitch(fs, "pinned-transfers", &runtime.staging,
                "On GPUs, move large blocks between host and device through pinned staging "
                "buffers, a chunk's host copy (on the worker's host threads) overlapping the "
                "previous chunk's DMA; --no-pinned-transfers leaves them to the driver's copies "
                "from pageable memory");
  AddAutoSwitch(fs, "concurrent-queues", &runtime.concurrent_queues,
                "On GPUs, run the shared expert on a second queue of the device beside the "
                "router, the grouping and the routed experts of a batch a worker runs alone; "
                "--no-concurrent-queues runs every launch in order on one queue");
  AddAutoSwitch(fs, "wgmma", &runtime.wgmma,
                "On Hopper GPUs (compute capability 9.0) with the tensor-core expert FFN, run its "
                "128-row tiles on the warpgroup MMA (wgmma, the program rebuilt for sm_90a; "
                "mma.sync where the driver does not build it); --no-wgmma keeps mma.sync; "
                "$EPSERVE_WGMMA=0 turns it off too");
  fs.Add("mma-decode-rows", &runtime.mma_decode_rows,
         "On GPUs with --weight-dtype=bf16 on the tensor cores, tiles of at most this many rows "
         "of one expert take the decode form (several work-groups a multiprocessor streaming "
         "the weights) instead of the 128-row tiles: 32, or 64 (tiles of 33-64 rows in a wide "
         "decode form of their own); 0 takes $EPSERVE_MMA_DECODE_ROWS, else 64");
  fs.Add("ffn-tune", &runtime.tune_ffn,
         "Time the FFN blocking's candidates on the device when the tuning cache has no entry "
         "for the shape (a few seconds, once per device, driver and shape); --no-ffn-tune takes "
         "the device's default blocking instead");
}

// The exchange's flags (shmem/, worker/: heap backend, payload dtypes, capacity).
void RegisterExchangeFlags(common::FlagSet& fs, Flags& flags) {
  worker::ExchangeOptions& x = flags.exchange;
  fs.AddTyped<shmem::HeapBackend>(
      "heap", &x.heap,
      "Symmetric heap backend: shm (shared-memory window, all ranks on one host), rma (MPI "
      "one-sided RMA, any hosts) or auto (shm when every rank shares a host)",
      shmem::ParseHeapBackend,
      [](const shmem::HeapBackend& b) { return Quoted(shmem::HeapBackendName(b)); });
  const auto dtype_name = [](const common::ElementType& t) { return Quoted(common::FlagName(t)); };
  fs.AddTyped<common::ElementType>(
      "dispatch-dtype", &x.dispatch_dtype,
      "Token rows sent to experts: fp32, bf16 or fp8 (e4m3, one fp32 scale per 128 values)",
      worker::ParseDispatchDtype, dtype_name);
  fs.AddTyped<common::ElementType>("combine-dtype", &x.combine_dtype,
                                   "Expert output rows sent back to their owners: fp32 or bf16",
                                   worker::ParseCombineDtype, dtype_name);
  fs.Add("max-recv-tokens-per-rank", &x.max_recv_tokens_per_rank,
         "Receive capacity of each worker in token rows per batch (bounds the heap); 0: "
         "--max-batch-tokens, which never overflows");
  fs.AddTyped<worker::OverflowPolicy>(
      "recv-overflow", &x.recv_overflow,
      "When a batch exceeds a receive capacity: fail (RESOURCE_EXHAUSTED) or split (run "
      "it in rounds)",
      worker::ParseOverflowPolicy,
      [](const worker::OverflowPolicy& p) { return Quoted(worker::OverflowPolicyName(p)); });
  fs.Add("exchange-timeout-ms", &x.exchange_timeout_ms,
         "Every cross-rank wait of a batch ends within this many milliseconds (or "
         "--batch-timeout, if shorter); a peer that stops taking part fails the batch with "
         "UNAVAILABLE");
  fs.AddTyped<worker::SharedExpertPlacement>(
      "shared-expert", &x.shared_expert,
      "Where the shared expert runs: owner (each worker holds all of it and runs it on its "
      "own tokens) or split (each worker holds 1/W of its intermediate columns and runs "
      "them on every token of the batch, which then goes to every worker: balanced and "
      "lighter on weight reads for small batches, more rows exchanged for large ones)",
      worker::ParseSharedExpertPlacement, [](const worker::SharedExpertPlacement& p) {
        return Quoted(worker::SharedExpertPlacementName(p));
      });
  fs.Add("redundant-experts", &flags.redundant_experts,
         "Copies of experts beyond one each, per layer, spread over the workers (at most "
         "experts x (workers - 1)); which experts get them and where follows the load of "
         "--eplb-profile (DeepSeek's EPLB policy). A pair goes to one copy, chosen so that the "
         "workers' loads even out; answers are bit-identical to an unreplicated service");
  fs.Add("eplb-interval", &flags.fe.eplb.interval_batches,
         "Rebalance the experts while serving every this many batches, by the loads those "
         "batches brought (new copies loaded beside the serving ones, switched between two "
         "batches); 0: never");
  fs.Add("eplb-min-gain", &flags.fe.eplb.min_gain,
         "A rebalance goes ahead only where it raises the expected worker balancedness "
         "(mean / max load, the worst layer) by at least this");
  fs.Add("eplb-min-copies", &flags.fe.eplb.min_copies,
         "Copies of every expert each placement keeps, at start and at every rebalance "
         "(needs --redundant-experts >= experts x (copies - 1)); 2: the job serves on through "
         "any one worker's death (under mpirun --enable-recovery, --shared-expert=owner)");
  fs.Add("eplb-profile", &flags.eplb_profile,
         "A saved expert load profile (JSON, as GET /eplb/profile on the metrics port gives) "
         "to place the experts and their --redundant-experts copies by; empty: uniform loads");
}

}  // namespace

absl::Status Flags::Validate() const {
  if (absl::Status s = fe.Validate(); !s.ok()) return s;
  return worker.Validate();
}

void RegisterFlags(common::FlagSet& fs, Flags& flags) {
  RegisterServingFlags(fs, flags);
  RegisterFrontEndFlags(fs, flags);
  RegisterWorkerFlags(fs, flags);
  RegisterPipelineFlags(fs, flags);
  RegisterConnectionFlags(fs, flags);
  RegisterKernelFlags(fs, flags);
  RegisterExchangeFlags(fs, flags);
}

}  // namespace epserve::app
