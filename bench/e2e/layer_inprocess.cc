// One MoE layer computed in-process by epserve's OpenCL kernels alone: no gRPC, no MPI, no
// symmetric heap. One Runtime (its device queue, and on GPUs a second one for the shared
// expert) runs route, the grouped expert FFN over every expert, the combine and the shared
// expert for a batch of T tokens; the host does
// what the workers' exchange does between them (grouping the (token, expert) pairs) and
// adds the shared expert's rows, as the owner rank does. This bounds what the service can
// reach on the same machine: the service runs the same kernels plus everything else.
//
//   bench_e2e_inprocess --model=synthetic:qwen1.5-moe-a2.7b --tokens=1,32,256 [--seed=0]
//                       [--weight-dtype=fp32|bf16] [--min-seconds=2] [--check-tokens=2]
//                       [--device=cpu|gpu|<platform>:<device>] [--no-tensor-cores] [--no-bf16-dot]
//
// Prints one JSON object per token count on stdout:
//   {"tokens":T,"median_ms":X,"tokens_per_s":X,"reps":N,"weight_dtype":"fp32",
//    "resident_median_ms":X,"experts_touched":E}
// (resident: x already on the device and the output left there, as for a caller on the
// same device; median_ms includes copying x in and the output out)
// and first {"device":"...","tensor_cores":b,"ffn_kernels":"...","check_tokens":n,
// "max_rel_error":X} against model::ReferenceForward. With --read-bandwidth, also first
//   {"read_gb_per_s":X,"threads":N,"one_token_weight_bytes":B,"one_token_floor_ms":X}
// the host's memory read bandwidth (N threads summing disjoint parts of a 512 MiB buffer,
// best of 5), the weights one token reads (the router, its top-k routed experts and the
// shared expert) and how long reading them once takes at that bandwidth. The bandwidth of
// a shared host drifts, so this holds for the moment it was measured.
// With --kernel-profile=N, instead of the timings, one line per batch size of the device's
// timeline over N resident forwards (Runtime::TakeCommandTimes):
//   {"kernel_profile":{"tokens":T,"experts_touched":E,"back_to_back_ms":X,"wall_ms":X,
//    "span_ms":X,"busy_ms":X,"idle_ms":X,"overlap_ms":X,"kernels":[{"name":..,"ms":X},..]}}
// (profiling slows each launch: for the shares, not the layer's time). --concurrent-queues=false
// runs the shared expert in order on the one queue instead of beside the routing. Where the
// device groups the pairs, the shared expert is forked after the grouping (beside the routed
// experts only, as a worker's local run does); --no-shared-after-grouping forks it before the
// router instead.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_support.h"
#include "common/element_type.h"
#include "common/flags.h"
#include "common/status.h"
#include "kernels/dtype.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"
#include "model/reference.h"
#include "model/synthetic.h"

namespace epserve::bench {
namespace {

using kernels::Buffer;

// Device buffers and host scratch for batches of up to max_tokens tokens.
class InProcessLayer {
 public:
  static absl::StatusOr<std::unique_ptr<InProcessLayer>> Create(
      const model::WeightSource& source, int layer, int64_t max_tokens, common::ElementType dtype,
      const kernels::RuntimeOptions& rto) {
    auto l = std::unique_ptr<InProcessLayer>(new InProcessLayer());
    l->cfg_ = source.config().layer;
    EPSERVE_ASSIGN_OR_RETURN(l->rt_, kernels::Runtime::Create(rto));
    kernels::Runtime& rt = *l->rt_;
    EPSERVE_ASSIGN_OR_RETURN(l->router_, kernels::UploadRouter(rt, source, layer));
    EPSERVE_ASSIGN_OR_RETURN(
        l->experts_, kernels::UploadExperts(rt, source, layer, 0, l->cfg_.num_experts, dtype));
    if (l->cfg_.shared_ffn_size > 0) {
      EPSERVE_ASSIGN_OR_RETURN(l->shared_, kernels::UploadSharedExpert(rt, source, layer, dtype));
    }
    const int64_t h = l->cfg_.hidden_size, k = l->cfg_.top_k, n = max_tokens;
    const size_t f = sizeof(float);
    EPSERVE_ASSIGN_OR_RETURN(l->x_, rt.Allocate(n * h * f));
    EPSERVE_ASSIGN_OR_RETURN(l->ids_, rt.Allocate(n * k * sizeof(int32_t)));
    EPSERVE_ASSIGN_OR_RETURN(l->weights_, rt.Allocate(n * k * f));
    EPSERVE_ASSIGN_OR_RETURN(l->row_index_, rt.Allocate(n * k * sizeof(int32_t)));
    EPSERVE_ASSIGN_OR_RETURN(l->pair_index_, rt.Allocate(n * k * sizeof(int32_t)));
    const int64_t scratch = n * std::max(k * l->cfg_.expert_ffn_size, l->cfg_.shared_ffn_size);
    EPSERVE_ASSIGN_OR_RETURN(l->h_, rt.Allocate(scratch * f));
    EPSERVE_ASSIGN_OR_RETURN(l->y_, rt.Allocate(n * k * h * f));
    EPSERVE_ASSIGN_OR_RETURN(l->out_, rt.Allocate(n * h * f));
    if (l->cfg_.shared_ffn_size > 0) {
      EPSERVE_ASSIGN_OR_RETURN(l->shared_y_, rt.Allocate(n * h * f));
      EPSERVE_ASSIGN_OR_RETURN(l->shared_h_, rt.Allocate(n * l->cfg_.shared_ffn_size * f));
    }
    l->ids_host_.resize(n * k);
    l->row_index_host_.resize(n * k);
    l->pair_index_host_.resize(n * k);
    std::vector<int32_t> identity(l->cfg_.num_experts);
    std::iota(identity.begin(), identity.end(), 0);
    EPSERVE_ASSIGN_OR_RETURN(l->local_of_,
                             rt.AllocateCopy(identity.data(), identity.size() * sizeof(int32_t)));
    EPSERVE_ASSIGN_OR_RETURN(l->groups_, kernels::AllocatePairGroups(rt, l->experts_, n * k));
    return l;
  }

  // y [n, H] = the layer on x [n, H], n <= max_tokens.
  kernels::Runtime& runtime() { return *rt_; }
  // How many experts the last Forward's batch routed a token to.
  absl::StatusOr<int> ExpertsTouched(bool device_grouping) {
    std::vector<int64_t> counts;
    if (device_grouping) {
      EPSERVE_ASSIGN_OR_RETURN(counts, kernels::ReadPairCounts(*rt_, groups_));
    } else {
      for (size_t e = 0; e + 1 < offsets_.size(); ++e)
        counts.push_back(offsets_[e + 1] - offsets_[e]);
    }
    return static_cast<int>(
        std::count_if(counts.begin(), counts.end(), [](int64_t c) { return c > 0; }));
  }
  bool tensor_cores() const { return experts_.tensor_cores; }
  const char* ffn_kernels() const { return kernels::FfnKernelsName(*rt_, experts_); }

  // y [n, H] = the layer on x [n, H]. With resident, x is already on the device (an earlier
  // call uploaded it) and the output stays there (y is not written): the layer as a caller
  // whose activations live on the same device sees it. With device_grouping (and at most
  // kernels::kDeviceGroupingMaxPairs pairs) the pairs are grouped by expert on the device
  // (kernels::GroupPairs) and nothing waits for the device until the output is read; else the
  // router's ids come to the host, which groups them. With
  // stages, each stage ends with a wait for the device and its seconds are added there.
  void set_shared_after_grouping(bool on) { shared_after_grouping_ = on; }
  enum Stage { kWrite, kRoute, kGroup, kShared, kExperts, kCombine, kRead, kNumStages };
  static constexpr const char* kStageNames[kNumStages] = {"write",   "route",   "group", "shared",
                                                          "experts", "combine", "read"};
  absl::Status Forward(const float* x, int64_t n, float* y, bool resident, bool device_grouping,
                       double* stages = nullptr) {
    const int64_t h = cfg_.hidden_size;
    const int k = cfg_.top_k;
    kernels::Runtime& rt = *rt_;
    double t0 = NowSeconds();
    auto stage = [&](Stage s) -> absl::Status {
      if (stages == nullptr) return absl::OkStatus();
      EPSERVE_RETURN_IF_ERROR(rt.Finish());
      const double t1 = NowSeconds();
      stages[s] += t1 - t0;
      t0 = t1;
      return absl::OkStatus();
    };
    // Batches of more pairs than the device groups quickly take the host's grouping.
    device_grouping = device_grouping && n * k <= kernels::kDeviceGroupingMaxPairs;
    if (!resident) EPSERVE_RETURN_IF_ERROR(rt.Write(x_, 0, x, n * h * sizeof(float)));
    EPSERVE_RETURN_IF_ERROR(stage(kWrite));
    // The shared expert needs nothing of the routing: beside the router, the grouping and the
    // routed experts (Runtime::ForkQueue) where the stages are not timed one by one; with
    // shared_after_grouping and the pairs grouped on the device, beside the routed experts
    // only (the router and group_pairs then have the device to themselves).
    const bool shared = cfg_.shared_ffn_size > 0;
    auto fork_shared = [&] {
      return rt.Forked(
          [&] { return kernels::SharedExpertFfn(rt, shared_, x_, n, shared_h_, shared_y_); });
    };
    const bool fork_late = shared_after_grouping_ && device_grouping;
    if (shared && stages == nullptr && !fork_late) EPSERVE_RETURN_IF_ERROR(fork_shared());
    EPSERVE_RETURN_IF_ERROR(kernels::Route(rt, router_, x_, n, ids_, weights_));
    EPSERVE_RETURN_IF_ERROR(stage(kRoute));
    if (device_grouping) {
      EPSERVE_RETURN_IF_ERROR(
          kernels::GroupPairs(rt, experts_, ids_, n, k, local_of_, cfg_.num_experts, groups_));
    } else {
      EPSERVE_RETURN_IF_ERROR(GroupOnHost(n));
    }
    EPSERVE_RETURN_IF_ERROR(stage(kGroup));
    if (shared && stages == nullptr && fork_late) EPSERVE_RETURN_IF_ERROR(fork_shared());
    if (shared && stages != nullptr) {
      EPSERVE_RETURN_IF_ERROR(kernels::SharedExpertFfn(rt, shared_, x_, n, shared_h_, shared_y_));
    }
    EPSERVE_RETURN_IF_ERROR(stage(kShared));
    if (device_grouping) {
      EPSERVE_RETURN_IF_ERROR(kernels::ExpertFfnGrouped(rt, experts_, x_, groups_, h_, y_));
    } else {
      EPSERVE_RETURN_IF_ERROR(kernels::ExpertFfn(rt, experts_, x_, row_index_, offsets_, h_, y_));
    }
    EPSERVE_RETURN_IF_ERROR(stage(kExperts));
    const Buffer& pair_index = device_grouping ? groups_.pair_of_choice : pair_index_;
    EPSERVE_RETURN_IF_ERROR(kernels::WeightedCombine(rt, y_, pair_index, weights_, n, k, h, out_));
    if (shared) {
      EPSERVE_RETURN_IF_ERROR(rt.JoinFork());
      EPSERVE_RETURN_IF_ERROR(kernels::AddInto(rt, shared_y_, n * h, out_));
    }
    EPSERVE_RETURN_IF_ERROR(stage(kCombine));
    if (resident) {
      EPSERVE_RETURN_IF_ERROR(rt.Finish());
    } else {
      EPSERVE_RETURN_IF_ERROR(rt.Read(out_, 0, y, n * h * sizeof(float)));
    }
    return stage(kRead);
  }

 private:
  // The router's ids to the host, grouped there expert-major as the exchange's layout does
  // (the combine weighs pair (t, j) by the router's weights_[t * k + j] where they are), and
  // the layout back to the device.
  absl::Status GroupOnHost(int64_t n) {
    const int k = cfg_.top_k;
    kernels::Runtime& rt = *rt_;
    EPSERVE_RETURN_IF_ERROR(rt.Read(ids_, 0, ids_host_.data(), n * k * sizeof(int32_t)));
    offsets_.assign(cfg_.num_experts + 1, 0);
    for (int64_t i = 0; i < n * k; ++i) ++offsets_[ids_host_[i] + 1];
    std::partial_sum(offsets_.begin(), offsets_.end(), offsets_.begin());
    cursor_.assign(offsets_.begin(), offsets_.end() - 1);
    for (int64_t t = 0; t < n; ++t) {
      for (int j = 0; j < k; ++j) {
        const int64_t p = cursor_[ids_host_[t * k + j]]++;
        row_index_host_[p] = static_cast<int32_t>(t);
        pair_index_host_[t * k + j] = static_cast<int32_t>(p);
      }
    }
    EPSERVE_RETURN_IF_ERROR(
        rt.Write(row_index_, 0, row_index_host_.data(), n * k * sizeof(int32_t)));
    return rt.Write(pair_index_, 0, pair_index_host_.data(), n * k * sizeof(int32_t));
  }

  InProcessLayer() = default;
  model::MoeLayerConfig cfg_;
  bool shared_after_grouping_ = true;
  std::unique_ptr<kernels::Runtime> rt_;
  kernels::RouterWeights router_;
  kernels::ExpertWeights experts_, shared_;
  Buffer x_, ids_, weights_, row_index_, pair_index_, h_, y_, out_, shared_h_, shared_y_;
  Buffer local_of_;             // int32 [E]: every expert is local (0, 1, 2, ...)
  kernels::PairGroups groups_;  // the device's grouping
  std::vector<int32_t> ids_host_, row_index_host_, pair_index_host_;
  std::vector<int64_t> offsets_, cursor_;
};

// The device's timeline of `reps` resident forwards of n tokens (Runtime::TakeCommandTimes),
// as one JSON line: how many experts the batch routes to, the host's time per forward of
// `reps` forwards back to back (as the timed runs) and of each alone (wall), from the first
// command's queueing to the last one's (enqueue) and to the first one's start (first_wait; both -1
// where the driver's queueing times are not on the device's clock), the span from the first
// command's start to the last one's end, the time some command ran (busy; the rest of the span the
// device sat idle, waiting for the host), the time two queues' commands ran at once, and each
// kernel's mean time.
absl::Status PrintKernelProfile(InProcessLayer& l, kernels::Runtime& rt, const float* x, int64_t n,
                                bool device_grouping, int reps, float* y) {
  // x up to the device (the resident forwards below read it there).
  EPSERVE_RETURN_IF_ERROR(l.Forward(x, n, y, false, device_grouping));
  EPSERVE_ASSIGN_OR_RETURN(const int touched, l.ExpertsTouched(device_grouping));
  // The same forwards back to back, timed as a whole (the timed runs' way), then one at a time.
  double t0 = NowSeconds();
  for (int r = 0; r < reps; ++r) EPSERVE_RETURN_IF_ERROR(l.Forward(x, n, y, true, device_grouping));
  const double back_to_back = (NowSeconds() - t0) / reps * 1e3;
  EPSERVE_RETURN_IF_ERROR(rt.TakeCommandTimes().status());  // the warm-up's and those
  double span = 0, busy = 0, overlap = 0, wall = 0, queueing = 0, first_wait = 0;
  bool queued_known = true;
  std::vector<std::pair<std::string, double>> kernels;  // first-seen order
  for (int r = 0; r < reps; ++r) {
    t0 = NowSeconds();
    EPSERVE_RETURN_IF_ERROR(l.Forward(x, n, y, true, device_grouping));
    wall += (NowSeconds() - t0) * 1e9;
    EPSERVE_ASSIGN_OR_RETURN(std::vector<kernels::CommandTime> times, rt.TakeCommandTimes());
    if (times.empty()) continue;
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    double total = 0;
    for (const kernels::CommandTime& t : times) {
      spans.emplace_back(t.start_ns, t.end_ns);
      total += static_cast<double>(t.end_ns - t.start_ns);
      auto it = std::find_if(kernels.begin(), kernels.end(),
                             [&](const auto& k) { return k.first == t.name; });
      if (it == kernels.end()) it = kernels.insert(kernels.end(), {t.name, 0.0});
      it->second += static_cast<double>(t.end_ns - t.start_ns);
    }
    std::sort(spans.begin(), spans.end());
    uint64_t covered = 0, from = spans[0].first, to = spans[0].first, last = 0;
    for (const auto& [a, b] : spans) {
      if (a > to) {
        covered += to - from;
        from = a;
      }
      to = std::max(to, b);
      last = std::max(last, b);
    }
    covered += to - from;
    span += static_cast<double>(last - spans[0].first);
    // From the first command's queueing to the last one's: the host's enqueueing; and from the
    // first one's queueing to its start.
    // (Drivers whose queueing times are not on the device's clock, PoCL's: left out.)
    const kernels::CommandTime &first = times.front(), &end = times.back();
    if (first.queued_ns == 0 || first.queued_ns > first.start_ns ||
        end.queued_ns < first.queued_ns) {
      queued_known = false;
    }
    queueing += static_cast<double>(end.queued_ns - first.queued_ns);
    first_wait += static_cast<double>(first.start_ns - first.queued_ns);
    busy += static_cast<double>(covered);
    overlap += total - static_cast<double>(covered);
  }
  std::string list;
  for (const auto& [name, ns] : kernels) {
    absl::StrAppendFormat(&list, "%s{\"name\":\"%s\",\"ms\":%.4f}", list.empty() ? "" : ",", name,
                          ns / reps / 1e6);
  }
  std::printf(
      "{\"kernel_profile\":{\"tokens\":%lld,\"grouping\":\"%s\",\"reps\":%d,"
      "\"concurrent_queues\":%s,\"experts_touched\":%d,\"back_to_back_ms\":%.4f,\"wall_ms\":%.4f,"
      "\"enqueue_ms\":%.4f,\"first_wait_ms\":%.4f,"
      "\"span_ms\":%.4f,\"busy_ms\":%.4f,\"idle_ms\":%.4f,\"overlap_ms\":%.4f,"
      "\"kernels\":[%s]}}\n",
      static_cast<long long>(n), device_grouping ? "device" : "host", reps,
      rt.concurrent_queues() ? "true" : "false", touched, back_to_back, wall / reps / 1e6,
      queued_known ? queueing / reps / 1e6 : -1.0, queued_known ? first_wait / reps / 1e6 : -1.0,
      span / reps / 1e6, busy / reps / 1e6, (span - busy) / reps / 1e6, overlap / reps / 1e6,
      list.c_str());
  std::fflush(stdout);
  return absl::OkStatus();
}

// Where ReadGbPerSecond's sums go, so that the reads behind them are not optimized away.
volatile float g_read_sink = 0;

// Best read bandwidth of `threads` threads, each summing its part of a 512 MiB buffer.
double ReadGbPerSecond(int threads) {
  const size_t n = (size_t{512} << 20) / sizeof(float);
  std::vector<float> buffer(n, 1.0f);
  std::vector<float> sums(threads);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = NowSeconds();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const float* p = buffer.data() + n * t / threads;
        const size_t count = n * (t + 1) / threads - n * t / threads;
        float acc[16] = {};  // independent sums the compiler keeps in vector registers
        for (size_t i = 0; i + 16 <= count; i += 16) {
          for (int j = 0; j < 16; ++j) acc[j] += p[i + j];
        }
        sums[t] = std::accumulate(acc, acc + 16, 0.0f);
      });
    }
    for (std::thread& th : pool) th.join();
    best = std::max(best, static_cast<double>(n * sizeof(float)) / (NowSeconds() - t0) / 1e9);
  }
  g_read_sink = std::accumulate(sums.begin(), sums.end(), 0.0f);
  return best;
}

int Run(int argc, char** argv) {
  std::string model_spec = "synthetic:qwen1.5-moe-a2.7b";
  std::vector<int64_t> token_counts = {1, 32, 256};
  std::string weight_dtype = "fp32";
  int64_t seed = 0;
  double min_seconds = 2.0;
  int64_t check_tokens = 2;
  bool read_bandwidth = false;
  std::string grouping = "auto";
  bool stages = false;
  kernels::RuntimeOptions rto;
  common::FlagSet fs("bench_e2e_inprocess",
                     "One MoE layer through epserve's kernels in one process (no gRPC, no MPI).");
  fs.Add("model", &model_spec, "synthetic:<preset>");
  fs.Add("seed", &seed, "Seed of the synthetic weights");
  fs.Add("tokens", &token_counts, "Comma list of batch sizes (tokens) to time");
  fs.Add("weight-dtype", &weight_dtype, "fp32 or bf16 expert weights");
  fs.Add("min-seconds", &min_seconds, "Time each batch size at least this long (>= 5 reps)");
  fs.Add("check-tokens", &check_tokens, "Tokens compared with the reference forward pass");
  fs.Add("device", &rto.device, "OpenCL device: cpu, gpu or <platform>:<device>");
  fs.Add("tensor-cores", &rto.tensor_cores, "Tensor-core FFN for bf16 weights where available");
  fs.Add("bf16-dot", &rto.bf16_dot, "AVX512-BF16 dot-product FFN for bf16 weights where available");
  bool pinned_transfers = true;
  fs.Add("pinned-transfers", &pinned_transfers,
         "Large host<->device copies through pinned staging (devices with their own memory)");
  fs.Add("transfer-threads", &rto.transfer_threads,
         "Host threads of the staged copies; 0: a quarter of the hardware threads, 1 to 8");
  fs.Add("grouping", &grouping,
         "Where the pairs are grouped by expert: auto (the device where the tensor-core FFN "
         "runs, else the host), host, device, or a comma list of them, each timed");
  fs.Add("stages", &stages,
         "Also time each stage alone (each ended by a wait for the device), resident");
  int kernel_profile = 0;
  fs.Add("kernel-profile", &kernel_profile,
         "Instead of timing, print the device's timeline of this many resident forwards per "
         "batch size (each kernel's time, the device's idle time between them)");
  bool concurrent_queues = true;
  fs.Add("concurrent-queues", &concurrent_queues,
         "The shared expert on a second queue beside the routed experts (devices other than CPUs)");
  bool shared_after_grouping = true;
  fs.Add("shared-after-grouping", &shared_after_grouping,
         "Where pairs are grouped on the device, fork the shared expert after the grouping "
         "(beside the routed experts only), as the workers do; off: before the router");
  fs.Add("read-bandwidth", &read_bandwidth,
         "Also measure the host's memory read bandwidth and the one-token floor it sets");
  const int code = ParseFlags(
      fs, argc, argv, [&] { return AllPositive(token_counts); },
      "every --tokens entry must be >= 1");
  if (code >= 0) return code;
  if (!pinned_transfers) rto.staging = kernels::RuntimeOptions::Staging::kOff;
  if (!concurrent_queues) rto.concurrent_queues = kernels::RuntimeOptions::ConcurrentQueues::kOff;
  rto.profile_commands = kernel_profile > 0;
  absl::StatusOr<common::ElementType> dtype =
      common::ParseFlagName(weight_dtype, "--weight-dtype", kernels::kKernelTypes);
  auto source = model::OpenModel(model_spec, static_cast<uint64_t>(seed));
  if (!dtype.ok() || !source.ok()) {
    std::fprintf(stderr, "%s\n",
                 std::string((!dtype.ok() ? dtype.status() : source.status()).message()).c_str());
    return 1;
  }
  const model::ModelConfig& config = (*source)->config();
  const int layer = config.moe_layers.front();
  const int64_t h = config.layer.hidden_size;
  const int64_t max_tokens =
      std::max(check_tokens, *std::max_element(token_counts.begin(), token_counts.end()));
  auto l = InProcessLayer::Create(**source, layer, max_tokens, *dtype, rto);
  if (!l.ok()) {
    std::fprintf(stderr, "%s\n", std::string(l.status().message()).c_str());
    return 1;
  }
  (*l)->set_shared_after_grouping(shared_after_grouping);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x(max_tokens * h), y(max_tokens * h);
  for (float& v : x) v = uniform(rng);

  // Which groupings run: the device's where the tensor-core FFN runs (GPUs), else the host's.
  std::vector<bool> device_groupings;
  const std::vector<std::string> grouping_names = absl::StrSplit(grouping, ',');
  for (const std::string& g : grouping_names) {
    if (g == "auto") {
      device_groupings.push_back((*l)->tensor_cores());
    } else if (g == "device" || g == "host") {
      device_groupings.push_back(g == "device");
    } else {
      std::fprintf(stderr, "--grouping: auto, host or device (comma list), got '%s'\n", g.c_str());
      return 1;
    }
  }
  auto grouping_name = [](bool device) { return device ? "device" : "host"; };

  for (const bool device_grouping : device_groupings) {
    if (check_tokens <= 0) break;
    auto weights = model::LoadLayer(**source, layer);
    if (!weights.ok() ||
        !(*l)->Forward(x.data(), check_tokens, y.data(), false, device_grouping).ok()) {
      std::fprintf(stderr, "check failed to run\n");
      return 1;
    }
    std::vector<float> want(check_tokens * h);
    model::Routing routing;
    model::ReferenceForward(config.layer, *weights, x.data(), check_tokens, want.data(), &routing);
    double scale = 0, diff = 0;
    for (int64_t i = 0; i < check_tokens * h; ++i) {
      scale = std::max(scale, std::fabs(double{want[i]}));
      diff = std::max(diff, std::fabs(double{y[i]} - double{want[i]}));
    }
    std::printf(
        "{\"device\":\"%s\",\"tensor_cores\":%s,\"ffn_kernels\":\"%s\",\"check_tokens\":%lld,"
        "\"grouping\":\"%s\",\"max_rel_error\":%.3g}\n",
        (*l)->runtime().device_info().device_name.c_str(), (*l)->tensor_cores() ? "true" : "false",
        (*l)->ffn_kernels(), static_cast<long long>(check_tokens), grouping_name(device_grouping),
        diff / scale);
    std::fflush(stdout);
  }

  if (read_bandwidth) {
    const model::MoeLayerConfig& c = config.layer;
    const int64_t elem = common::ElementBytes(*dtype);
    const int64_t bytes = c.num_experts * h * 4 + c.top_k * 3 * h * c.expert_ffn_size * elem +
                          3 * h * c.shared_ffn_size * elem;
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const double gbps = ReadGbPerSecond(threads);
    std::printf(
        "{\"read_gb_per_s\":%.2f,\"threads\":%d,\"one_token_weight_bytes\":%lld,"
        "\"one_token_floor_ms\":%.3f}\n",
        gbps, threads, static_cast<long long>(bytes), static_cast<double>(bytes) / gbps / 1e6);
    std::fflush(stdout);
  }

  for (int64_t n : token_counts) {
    for (const bool dg : device_groupings) {
      if (kernel_profile > 0) {
        if (absl::Status s =
                PrintKernelProfile(**l, (*l)->runtime(), x.data(), n, dg, kernel_profile, y.data());
            !s.ok()) {
          std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
          return 1;
        }
        continue;
      }
      for (int i = 0; i < 2; ++i) {
        if (absl::Status s = (*l)->Forward(x.data(), n, y.data(), false, dg); !s.ok()) {
          std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
          return 1;
        }
      }
      int reps = 0;
      const double median =
          MedianSeconds([&] { (void)(*l)->Forward(x.data(), n, y.data(), false, dg); },
                        /*warmup=*/0, /*min_reps=*/5, INT_MAX, min_seconds, &reps);
      // The same with x already on the device (the runs above left it there) and the output
      // left there.
      const double resident =
          MedianSeconds([&] { (void)(*l)->Forward(x.data(), n, y.data(), true, dg); },
                        /*warmup=*/1, /*min_reps=*/5, INT_MAX, min_seconds / 2);
      std::string stage_json;
      if (stages) {
        // Mean seconds of each stage, each ended by a wait, resident.
        double sums[InProcessLayer::kNumStages] = {};
        const int stage_reps = std::max(5, reps / 2);
        for (int r = 0; r < stage_reps; ++r) {
          (void)(*l)->Forward(x.data(), n, y.data(), true, dg, sums);
        }
        for (int s = 0; s < InProcessLayer::kNumStages; ++s) {
          absl::StrAppendFormat(&stage_json, "%s\"%s\":%.4f", s == 0 ? "" : ",",
                                InProcessLayer::kStageNames[s], sums[s] / stage_reps * 1e3);
        }
        stage_json = absl::StrCat(",\"stages_ms\":{", stage_json, "}");
      }
      // The experts the last forward routed to (the same rows every forward): its weight-read
      // bound's expert count (bench/gpu/run_gpu_bench.py).
      const absl::StatusOr<int> touched = (*l)->ExpertsTouched(dg);
      std::printf(
          "{\"tokens\":%lld,\"median_ms\":%.4f,\"tokens_per_s\":%.2f,\"reps\":%d,"
          "\"weight_dtype\":\"%s\",\"resident_median_ms\":%.4f,\"grouping\":\"%s\","
          "\"experts_touched\":%d%s}\n",
          static_cast<long long>(n), median * 1e3, static_cast<double>(n) / median, reps,
          std::string(common::FlagName(*dtype)).c_str(), resident * 1e3, grouping_name(dg),
          touched.ok() ? *touched : -1, stage_json.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace epserve::bench

int main(int argc, char** argv) { return epserve::bench::Run(argc, argv); }
