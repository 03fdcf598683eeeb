// Client side of Triton's system shared-memory extension for epserve-load --shared-memory: one
// POSIX shared memory object, registered with the server as one region, cut into slots of an
// input area and an output area each; the closed loop's i-th request in flight uses slot i, so a
// request's rows are written straight into its slot and its answer is read from there.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpc_service.grpc.pb.h"

namespace epserve::client {

class SharedMemorySlots {
 public:
  // Creates the object (`slots` x 2 x `bytes_per_direction` bytes), maps it and registers it
  // with the server under a name of its own; the RPC's error (region named) on failure.
  static absl::StatusOr<std::unique_ptr<SharedMemorySlots>> Create(
      inference::GRPCInferenceService::Stub& stub, const std::string& token, int slots,
      int64_t bytes_per_direction);
  ~SharedMemorySlots();  // unregisters (best effort), unmaps and unlinks

  const std::string& region() const { return name_; }
  int slots() const { return slots_; }
  int64_t input_offset(int slot) const { return 2 * slot * bytes_; }
  int64_t output_offset(int slot) const { return (2 * slot + 1) * bytes_; }
  char* at(int64_t offset) const { return base_ + offset; }

 private:
  SharedMemorySlots() = default;
  inference::GRPCInferenceService::Stub* stub_ = nullptr;
  std::string token_, name_, key_;
  int slots_ = 0;
  int64_t bytes_ = 0;
  char* base_ = nullptr;
  size_t size_ = 0;
};

}  // namespace epserve::client
