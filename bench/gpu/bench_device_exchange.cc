// The exchange alone between the GPUs of one host, device to device (worker/device_exchange.h),
// against a device-to-device copy of the same bytes in the same run. Every rank is a worker on
// its own GPU (mpirun -np W, W >= 2); a batch's tokens are spread evenly, routed uniformly at
// random over the experts (contiguous placement):
//   dispatch  Exchange::Dispatch with the DeviceExchange: the pair table into each receiver's
//             heap segment and each rank's rows into every destination's receive rows
//             (DeviceExchange::Send, one CopyRowRuns launch), all ranks at once;
//   combine   DeviceExchange::Return: each receiver's output rows into their owners' devices
//             (and, with the shared expert split, its part of every token it received);
//   copy      the baseline: each rank copies the same number of bytes it sends (returns) from
//             a buffer of its own into a peer's memory (clEnqueueCopyBuffer into the peer's
//             imported allocation), all ranks at once: what any exchange moving those bytes
//             between these GPUs at least costs.
// GB/s per direction: bytes one rank moves to (or from) other GPUs per second, the slowest
// rank's mean over back-to-back repetitions, each ended by a barrier. One JSON line per figure.
// Where the time goes, beside them: send_alone (the dispatch's row moves without the heap's
// metadata and signals), host_us (rank 0's host time per step: DeviceExchange::HostTimes),
// and `form` lines (CopyRows' forms, and a local gather then one copy, moving as many random
// rows of x into the peer's memory); --timeline adds rank 0's device commands of one pass.
//   mpirun -np 2 bench_device_exchange [--tokens=4096] [--hidden=2048] [--experts=60]
//                                      [--top-k=4] [--shared-expert=split|owner|none]
//                                      [--kind=cuda|host] [--reps=50] [--timeline]
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/flags.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "shmem/heap.h"
#include "shmem/peer_memory.h"
#include "worker/device_exchange.h"
#include "worker/exchange.h"
#include "worker/heap_regions.h"

namespace epserve {
namespace {

struct Args {
  int64_t tokens = 4096;
  int64_t hidden = 2048;
  int64_t experts = 60;
  int64_t top_k = 4;
  int64_t reps = 50;
  std::string shared_expert = "split";
  std::string kind = "cuda";
  bool timeline = false;
};

int Fail(int rank, const absl::Status& s) {
  std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  return 1;
}

// Mean seconds of `body` on the slowest rank over `reps` calls, each followed by a barrier.
template <typename Body>
double Time(int64_t reps, Body body) {
  body();  // warm-up
  MPI_Barrier(MPI_COMM_WORLD);
  const double start = MPI_Wtime();
  for (int64_t r = 0; r < reps; ++r) {
    body();
    MPI_Barrier(MPI_COMM_WORLD);
  }
  double seconds = (MPI_Wtime() - start) / static_cast<double>(reps);
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return seconds;
}

void Emit(int rank, const char* what, double bytes, double seconds, const std::string& extra) {
  double all = bytes;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  if (rank != 0) return;
  std::printf("{\"figure\":\"%s\",\"bytes_per_rank\":%.0f,\"ms\":%.4f,\"gb_per_s\":%.1f%s}\n", what,
              all, seconds * 1e3, all / seconds / 1e9, extra.c_str());
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  Args a;
  common::FlagSet fs("bench_device_exchange",
                     "The exchange alone between GPUs, device to device, against a "
                     "device-to-device copy of the same bytes (mpirun -np W, one GPU per rank)");
  fs.Add("tokens", &a.tokens, "Tokens of a batch, over all ranks");
  fs.Add("hidden", &a.hidden, "Hidden size (FP32 rows of hidden values)");
  fs.Add("experts", &a.experts, "Routed experts");
  fs.Add("top-k", &a.top_k, "Experts per token");
  fs.Add("reps", &a.reps, "Timed repetitions of each figure");
  fs.Add("shared-expert", &a.shared_expert,
         "split (every token to every worker, row parts returned back), owner or none");
  fs.Add("kind", &a.kind, "cuda (GPUs) or host (CPU devices: shared host memory)");
  fs.Add("timeline", &a.timeline,
         "Also print rank 0's commands of one dispatch and return on the device's clock "
         "(every figure then runs with command profiling on)");
  if (absl::Status s = fs.Parse(argc, argv); !s.ok()) return Fail(rank, s);
  if (fs.help_requested()) {
    if (rank == 0) std::printf("%s", fs.Usage().c_str());
    return 0;
  }
  if (ranks < 2 || a.tokens < ranks || a.reps < 1 ||
      (a.shared_expert != "split" && a.shared_expert != "owner" && a.shared_expert != "none") ||
      (a.kind != "cuda" && a.kind != "host")) {
    return Fail(rank, absl::InvalidArgumentError(
                          "need -np >= 2, --tokens >= ranks, --reps >= 1, --shared-expert "
                          "split|owner|none, --kind cuda|host"));
  }
  const bool cuda = a.kind == "cuda";

  worker::ExchangeShape shape;
  shape.num_workers = ranks;
  shape.first_rank = 0;
  shape.num_experts = static_cast<int>(a.experts);
  shape.top_k = static_cast<int>(a.top_k);
  shape.hidden = a.hidden;
  shape.max_batch_tokens = a.tokens;
  shape.has_shared_expert = a.shared_expert != "none";
  worker::ExchangeOptions options;
  options.shared_expert = a.shared_expert == "split" ? worker::SharedExpertPlacement::kSplit
                                                     : worker::SharedExpertPlacement::kOwner;
  absl::StatusOr<worker::ExchangePlan> plan = worker::ExchangePlan::Make(shape, options);
  if (!plan.ok()) return Fail(rank, plan.status());
  absl::StatusOr<std::unique_ptr<shmem::SymmetricHeap>> heap = shmem::SymmetricHeap::Create(
      MPI_COMM_WORLD, worker::HeapRegions::BytesNeeded(*plan) + (1 << 20),
      shmem::HeapBackend::kShm);
  if (!heap.ok()) return Fail(rank, heap.status());
  absl::StatusOr<worker::HeapRegions> regions = worker::HeapRegions::Allocate(**heap, *plan);
  if (!regions.ok()) return Fail(rank, regions.status());
  absl::StatusOr<size_t> copy_rendezvous = (*heap)->Allocate(64 * ranks);
  if (!copy_rendezvous.ok()) return Fail(rank, copy_rendezvous.status());

  kernels::RuntimeOptions ro;
  ro.device = cuda ? "gpu" : "cpu";
  ro.local_rank = rank;
  ro.profile_commands = a.timeline;
  absl::StatusOr<std::unique_ptr<kernels::Runtime>> rt = kernels::Runtime::Create(ro);
  if (!rt.ok()) return Fail(rank, rt.status());
  kernels::Runtime& r = **rt;

  // This rank's tokens and their routing.
  const int64_t n = a.tokens / ranks;
  const size_t row = static_cast<size_t>(a.hidden) * sizeof(float);
  std::mt19937_64 rng(1000 + static_cast<uint64_t>(rank));
  std::vector<float> x(static_cast<size_t>(n * a.hidden));
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (float& v : x) v = value(rng);
  std::vector<int32_t> ids(static_cast<size_t>(n * a.top_k));
  std::vector<float> weights(ids.size(), 1.0f / static_cast<float>(a.top_k));
  std::vector<int32_t> experts(static_cast<size_t>(a.experts));
  for (int64_t t = 0; t < n; ++t) {  // top-k distinct experts, uniformly
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    std::copy_n(experts.begin(), a.top_k, ids.begin() + t * a.top_k);
  }
  kernels::Buffer x_dev, weights_dev, recv, pairs, parts;
  absl::StatusOr<kernels::Buffer> b = r.AllocateCopy(x.data(), x.size() * sizeof(float));
  if (!b.ok()) return Fail(rank, b.status());
  x_dev = *std::move(b);
  b = r.AllocateCopy(weights.data(), weights.size() * sizeof(float));
  if (!b.ok()) return Fail(rank, b.status());
  weights_dev = *std::move(b);
  const int64_t row_parts =
      plan->shared_expert_split() ? plan->recv_capacity() : plan->max_rows_per_worker();
  absl::StatusOr<std::unique_ptr<worker::DeviceExchange>> dx = worker::DeviceExchange::Create(
      r, **heap, *regions, rank, cuda ? shmem::PeerMemoryKind::kCuda : shmem::PeerMemoryKind::kHost,
      row_parts, {&recv, &pairs, &parts}, {&x_dev, &weights_dev}, absl::Now() + absl::Seconds(60));
  if (!dx.ok()) return Fail(rank, dx.status());
  absl::StatusOr<std::unique_ptr<worker::Exchange>> ex =
      worker::Exchange::Create(**heap, *plan, regions->exchange, rank);
  if (!ex.ok()) return Fail(rank, ex.status());
  // The layout of one pass (counts shared through the heap), then its moves again and again.
  absl::StatusOr<int64_t> max_recv =
      (*ex)->CountAndNotify(n, ids.data(), absl::Now() + absl::Seconds(60));
  if (!max_recv.ok()) return Fail(rank, max_recv.status());

  absl::Status status;
  const absl::Time deadline = absl::Now() + absl::Minutes(10);
  // Where each step's host time goes (DeviceExchange::HostTimes, summed over the timed calls,
  // not the warm-up), and the dispatch's part outside the mover (the heap's metadata, signals).
  worker::DeviceExchange::HostTimes send_sum, return_sum;
  int64_t dispatch_ns = 0;
  int64_t dispatches = 0, returns = 0;
  auto add = [](worker::DeviceExchange::HostTimes& sum,
                const worker::DeviceExchange::HostTimes& t) {
    sum.build_ns += t.build_ns;
    sum.queue_ns += t.queue_ns;
    sum.wait_ns += t.wait_ns;
  };
  const double send_s = Time(a.reps, [&] {
    const absl::Time start = absl::Now();
    if (status.ok()) status = (*ex)->Dispatch(x.data(), deadline, dx->get());
    if (dispatches++ == 0) return;
    dispatch_ns += absl::ToInt64Nanoseconds(absl::Now() - start);
    add(send_sum, (*dx)->send_times());
  });
  const double sent = static_cast<double>((*dx)->bytes_sent_to_peers());
  const double return_s = Time(a.reps, [&] {
    if (status.ok()) status = (*dx)->Return(**ex);
    if (returns++ > 0) add(return_sum, (*dx)->return_times());
  });
  const size_t returned = (*dx)->bytes_returned_to_peers();
  if (!status.ok()) return Fail(rank, status);

  // The baseline: plain copies of the same bytes into a peer's memory (rank + 1), through the
  // same kind of memory, imported the same way.
  unsigned long most = std::max<size_t>(std::max(static_cast<size_t>(sent), returned), row);
  MPI_Allreduce(MPI_IN_PLACE, &most, 1, MPI_UNSIGNED_LONG, MPI_MAX, MPI_COMM_WORLD);
  const size_t copy_bytes = most;  // the same size on every rank
  shmem::PeerGroup group;
  group.heap = heap->get();
  group.first_rank = 0;
  group.size = ranks;
  group.me = rank;
  group.rendezvous = *copy_rendezvous;
  absl::StatusOr<std::unique_ptr<shmem::PeerMemory>> mem = shmem::PeerMemory::Create(
      group, cuda ? shmem::PeerMemoryKind::kCuda : shmem::PeerMemoryKind::kHost, {copy_bytes},
      r.device_info().uuid, absl::Now() + absl::Seconds(60));
  if (!mem.ok()) return Fail(rank, mem.status());
  const int peer = (rank + 1) % ranks;
  absl::StatusOr<kernels::Buffer> target =
      cuda ? r.ImportOpaqueFd((*mem)->fd(peer, 0), (*mem)->bytes(0))
           : r.WrapHostMemory((*mem)->host(peer, 0), (*mem)->bytes(0));
  if (!target.ok()) return Fail(rank, target.status());
  absl::StatusOr<kernels::Buffer> local = r.Allocate(copy_bytes);
  if (!local.ok()) return Fail(rank, local.status());
  auto copy_time = [&](size_t bytes) {
    return Time(a.reps, [&] {
      if (bytes > 0 && clEnqueueCopyBuffer(r.queue(), local->mem(), target->mem(), 0, 0, bytes, 0,
                                           nullptr, nullptr) != CL_SUCCESS) {
        status = absl::InternalError("clEnqueueCopyBuffer failed");
      }
      if (status.ok()) status = r.Finish();
    });
  };
  const double copy_sent_s = copy_time(static_cast<size_t>(sent));
  const double copy_returned_s = copy_time(returned);
  if (!status.ok()) return Fail(rank, status);

  // What the dispatch's time holds: its row moves alone (Send and Sync, no metadata or
  // signals through the heap), and the forms of the row moves into the peer's memory, rows
  // gathered from random rows of x into consecutive rows there, each timed as the copy is.
  const double send_alone_s = Time(a.reps, [&] {
    if (status.ok()) status = (*dx)->Send(**ex);
    if (status.ok()) status = (*dx)->Sync();
  });
  if (!status.ok()) return Fail(rank, status);
  struct Form {
    std::string name;
    int64_t groups;  // CopyRows' groups
    bool pack;       // gathered into `local`, then one copy into the peer's memory
  };
  const int64_t units = r.device_info().compute_units;
  std::vector<Form> forms = {
      {"per_value", -1, false}, {"grouped_default", 0, false}, {"pack_then_copy", 0, true}};
  for (int64_t per_unit : {1, 2, 4, 16}) {
    forms.push_back({absl::StrCat("grouped_", per_unit, "_per_unit"), per_unit * units, false});
  }
  std::vector<std::string> form_lines;
  for (const size_t bytes : {static_cast<size_t>(sent), returned}) {
    const int64_t rows = static_cast<int64_t>(bytes / row);
    if (rows == 0) continue;
    std::vector<int32_t> moves(static_cast<size_t>(rows) * 2);
    std::uniform_int_distribution<int32_t> source(0, static_cast<int32_t>(n - 1));
    for (int64_t i = 0; i < rows; ++i) {
      moves[2 * i] = source(rng);
      moves[2 * i + 1] = static_cast<int32_t>(i);
    }
    absl::StatusOr<kernels::Buffer> moves_dev =
        r.AllocateCopy(moves.data(), moves.size() * sizeof(int32_t));
    if (!moves_dev.ok()) return Fail(rank, moves_dev.status());
    for (const Form& f : forms) {
      const double s = Time(a.reps, [&] {
        if (status.ok()) {
          status = kernels::CopyRows(r, x_dev, *moves_dev, 0, rows, a.hidden, false,
                                     f.pack ? *local : *target, f.groups);
        }
        if (status.ok() && f.pack &&
            clEnqueueCopyBuffer(r.queue(), local->mem(), target->mem(), 0, 0,
                                static_cast<size_t>(rows) * row, 0, nullptr,
                                nullptr) != CL_SUCCESS) {
          status = absl::InternalError("clEnqueueCopyBuffer failed");
        }
        if (status.ok()) status = r.Finish();
      });
      if (!status.ok()) return Fail(rank, status);
      double bytes_moved = static_cast<double>(rows) * static_cast<double>(row);
      double slowest = s;
      MPI_Allreduce(MPI_IN_PLACE, &bytes_moved, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      form_lines.push_back(absl::StrFormat(
          "{\"figure\":\"form\",\"form\":\"%s\",\"rows\":%d,\"bytes_per_rank\":%.0f,"
          "\"ms\":%.4f,\"gb_per_s\":%.1f}",
          f.name, rows, bytes_moved, slowest * 1e3, bytes_moved / slowest / 1e9));
    }
  }

  const std::string extra =
      absl::StrCat(",\"ranks\":", ranks, ",\"tokens\":", a.tokens, ",\"hidden\":", a.hidden,
                   ",\"top_k\":", a.top_k, ",\"shared_expert\":\"", a.shared_expert,
                   "\",\"kind\":\"", a.kind, "\",\"device\":\"", r.device_info().device_name, "\"");
  Emit(rank, "dispatch", sent, send_s, extra);
  Emit(rank, "copy_of_dispatch_bytes", sent, copy_sent_s, extra);
  Emit(rank, "combine_return", static_cast<double>(returned), return_s, extra);
  Emit(rank, "copy_of_combine_bytes", static_cast<double>(returned), copy_returned_s, extra);
  Emit(rank, "send_alone", sent, send_alone_s, extra);
  if (rank == 0) {
    const double calls = static_cast<double>(a.reps) * 1e3;
    auto us = [&](int64_t ns) { return static_cast<double>(ns) / calls; };
    std::printf(
        "{\"figure\":\"host_us\",\"dispatch\":%.1f,\"send_build\":%.1f,\"send_queue\":%.1f,"
        "\"send_wait\":%.1f,\"return_build\":%.1f,\"return_queue\":%.1f,\"return_wait\":%.1f}\n",
        us(dispatch_ns), us(send_sum.build_ns), us(send_sum.queue_ns), us(send_sum.wait_ns),
        us(return_sum.build_ns), us(return_sum.queue_ns), us(return_sum.wait_ns));
  }
  if (rank == 0) {
    for (const std::string& line : form_lines) std::printf("%s\n", line.c_str());
    std::printf("{\"figure\":\"ratios\",\"dispatch_over_copy\":%.3f,\"combine_over_copy\":%.3f}\n",
                copy_sent_s / send_s, copy_returned_s / return_s);
  }
  if (a.timeline) {
    // One more pass, dispatch then return: its commands on the device, and the host's time.
    if (absl::StatusOr<std::vector<kernels::CommandTime>> old = r.TakeCommandTimes(); !old.ok()) {
      return Fail(rank, old.status());
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const absl::Time pass_start = absl::Now();
    status = (*ex)->Dispatch(x.data(), deadline, dx->get());
    const double dispatch_host_us = absl::ToDoubleMicroseconds(absl::Now() - pass_start);
    if (status.ok()) status = (*dx)->Return(**ex);
    const double pass_host_us = absl::ToDoubleMicroseconds(absl::Now() - pass_start);
    if (!status.ok()) return Fail(rank, status);
    absl::StatusOr<std::vector<kernels::CommandTime>> times = r.TakeCommandTimes();
    if (!times.ok()) return Fail(rank, times.status());
    if (rank == 0 && !times->empty()) {
      // On the device's clock from the first command's start (drivers' queueing times may be
      // on another clock).
      const uint64_t t0 = times->front().start_ns;
      for (const kernels::CommandTime& t : *times) {
        std::printf(
            "{\"figure\":\"timeline\",\"command\":\"%s\",\"forked\":%d,\"start_us\":%.1f,"
            "\"end_us\":%.1f}\n",
            t.name.c_str(), t.forked ? 1 : 0, (static_cast<double>(t.start_ns) - t0) / 1e3,
            (static_cast<double>(t.end_ns) - t0) / 1e3);
      }
      std::printf("{\"figure\":\"timeline_host\",\"dispatch_us\":%.1f,\"pass_us\":%.1f}\n",
                  dispatch_host_us, pass_host_us);
    }
    // The host's part of Send (the moves built, uploaded and queued) and of its Sync, alone.
    double send_us = 0, sync_us = 0;
    for (int i = 0; i < 10 && status.ok(); ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const absl::Time t0 = absl::Now();
      status = (*dx)->Send(**ex);
      const absl::Time t1 = absl::Now();
      if (status.ok()) status = (*dx)->Sync();
      send_us += absl::ToDoubleMicroseconds(t1 - t0) / 10;
      sync_us += absl::ToDoubleMicroseconds(absl::Now() - t1) / 10;
    }
    if (!status.ok()) return Fail(rank, status);
    if (rank == 0) {
      std::printf("{\"figure\":\"send_host\",\"send_us\":%.1f,\"sync_us\":%.1f}\n", send_us,
                  sync_us);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return 0;
}

}  // namespace
}  // namespace epserve

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const int rc = epserve::Main(argc, argv);
  MPI_Finalize();
  return rc;
}
