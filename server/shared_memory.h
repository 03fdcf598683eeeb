// Triton's system shared-memory extension: clients on the same host register POSIX shared
// memory regions (shm_open keys) by name, and requests name a region, offset and size for an
// input or output instead of carrying its bytes. Rank 0 maps each region once; the batcher
// reads a request's rows straight from it and writes the answer straight into it.
//
// A region stays mapped while any request uses it, even after it is unregistered. Every use
// is checked against the registered size and, since the owner may shrink the object under us
// (a read past its end would be SIGBUS), against the object's current size. Thread-safe.
//
// An owner may still shrink the object after a request was checked and before the batcher
// reads or writes its rows. Rank 0 must not die of that: a SIGBUS handler (installed with the
// first registration, chaining to the one before it for every other address) recognises a
// fault inside a registered mapping, maps anonymous zero pages over the rest of that mapping,
// so that the access goes on harmlessly, and marks the region faulted(). A faulted region is
// refused from then on, and every request that used it is answered with an error instead of
// the rows it could not read or write (InferenceService checks faulted() before it answers).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/region_map.h"

namespace epserve::server {

// One mapped region: bytes [offset, offset + byte_size) of the object named `key`.
class SharedMemoryRegion {
 public:
  ~SharedMemoryRegion();  // unmaps and closes
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& name() const { return name_; }
  const std::string& key() const { return key_; }
  uint64_t offset() const { return offset_; }
  uint64_t byte_size() const { return byte_size_; }
  // Numbers the registration (from 1, never reused in this process).
  uint64_t id() const { return id_; }
  // This process's descriptor of the object, open while the region lives: a worker on this
  // host opens the same object through /proc/<pid>/fd/<fd> (worker/host_rows.h).
  int fd() const { return fd_; }
  // The byte offset in the object of `p`, an address inside the region.
  uint64_t ObjectOffset(const char* p) const { return offset_ + static_cast<uint64_t>(p - data_); }

  // The address of bytes [at, at + bytes) of the region, after checking that they lie inside
  // it and inside the object as it is now; INVALID_ARGUMENT naming `what` otherwise.
  absl::StatusOr<char*> Span(uint64_t at, uint64_t bytes, const std::string& what) const;

  // True once an access past the object's end has faulted (the owner shrank it while it was
  // in use): what was read from the region since may be zeros, and what was written may be
  // lost. Safe to call from any thread.
  bool faulted() const { return faulted_.load(std::memory_order_acquire); }
  // For a request that has used the region, checked when it is answered: INVALID_ARGUMENT
  // naming `what` when the region faulted or its object is now smaller than the region (a
  // shrink within the last page faults no access, but the bytes past the end read as zeros
  // and writes there are lost).
  absl::Status CheckIntact(const std::string& what) const;

 private:
  friend class SharedMemoryRegistry;
  SharedMemoryRegion() = default;
  std::string name_, key_;
  uint64_t offset_ = 0, byte_size_ = 0;
  uint64_t id_ = 0;
  int fd_ = -1;
  void* map_ = nullptr;  // page-aligned mapping that covers the region
  size_t map_bytes_ = 0;
  char* data_ = nullptr;                      // the region's first byte
  int guard_slot_ = -1;                       // its entry in the SIGBUS handler's table of mappings
  mutable std::atomic<bool> faulted_{false};  // set by the SIGBUS handler
};

struct SharedMemoryStatus {
  std::string name, key;
  uint64_t offset = 0, byte_size = 0;
};

class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(size_t max_regions = 1024) : max_regions_(max_regions) {}

  // Maps bytes [offset, offset + byte_size) of the POSIX shared memory object `key` (as given
  // to shm_open, e.g. "/epserve_in") under `name`. ALREADY_EXISTS for a name in use,
  // INVALID_ARGUMENT for an empty name or key, a zero size or bytes past the object's end,
  // NOT_FOUND for a key no object has, RESOURCE_EXHAUSTED beyond max_regions.
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);
  // Forgets `name` (all regions when empty; an unknown name is no error, as in Triton);
  // requests using it keep its mapping until they end.
  absl::Status Unregister(const std::string& name);
  // The region named `name`; NOT_FOUND (naming it) when none is registered.
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> Find(const std::string& name) const;
  // Every region (name empty) or the one named; NOT_FOUND for an unknown name.
  absl::StatusOr<std::vector<SharedMemoryStatus>> Status(const std::string& name) const;

 private:
  const size_t max_regions_;
  std::atomic<uint64_t> next_id_{1};
  mutable std::mutex mu_;
  RegionMap<SharedMemoryRegion> regions_;  // guarded by mu_
};

}  // namespace epserve::server
