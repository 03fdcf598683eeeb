// An expert worker: the per-rank EP pipeline (route, count/notify, dispatch, expert FFN,
// combine) and its batch loop. One per worker rank; driven by one thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/weights.h"
#include "shmem/heap.h"
#include "worker/cuda_rows.h"
#include "worker/device_exchange.h"
#include "worker/exchange.h"
#include "worker/heap_regions.h"
#include "worker/host_rows.h"
#include "worker/placement.h"
#include "worker/worker_options.h"

namespace epserve::worker {

// The runs [begin, end) of rows 0..n that `table` (null: none) does not place in CUDA memory,
// for its input (output false) or output segments: the rows that travel through the heap.
std::vector<std::pair<int64_t, int64_t>> HostRowRanges(const DeviceRowTable* table, int64_t n,
                                                       bool output);

class Worker {
 public:
  // Loads the experts this worker owns of every served layer onto its device.
  // Configuration-time: slow, allocates.
  ~Worker();  // waits for a weight swap's loading

  static absl::StatusOr<std::unique_ptr<Worker>> Create(shmem::SymmetricHeap& heap,
                                                        const HeapRegions& regions,
                                                        const model::WeightSource& source,
                                                        const WorkerOptions& options);

  // Tells rank 0 this worker is ready, then serves batches until rank 0 sends kStop, or
  // `stop` turns true and no batch comes within orphan_grace. A batch's error is reported
  // to rank 0 and the loop goes on.
  absl::Status Serve(const std::atomic<bool>& stop);

  const kernels::DeviceInfo& device() const { return rt_->device_info(); }
  size_t weight_bytes() const;
  // The expert FFN kernels the weights run on (kernels::FfnKernelsName).
  const char* ffn_kernels() const;
  // The portable FFN kernels' blocking per expert shape, and where each came from (tuned now,
  // cache, forced, default): "vec=8 rows=6 prefetch=64 chunk=96 (cache) for H=... F=...; ...".
  std::string ffn_blocking() const;
  // Seconds Create spent running every kernel of a batch once (WarmUp), so that the first
  // batches pay no kernel build.
  double warmup_seconds() const { return warmup_seconds_; }
  // Host threads of the combine's sum (WorkerOptions::host_threads, resolved).
  int host_threads() const { return host_threads_; }
  // Whether the device's large host transfers go through pinned staging (on those threads).
  bool stages_transfers() const { return rt_->stages_transfers(); }
  // How the exchange moves rows: "device to device (cuda)", "device to device (host)", or
  // "through the heap" and why.
  std::string exchange_path() const;
  // Whether the next batch's rows are uploaded while the current one computes, and of how many
  // batches served the rows were on the device already.
  bool uploads_ahead() const { return upload_ahead_; }
  int64_t batches_uploaded_ahead() const { return batches_uploaded_ahead_; }
  int64_t batches_served() const { return batches_served_; }
  // Whether rank 0 died or has told this worker that a peer died (its batches name fewer live
  // workers than the job has): the MPI job is then short of a rank, and collective calls
  // (the heap's free, MPI_Finalize) would wait for it.
  bool peers_lost() const {
    return front_end_lost_ || live_.Count() < regions_.plan.shape().num_workers;
  }

 private:
  struct Layer {
    const ExpertPlacement* placement = nullptr;  // an element of placements_ (or staged_...)
    kernels::RouterWeights router;
    kernels::ExpertWeights experts;  // this worker's, in the placement's local order
    kernels::ExpertWeights shared;   // num_experts == 0 when the model has none
  };

  Worker(shmem::SymmetricHeap& heap, const HeapRegions& regions, const model::ModelConfig& model,
         const WorkerOptions& options)
      : heap_(heap), regions_(regions), model_(model), cfg_(model.layer), options_(options) {}

  static size_t LayerBytes(const Layer& layer);
  // This worker's part of every served layer of `source`, on its device.
  // With `reuse` (the serving layers, when the weights stay the same), experts they hold
  // are copied on the device instead of read from the source.
  absl::StatusOr<std::vector<Layer>> LoadLayers(const model::WeightSource& source,
                                                const std::vector<ExpertPlacement>& placements,
                                                const std::vector<Layer>* reuse = nullptr);
  // One placement per served layer, each fitting the exchange.
  absl::Status CheckPlacements(const std::vector<ExpertPlacement>& placements);
  // kStage (batch `seq`): checks the model the ControlMessage names, then loads it into
  // staged_ on loader_ (the serving layers stay and batches go on).
  absl::Status Stage(uint64_t seq);
  // Once loader_ has ended: its outcome into rank 0's stage_reports and staged signal (from
  // the batch thread: the heap is used from one thread).
  absl::Status PublishStage();
  // kSwitch / kDiscard: the staged layers become the serving ones, or are freed.
  absl::Status EndStage(bool use_new);
  // Host memory a second copy of this worker's weights needs, against what the host has.
  absl::Status CheckRoomForSecondCopy() const;

  class Heart;
  // Runs the op rank 0 posted as batch `seq` (a batch or a weight swap's control step) and
  // writes its outcome into `report`, an error naming this worker.
  void RunPosted(uint64_t seq, const BatchDescriptor& desc, WorkerReport& report);
  absl::Status RunBatch(const BatchDescriptor& desc, WorkerReport& report);
  // RunBatch's parts: the route stage, the expert step the exchange calls, and the expert
  // load report to rank 0.
  absl::Status Route(const Layer& layer, const BatchDescriptor& desc, float* x_in,
                     bool to_host = true);
  absl::Status SendRouting(const BatchDescriptor& desc);
  // The routing of desc's rows, read into ids_host_ and weights_host_, into rank 0's topk
  // regions.
  absl::Status PutRouting(const BatchDescriptor& desc);
  absl::Status ExpertStep(const Layer& layer, bool split_shared, const ReceivedRows& in,
                          float* pair_out, float* row_out);
  absl::Status PublishExpertLoad(const ExpertPlacement& placement, const ExchangeStats& stats);
  // The uploader thread (upload_ahead_): each copy of rows rank 0 announces (RowsAhead) into
  // x_next_ through the runtime's second queue (WriteBeside), while this worker's batch thread
  // computes the batch before; until `stop`.
  void UploadLoop(const std::atomic<bool>& stop);
  // Route's side: batch `desc`'s rows into x_local_, swapped in from x_next_ where the uploader
  // has them (waiting for an upload of them under way), else (always, without the uploader)
  // written from `x_in`.
  absl::Status RowsOnDevice(const BatchDescriptor& desc, const float* x_in);
  // Whether batch `desc` can run without the exchange: this worker is its only live worker,
  // the payload dtypes are ones the device reproduces (fp32, bf16) and its rows fit one pass.
  bool RunsLocally(const BatchDescriptor& desc) const;
  // The batch on this worker's device alone (the route has run: x_local_, ids_, weights_
  // and their host copies hold this worker's rows and routing): the pair table, the FFN on
  // the rows as the dispatch payload would deliver them, the shared expert, the owner's sum
  // (kernels::SumPairRows) and the output rows into y, with the exchange's stats.
  absl::Status RunLocal(const Layer& layer, const ExpertPlacement& placement,
                        const BatchDescriptor& desc, float* y, ExchangeStats& stats);
  // The local runs' shared steps. LocalRows: the batch's n rows as the dispatch payload would
  // deliver them (x_local_, or x_recv_ rounded to BF16), the `dispatch` stage's stats.
  // LocalSharedExpert: the shared expert on them (the whole of it, or its slice where it is
  // split), and how the owner's sum starts. LocalSum: the owner's sum of the pairs' rows
  // (pair_of_choice: each choice's pair) onto it, and the rows delivered (DeliverRows).
  absl::StatusOr<const kernels::Buffer*> LocalRows(int64_t n, ExchangeStats& stats);
  absl::StatusOr<kernels::SumStart> LocalSharedExpert(const Layer& layer, const kernels::Buffer& x,
                                                      int64_t n);
  absl::Status LocalSum(const kernels::Buffer& pair_of_choice, kernels::SumStart start,
                        const BatchDescriptor& desc, float* y);
  // Whether a local run of `n` rows of `layer` groups its pairs on the device
  // (RunLocalOnDevice): tensor-core weights on a device other than a CPU, and at most
  // kernels::kDeviceGroupingMaxPairs pairs.
  bool GroupsOnDevice(const Layer& layer, int64_t n) const;
  // RunLocal with the pairs grouped on the device (kernels::GroupPairs) and nothing waited
  // for until the output is read: the route's results reach the host (and rank 0) after the
  // layer. Its stages are enqueued without waits, so the layer's device time shows in the
  // combine stage.
  absl::Status RunLocalOnDevice(const Layer& layer, const ExpertPlacement& placement,
                                const BatchDescriptor& desc, float* y, ExchangeStats& stats);
  // local_of_expert_ for `placement` into local_of_device_ (uploaded when it changed), and
  // pair_groups_ made for `experts`' count.
  absl::Status PrepareDeviceGrouping(const ExpertPlacement& placement,
                                     const kernels::ExpertWeights& experts);
  // The placement batch `desc` runs `layer` with: the layer's own while every worker lives,
  // else the layer's placement OnlyOn the live workers (computed once per set of survivors
  // and serving placements).
  absl::StatusOr<const ExpertPlacement*> PlacementFor(const BatchDescriptor& desc,
                                                      const Layer& layer);
  absl::Status AllocateBuffers();
  // ---- rows in clients' memory: CUDA, and system shared memory (worker_client_rows.cc) ----
  // cuda_rows_ where the device can reach CUDA memory, else why not in cuda_rows_why_;
  // host_rows_ where this worker takes rows in system shared memory (--workers-read-shm).
  absl::Status StartCudaRows();
  absl::Status StartHostRows();
  // Batch `desc`'s DeviceRowTable, or null when none of its rows is in clients' memory;
  // FAILED_PRECONDITION where some are and this worker cannot reach them.
  absl::StatusOr<const DeviceRowTable*> DeviceRowsOf(const BatchDescriptor& desc) const;
  // The table's input rows of either kind into x_local_; its output rows of y into the
  // clients' memory.
  absl::Status ReadClientRows(const DeviceRowTable& table, int64_t n);
  absl::Status WriteClientRows(const DeviceRowTable& table, int64_t n, const kernels::Buffer& y);
  // After the rows rank 0 copied are in x_local_: the rows in clients' memory into x_local_
  // (and into x_in, the input slot, where the exchange sends from the host).
  absl::Status DeviceRowsIn(const BatchDescriptor& desc, float* x_in);
  // The batch's output rows from the device buffer `out` ([n][H] FP32): into y (rank 0's
  // segment) for rows rank 0 answers, into the clients' memory for the others.
  absl::Status DeliverRows(const BatchDescriptor& desc, const kernels::Buffer& out, float* y);
  // The same where the output rows were summed on the host into y: the rows that go to
  // clients' memory from there.
  absl::Status DeliverHostRows(const BatchDescriptor& desc, const float* y);
  // The device exchange, as options_.device_exchange says (device_exchange_, or why not in
  // exchange_path_).
  absl::Status StartDeviceExchange();
  // Runs, on one row of zeros, every device kernel RunBatch can reach for every served layer
  // (router, expert FFN from FP32 and, where rows arrive as BF16, BF16 rows, combine, the
  // shared expert and its sum), on this worker's own device alone (no exchange): drivers
  // build a kernel's code on its first launch, and the first batches would otherwise wait
  // for it. The kernels' work-group sizes do not depend on the batch (kernels/detail/
  // launch.h), so one run covers every batch size.
  absl::Status WarmUp();

  shmem::SymmetricHeap& heap_;
  const HeapRegions regions_;
  model::ModelConfig model_;  // of the serving weights (source changes with a swap)
  const model::MoeLayerConfig cfg_;
  const WorkerOptions options_;
  std::unique_ptr<Exchange> exchange_;
  std::unique_ptr<DeviceExchange> device_exchange_;  // null: rows through the heap
  std::string exchange_path_;
  // The serving layers' placements, and a kStage's (loader_ reads them while it runs).
  std::vector<ExpertPlacement> placements_, staged_placements_;
  // The workers of the last batch, and placements_ OnlyOn them (empty until a worker died,
  // cleared when placements_ change).
  WorkerSet live_;
  std::vector<ExpertPlacement> survivor_placements_;
  // Serve's idle check (shm heap): rank 0's process has ended (the job runs on without it
  // under mpirun --enable-recovery, so this worker leaves).
  bool FrontEndDied();
  bool front_end_lost_ = false;
  int host_threads_ = 1;
  int me_ = 0;    // worker index
  int rank_ = 0;  // heap rank, RankOfWorker(me_)
  std::unique_ptr<kernels::Runtime> rt_;
  std::unique_ptr<CudaRows> cuda_rows_;  // null: no CUDA memory reachable (cuda_rows_why_)
  std::string cuda_rows_why_;
  std::unique_ptr<HostRows> host_rows_;  // null: rank 0 copies rows in system shared memory
  // The first error reading or writing clients' memory in the running batch, returned
  // once the batch has run its exchange (RunBatch).
  absl::Status client_rows_error_;
  std::vector<Layer> layers_;
  // A weight swap's new layers: loaded by loader_ (which alone touches staged_ while it
  // runs), made serving by kSwitch.
  std::vector<Layer> staged_;
  model::ModelConfig staged_model_;
  std::thread loader_;
  std::atomic<bool> load_done_{false};
  absl::Status load_status_;  // written by loader_ before load_done_
  uint64_t stage_seq_ = 0;    // the kStage's batch seq; 0: no swap under way
  bool stage_published_ = false;

  // Device buffers, sized for the largest batch.
  absl::Duration orphan_grace_ = absl::Seconds(3);  // WorkerOptions::orphan_grace
  absl::Duration idle_poll_;                        // WorkerOptions::idle_poll, derived where 0
  kernels::Buffer x_local_, ids_, weights_, shared_h_, shared_y_;
  // The next batch's rows, uploaded ahead by the uploader thread: copy ahead_copy_ of
  // ahead_rows_ rows, being uploaded or there (ahead_state_); RowsOnDevice swaps them into
  // x_local_ when its batch reads that copy. The uploader takes a copy only while
  // last_started_copy_ (the newest copy a batch began with) is older.
  kernels::Buffer x_next_;
  bool upload_ahead_ = false;
  enum class AheadState { kIdle, kUploading, kReady };
  std::mutex ahead_mu_;
  std::condition_variable ahead_cv_;
  AheadState ahead_state_ = AheadState::kIdle;  // guarded by ahead_mu_, as the three below
  uint64_t ahead_copy_ = 0;
  int64_t ahead_rows_ = 0;
  uint64_t last_started_copy_ = 0;
  int64_t batches_uploaded_ahead_ = 0;
  int64_t batches_served_ = 0;
  kernels::Buffer x_recv_, row_index_, h_, y_;
  // Host scratch, sized for the largest batch. The routing ([rows][k] ids and weights) and the
  // local run's pairs per local expert (num_experts + 1) in pinned memory
  // (Runtime::AllocatePinnedHost), where reads queued without a wait can land.
  std::span<int32_t> ids_host_;
  std::span<float> weights_host_;
  int32_t* pair_counts_host_ = nullptr;
  std::vector<float> x_recv_host_;      // decoded rows when the payload is not plain fp32
  std::vector<float> y_host_;           // output rows when rank 0's segment is not load/store
  std::vector<int64_t> expert_tokens_;  // [E]: pairs per expert this worker computed
  // RunLocal's pair table: local expert of each global one, pairs per local expert (prefix
  // sums), each pair's row (token) and each (token, choice)'s pair.
  std::vector<int32_t> local_of_expert_;
  std::vector<int64_t> local_offsets_;
  std::vector<int32_t> local_pair_row_, local_pair_of_choice_;
  // RunLocalOnDevice's: the local expert of each global one on the device (and the host copy
  // it was uploaded from), the pairs' grouping.
  kernels::Buffer local_of_device_;
  std::vector<int32_t> local_of_uploaded_;
  kernels::PairGroups pair_groups_;
  double warmup_seconds_ = 0;
};

}  // namespace epserve::worker
