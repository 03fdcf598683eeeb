// Where the front-end and the workers meet in the symmetric heap: HeapRegions, the offset of
// each region in every rank's segment. Rank 0 is the front-end; worker w is rank
// RankOfWorker(w) (worker/placement.h). Every rank computes the same regions from the same
// ExchangePlan (worker/exchange_config.h), so every offset below is valid on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "shmem/heap.h"
#include "worker/device_rows.h"
#include "worker/exchange.h"
#include "worker/payload.h"

namespace epserve::worker {

// The stages a worker times for each batch, in order. kLayout, named "layout" in metrics
// (the Prometheus `stage` label, kept for dashboards and recorded series), is the counting
// step: Exchange::CountAndNotify, which counts, exchanges the count matrix and computes
// where every row lands (ExchangeStats::layout_ns).
enum WorkerStage { kRoute = 0, kLayout, kDispatch, kExpertFfn, kCombine, kNumWorkerStages };
const char* WorkerStageName(int stage);

// kRun: a batch. kStop: leave the loop. A weight swap is two-phase so that either every
// worker switches or none does: kStage checks the model a ControlMessage names and starts
// loading it beside the serving weights on a thread of the worker's own (batches go on; the
// worker reports the end of the loading through `staged`), then kSwitch makes the new
// weights the serving ones and frees the old (or kDiscard frees the new ones, when any
// worker failed).
enum class BatchOp : int32_t { kRun = 1, kStop = 2, kStage = 3, kSwitch = 4, kDiscard = 5 };

// Written by rank 0 into each worker's segment before a kStage: the model to load, as
// --model names it (a checkpoint folder or synthetic:<preset>), and its seed.
// With placement_words > 0 (a rebalance: the serving weights, placed anew) the new placements
// of the served layers, as EncodePlacements' words, are at the start of the worker's `input`
// region (free between batches; the worker reads them when it takes the kStage); the worker
// copies the experts it already holds on its device and reads only its new copies.
struct ControlMessage {
  static constexpr size_t kMaxModel = 4080;
  uint64_t seed;
  uint32_t model_bytes;
  uint32_t placement_words;
  char model[kMaxModel];
};

// Written by rank 0 into each worker's segment before it stores batch_seq.
struct BatchDescriptor {
  BatchOp op;
  int32_t layer_pos;         // index into the served layers
  int64_t row_start;         // first batch row this worker owns
  int64_t num_rows;          // rows this worker owns
  int64_t deadline_unix_us;  // every wait of this batch ends by then
  // The workers taking part: all of them, until one dies (then the survivors, each serving
  // its layers' placements OnlyOn them; Exchange::UseLiveWorkers).
  WorkerSet live;
  // Passes rank 0 ended early so far: the batch's waits end (CANCELLED) once the worker's
  // `cancel` signal exceeds it (Exchange::CancelWhen).
  uint64_t generation;
  // Which of the kSlots input, output and routing regions the batch reads and writes: rank 0
  // fills one slot with the next batch's rows while the workers compute from the other.
  int32_t slot;
  int32_t pad;
  // The copy of rows the batch reads (RowsAhead): a worker that uploaded that copy to its
  // device while the previous batch computed skips the upload; 0 matches no copy.
  uint64_t copy_id;
};

// Rows rank 0 has copied into a worker's input slot for a batch not posted yet (the workers
// compute the one before it): the worker may upload them to its device meanwhile. Rank 0
// writes record copy_id % 2 of the worker's rows_ahead after the rows, then stores copy_id into
// its rows_ahead_seq signal. A worker uploads a copy only while no batch of that copy or a
// later one has begun on it (so rank 0, which rewrites a record or a slot only once the batch
// two before has ended, cannot be writing what it reads), and uses the upload only for a batch
// whose BatchDescriptor::copy_id is the same (rank 0 numbers every copy anew: rows copied again,
// as after a worker's death, never match an older upload).
struct RowsAhead {
  uint64_t copy_id;
  int32_t slot;
  int32_t pad;
  int64_t num_rows;
};

// Written by worker w into rank 0's segment before it stores done_seq.
struct WorkerReport {
  int32_t status_code;  // absl::StatusCode
  int32_t pad;
  char message[240];
  int64_t stage_ns[kNumWorkerStages];
  int64_t rows_received;
  int64_t pairs;
  int64_t weight_bytes;  // a stage report: bytes of weights read from the source

  // What the worker wrote into `message` (not NUL-terminated when full), and with its code.
  std::string Message() const { return std::string(message, strnlen(message, sizeof(message))); }
  absl::Status ToStatus() const {
    return absl::Status(static_cast<absl::StatusCode>(status_code), Message());
  }
};

// Offsets of the regions in each rank's segment (the worker-to-worker ones in `exchange`).
struct HeapRegions {
  ExchangePlan plan;
  // rank 0 -> worker
  size_t batch_seq;   // uint64 signal
  size_t descriptor;  // BatchDescriptor
  size_t control;     // ControlMessage (kStage)
  // worker -> rank 0 (meaningful on rank 0's segment)
  // uint64[W]: worker w stored kReady once its weights are loaded, with kReadyReadsCuda set
  // where it reads and writes rows in clients' CUDA memory (worker/cuda_rows.h), and
  // kReadyReadsShm where it does so in clients' system shared memory (worker/host_rows.h)
  size_t ready;
  size_t done_seq;       // uint64[W] signals, 64 bytes apart
  size_t reports;        // WorkerReport[W]
  size_t expert_tokens;  // int64[W][E]: pairs per expert each worker computed in the last batch
  // uint64[W], 64 bytes apart: worker w's heartbeat, advanced every kHeartbeatInterval by a
  // thread of its own while it lives (backends with load/store access to rank 0's segment).
  size_t heartbeats;
  // uint64[W], 64 bytes apart: worker w's process id, stored before its `ready` (rank 0
  // watches for the process's end: a worker's death).
  size_t pids;
  // uint64 (rank 0's segment): rank 0's process id, stored before it waits for the workers
  // (a worker whose rank 0 died leaves, so that mpirun --enable-recovery ends the job).
  size_t front_end_pid;
  // uint64 signal (worker segments): rank 0 stores a generation above the running batch's
  // when a worker died under it, ending the survivors' waits for the dead one at once.
  size_t cancel;
  // uint64[W] signals and WorkerReport[W]: worker w's loading of a weight swap's new weights
  // ended (the kStage's batch seq), with its outcome.
  size_t staged;
  size_t stage_reports;
  // uint64[W] signals (worker segments): the rendezvous of the workers' device memory
  // (shmem::PeerMemory, worker/device_exchange.h), once at start.
  size_t peer_memory;
  // RowsAhead[2] and their uint64 signal (worker segments), written by rank 0.
  size_t rows_ahead;
  size_t rows_ahead_seq;
  // data, kSlots of each (Input(slot) and so on): two batches in flight, one being computed
  // while rank 0 copies the next one's rows in and the last one's output out
  size_t input;  // float[max_rows_per_worker][H] (worker segments), written by rank 0
  // DeviceRowTable (worker segments), written by rank 0 with the input slot's rows: which of
  // them come from, and go to, clients' CUDA memory (worker/device_rows.h)
  size_t device_rows;
  size_t output;        // float[max_batch_tokens][H] (rank 0's segment), written by owners
  size_t topk_ids;      // int32[max_batch_tokens][k] (rank 0's segment): the routing, by owners
  size_t topk_weights;  // float[max_batch_tokens][k] (rank 0's segment)
  // worker <-> worker
  ExchangeRegions exchange;

  static constexpr absl::Duration kHeartbeatInterval = absl::Milliseconds(200);

  // Reserves the regions in `heap`; every rank must call it with the same plan.
  static absl::StatusOr<HeapRegions> Allocate(shmem::SymmetricHeap& heap, const ExchangePlan& plan);
  // Bytes per rank the regions need, for sizing the heap.
  static size_t BytesNeeded(const ExchangePlan& plan);

  static constexpr uint64_t kReady = 1, kReadyReadsCuda = 2, kReadyReadsShm = 4;
  static constexpr int kSlots = 2;
  // Bytes of one slot of a worker's `input` region.
  size_t InputBytes() const {
    return static_cast<size_t>(plan.max_rows_per_worker() * plan.shape().hidden) * sizeof(float);
  }
  // The regions of slot `slot` (0 <= slot < kSlots).
  size_t Input(int slot) const { return input + static_cast<size_t>(slot) * InputBytes(); }
  size_t DeviceRowTables(int slot) const {
    return device_rows +
           static_cast<size_t>(slot) * DeviceRowTable::BytesFor(plan.max_rows_per_worker());
  }
  size_t Output(int slot) const {
    return output + static_cast<size_t>(slot) * BatchRows() * plan.shape().hidden * sizeof(float);
  }
  size_t TopkIds(int slot) const {
    return topk_ids +
           static_cast<size_t>(slot) * BatchRows() * plan.shape().top_k * sizeof(int32_t);
  }
  size_t TopkWeights(int slot) const {
    return topk_weights +
           static_cast<size_t>(slot) * BatchRows() * plan.shape().top_k * sizeof(float);
  }

  size_t BatchRows() const { return static_cast<size_t>(plan.shape().max_batch_tokens); }

  // Offset of signal `index` of the array at `base` (worker::SignalOffset).
  static size_t Signal(size_t base, int index) { return SignalOffset(base, index); }
};

}  // namespace epserve::worker
