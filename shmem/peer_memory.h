// Memory that each member of a group of processes on one host makes on its own device, and
// that every member can address: the device half of the symmetric heap, through which the
// GPU workers' exchange moves rows from device to device (worker/device_exchange.h). The
// heap (shmem/heap.h) stays the control plane: counts, metadata and signals.
//
// Each member makes its pieces, exports each as a file descriptor and hands the descriptors
// to every other member over a Unix socket (SCM_RIGHTS; an abstract socket named by the
// member's pid, which the member publishes in its peers' rendezvous words in the heap). What a
// member does with a peer's descriptor is its device's business: kernels::Runtime imports a
// CUDA allocation into OpenCL (ImportOpaqueFd) or uses a mapped host piece in place
// (WrapHostMemory). Two kinds:
//   cuda  device memory made with the CUDA driver's virtual memory API on the GPU whose UUID
//         the member names (cuMemCreate, POSIX file-descriptor handles). libcuda is loaded at
//         run time; the CUDA toolkit's cuda.h is needed at build time only for this kind
//         (EPSERVE_HAVE_CUDA_DRIVER_API), never for the rest.
//   host  host memory (memfd_create), mapped by every member: the same protocol for CPU
//         devices and for tests on machines without GPUs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "shmem/cuda_device.h"
#include "shmem/heap.h"

namespace epserve::shmem {

enum class PeerMemoryKind { kHost, kCuda };
const char* PeerMemoryKindName(PeerMemoryKind kind);
// Whether this build can make `kind` at all (kCuda needs the CUDA driver API's header at build
// time; the driver itself is looked for at run time).
bool PeerMemoryKindBuilt(PeerMemoryKind kind);

// The members: heap ranks first_rank .. first_rank + size - 1, this process being member `me`.
// rendezvous: uint64 words, `signal_stride` bytes apart, one per member, in every member's
// segment (zero until used; one use per heap).
struct PeerGroup {
  SymmetricHeap* heap = nullptr;
  int first_rank = 0;
  int size = 1;
  int me = 0;
  size_t rendezvous = 0;
  size_t signal_stride = 64;
};

class PeerMemory {
 public:
  // Collective over the group's members: each makes one piece of each size in `bytes`
  // (rounded up to the allocation granularity) and receives every peer's. kCuda: on the CUDA
  // device whose 16-byte UUID is `cuda_uuid`. When any member fails to make its pieces, every
  // member returns an error (the failing member's names the reason, the others which member
  // failed); DEADLINE_EXCEEDED when a member does not take part by `deadline`.
  static absl::StatusOr<std::unique_ptr<PeerMemory>> Create(const PeerGroup& group,
                                                            PeerMemoryKind kind,
                                                            const std::vector<size_t>& bytes,
                                                            absl::string_view cuda_uuid,
                                                            absl::Time deadline);
  // A member that cannot take part (its device cannot use the memory) answers the rendezvous
  // with this instead of Create: its peers' Create then fails at once, naming it.
  static absl::Status Decline(const PeerGroup& group);
  ~PeerMemory();
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  PeerMemoryKind kind() const { return kind_; }
  int members() const { return members_; }
  int pieces() const { return static_cast<int>(bytes_.size()); }
  size_t bytes(int piece) const { return bytes_[piece]; }
  // Member `member`'s piece `piece` as a file descriptor (owned by this object).
  int fd(int member, int piece) const { return fds_[Index(member, piece)]; }
  // kHost: this process's mapping of the piece (page-aligned); kCuda: nullptr.
  void* host(int member, int piece) const {
    return maps_.empty() ? nullptr : maps_[Index(member, piece)];
  }

 private:
  PeerMemory() = default;
  size_t Index(int member, int piece) const {
    return static_cast<size_t>(member) * bytes_.size() + static_cast<size_t>(piece);
  }
  // This member's pieces, made and exported (fds_ of `me`), or why not.
  absl::Status MakeOwnPieces(int me, absl::string_view cuda_uuid);
  // Create's steps after the rendezvous words: every peer's descriptors from its socket
  // (`words`: pid + 2 of each), and, for kHost, every piece mapped.
  absl::Status TakePeerPieces(const PeerGroup& group, const std::vector<uint64_t>& words,
                              absl::Time deadline);
  absl::Status MapHostPieces();

  PeerMemoryKind kind_ = PeerMemoryKind::kHost;
  int members_ = 0;
  std::vector<size_t> bytes_;
  std::vector<int> fds_;              // [member][piece]
  std::vector<void*> maps_;           // kHost: [member][piece]
  std::unique_ptr<CudaDevice> cuda_;  // kCuda: the device and this member's allocations
};

}  // namespace epserve::shmem
