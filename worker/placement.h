// Which worker holds which experts, which rank is which worker, and how a batch's rows are
// split over the workers: the placement every part reads.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/share.h"

namespace epserve::worker {

// Which rank is which: in a serving job (mpirun -np 1+W) rank 0 is the front-end and worker
// w is rank kFirstWorkerRank + w. The one place that mapping is written.
inline constexpr int kFirstWorkerRank = 1;
constexpr int RankOfWorker(int worker) { return kFirstWorkerRank + worker; }
constexpr int WorkerOfRank(int rank) { return rank - kFirstWorkerRank; }
// Workers in a job of `num_ranks` ranks (the front-end is not one).
constexpr int NumWorkers(int num_ranks) { return num_ranks - kFirstWorkerRank; }
// INVALID_ARGUMENT, saying how to launch, unless 1 <= num_workers <= num_experts: a job of
// 1 + W ranks serves a model of E experts.
absl::Status CheckWorkerCount(int num_workers, int num_experts);

// The workers on one host: a worker's index among them (0 for the first), which picks its GPU
// with --device=gpu, and how many there are, who share the host's memory when a weight swap
// stages a second copy. The front-end's is {0, 1}.
struct HostWorkers {
  int index = 0;
  int count = 1;
};
// Those of rank `rank`, given the ranks on its host (shmem::RanksOnThisHost), ascending.
inline HostWorkers WorkersOnHost(std::span<const int> ranks_on_host, int rank) {
  HostWorkers out;
  if (rank < kFirstWorkerRank) return out;
  out.count = 0;
  for (int r : ranks_on_host) {
    if (r < kFirstWorkerRank) continue;
    if (r < rank) ++out.index;
    ++out.count;
  }
  return out;
}

// The most workers a job may have: the size of a WorkerSet.
inline constexpr int kMaxWorkers = 256;

// A set of workers (the live ones of a job), plain bits so that it travels in the heap.
struct WorkerSet {
  uint64_t words[kMaxWorkers / 64] = {};

  // Workers [0, num_workers).
  static WorkerSet All(int num_workers) {
    WorkerSet s;
    for (int w = 0; w < num_workers; ++w) s.Add(w);
    return s;
  }
  bool Has(int w) const { return (words[w / 64] >> (w % 64)) & 1; }
  void Add(int w) { words[w / 64] |= uint64_t{1} << (w % 64); }
  void Remove(int w) { words[w / 64] &= ~(uint64_t{1} << (w % 64)); }
  // Workers [0, num_workers) not in the set.
  WorkerSet Missing(int num_workers) const {
    WorkerSet out;
    for (int w = 0; w < num_workers; ++w) {
      if (!Has(w)) out.Add(w);
    }
    return out;
  }
  // "0, 2": the members below num_workers, for logs.
  std::string List(int num_workers) const;
  int Count() const {
    int n = 0;
    for (uint64_t x : words) n += __builtin_popcountll(x);
    return n;
  }
  bool operator==(const WorkerSet& o) const {
    for (int i = 0; i < kMaxWorkers / 64; ++i) {
      if (words[i] != o.words[i]) return false;
    }
    return true;
  }
};

// How a batch's rows are split over the workers: worker w takes rows
// [RowSplit(total, w, W), RowSplit(total, w + 1, W)), sizes differing by at most one.
constexpr int64_t RowSplit(int64_t total_rows, int worker, int num_workers) {
  return common::ShareBegin(total_rows, worker, num_workers);
}
// The same over the live workers of `live` (of num_workers): the i-th live worker takes the
// i-th of live.Count() even shares, a worker outside `live` none.
int64_t RowSplit(int64_t total_rows, int worker, int num_workers, const WorkerSet& live);

// Slots per worker when E experts and N redundant copies are spread over W workers: the
// first (E + N) % W workers hold one more than the others. Its maximum, ceil((E + N) / W), is
// the L every rank sizes the exchange's per-expert counts for (ExchangePlan).
constexpr int SlotsOfWorker(int num_experts, int redundant, int worker, int num_workers) {
  return (num_experts + redundant) / num_workers +
         (worker < (num_experts + redundant) % num_workers ? 1 : 0);
}

// The map from expert to the workers holding a copy of it, and from each worker's local
// expert index ("slot") to the expert: one per served layer. Every expert has at least one
// copy, no worker holds two copies of one expert. Which copy computes a pair is the sender's
// choice (ChooseCopies); the combine sums a token's pairs in the order of its choices
// whichever copies computed them (worker/exchange.h), so every placement of the same experts
// gives bit-identical answers. Immutable, thread-safe.
class ExpertPlacement {
 public:
  struct Copy {
    int worker;
    int local;  // index among the worker's experts
  };

  // Worker w holds experts [E*w/W, E*(w+1)/W), one copy each: counts differ by at most one.
  // 1 <= num_workers <= num_experts, else INVALID_ARGUMENT.
  static absl::StatusOr<ExpertPlacement> Contiguous(int num_experts, int num_workers);
  // `experts_of[w]`: the experts worker w holds, in its local order. INVALID_ARGUMENT naming
  // the worker and the expert where an id is outside [0, num_experts), a worker holds an
  // expert twice, or an expert has no copy; and where a worker holds no expert, unless
  // `idle_workers` (a placement over the survivors of a worker's death).
  static absl::StatusOr<ExpertPlacement> FromSlots(int num_experts,
                                                   std::vector<std::vector<int>> experts_of,
                                                   bool idle_workers = false);

  // This placement over the workers of `live` only: every other worker holds nothing, the
  // live ones keep their experts in their local order (so their weights serve as they are).
  // FAILED_PRECONDITION naming an expert with no copy on a live worker.
  absl::StatusOr<ExpertPlacement> OnlyOn(const WorkerSet& live) const;

  int num_experts() const { return static_cast<int>(copies_.size()); }
  int num_workers() const { return static_cast<int>(experts_of_.size()); }
  // Experts worker w holds, and the id of its local expert `local`.
  int count(int worker) const { return static_cast<int>(experts_of_[worker].size()); }
  int expert(int worker, int local) const { return experts_of_[worker][local]; }
  std::span<const int> experts(int worker) const { return experts_of_[worker]; }
  // Copies of expert e, by ascending worker.
  std::span<const Copy> copies(int expert) const { return copies_[expert]; }
  // Worker w's local index of expert e, or -1 where it holds none.
  int LocalIndex(int worker, int expert) const;
  // The most experts one worker holds.
  int max_local() const { return max_local_; }
  // Copies beyond one per expert.
  int redundant() const;
  // "w0: 0-14 20, w1: 15-29 20" (runs of consecutive ids), for logs and epserve-inspect.
  std::string Describe() const;

  bool operator==(const ExpertPlacement& other) const { return experts_of_ == other.experts_of_; }

 private:
  std::vector<std::vector<int>> experts_of_;
  std::vector<std::vector<Copy>> copies_;
  int max_local_ = 0;
};

// The placements of a job's served layers as int32 words, to send them to the workers
// (a rebalance): [layers, workers, then per layer and worker: its count, its experts].
// Decode checks every word: INVALID_ARGUMENT naming what is wrong.
std::vector<int32_t> EncodePlacements(std::span<const ExpertPlacement> placements);
absl::StatusOr<std::vector<ExpertPlacement>> DecodePlacements(std::span<const int32_t> words,
                                                              int num_experts, int num_workers);

// The copy of each of a sender's pairs: dest[t*k + j] = the worker that computes choice j of
// token t, copies[...] its local index there. Single-copy experts go to their one holder; a
// pair of a replicated expert goes to the copy whose worker has so far been given the fewest
// of this sender's pairs (ties: a worker the token already goes to, saving a row; then the
// lower worker after rotating by `sender`, so that senders spread their ties differently). A
// pure function of its inputs, so tests and benchmarks can follow any sender's choices.
void ChooseCopies(const ExpertPlacement& placement, const int32_t* ids, int64_t n, int k,
                  int sender, int32_t* dest, int32_t* local);

}  // namespace epserve::worker
