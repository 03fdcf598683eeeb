// Runtime::ChooseFfnPlan: the per-device, per-shape choice of the FFN kernels' form for each
// row class (kernels/ffn_blocking.h), with its cache beside the program-binary cache.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/detail/program_cache.h"
#include "kernels/moe_kernels.h"
#include "kernels/runtime.h"

namespace epserve::kernels {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A buffer of `bytes` whose every 4-byte word is `pattern` (small finite values: no NaN or
// denormal slows one candidate down and not another).
absl::StatusOr<Buffer> Filled(Runtime& rt, size_t bytes, uint32_t pattern) {
  absl::StatusOr<Buffer> b = rt.Allocate(bytes);
  if (!b.ok() || bytes == 0) return b;
  CL_CHECK(clEnqueueFillBuffer(rt.queue(), b->mem(), &pattern, sizeof(pattern), 0, bytes, 0,
                               nullptr, nullptr));
  return b;
}

// The shapes the forms are timed on: one per row class (FfnRowClassSample rows per expert),
// the few-row ones over enough experts that their weights stream from memory past the
// device's cache, as they do when serving.
struct TuneCase {
  int64_t rows_per_expert;
  int experts;
};
constexpr int kTuneRepeats = 4;
// Experts smaller than this (test and toy shapes) take the default blocking: their FFN costs
// little, and building the candidates costs seconds and, while PoCL compiles, hundreds of MiB
// that the process keeps. Real models' experts are larger (qwen1.5-moe: 17 MiB in BF16).
constexpr int64_t kMinTunedExpertBytes = int64_t{8} << 20;

std::vector<TuneCase> TuneCases(const Runtime& rt, int64_t expert_bytes, std::string* log) {
  cl_ulong cache_bytes = 0;
  if (clGetDeviceInfo(rt.device(), CL_DEVICE_GLOBAL_MEM_CACHE_SIZE, sizeof(cache_bytes),
                      &cache_bytes, nullptr) != CL_SUCCESS) {
    cache_bytes = 0;
  }
  // Twice the cache's bytes of weights (at most 8 experts), in each of the two halves that
  // successive runs alternate between.
  const int streamed = static_cast<int>(std::clamp<int64_t>(
      detail::CeilDiv(2 * static_cast<int64_t>(cache_bytes), std::max<int64_t>(expert_bytes, 1)), 1,
      8));
  absl::StrAppendFormat(log, "# device cache %.1f MiB: few-row cases over %d experts\n",
                        static_cast<double>(cache_bytes) / (1 << 20), streamed);
  std::vector<TuneCase> cases;
  for (int c = 0; c < kFfnRowClasses; ++c) {
    const int64_t rows = FfnRowClassSample(c);
    cases.push_back({rows, rows <= detail::kDotDirectRows ? streamed : rows <= 64 ? 2 : 1});
  }
  return cases;
}

// One run of the FFN through `form` on one case, its rows in experts [first, first +
// c.experts), in seconds (queue finished).
absl::StatusOr<double> RunCase(Runtime& rt, const ExpertWeights& w, const FfnBlocking& form,
                               const TuneCase& c, int first, const Buffer& x,
                               const Buffer& row_index, Buffer& h, Buffer& y) {
  std::vector<int64_t> offsets(w.num_experts + 1, 0);
  for (int e = 0; e < w.num_experts; ++e) {
    const bool used = e >= first && e < first + c.experts;
    offsets[e + 1] = offsets[e] + (used ? c.rows_per_expert : 0);
  }
  const Clock::time_point start = Clock::now();
  EPSERVE_RETURN_IF_ERROR(ExpertFfnAs(rt, w, form, x, row_index, offsets, h, y));
  EPSERVE_RETURN_IF_ERROR(rt.Finish());
  return SecondsSince(start);
}

// Weights of `experts` experts in form b's layout, every value small and finite.
absl::StatusOr<ExpertWeights> TuneWeights(Runtime& rt, const FfnBlocking& b, int experts,
                                          int64_t hidden, int64_t ffn, common::ElementType dtype,
                                          uint32_t fp32_pattern) {
  ExpertWeights w;
  w.num_experts = experts;
  w.hidden = hidden;
  w.ffn = ffn;
  w.dtype = dtype;
  w.plan = FfnPlan::Uniform(b);
  w.blocking = b;
  w.bf16_dot = b.dot;
  const int64_t pw = b.panel_cols();
  // BF16 weights: two 0.0078125 values a word; FP32: the pattern given.
  const uint32_t pattern = dtype == common::ElementType::kBf16 ? 0x3c003c00u : fp32_pattern;
  const size_t elem = common::ElementBytes(dtype);
  const int64_t gate_up_values = b.dot ? detail::GateUpDotValuesPerExpert(hidden, ffn)
                                       : detail::GateUpFloatsPerExpert(hidden, ffn, pw);
  const int64_t down_values = b.dot ? detail::DownDotValuesPerExpert(hidden, ffn)
                                    : detail::DownFloatsPerExpert(hidden, ffn, pw);
  EPSERVE_ASSIGN_OR_RETURN(Buffer gate_up, Filled(rt, gate_up_values * experts * elem, pattern));
  EPSERVE_ASSIGN_OR_RETURN(Buffer down, Filled(rt, down_values * experts * elem, pattern));
  w.gate_up = std::move(gate_up);
  w.down = std::move(down);
  return w;
}

// times[i][c]: the fastest run of candidate i on case c (infinity where it does not serve it).
using TimeTable = std::vector<std::vector<double>>;

// Times every candidate on every case it serves, round-robin (one run of each candidate and
// case per round, after a warm-up round that also builds the candidates' programs), so that a
// drift in the machine's load hits every candidate alike; the fastest run of each counts.
absl::StatusOr<TimeTable> TimeCandidates(Runtime& rt, const std::vector<FfnBlocking>& candidates,
                                         const std::vector<TuneCase>& cases, int64_t hidden,
                                         int64_t ffn, common::ElementType dtype, std::string* log) {
  const Clock::time_point start = Clock::now();
  int64_t max_rows = 0;
  int experts = 1;
  for (const TuneCase& c : cases) {
    max_rows = std::max(max_rows, c.rows_per_expert * c.experts);
    experts = std::max(experts, 2 * c.experts);
  }
  const uint32_t x_pattern = 0x3c23d70a;  // 0.01f
  EPSERVE_ASSIGN_OR_RETURN(Buffer x, Filled(rt, max_rows * hidden * sizeof(float), x_pattern));
  std::vector<int32_t> index(max_rows);
  std::iota(index.begin(), index.end(), 0);
  EPSERVE_ASSIGN_OR_RETURN(Buffer row_index,
                           rt.AllocateCopy(index.data(), index.size() * sizeof(int32_t)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer h, rt.Allocate(max_rows * ffn * sizeof(float)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer y, rt.Allocate(max_rows * hidden * sizeof(float)));
  // One set of weights per layout: forms of one layout read the same weights (filling a set,
  // tens of MiB of fresh pages, cost more than all the timed runs of its forms together).
  std::vector<ExpertWeights> layouts;
  std::vector<size_t> layout_of(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) {
    size_t j = 0;
    while (j < layouts.size() && !SameFfnLayout(layouts[j].blocking, candidates[i])) ++j;
    if (j == layouts.size()) {
      EPSERVE_ASSIGN_OR_RETURN(
          ExpertWeights w, TuneWeights(rt, candidates[i], experts, hidden, ffn, dtype, x_pattern));
      layouts.push_back(std::move(w));
    }
    layout_of[i] = j;
  }
  TimeTable times(candidates.size(),
                  std::vector<double>(cases.size(), std::numeric_limits<double>::infinity()));
  EPSERVE_RETURN_IF_ERROR(rt.Finish());  // the fills, so that the first round times no fill
  absl::StrAppendFormat(log, "# weights and buffers %.2f s", SecondsSince(start));
  // Successive runs take alternate halves of the experts, so that no run finds in cache the
  // weights the run before it streamed (the few-row cases' weights are twice the cache).
  int runs = 0;
  for (int round = 0; round <= kTuneRepeats; ++round) {
    const Clock::time_point round_start = Clock::now();
    for (size_t i = 0; i < candidates.size(); ++i) {
      for (size_t c = 0; c < cases.size(); ++c) {
        if (!FfnFormServes(candidates[i], FfnRowClass(cases[c].rows_per_expert))) continue;
        const int first = (runs++ % 2) * (experts / 2);
        EPSERVE_ASSIGN_OR_RETURN(double t, RunCase(rt, layouts[layout_of[i]], candidates[i],
                                                   cases[c], first, x, row_index, h, y));
        if (round > 0) times[i][c] = std::min(times[i][c], t);
      }
    }
    absl::StrAppendFormat(log, round == 0 ? "; first round (builds) %.2f s" : ", %.2f s",
                          SecondsSince(round_start));
  }
  absl::StrAppend(log, "\n");
  return times;
}

// The plan of the layout whose fastest forms score lowest (each class's time relative to the
// fastest form of any layout, summed over the classes): in it, each class's fastest form.
// The times go to `log`.
FfnPlan PlanFromTimes(const std::vector<FfnBlocking>& candidates,
                      const std::vector<TuneCase>& cases, const TimeTable& times,
                      std::string* log) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> best(cases.size(), inf);
  for (const std::vector<double>& t : times) {
    for (size_t c = 0; c < cases.size(); ++c) best[c] = std::min(best[c], t[c]);
  }
  FfnPlan winner = FfnPlan::Uniform(candidates.front());
  double winner_score = inf;
  for (size_t first = 0; first < candidates.size(); ++first) {
    bool scored = false;  // from an earlier candidate of its layout
    for (size_t j = 0; j < first; ++j)
      scored = scored || SameFfnLayout(candidates[j], candidates[first]);
    if (scored) continue;
    FfnPlan plan;
    std::vector<double> plan_time(cases.size(), inf);
    for (size_t i = first; i < candidates.size(); ++i) {
      if (!SameFfnLayout(candidates[i], candidates[first])) continue;
      for (size_t c = 0; c < cases.size(); ++c) {
        if (times[i][c] < plan_time[c]) {
          plan_time[c] = times[i][c];
          plan.forms[c] = candidates[i];
        }
      }
    }
    double score = 0;
    for (size_t c = 0; c < cases.size(); ++c) score += plan_time[c] / best[c];
    if (score < winner_score) {
      winner_score = score;
      winner = plan;
    }
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    absl::StrAppendFormat(log, "# %s:", candidates[i].ToString());
    for (size_t c = 0; c < cases.size(); ++c) {
      if (times[i][c] == inf) continue;
      absl::StrAppendFormat(log, " %lldx%d rows %.3f ms;",
                            static_cast<long long>(cases[c].rows_per_expert), cases[c].experts,
                            times[i][c] * 1e3);
    }
    absl::StrAppend(log, "\n");
  }
  return winner;
}

// The tuning entry at `path` when its forms are all among `candidates`.
std::optional<FfnPlan> ReadCachedPlan(const std::string& path,
                                      const std::vector<FfnBlocking>& candidates) {
  absl::StatusOr<std::string> text = common::ReadWholeFile(path);
  if (!text.ok()) return std::nullopt;
  const std::string first_line(absl::string_view(*text).substr(0, text->find('\n')));
  absl::StatusOr<FfnPlan> plan = ParseFfnPlan(first_line);
  if (!plan.ok()) return std::nullopt;
  for (const FfnBlocking& b : plan->forms) {
    if (std::find(candidates.begin(), candidates.end(), b) == candidates.end()) {
      return std::nullopt;
    }
  }
  return *plan;
}

// An exclusive flock on a file, held until destruction, taken within kTuneLockWait or not at
// all (then the holder simply does not have it: tuning twice is only slower).
constexpr double kTuneLockWait = 120;
class CacheLock {
 public:
  CacheLock() = default;
  explicit CacheLock(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) return;
    const Clock::time_point start = Clock::now();
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      if (SecondsSince(start) > kTuneLockWait) {
        Release();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  CacheLock& operator=(CacheLock&& o) noexcept {
    Release();
    fd_ = std::exchange(o.fd_, -1);
    return *this;
  }
  CacheLock(const CacheLock&) = delete;
  ~CacheLock() { Release(); }

 private:
  void Release() {
    if (fd_ >= 0) ::close(fd_);  // closing drops the flock
    fd_ = -1;
  }
  int fd_ = -1;
};

std::string JoinCandidates(const std::vector<FfnBlocking>& candidates) {
  std::string out;
  for (const FfnBlocking& b : candidates) absl::StrAppend(&out, b.ToString(), ";");
  return out;
}

}  // namespace

std::string FfnChoice::Describe() const {
  std::string how = FfnBlockingOriginName(origin);
  if (origin == FfnBlockingOrigin::kTuned) {
    how = absl::StrFormat("tuned now in %.2f s", seconds);
  }
  const std::string forms = plan.ToString();
  return absl::StrCat(forms.find(':') == std::string::npos ? "" : "rows ", forms, " (", how,
                      ") for H=", hidden, " F=", ffn, " ", common::FlagName(dtype), " weights");
}

std::vector<FfnBlocking> Runtime::FfnFormCandidates(common::ElementType dtype) const {
  // BF16 weights where the pair-panel kernels run: their forms only. Their FP32-FMA forms
  // (pair-fma) do what the FMA blockings do on the other layout, the same multiply-adds per
  // weight byte, and ran as fast from one row to 8 on the Zen 5 host, where the dot products
  // were faster from 8 rows (BENCHMARKS.md, issue 39); timing both layouts cost a cold start
  // 3-4 s of PoCL builds of the FMA blockings.
  if (dtype == common::ElementType::kBf16 && bf16_dot_) return DotForms(bf16_amx_);
  return FfnBlockingCandidates(info_);
}

namespace {

// A forced plan (--ffn-blocking / EPSERVE_FFN_BLOCKING) checked against the device and the
// weights: its plan and origin into `choice` (pair-panel forms name BF16 weights' kernels, so
// FP32 weights keep `device_default`), or INVALID_ARGUMENT quoting it and saying why.
absl::Status ApplyForcedPlan(const std::string& forced, common::ElementType dtype, bool dot_runs,
                             bool amx, const DeviceInfo& info, const FfnBlocking& device_default,
                             FfnChoice& choice) {
  const std::string quoted =
      absl::StrCat("--ffn-blocking / EPSERVE_FFN_BLOCKING='", forced.substr(0, 128), "': ");
  absl::StatusOr<FfnPlan> plan = ParseFfnPlan(forced);
  if (!plan.ok()) return absl::InvalidArgumentError(absl::StrCat(quoted, plan.status().message()));
  const FfnBlocking& b = plan->layout();
  if (b.dot && dtype == common::ElementType::kBf16 && !dot_runs) {
    return absl::InvalidArgumentError(absl::StrCat(
        quoted, "this device runs no BF16 dot-product kernels (x86 AVX512-BF16 under PoCL)"));
  }
  for (const FfnBlocking& f : plan->forms) {
    if (f.dot && f.dot_op == FfnBlocking::DotOp::kVdp && !amx && dot_runs) {
      return absl::InvalidArgumentError(
          absl::StrCat(quoted, "dot-vdp is for hosts that run AMX tiles; 'dot' is vdpbf16ps here"));
    }
  }
  if (!b.dot && b.vec == 16 && !info.target_isa.empty() && info.target_isa != "avx512f") {
    return absl::InvalidArgumentError(
        absl::StrCat(quoted, "vec=16 needs 16-lane vectors, and this device's code is built for ",
                     info.target_isa, " (8 lanes): use vec=8"));
  }
  const bool fp32_under_dot = b.dot && dtype != common::ElementType::kBf16;
  choice.plan = fp32_under_dot ? FfnPlan::Uniform(device_default) : *plan;
  choice.origin = fp32_under_dot ? FfnBlockingOrigin::kDefault : FfnBlockingOrigin::kForced;
  return absl::OkStatus();
}

// The tuning cache entry's path for the shape and candidates ("" without a cache folder).
std::string TuneCachePath(const std::string& cache_dir, const std::string& key_source,
                          const DeviceInfo& info, int64_t hidden, int64_t ffn,
                          common::ElementType dtype, const std::vector<FfnBlocking>& candidates) {
  if (cache_dir.empty()) return "";
  // Keyed like the program binaries (source, options, device, driver) plus the shape, the row
  // classes and the candidate list, so a changed kernel or candidate set tunes again.
  std::string what = absl::StrCat("ffn-plan H=", hidden, " F=", ffn, " ", common::FlagName(dtype),
                                  " ", JoinCandidates(candidates), " classes");
  for (int c = 0; c < kFfnRowClasses; ++c) absl::StrAppend(&what, " ", FfnRowClassName(c));
  std::string path = detail::ProgramCachePath(cache_dir, "ffn-blocking",
                                              detail::ProgramCacheKey(key_source, what, info));
  path.replace(path.size() - 4, 4, ".txt");  // ".bin" -> ".txt"
  return path;
}

}  // namespace

absl::StatusOr<FfnPlan> Runtime::ChooseFfnPlan(int64_t hidden, int64_t ffn,
                                               common::ElementType dtype) {
  EPSERVE_RETURN_IF_ERROR(CheckKernelType(dtype, "the weights' element type"));
  for (const FfnChoice& c : ffn_choices()) {
    if (c.hidden == hidden && c.ffn == ffn && c.dtype == dtype) return c.plan;
  }
  const Clock::time_point start = Clock::now();
  FfnChoice choice;
  choice.hidden = hidden;
  choice.ffn = ffn;
  choice.dtype = dtype;
  std::string forced = options_.ffn_blocking;
  if (forced.empty()) {
    const char* env = std::getenv("EPSERVE_FFN_BLOCKING");
    if (env != nullptr) forced = env;
  }
  // BF16 weights on a runtime with the dot-product kernels: the pair-panel forms too.
  const bool dot_runs = dtype == common::ElementType::kBf16 && bf16_dot_;
  const std::vector<FfnBlocking> candidates = FfnFormCandidates(dtype);
  const int64_t expert_bytes = 3 * hidden * ffn * static_cast<int64_t>(common::ElementBytes(dtype));
  if (!forced.empty()) {
    EPSERVE_RETURN_IF_ERROR(
        ApplyForcedPlan(forced, dtype, dot_runs, bf16_amx_, info_, default_ffn_blocking_, choice));
  } else if (candidates.size() < 2 || !options_.tune_ffn || expert_bytes < kMinTunedExpertBytes) {
    choice.plan = FfnPlan::Uniform(dot_runs ? DotKernels() : default_ffn_blocking_);
    choice.origin = FfnBlockingOrigin::kDefault;
  } else {
    const std::string cache_path =
        TuneCachePath(cache_dir_, FfnProgramKeySource(), info_, hidden, ffn, dtype, candidates);
    CacheLock lock;
    if (!cache_path.empty()) {
      // Workers of one host share the device kind and the cache: one tunes while the others
      // wait for its entry (at most kTuneLockWait, then they time the candidates themselves).
      std::error_code ignored;  // a folder that cannot be made leaves the lock (and cache) off
      std::filesystem::create_directories(cache_dir_, ignored);
      lock = CacheLock(cache_path + ".lock");
      if (std::optional<FfnPlan> plan = ReadCachedPlan(cache_path, candidates)) {
        choice.plan = *plan;
        choice.origin = FfnBlockingOrigin::kCache;
      }
    }
    if (choice.origin != FfnBlockingOrigin::kCache) {
      std::string log;
      const std::vector<TuneCase> cases = TuneCases(*this, expert_bytes, &log);
      EPSERVE_ASSIGN_OR_RETURN(TimeTable times,
                               TimeCandidates(*this, candidates, cases, hidden, ffn, dtype, &log));
      choice.plan = PlanFromTimes(candidates, cases, times, &log);
      choice.origin = FfnBlockingOrigin::kTuned;
      if (!cache_path.empty()) {
        const absl::Status s = detail::WriteFileAtomically(
            cache_path, absl::StrCat(choice.plan.ToString(), "\n", log));
        (void)s;  // a cache that cannot be written only costs the next start a tuning
      }
    }
  }
  choice.seconds = SecondsSince(start);
  mutable_ffn_choices().push_back(choice);
  return choice.plan;
}

}  // namespace epserve::kernels
