// StepRun's lifecycle: the threads of a step started and joined, progress, the report.
#include "client/detail/step_run.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/server_queries.h"

namespace epserve::client::detail {
namespace {

Clock::duration ToClock(absl::Duration d) {
  return std::chrono::duration_cast<Clock::duration>(absl::ToChronoNanoseconds(d));
}

}  // namespace

StepRun::StepRun(const LoadOptions& options,
                 const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                 const std::vector<std::unique_ptr<Stub>>& stubs, const StepSpec& step,
                 int step_index)
    : options_(options), channels_(channels), stubs_(stubs), step_(step) {
  for (int k = 0; k < options.num_threads && !options.stream; ++k) {
    // Generator streams: step i's lane k uses i * 1024 + k, its pacer i * 1024 + 1023.
    const uint64_t stream = static_cast<uint64_t>(step_index) * 1024 + static_cast<uint64_t>(k);
    lanes_.push_back(
        std::make_unique<Lane>(options.seed, stream, absl::StrCat("s", step_index, "-w", k, "-")));
  }
  for (int k = 0; k < options.num_streams && options.stream; ++k) {
    const uint64_t stream = static_cast<uint64_t>(step_index) * 1024 + static_cast<uint64_t>(k);
    conns_.push_back(std::make_unique<StreamConn>(options.seed, stream,
                                                  absl::StrCat("s", step_index, "-t", k, "-")));
  }
  pacer_stream_ = static_cast<uint64_t>(step_index) * 1024 + 1023;
  pacer_id_prefix_ = absl::StrCat("s", step_index, "-p-");
}

StepReport StepRun::Run() {
  start_ = Clock::now();
  measure_begin_ = start_ + ToClock(options_.warmup);
  measure_end_ = measure_begin_ + ToClock(options_.duration);
  if (options_.server_stats) {
    StartServerStatsThread();
  } else {
    OpenWindow();
  }
  if (options_.progress) progress_thread_ = std::thread([this] { ReportProgress(); });
  if (options_.stream) OpenStreams();
  OfferLoad();
  WaitForCompletions();
  return Report();
}

// ModelStatistics at the opening of the window, taken on a thread of its own.
void StepRun::StartServerStatsThread() {
  stats_thread_ = std::thread([this] {
    std::this_thread::sleep_until(measure_begin_);
    auto s = QueryStatistics(channels_.front(), options_.request.model_name, absl::Seconds(10),
                             options_.token);
    if (s.ok()) stats_before_ = *std::move(s);
    OpenWindow();
  });
}

void StepRun::OpenWindow() {
  {
    std::lock_guard<std::mutex> lock(window_mu_);
    window_open_.store(true, std::memory_order_release);
  }
  window_cv_.notify_all();
}

void StepRun::AwaitWindow() {
  // Every measured send asks; once the window is open the answer takes no lock.
  if (window_open_.load(std::memory_order_acquire)) return;
  std::unique_lock<std::mutex> lock(window_mu_);
  window_cv_.wait(lock, [this] { return window_open_.load(std::memory_order_relaxed); });
}

void StepRun::StartCompletionThreads() {
  for (auto& lane : lanes_) {
    Lane* l = lane.get();
    l->thread = std::thread([this, l] { Drain(*l); });
  }
  for (auto& conn : conns_) {
    StreamConn* c = conn.get();
    c->writer = std::thread([this, c] { WriteStream(*c); });
    c->reader = std::thread([this, c] { ReadStream(*c); });
  }
}

void StepRun::OfferLoad() {
  if (step_.mode == LoadMode::kClosedLoop) {
    // Initial sends happen on this thread before the completion threads exist, so each
    // sender is only ever used by one thread at a time.
    for (int slot = 0; slot < step_.concurrency; ++slot) SendNextForSlot(slot);
    StartCompletionThreads();
  } else {
    StartCompletionThreads();
    std::thread pacer([this] { PaceOpenLoop(); });
    pacer.join();
  }
}

void StepRun::WaitForCompletions() {
  while (in_flight_.load(std::memory_order_acquire) > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (auto& lane : lanes_) lane->cq.Shutdown();
  for (auto& lane : lanes_) lane->thread.join();
  for (auto& conn : conns_) {
    {
      std::lock_guard<std::mutex> lock(conn->mu);
      conn->closing = true;
    }
    conn->cv.notify_all();
  }
  for (auto& conn : conns_) {
    conn->reader.join();
    if (conn->writer.joinable()) conn->writer.join();
  }
  done_.store(true);
  if (progress_thread_.joinable()) progress_thread_.join();
  if (stats_thread_.joinable()) stats_thread_.join();
}

void StepRun::ReportProgress() {
  while (!done_.load()) {
    for (int i = 0; i < 20 && !done_.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (done_.load()) break;
    Progress p;
    p.elapsed_s = std::chrono::duration<double>(Clock::now() - start_).count();
    p.warmup_s = absl::ToDoubleSeconds(options_.warmup);
    p.window_s = options_.num_requests > 0 ? 0 : absl::ToDoubleSeconds(options_.duration);
    p.target_requests = options_.num_requests;
    p.ok = live_ok_.load(std::memory_order_relaxed);
    p.errors = live_errors_.load(std::memory_order_relaxed);
    p.ok_tokens = live_tokens_.load(std::memory_order_relaxed);
    options_.progress(p);
  }
}

StepReport StepRun::Report() {
  ThreadStats merged;
  Clock::time_point last = pacer_.last_measured_completion;
  merged.MergeFrom(std::move(pacer_.stats));
  for (auto& lane : lanes_) {
    merged.MergeFrom(std::move(lane->recorder.stats));
    last = std::max(last, lane->recorder.last_measured_completion);
  }
  for (auto& conn : conns_) {
    merged.MergeFrom(std::move(conn->recorder.stats));
    last = std::max(last, conn->recorder.last_measured_completion);
  }
  if (unmatched_answers_.load() > 0) {
    merged.RecordError(kBadResponse, absl::StrCat(unmatched_answers_.load(),
                                                  " stream answers matched no request id"));
  }
  Clock::time_point end = options_.num_requests == 0 ? measure_end_ : measure_begin_;
  end = std::max(end, last);
  const double duration_s = std::chrono::duration<double>(end - measure_begin_).count();
  StepReport report = MakeStepReport(
      step_.mode, step_.concurrency, step_.rate_per_s,
      step_.mode == LoadMode::kOpenLoop ? std::string(ArrivalName(step_.arrival)) : std::string(),
      merged, duration_s);
  if (stats_before_.has_value()) {
    auto after = QueryStatistics(channels_.front(), options_.request.model_name, absl::Seconds(10),
                                 options_.token);
    if (after.ok()) report.server = SplitBetween(*stats_before_, *after);
  }
  return report;
}

}  // namespace epserve::client::detail
