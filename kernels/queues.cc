// The runtime's second compute queue (Runtime::ForkQueue: work beside the main queue's) and
// its command timeline (Runtime::TakeCommandTimes).
#include <utility>

#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/runtime.h"

namespace epserve::kernels {

bool Runtime::concurrent_queues() const {
  using Mode = RuntimeOptions::ConcurrentQueues;
  return options_.concurrent_queues == Mode::kAlways ||
         (options_.concurrent_queues == Mode::kAuto && !info_.is_cpu);
}

absl::Status Runtime::ForkQueue() {
  if (!concurrent_queues()) return absl::OkStatus();
  cl_int err = CL_SUCCESS;
  if (fork_queue_ == nullptr) {
    const cl_command_queue_properties props =
        options_.profile_commands ? CL_QUEUE_PROFILING_ENABLE : 0;
    CL_CHECK((fork_queue_ = clCreateCommandQueue(context_, device_, props, &err), err));
  }
  if (forked_) CL_CHECK(clFinish(fork_queue_));  // a fork an error left open: start afresh
  cl_event start = nullptr;
  CL_CHECK(clEnqueueMarkerWithWaitList(queue_, 0, nullptr, &start));
  err = clEnqueueBarrierWithWaitList(fork_queue_, 1, &start, nullptr);
  clReleaseEvent(start);
  CL_CHECK(err);
  forked_ = true;
  return absl::OkStatus();
}

absl::Status Runtime::EndFork() {
  if (!forked_) return absl::OkStatus();
  forked_ = false;
  if (fork_end_ != nullptr) clReleaseEvent(fork_end_);
  fork_end_ = nullptr;
  CL_CHECK(clEnqueueMarkerWithWaitList(fork_queue_, 0, nullptr, &fork_end_));
  CL_CHECK(clFlush(fork_queue_));  // under way now, not when the main queue is next waited for
  return absl::OkStatus();
}

absl::Status Runtime::Forked(const std::function<absl::Status()>& launches) {
  EPSERVE_RETURN_IF_ERROR(ForkQueue());
  const absl::Status status = launches();
  const absl::Status ended = EndFork();
  return status.ok() ? ended : status;
}

absl::Status Runtime::Flush() {
  if (fork_queue_ != nullptr) CL_CHECK(clFlush(fork_queue_));
  CL_CHECK(clFlush(queue_));
  return absl::OkStatus();
}

absl::Status Runtime::JoinFork() {
  EPSERVE_RETURN_IF_ERROR(EndFork());  // a fork still open ends here
  if (fork_end_ == nullptr) return absl::OkStatus();
  const cl_int err = clEnqueueBarrierWithWaitList(queue_, 1, &fork_end_, nullptr);
  clReleaseEvent(fork_end_);
  fork_end_ = nullptr;
  CL_CHECK(err);
  return absl::OkStatus();
}

void Runtime::ReleaseFork() {
  if (fork_queue_ == nullptr) return;
  clFinish(fork_queue_);
  if (fork_end_ != nullptr) clReleaseEvent(fork_end_);
  fork_end_ = nullptr;
  forked_ = false;
  for (Buffer& b : fork_scratch_) b = Buffer();
  clReleaseCommandQueue(fork_queue_);
  fork_queue_ = nullptr;
}

void Runtime::RecordCommand(cl_event event, cl_kernel kernel, const char* what) {
  recorded_.push_back({event, kernel, what, forked_});
}

absl::StatusOr<std::vector<CommandTime>> Runtime::TakeCommandTimes() {
  EPSERVE_RETURN_IF_ERROR(Finish());
  std::vector<Recorded> recorded = std::exchange(recorded_, {});
  std::vector<CommandTime> out;
  absl::Status status;
  for (const Recorded& r : recorded) {
    CommandTime t;
    t.forked = r.forked;
    t.name = r.what;
    if (r.kernel != nullptr) {
      char name[256] = {};
      if (clGetKernelInfo(r.kernel, CL_KERNEL_FUNCTION_NAME, sizeof(name) - 1, name, nullptr) ==
          CL_SUCCESS) {
        t.name = name;
      }
    }
    cl_ulong start = 0, end = 0;
    const cl_int e1 = clGetEventProfilingInfo(r.event, CL_PROFILING_COMMAND_START, sizeof(start),
                                              &start, nullptr);
    const cl_int e2 =
        clGetEventProfilingInfo(r.event, CL_PROFILING_COMMAND_END, sizeof(end), &end, nullptr);
    clReleaseEvent(r.event);
    if (e1 != CL_SUCCESS || e2 != CL_SUCCESS) {
      if (status.ok()) {
        status = detail::ClError(e1 != CL_SUCCESS ? e1 : e2, "clGetEventProfilingInfo", __FILE__,
                                 __LINE__);
      }
      continue;
    }
    t.start_ns = start;
    t.end_ns = end;
    out.push_back(std::move(t));
  }
  if (!status.ok()) return status;
  return out;
}

}  // namespace epserve::kernels
