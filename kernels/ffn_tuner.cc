// Runtime::ChooseFfnPlan: the per-device, per-shape choice of the FFN kernels' form for each
// row class (kernels/ffn_blocking.h), with its cache beside the program-binary cache.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/detail/file_lock.h"
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
  // Whether successive runs of the case take alternate halves of the tuning weights' experts,
  // so that none finds in cache the weights the run before it read: the few-row cases, and
  // any other whose weights are under twice the device's cache (larger ones leave no
  // earlier run's weights in cache to find, and need not double the weights filled).
  bool alternate;
};
constexpr int kTuneRepeats = 4;
// The way the candidates are timed (the cases, their experts): a plan timed another way is
// tuned again. 2: the few-row cases past twice the cache on every device (1: at most 8
// experts a half, inside the cache of a 300 MiB L3).
constexpr int kTuneMethod = 2;
// Experts smaller than this (test and toy shapes) take the default blocking: their FFN costs
// little, and building the candidates costs seconds and, while PoCL compiles, hundreds of MiB
// that the process keeps. Real models' experts are larger (qwen1.5-moe: 17 MiB in BF16).
constexpr int64_t kMinTunedExpertBytes = int64_t{8} << 20;

std::vector<TuneCase> TuneCases(const Runtime& rt, int64_t expert_bytes, std::string* log) {
  cl_ulong cache_bytes = 0, memory_bytes = 0;
  if (clGetDeviceInfo(rt.device(), CL_DEVICE_GLOBAL_MEM_CACHE_SIZE, sizeof(cache_bytes),
                      &cache_bytes, nullptr) != CL_SUCCESS) {
    cache_bytes = 0;
  }
  if (clGetDeviceInfo(rt.device(), CL_DEVICE_GLOBAL_MEM_SIZE, sizeof(memory_bytes), &memory_bytes,
                      nullptr) != CL_SUCCESS) {
    memory_bytes = 0;
  }
  // Twice the cache's bytes of weights in each of the two halves that successive runs
  // alternate between, within a sixteenth of the device's memory.
  const int64_t budget = static_cast<int64_t>(memory_bytes / 16);
  const int streamed = FewRowTuneExperts(static_cast<int64_t>(cache_bytes), expert_bytes, budget);
  absl::StrAppendFormat(log, "# device cache %.1f MiB: few-row cases over %d experts%s\n",
                        static_cast<double>(cache_bytes) / (1 << 20), streamed,
                        streamed * expert_bytes < 2 * static_cast<int64_t>(cache_bytes)
                            ? " (fewer than twice the cache: the memory budget)"
                            : "");
  std::vector<TuneCase> cases;
  for (int c = 0; c < kFfnRowClasses; ++c) {
    const int64_t rows = FfnRowClassSample(c);
    const int experts = rows <= detail::kDotDirectRows ? streamed : rows <= 64 ? 2 : 1;
    const bool alternate = rows <= detail::kDotDirectRows ||
                           experts * expert_bytes < 2 * static_cast<int64_t>(cache_bytes);
    cases.push_back({rows, experts, alternate});
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

// How long a tuner waits for another process's lock (a shape's entry, a candidate's build,
// the device's timing) before it goes on without it: tuning twice is only slower.
constexpr double kTuneLockWait = 120;

// The tuner's lock files for one shape ("" everywhere without a cache folder): the cache
// entry's (`entry` + ".lock", held while a process tunes the shape), one claim per candidate
// (held while a process builds the candidate's programs; keyed by the programs, not by the
// shape, so that processes tuning different shapes share them) and the device's timing lock
// (held while a process times forms on the device).
struct TuneFiles {
  std::string entry;
  std::vector<std::string> claims;
  std::string timing;
};

// The buffers the runs read and write, and one set of weights per layout: forms of one layout
// read the same weights (filling a set, tens of MiB of fresh pages, cost more than all the
// timed runs of its forms together).
struct TuneBuffers {
  Buffer x, row_index, h, y;
  std::vector<ExpertWeights> layouts;
  std::vector<size_t> layout_of;  // per candidate
  int experts = 1;  // in each set: two halves that successive alternating runs take in turn
  int runs = 0;     // alternating runs made (the half the next one takes)
};

absl::StatusOr<TuneBuffers> MakeTuneBuffers(Runtime& rt, const std::vector<FfnBlocking>& candidates,
                                            const std::vector<TuneCase>& cases, int64_t hidden,
                                            int64_t ffn, common::ElementType dtype) {
  TuneBuffers b;
  int64_t max_rows = 0;
  for (const TuneCase& c : cases) {
    max_rows = std::max(max_rows, c.rows_per_expert * c.experts);
    b.experts = std::max(b.experts, (c.alternate ? 2 : 1) * c.experts);
  }
  const uint32_t x_pattern = 0x3c23d70a;  // 0.01f
  EPSERVE_ASSIGN_OR_RETURN(b.x, Filled(rt, max_rows * hidden * sizeof(float), x_pattern));
  std::vector<int32_t> index(max_rows);
  std::iota(index.begin(), index.end(), 0);
  EPSERVE_ASSIGN_OR_RETURN(b.row_index,
                           rt.AllocateCopy(index.data(), index.size() * sizeof(int32_t)));
  EPSERVE_ASSIGN_OR_RETURN(b.h, rt.Allocate(max_rows * ffn * sizeof(float)));
  EPSERVE_ASSIGN_OR_RETURN(b.y, rt.Allocate(max_rows * hidden * sizeof(float)));
  b.layout_of.resize(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) {
    size_t j = 0;
    while (j < b.layouts.size() && !SameFfnLayout(b.layouts[j].blocking, candidates[i])) ++j;
    if (j == b.layouts.size()) {
      EPSERVE_ASSIGN_OR_RETURN(ExpertWeights w, TuneWeights(rt, candidates[i], b.experts, hidden,
                                                            ffn, dtype, x_pattern));
      b.layouts.push_back(std::move(w));
    }
    b.layout_of[i] = j;
  }
  EPSERVE_RETURN_IF_ERROR(rt.Finish());  // the fills, so that no run times a fill
  return b;
}

// One run of candidate i on every case it serves, each time into (*times)[c] where faster
// than what it holds (times may be null: an untimed round). Successive runs of the
// alternating cases take alternate halves of the experts (TuneCase::alternate), the others
// the first experts.
absl::Status RunCandidate(Runtime& rt, TuneBuffers& b, const std::vector<FfnBlocking>& candidates,
                          size_t i, const std::vector<TuneCase>& cases,
                          std::vector<double>* times) {
  for (size_t c = 0; c < cases.size(); ++c) {
    if (!FfnFormServes(candidates[i], FfnRowClass(cases[c].rows_per_expert))) continue;
    const int first = cases[c].alternate ? (b.runs++ % 2) * (b.experts / 2) : 0;
    EPSERVE_ASSIGN_OR_RETURN(double t, RunCase(rt, b.layouts[b.layout_of[i]], candidates[i],
                                               cases[c], first, b.x, b.row_index, b.h, b.y));
    if (times != nullptr) (*times)[c] = std::min((*times)[c], t);
  }
  return absl::OkStatus();
}

// The untimed first round, which builds the candidates' programs and compiles their kernels
// for every case's launch. Each candidate runs under its claim: first those no other process
// is building, then, each once its builder is done, the others, whose programs and kernels
// the driver's own cache then holds (PoCL's, shared by the workers of a host), so that
// processes tuning different shapes at once build different candidates.
absl::Status BuildRound(Runtime& rt, TuneBuffers& b, const std::vector<FfnBlocking>& candidates,
                        const std::vector<TuneCase>& cases, const TuneFiles& files,
                        std::string* log) {
  const Clock::time_point start = Clock::now();
  std::vector<size_t> elsewhere;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const detail::FileLock claim(files.claims[i], 0);
    if (claim.busy()) {
      elsewhere.push_back(i);
      continue;
    }
    EPSERVE_RETURN_IF_ERROR(RunCandidate(rt, b, candidates, i, cases, nullptr));
  }
  const double own_seconds = SecondsSince(start);
  for (size_t i : elsewhere) {
    const detail::FileLock claim(files.claims[i], kTuneLockWait);
    EPSERVE_RETURN_IF_ERROR(RunCandidate(rt, b, candidates, i, cases, nullptr));
  }
  absl::StrAppendFormat(log, "; first round (builds) %.2f s", SecondsSince(start));
  if (!elsewhere.empty()) {
    absl::StrAppendFormat(log, " (%zu of %zu candidates built by another process; %.2f s here)",
                          elsewhere.size(), candidates.size(), own_seconds);
  }
  return absl::OkStatus();
}

// Times every candidate on every case it serves, round-robin (one run of each candidate and
// case per round, after BuildRound's), so that a drift in the machine's load hits every
// candidate alike; the fastest run of each counts. The timed rounds hold the device's timing
// lock, so that the workers of a host time their shapes one after the other.
absl::StatusOr<TimeTable> TimeCandidates(Runtime& rt, const std::vector<FfnBlocking>& candidates,
                                         const std::vector<TuneCase>& cases, int64_t hidden,
                                         int64_t ffn, common::ElementType dtype,
                                         const TuneFiles& files, std::string* log) {
  const Clock::time_point start = Clock::now();
  EPSERVE_ASSIGN_OR_RETURN(TuneBuffers b,
                           MakeTuneBuffers(rt, candidates, cases, hidden, ffn, dtype));
  absl::StrAppendFormat(log, "# weights and buffers %.2f s", SecondsSince(start));
  EPSERVE_RETURN_IF_ERROR(BuildRound(rt, b, candidates, cases, files, log));
  const Clock::time_point wait_start = Clock::now();
  const detail::FileLock timing(files.timing, kTuneLockWait);
  absl::StrAppendFormat(log, "; waited %.2f s to time", SecondsSince(wait_start));
  TimeTable times(candidates.size(),
                  std::vector<double>(cases.size(), std::numeric_limits<double>::infinity()));
  for (int round = 1; round <= kTuneRepeats; ++round) {
    const Clock::time_point round_start = Clock::now();
    for (size_t i = 0; i < candidates.size(); ++i) {
      EPSERVE_RETURN_IF_ERROR(RunCandidate(rt, b, candidates, i, cases, &times[i]));
    }
    absl::StrAppendFormat(log, ", %.2f s", SecondsSince(round_start));
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

// A lock file's path in the cache folder, keyed like the program binaries by `what`.
std::string LockPath(const std::string& cache_dir, std::string_view name,
                     const std::string& key_source, const std::string& what,
                     const DeviceInfo& info) {
  std::string path =
      detail::ProgramCachePath(cache_dir, name, detail::ProgramCacheKey(key_source, what, info));
  path.replace(path.size() - 4, 4, ".lock");  // ".bin" -> ".lock"
  return path;
}

// The tuner's files for the shape and candidates (TuneFiles; "" without a cache folder).
TuneFiles MakeTuneFiles(const std::string& cache_dir, const std::string& key_source,
                        const DeviceInfo& info, const FfnShape& shape,
                        const std::vector<FfnBlocking>& candidates) {
  TuneFiles files;
  files.claims.resize(candidates.size());
  if (cache_dir.empty()) return files;
  // Keyed like the program binaries (source, options, device, driver) plus the shape, the row
  // classes, the candidate list and the timing's method, so a changed kernel, candidate set
  // or way of timing them tunes again.
  const absl::string_view dtype = common::FlagName(shape.dtype);
  std::string what = absl::StrCat("ffn-plan H=", shape.hidden, " F=", shape.ffn, " ", dtype, " ",
                                  JoinCandidates(candidates), " timing ", kTuneMethod, " classes");
  for (int c = 0; c < kFfnRowClasses; ++c) absl::StrAppend(&what, " ", FfnRowClassName(c));
  files.entry = detail::ProgramCachePath(cache_dir, "ffn-blocking",
                                         detail::ProgramCacheKey(key_source, what, info));
  files.entry.replace(files.entry.size() - 4, 4, ".txt");  // ".bin" -> ".txt"
  for (size_t i = 0; i < candidates.size(); ++i) {
    // A candidate's programs follow from its kernels' family (the weights' dtype) and, for the
    // pair-panel forms, from the DotOp alone (a direct form shares its staged form's part).
    const FfnBlocking& b = candidates[i];
    const std::string program = b.dot ? DotKernels(b.dot_op).ToString() : b.ToString();
    files.claims[i] = LockPath(cache_dir, "ffn-build", key_source,
                               absl::StrCat(program, " ", dtype, " weights"), info);
  }
  files.timing = LockPath(cache_dir, "ffn-timing", "", "", info);
  return files;
}

// Times the candidates on the shape, stores the plan at files.entry (when there is one) and
// returns it.
absl::StatusOr<FfnPlan> TuneAndStore(Runtime& rt, const std::vector<FfnBlocking>& candidates,
                                     const FfnShape& shape, int64_t expert_bytes,
                                     const TuneFiles& files) {
  std::string log;
  const std::vector<TuneCase> cases = TuneCases(rt, expert_bytes, &log);
  EPSERVE_ASSIGN_OR_RETURN(TimeTable times, TimeCandidates(rt, candidates, cases, shape.hidden,
                                                           shape.ffn, shape.dtype, files, &log));
  const FfnPlan plan = PlanFromTimes(candidates, cases, times, &log);
  if (!files.entry.empty()) {
    const absl::Status s =
        detail::WriteFileAtomically(files.entry, absl::StrCat(plan.ToString(), "\n", log));
    (void)s;  // a cache that cannot be written only costs the next start a tuning
  }
  return plan;
}

}  // namespace

absl::StatusOr<FfnPlan> Runtime::ChooseFfnPlan(int64_t hidden, int64_t ffn,
                                               common::ElementType dtype) {
  EPSERVE_ASSIGN_OR_RETURN(std::optional<FfnPlan> plan,
                           ChooseFfnPlan(FfnShape{hidden, ffn, dtype}, /*defer_when_busy=*/false));
  return *plan;  // made, since nothing was deferred
}

absl::Status Runtime::ChooseFfnPlans(std::span<const FfnShape> shapes) {
  // First the shapes no other process is tuning, then the others (their entries, once made).
  for (const FfnShape& s : shapes) {
    EPSERVE_RETURN_IF_ERROR(ChooseFfnPlan(s, /*defer_when_busy=*/true).status());
  }
  for (const FfnShape& s : shapes) {
    EPSERVE_RETURN_IF_ERROR(ChooseFfnPlan(s.hidden, s.ffn, s.dtype).status());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<FfnPlan>> Runtime::ChooseFfnPlan(const FfnShape& shape,
                                                              bool defer_when_busy) {
  const common::ElementType dtype = shape.dtype;
  EPSERVE_RETURN_IF_ERROR(CheckKernelType(dtype, "the weights' element type"));
  for (const FfnChoice& c : ffn_choices()) {
    if (c.hidden == shape.hidden && c.ffn == shape.ffn && c.dtype == dtype) return c.plan;
  }
  const Clock::time_point start = Clock::now();
  FfnChoice choice;
  choice.hidden = shape.hidden;
  choice.ffn = shape.ffn;
  choice.dtype = dtype;
  std::string forced = options_.ffn_blocking;
  if (forced.empty()) {
    const char* env = std::getenv("EPSERVE_FFN_BLOCKING");
    if (env != nullptr) forced = env;
  }
  // BF16 weights on a runtime with the dot-product kernels: the pair-panel forms too.
  const bool dot_runs = dtype == common::ElementType::kBf16 && bf16_dot_;
  const std::vector<FfnBlocking> candidates = FfnFormCandidates(dtype);
  const int64_t expert_bytes =
      3 * shape.hidden * shape.ffn * static_cast<int64_t>(common::ElementBytes(dtype));
  if (!forced.empty()) {
    EPSERVE_RETURN_IF_ERROR(
        ApplyForcedPlan(forced, dtype, dot_runs, bf16_amx_, info_, default_ffn_blocking_, choice));
  } else if (candidates.size() < 2 || !options_.tune_ffn || expert_bytes < kMinTunedExpertBytes) {
    choice.plan = FfnPlan::Uniform(dot_runs ? DotKernels() : default_ffn_blocking_);
    choice.origin = FfnBlockingOrigin::kDefault;
  } else {
    const TuneFiles files =
        MakeTuneFiles(cache_dir_, FfnProgramKeySource(), info_, shape, candidates);
    detail::FileLock lock;
    if (!files.entry.empty()) {
      // Workers of one host share the device kind and the cache: one tunes a shape while the
      // others wait for its entry (at most kTuneLockWait, then they time the candidates
      // themselves), or, deferring, choose their other shapes first.
      std::error_code ignored;  // a folder that cannot be made leaves the lock (and cache) off
      std::filesystem::create_directories(cache_dir_, ignored);
      lock = detail::FileLock(files.entry + ".lock", defer_when_busy ? 0 : kTuneLockWait);
      if (defer_when_busy && lock.busy()) return std::nullopt;
      if (std::optional<FfnPlan> plan = ReadCachedPlan(files.entry, candidates)) {
        choice.plan = *plan;
        choice.origin = FfnBlockingOrigin::kCache;
      }
    }
    if (choice.origin != FfnBlockingOrigin::kCache) {
      EPSERVE_ASSIGN_OR_RETURN(choice.plan,
                               TuneAndStore(*this, candidates, shape, expert_bytes, files));
      choice.origin = FfnBlockingOrigin::kTuned;
    }
  }
  choice.seconds = SecondsSince(start);
  mutable_ffn_choices().push_back(choice);
  return choice.plan;
}

}  // namespace epserve::kernels
