// StepRun's sending side: requests built and handed to gRPC or queued on a stream, the
// closed loop's next send of a slot, the open loop's pacer, and the stream writers.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/detail/grpc_call.h"
#include "client/detail/step_run.h"
#include "client/shm_slots.h"

namespace epserve::client::detail {

void StepRun::OpenStreams() {
  for (size_t i = 0; i < conns_.size(); ++i) {
    StreamConn& conn = *conns_[i];
    AddToken(conn.context, options_.token);
    // Past this the stream is abandoned; each request is bounded by its "timeout".
    const absl::Duration window = options_.num_requests > 0 ? absl::Hours(24) : options_.duration;
    conn.context.set_deadline(
        DeadlineAfter(options_.warmup + window + options_.timeout + absl::Seconds(30)));
    conn.rw = stubs_[i % stubs_.size()]->ModelStreamInfer(&conn.context);
  }
}

void StepRun::BuildNext(Sender& sender, Call& call) {
  const int64_t tokens =
      options_.tokens.min_tokens +
      static_cast<int64_t>(sender.rng() % static_cast<uint64_t>(options_.tokens.max_tokens -
                                                                options_.tokens.min_tokens + 1));
  call.id = absl::StrCat(sender.id_prefix, sender.next_id++);
  call.tokens = tokens;
  BuildInferRequest(options_.request, tokens, call.id, sender.rng, &sender.scratch,
                    options_.verifier != nullptr ? &call.input : nullptr);
  if (const SharedMemorySlots* shm = options_.shared_memory; shm != nullptr) {
    // The rows go into the slot's input area; the request names it, and the answer's place.
    inference::ModelInferRequest& r = sender.scratch;
    const std::string& raw = r.raw_input_contents(0);
    const int64_t bytes = static_cast<int64_t>(raw.size());
    std::memcpy(shm->at(shm->input_offset(call.slot)), raw.data(), raw.size());
    r.clear_raw_input_contents();
    auto place = [&](google::protobuf::Map<std::string, inference::InferParameter>& p,
                     int64_t offset) {
      p["shared_memory_region"].set_string_param(shm->region());
      p["shared_memory_byte_size"].set_int64_param(bytes);
      p["shared_memory_offset"].set_int64_param(offset);
    };
    place(*r.mutable_inputs(0)->mutable_parameters(), shm->input_offset(call.slot));
    place(*r.mutable_outputs(0)->mutable_parameters(), shm->output_offset(call.slot));
  }
}

void StepRun::StartUnary(Sender& sender, std::unique_ptr<Call> call, grpc::CompletionQueue& cq) {
  call->context.set_deadline(DeadlineAfter(options_.timeout));
  AddToken(call->context, options_.token);
  Stub& stub = *stubs_[sender.next_stub++ % stubs_.size()];
  in_flight_.fetch_add(1, std::memory_order_acq_rel);
  // PrepareAsync serializes the request, so the scratch may be rebuilt right after.
  call->reader = stub.PrepareAsyncModelInfer(&call->context, sender.scratch, &cq);
  call->reader->StartCall();
  Call* raw = call.release();
  raw->reader->Finish(&raw->response, &raw->status, raw);
}

void StepRun::StartStream(Sender& sender, std::unique_ptr<Call> call, StreamConn& conn,
                          Recorder& recorder) {
  auto request = std::make_unique<inference::ModelInferRequest>(std::move(sender.scratch));
  sender.scratch.Clear();
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    if (!conn.dead && !conn.broken) {
      in_flight_.fetch_add(1, std::memory_order_acq_rel);
      const std::string id = call->id;
      conn.pending.emplace(id, std::move(call));
      conn.queue.push_back(std::move(request));
    }
  }
  if (call != nullptr) {  // not queued
    call->status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream has ended");
    if (call->measured) Record(recorder, *call, Clock::now());
    return;
  }
  conn.cv.notify_one();
}

void StepRun::SendNextForSlot(int slot) {
  Clock::time_point now = Clock::now();
  bool measured = false;
  if (options_.num_requests == 0) {
    if (now >= measure_end_) return;
    measured = now >= measure_begin_;
  } else if (now >= measure_begin_) {
    if (tickets_.fetch_add(1, std::memory_order_relaxed) >= options_.num_requests) return;
    measured = true;
  }
  if (measured) AwaitWindow();
  auto call = std::make_unique<Call>();
  call->measured = measured;
  call->slot = slot;
  if (options_.stream) {
    StreamConn& conn = *conns_[static_cast<size_t>(slot) % conns_.size()];
    BuildNext(conn.sender, *call);
    call->start = Clock::now();
    StartStream(conn.sender, std::move(call), conn, conn.recorder);
  } else {
    Lane& lane = *lanes_[static_cast<size_t>(slot) % lanes_.size()];
    BuildNext(lane.sender, *call);
    call->start = Clock::now();
    StartUnary(lane.sender, std::move(call), lane.cq);
  }
}

void StepRun::PaceOpenLoop() {
  Sender sender(options_.seed, pacer_stream_, pacer_id_prefix_);
  const double mean_gap_s = 1.0 / step_.rate_per_s;
  Clock::time_point intended = start_;
  int64_t measured_sent = 0;
  size_t next = 0;
  for (;;) {
    if (options_.num_requests == 0 && intended >= measure_end_) break;
    const bool measured = intended >= measure_begin_;
    if (measured && options_.num_requests > 0 && measured_sent >= options_.num_requests) break;
    if (measured) ++measured_sent;

    if (in_flight_.load(std::memory_order_acquire) >= options_.max_outstanding) {
      // Not sent: counted, never silently skipped. The pacer records it itself;
      // its stats are merged after it has been joined.
      std::this_thread::sleep_until(intended);
      if (measured) {
        pacer_.stats.RecordError("CLIENT_BACKLOG",
                                 absl::StrCat(options_.max_outstanding,
                                              " requests already in flight (--max-outstanding)"));
        pacer_.last_measured_completion = std::max(pacer_.last_measured_completion, Clock::now());
        live_errors_.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      auto call = std::make_unique<Call>();
      BuildNext(sender, *call);  // built ahead of its send time
      call->measured = measured;
      call->start = intended;
      std::this_thread::sleep_until(intended);
      if (options_.stream) {
        StartStream(sender, std::move(call), *conns_[next++ % conns_.size()], pacer_);
      } else {
        StartUnary(sender, std::move(call), lanes_[next++ % lanes_.size()]->cq);
      }
    }

    double gap_s = mean_gap_s;
    if (step_.arrival == Arrival::kPoisson)
      gap_s = -std::log1p(-sender.rng.UniformUnit()) * mean_gap_s;
    intended += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap_s));
  }
}

void StepRun::WriteStream(StreamConn& conn) {
  std::unique_lock<std::mutex> lock(conn.mu);
  for (;;) {
    conn.cv.wait(lock, [&] { return !conn.queue.empty() || conn.closing || conn.broken; });
    if (conn.broken) return;
    if (!conn.queue.empty()) {
      std::unique_ptr<inference::ModelInferRequest> request = std::move(conn.queue.front());
      conn.queue.pop_front();
      lock.unlock();
      const bool ok = conn.rw->Write(*request);
      request.reset();
      lock.lock();
      if (!ok) {
        conn.broken = true;
        return;
      }
      continue;
    }
    lock.unlock();
    conn.rw->WritesDone();
    return;
  }
}

}  // namespace epserve::client::detail
