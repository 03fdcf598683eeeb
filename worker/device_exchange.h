// The exchange's rows device to device (a DeviceMover, worker/exchange.h): every worker's
// receive rows, its experts' output rows and its row parts live in memory on its device that
// every worker of the host can address (shmem::PeerMemory: CUDA allocations imported into
// each worker's OpenCL context, or, on CPU devices, shared host memory used in place). A pass:
//   Send  the sender's rows, still on its device where the router read them, go into each
//         destination's receive rows (rounded to BF16 values when the dispatch dtype is BF16):
//         one launch for every destination (kernels::CopyRowRuns) before the host writes the
//         tokens and the pair table into the heap, which carries them and the signals as
//         before. A destination that gets every token (each one, with a split shared expert)
//         takes them as a block of rows; for the others the moves are built in pinned memory
//         and uploaded without a wait.
//   (expert step)  the receiver's FFN reads its receive rows in place and writes its pair rows
//         (and a split shared expert's row parts) where they are, on its device.
//   Return  the receiver writes each output row into its owner's device, at the position the
//         owner gave the pair (and a split shared expert's part of each received row at the
//         token's): writes into a peer's memory, which the links carry faster than the peer's
//         reads. On GPUs one kernel reads the receiver's pair table itself (kernels::
//         ReturnRows); on CPU devices the host builds the moves first.
//   Sum   the owner sums its tokens' returned rows on its own device (SumPairRows: the host
//         sum's bits) and reads the layer's output once.
// So a row crosses the host twice, as the protocol needs: up from rank 0's heap to the router,
// and the output down. Only with every worker of the batch live, the shm heap, FP32 or BF16
// payloads, and a batch that fits one pass; others take the heap exchange.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "shmem/heap.h"
#include "shmem/peer_memory.h"
#include "worker/exchange.h"
#include "worker/heap_regions.h"
#include "worker/worker_options.h"

namespace epserve::worker {

// The largest piece NVIDIA's OpenCL driver imports (BENCHMARKS.md, the device-heap probe: one
// allocation of 512 MiB or more crashed the import, 384 MiB worked).
inline constexpr size_t kMaxImportBytes = size_t{384} << 20;

class DeviceExchange final : public DeviceMover {
 public:
  // This worker's own device buffers, which it computes into and peers address; Create makes
  // them (replacing what they held).
  struct Own {
    kernels::Buffer* recv_rows;  // [recv capacity][H] FP32: the FFN's input rows
    kernels::Buffer* pair_rows;  // [recv capacity x k][H] FP32: the FFN's output rows
    kernels::Buffer* row_parts;  // [recv capacity or rows per worker][H] FP32: the shared expert's
  };
  // What the pass's sender and owner read on this worker's device: its rows (the router's
  // input) and their routing weights [n][k]. With the shared expert on the owner, its output is
  // in Own::row_parts, and the owner's sum adds onto it there.
  struct Inputs {
    const kernels::Buffer* x = nullptr;
    const kernels::Buffer* weights = nullptr;
  };

  // Collective over the workers of `regions` (each calls it once, at start, with the same
  // kind): makes this worker's memory, imports every peer's. FAILED_PRECONDITION (every worker
  // alike) where a worker cannot; kind kHost needs a CPU device, kCuda a device that imports
  // CUDA memory; both the shm heap.
  static absl::StatusOr<std::unique_ptr<DeviceExchange>> Create(
      kernels::Runtime& rt, shmem::SymmetricHeap& heap, const HeapRegions& regions, int me,
      shmem::PeerMemoryKind kind, int64_t row_parts_rows, const Own& own, const Inputs& inputs,
      absl::Time deadline);

  shmem::PeerMemoryKind kind() const { return memory_->kind(); }
  // Whether batch `desc` moves device to device: every worker live, payload dtypes the devices
  // reproduce (FP32, BF16). The same answer on every worker.
  bool Serves(const BatchDescriptor& desc) const;

  absl::Status Send(const Exchange& ex) override;
  absl::Status Sync() override;
  absl::Status Return(const Exchange& ex) override;
  absl::Status Sum(const Exchange& ex, float* y, bool accumulate) override;
  // The bytes the last Send wrote into other workers' devices, and the last Return.
  size_t bytes_sent_to_peers() const { return bytes_sent_to_peers_; }
  size_t bytes_returned_to_peers() const { return bytes_returned_to_peers_; }

  // Where the host's time of the last Send and its Sync, and of the last Return, went: the
  // moves built before the device had any to run, the rest built and queued (Return's later
  // launches; Send's one), the wait for the device.
  struct HostTimes {
    int64_t build_ns = 0;
    int64_t queue_ns = 0;
    int64_t wait_ns = 0;
  };
  const HostTimes& send_times() const { return send_times_; }
  const HostTimes& return_times() const { return return_times_; }

  // How Sum hands over the owner's output rows (the device buffer, [n][H] FP32, and y): the
  // worker's own delivery (some rows may go to clients' CUDA memory); unset: all into y.
  void set_deliver(std::function<absl::Status(const kernels::Buffer&, float*)> deliver) {
    deliver_ = std::move(deliver);
  }

  // Runs CopyRows once (one row into this worker's own receive rows), so that its build is
  // not paid by the first batch.
  absl::Status WarmUp();

 private:
  DeviceExchange(kernels::Runtime& rt, const HeapRegions& regions, int me, const Own& own,
                 const Inputs& inputs)
      : rt_(rt), regions_(regions), me_(me), own_(own), inputs_(inputs) {}
  // Worker d's piece: its own buffer for this worker, the imported one for a peer.
  const kernels::Buffer& RecvRows(int d) const { return d == me_ ? *own_.recv_rows : recv_[d]; }
  // One kernels::Buffer over member d's piece p of memory_.
  absl::StatusOr<kernels::Buffer> Import(int d, int p);
  // A pass's row moves: (source row, destination row) pairs in runs, each run from one buffer
  // into one buffer. StartRuns clears them (for up to `most_moves` pairs); AddMove adds a
  // pair; CloseRun ends the run of the pairs added since the last one (none: no run), from
  // `from` into worker `to_worker`'s `to`, counting its rows in *rows_to_peers when that worker
  // is another; RunMoves uploads the pairs (if any) and queues every run (kernels::
  // CopyRowRuns: those into peers' memory beside this worker's own) without waiting for them
  // (Sync waits).
  absl::Status StartRuns(int64_t most_moves);
  void AddMove(int32_t from_row, int32_t to_row) {
    moves_host_[2 * moves_count_] = from_row;
    moves_host_[2 * moves_count_ + 1] = to_row;
    ++moves_count_;
  }
  void CloseRun(int to_worker, const kernels::Buffer* from, const kernels::Buffer* to,
                size_t* rows_to_peers);
  // Adds `run` (a block, or pairs the caller wrote into moves_host_ itself) into worker
  // `to_worker`'s memory.
  void AddRun(int to_worker, const kernels::RowRun& run, size_t* rows_to_peers);
  absl::Status RunMoves(bool round_bf16);
  // Return's two ways, each counting the rows it sends to peers and saying when the device
  // was given the work. On GPUs the receiver's pair table itself goes up and one kernel reads
  // it (kernels::ReturnRows) while the host checks it: the device starts at once. On CPU
  // devices the host builds the moves in runs first (RunMoves), which PoCL copies faster
  // than it runs ReturnRows' per-row lookups.
  absl::Status ReturnByTable(const Exchange& ex, size_t* rows_to_peers, absl::Time* first_launch);
  absl::Status ReturnByMoves(const Exchange& ex, size_t* rows_to_peers, absl::Time* first_launch);

  kernels::Runtime& rt_;
  std::function<absl::Status(const kernels::Buffer&, float*)> deliver_;
  const HeapRegions& regions_;
  const int me_;
  const Own own_;
  const Inputs inputs_;
  std::unique_ptr<shmem::PeerMemory> memory_;
  std::vector<kernels::Buffer> recv_;  // peers' receive rows ([me_] empty: own_.recv_rows)
  // Every worker's (this one's included) pair rows [rows per worker x k][H] and row parts
  // [W][rows per worker][H] as returned to it: where Return writes and Sum reads.
  std::vector<kernels::Buffer> returned_pairs_, returned_parts_;
  kernels::Buffer identity_;  // int32 [rows per worker x k]: 0, 1, 2, ...
  kernels::Buffer moves_;     // int32 pairs, a pass's moves
  // The pass's (source, destination) pairs (Return: its pair table), built in pinned memory:
  // moves_count_ of at most moves_capacity_.
  int32_t* moves_host_ = nullptr;
  int64_t moves_capacity_ = 0;
  int64_t moves_count_ = 0;
  bool queued_ = false;                   // uploads of the table queued since the last Finish
  int64_t run_start_ = 0;                 // where the open run's pairs start
  std::vector<kernels::RowRun> pending_;  // the pass's runs, in the order added
  std::vector<bool> run_to_peer_;         // [runs]: into another worker's memory
  std::vector<kernels::RowRun> runs_;     // RunMoves' launch order
  std::vector<int64_t> table_at_;         // Send's: where each destination's pairs start
  std::vector<const kernels::Buffer*> table_pairs_to_, table_parts_to_;  // ReturnByTable's
  std::vector<int64_t> table_tokens_;
  HostTimes send_times_, return_times_;
  size_t bytes_sent_to_peers_ = 0;
  size_t bytes_returned_to_peers_ = 0;
};

}  // namespace epserve::worker
