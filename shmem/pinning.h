// Page-locking host memory for transfers to and from NVIDIA GPUs, where OpenCL has no API for
// it: the CUDA driver's cuMemHostRegister (PORTABLE: pinned for every CUDA context of the
// process, NVIDIA's OpenCL driver's included), loaded at run time with dlopen, so neither the
// build nor a host without NVIDIA's driver needs CUDA. The worker pins the heap segments its
// device reads from and writes to (its own and rank 0's), so that those copies run by DMA
// instead of through the driver's staging buffers.
#pragma once

#include <cstddef>

#include "absl/status/status.h"

namespace epserve::shmem {

// Pins [addr, addr + bytes) (rounded out to pages) until the process ends. UNAVAILABLE naming
// what is missing (libcuda.so.1, a CUDA device) or the driver's error.
absl::Status PinForGpuTransfers(void* addr, size_t bytes);

}  // namespace epserve::shmem
