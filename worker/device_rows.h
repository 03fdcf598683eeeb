// Rows that live in a client's CUDA memory (KServe's CUDA shared-memory extension): a request
// whose input or output names a CUDA region is not copied through rank 0. Rank 0 tells each
// worker, per batch, which of its rows come from (or go to) which client allocation
// (DeviceRowTable, in the worker's segment beside its input slot); the worker opens the
// allocation from its IPC handle in its own CUDA context and moves the rows device to device
// (worker/cuda_rows.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/element_type.h"
#include "shmem/cuda_device.h"

namespace epserve::worker {

// Where a request's rows are in a client's CUDA memory: the allocation (its IPC handle, as
// registered; `region_id` numbers the registration, never reused), the byte offset of the
// first row in it, and the element type of the rows there.
struct DeviceRows {
  uint64_t region_id = 0;  // 0: the rows are not in CUDA memory
  uint64_t offset = 0;
  common::ElementType type = common::ElementType::kFp32;
  // The handle as registered (the worker opens it on its own device, through peer access
  // where the client's allocation is on another).
  char handle[shmem::CudaDevice::kIpcHandleBytes] = {};

  bool valid() const { return region_id != 0; }
  // The same rows `rows` rows of `hidden` values further on.
  DeviceRows Advanced(int64_t rows, int64_t hidden) const {
    DeviceRows d = *this;
    d.offset += static_cast<uint64_t>(rows * hidden) * common::ElementBytes(type);
    return d;
  }
};

// One run of a worker's rows in CUDA memory: rows [first_row, first_row + rows) of the
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
