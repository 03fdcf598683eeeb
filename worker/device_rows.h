// Rows that live in a client's memory: its CUDA memory (KServe's CUDA shared-memory
// extension), or its system shared memory where the workers take such rows themselves
// (--workers-read-shm). A request whose input or output names such a region is not copied
// through rank 0. Rank 0 tells each worker, per batch, which of its rows come from (or go to)
// which client allocation (DeviceRowTable, in the worker's segment beside its input slot); the
// worker opens a CUDA allocation from its IPC handle in its own CUDA context and moves the rows
// device to device (worker/cuda_rows.h), and reads or writes a system shared memory object
// through rank 0's own descriptor of it (worker/host_rows.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/element_type.h"
#include "shmem/cuda_device.h"

namespace epserve::worker {

// rank 0's open descriptor of a system shared memory object: a worker on the same host opens
// /proc/<pid>/fd/<fd>, which is the object rank 0 registered even where the client has
// unlinked its name since (or made another object under it).
struct HostShmHandle {
  int64_t pid = 0;
  int64_t fd = -1;
};

// Where a request's rows are in a client's memory: the allocation (`kind`; for CUDA its IPC
// handle as registered, for system shared memory rank 0's descriptor of the object;
// `region_id` numbers the registration of its kind, never reused), the byte offset of the first
// row in it (for system shared memory: in the object, not the region), and the element type
// of the rows there.
struct DeviceRows {
  enum class Kind : int32_t { kCuda = 0, kHostShm = 1 };
  uint64_t region_id = 0;  // 0: the rows are not in a client's memory
  uint64_t offset = 0;
  common::ElementType type = common::ElementType::kFp32;
  Kind kind = Kind::kCuda;
  // kCuda: the handle as registered (the worker opens it on its own device, through peer
  // access where the client's allocation is on another). kHostShm: a HostShmHandle.
  char handle[shmem::CudaDevice::kIpcHandleBytes] = {};

  bool valid() const { return region_id != 0; }
  bool in_host_shm() const { return kind == Kind::kHostShm; }
  HostShmHandle host_shm() const {
    HostShmHandle h;
    std::memcpy(&h, handle, sizeof(h));
    return h;
  }
  void set_host_shm(const HostShmHandle& h) {
    kind = Kind::kHostShm;
    std::memcpy(handle, &h, sizeof(h));
  }
  // The same rows `rows` rows of `hidden` values further on.
  DeviceRows Advanced(int64_t rows, int64_t hidden) const {
    DeviceRows d = *this;
    d.offset += static_cast<uint64_t>(rows * hidden) * common::ElementBytes(type);
    return d;
  }
};

static_assert(sizeof(HostShmHandle) <= sizeof(DeviceRows::handle));

// One run of a worker's rows in a client's memory: rows [first_row, first_row + rows) of the
// worker's part of the batch are read from (output 0) or written to (output 1) `where`.
struct DeviceRowSegment {
  int64_t first_row;
  int64_t rows;
  int32_t output;
  int32_t pad;
  DeviceRows where;
};

// A worker's segments of one batch, in its segment (HeapRegions::DeviceRowTables, one per
// input slot), written by rank 0 with the batch's rows: this header, then `count` segments
// (segment(i)). Capacity: two per row (an input and an output segment), so that any batch fits.
struct DeviceRowTable {
  int64_t count;
  int64_t pad;

  static size_t BytesFor(int64_t max_rows) {
    return sizeof(DeviceRowTable) + static_cast<size_t>(2 * max_rows) * sizeof(DeviceRowSegment);
  }
  // Byte offset of the segments from the table's start.
  static constexpr size_t kSegmentsAt = sizeof(int64_t) * 2;
  const DeviceRowSegment& segment(int64_t i) const {
    return reinterpret_cast<const DeviceRowSegment*>(reinterpret_cast<const char*>(this) +
                                                     kSegmentsAt)[i];
  }
  DeviceRowSegment* segments() {
    return reinterpret_cast<DeviceRowSegment*>(reinterpret_cast<char*>(this) + kSegmentsAt);
  }
};
static_assert(sizeof(DeviceRowTable) == DeviceRowTable::kSegmentsAt);
static_assert(DeviceRowTable::kSegmentsAt % alignof(DeviceRowSegment) == 0);

}  // namespace epserve::worker
