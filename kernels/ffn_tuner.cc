// Runtime::ChooseFfnBlocking: the per-device, per-shape choice of the portable FFN kernels'
// blocking (kernels/ffn_blocking.h), with its cache beside the program-binary cache.
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

// The shapes a candidate is timed on: few rows per expert (weight streaming) and many
// (FMA throughput); each candidate's score is the sum of its times relative to the best.
struct TuneCase {
  int64_t rows_per_expert;
  int experts;
};
constexpr TuneCase kTuneCases[] = {{8, 2}, {128, 1}};
constexpr int kTuneExperts = 2;
constexpr int kTuneRepeats = 4;
// Experts smaller than this (test and toy shapes) take the default blocking: their FFN costs
// little, and building the candidates costs seconds and, while PoCL compiles, hundreds of MiB
// that the process keeps. Real models' experts are larger (qwen1.5-moe: 17 MiB in BF16).
constexpr int64_t kMinTunedExpertBytes = int64_t{8} << 20;

// One run of the FFN on one case, in seconds (queue finished).
absl::StatusOr<double> RunCase(Runtime& rt, const ExpertWeights& w, const TuneCase& c,
                               const Buffer& x, const Buffer& row_index, Buffer& h, Buffer& y) {
  std::vector<int64_t> offsets(w.num_experts + 1, 0);
  for (int e = 0; e < w.num_experts; ++e) {
    offsets[e + 1] = offsets[e] + (e < c.experts ? c.rows_per_expert : 0);
  }
  const Clock::time_point start = Clock::now();
  EPSERVE_RETURN_IF_ERROR(ExpertFfn(rt, w, x, row_index, offsets, h, y));
  EPSERVE_RETURN_IF_ERROR(rt.Finish());
  return SecondsSince(start);
}

// Weights of kTuneExperts experts in candidate b's layout, every value small and finite.
absl::StatusOr<ExpertWeights> TuneWeights(Runtime& rt, const FfnBlocking& b, int64_t hidden,
                                          int64_t ffn, common::ElementType dtype,
                                          uint32_t fp32_pattern) {
  ExpertWeights w;
  w.num_experts = kTuneExperts;
  w.hidden = hidden;
  w.ffn = ffn;
  w.dtype = dtype;
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
  EPSERVE_ASSIGN_OR_RETURN(Buffer gate_up,
                           Filled(rt, gate_up_values * kTuneExperts * elem, pattern));
  EPSERVE_ASSIGN_OR_RETURN(Buffer down, Filled(rt, down_values * kTuneExperts * elem, pattern));
  w.gate_up = std::move(gate_up);
  w.down = std::move(down);
  return w;
}

// Whether weights laid out for blocking a serve blocking b as they are.
bool SameLayout(const FfnBlocking& a, const FfnBlocking& b) {
  return a.dot == b.dot && (a.dot || a.panel_cols() == b.panel_cols());
}

// Times every candidate on every case, round-robin (one run of each candidate and case per
// round, after a warm-up round that also builds the candidates' programs), so that a drift
// in the machine's load hits every candidate alike; the fastest run of each counts. Returns
// the index of the candidate with the lowest score and writes the times to `log`.
absl::StatusOr<size_t> TimeCandidates(Runtime& rt, const std::vector<FfnBlocking>& candidates,
                                      int64_t hidden, int64_t ffn, common::ElementType dtype,
                                      std::string* log) {
  int64_t max_rows = 0;
  for (const TuneCase& c : kTuneCases) max_rows = std::max(max_rows, c.rows_per_expert * c.experts);
  const uint32_t x_pattern = 0x3c23d70a;  // 0.01f
  EPSERVE_ASSIGN_OR_RETURN(Buffer x, Filled(rt, max_rows * hidden * sizeof(float), x_pattern));
  std::vector<int32_t> index(max_rows);
  std::iota(index.begin(), index.end(), 0);
  EPSERVE_ASSIGN_OR_RETURN(Buffer row_index,
                           rt.AllocateCopy(index.data(), index.size() * sizeof(int32_t)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer h, rt.Allocate(max_rows * ffn * sizeof(float)));
  EPSERVE_ASSIGN_OR_RETURN(Buffer y, rt.Allocate(max_rows * hidden * sizeof(float)));
  // One set of weights per layout: candidates of one panel width lay their weights out alike
  // (the rest of a blocking changes only how the kernels walk them), so they share a set, its
  // blocking set before each run. Filling a set (tens of MiB of fresh pages) cost more than
  // all the timed runs together.
  std::vector<ExpertWeights> layouts;
  std::vector<size_t> layout_of(candidates.size());
  for (size_t i = 0; i < candidates.size(); ++i) {
    const FfnBlocking& b = candidates[i];
    size_t j = 0;
    while (j < layouts.size() && !SameLayout(layouts[j].blocking, b)) ++j;
    if (j == layouts.size()) {
      EPSERVE_ASSIGN_OR_RETURN(ExpertWeights w, TuneWeights(rt, b, hidden, ffn, dtype, x_pattern));
      layouts.push_back(std::move(w));
    }
    layout_of[i] = j;
  }

  const size_t num_cases = std::size(kTuneCases);
  std::vector<std::vector<double>> times(
      candidates.size(), std::vector<double>(num_cases, std::numeric_limits<double>::infinity()));
  for (int round = 0; round <= kTuneRepeats; ++round) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      for (size_t c = 0; c < num_cases; ++c) {
        ExpertWeights& w = layouts[layout_of[i]];
        w.blocking = candidates[i];
        EPSERVE_ASSIGN_OR_RETURN(double t, RunCase(rt, w, kTuneCases[c], x, row_index, h, y));
        if (round > 0) times[i][c] = std::min(times[i][c], t);
      }
    }
  }
  std::vector<double> best(num_cases, std::numeric_limits<double>::infinity());
  for (const std::vector<double>& t : times) {
    for (size_t c = 0; c < num_cases; ++c) best[c] = std::min(best[c], t[c]);
  }
  size_t winner = 0;
  double winner_score = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < candidates.size(); ++i) {
    double score = 0;
    for (size_t c = 0; c < num_cases; ++c) score += times[i][c] / best[c];
    absl::StrAppendFormat(log, "# %s:", candidates[i].ToString());
    for (size_t c = 0; c < num_cases; ++c) {
      absl::StrAppendFormat(log, " %lldx%d rows %.3f ms;",
                            static_cast<long long>(kTuneCases[c].rows_per_expert),
                            kTuneCases[c].experts, times[i][c] * 1e3);
    }
    absl::StrAppendFormat(log, " score %.3f\n", score);
    if (score < winner_score) {
      winner_score = score;
      winner = i;
    }
  }
  return winner;
}

// The tuning entry at `path` when it names one of `candidates`.
std::optional<FfnBlocking> ReadCachedChoice(const std::string& path,
                                            const std::vector<FfnBlocking>& candidates) {
  absl::StatusOr<std::string> text = common::ReadWholeFile(path);
  if (!text.ok()) return std::nullopt;
  const std::string first_line(absl::string_view(*text).substr(0, text->find('\n')));
  absl::StatusOr<FfnBlocking> b = ParseFfnBlocking(first_line);
  if (!b.ok() || std::find(candidates.begin(), candidates.end(), *b) == candidates.end()) {
    return std::nullopt;
  }
  return *b;
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
  return absl::StrCat(blocking.ToString(), " (", how, ") for H=", hidden, " F=", ffn, " ",
                      common::FlagName(dtype), " weights");
}

namespace {

// A forced blocking (--ffn-blocking / EPSERVE_FFN_BLOCKING) checked against the device and
// the weights: its blocking and origin into `choice` ("dot" names BF16 weights' kernels, so
// FP32 weights keep `device_default`), or INVALID_ARGUMENT quoting it and saying why.
absl::Status ApplyForcedBlocking(const std::string& forced, common::ElementType dtype,
                                 bool dot_runs, const DeviceInfo& info,
                                 const FfnBlocking& device_default, FfnChoice& choice) {
  absl::StatusOr<FfnBlocking> b = ParseFfnBlocking(forced);
  if (!b.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--ffn-blocking / EPSERVE_FFN_BLOCKING='",
                                                   forced.substr(0, 128),
                                                   "': ", b.status().message()));
  }
  if (b->dot && dtype == common::ElementType::kBf16 && !dot_runs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ffn-blocking / EPSERVE_FFN_BLOCKING='", forced.substr(0, 128),
        "': this device runs no BF16 dot-product kernels (x86 AVX512-BF16 under PoCL)"));
  }
  if (!b->dot && b->vec == 16 && !info.target_isa.empty() && info.target_isa != "avx512f") {
    return absl::InvalidArgumentError(
        absl::StrCat("--ffn-blocking / EPSERVE_FFN_BLOCKING='", forced.substr(0, 128),
                     "': vec=16 needs 16-lane vectors, and this device's code is built for ",
                     info.target_isa, " (8 lanes): use vec=8"));
  }
  const bool fp32_under_dot = b->dot && dtype != common::ElementType::kBf16;
  choice.blocking = fp32_under_dot ? device_default : *b;
  choice.origin = fp32_under_dot ? FfnBlockingOrigin::kDefault : FfnBlockingOrigin::kForced;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<FfnBlocking> Runtime::ChooseFfnBlocking(int64_t hidden, int64_t ffn,
                                                       common::ElementType dtype) {
  EPSERVE_RETURN_IF_ERROR(CheckKernelType(dtype, "the weights' element type"));
  for (const FfnChoice& c : ffn_choices()) {
    if (c.hidden == hidden && c.ffn == ffn && c.dtype == dtype) return c.blocking;
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
  // BF16 weights on a runtime with the dot-product kernels: those are a candidate too.
  const bool dot_runs = dtype == common::ElementType::kBf16 && bf16_dot_;
  std::vector<FfnBlocking> candidates = FfnBlockingCandidates(info_);
  if (dot_runs) candidates.push_back(DotKernels());
  if (!forced.empty()) {
    EPSERVE_RETURN_IF_ERROR(
        ApplyForcedBlocking(forced, dtype, dot_runs, info_, default_ffn_blocking_, choice));
  } else if (candidates.size() < 2 || !options_.tune_ffn ||
             3 * hidden * ffn * static_cast<int64_t>(common::ElementBytes(dtype)) <
                 kMinTunedExpertBytes) {
    choice.blocking = dot_runs ? DotKernels() : default_ffn_blocking_;
    choice.origin = FfnBlockingOrigin::kDefault;
  } else {
    // Keyed like the program binaries (source, options, device, driver) plus the shape class
    // and the candidate list, so a changed kernel or candidate set tunes again.
    std::string cache_path;
    CacheLock lock;
    if (!cache_dir_.empty()) {
      const std::string what =
          absl::StrCat("ffn-blocking H=", hidden, " F=", ffn, " ", common::FlagName(dtype), " ",
                       JoinCandidates(candidates));
      cache_path = detail::ProgramCachePath(
          cache_dir_, "ffn-blocking", detail::ProgramCacheKey(FfnProgramKeySource(), what, info_));
      cache_path.replace(cache_path.size() - 4, 4, ".txt");  // ".bin" -> ".txt"
      // Workers of one host share the device kind and the cache: one tunes while the others
      // wait for its entry (at most kTuneLockWait, then they time the candidates themselves).
      std::error_code ignored;  // a folder that cannot be made leaves the lock (and cache) off
      std::filesystem::create_directories(cache_dir_, ignored);
      lock = CacheLock(cache_path + ".lock");
      if (std::optional<FfnBlocking> b = ReadCachedChoice(cache_path, candidates)) {
        choice.blocking = *b;
        choice.origin = FfnBlockingOrigin::kCache;
      }
    }
    if (choice.origin != FfnBlockingOrigin::kCache) {
      std::string log;
      EPSERVE_ASSIGN_OR_RETURN(size_t winner,
                               TimeCandidates(*this, candidates, hidden, ffn, dtype, &log));
      choice.blocking = candidates[winner];
      choice.origin = FfnBlockingOrigin::kTuned;
      if (!cache_path.empty()) {
        const absl::Status s = detail::WriteFileAtomically(
            cache_path, absl::StrCat(choice.blocking.ToString(), "\n", log));
        (void)s;  // a cache that cannot be written only costs the next start a tuning
      }
    }
  }
  choice.seconds = SecondsSince(start);
  mutable_ffn_choices().push_back(choice);
  return choice.blocking;
}

}  // namespace epserve::kernels
