#include "server/shared_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/clip.h"

namespace epserve::server {
namespace {

// The SIGBUS handler's table of client mappings. A slot is claimed under `guard_mu` by a
// registration and published by storing `end` last (release); the handler reads it without a
// lock (acquire), as a signal handler must. A slot is cleared before its mapping is unmapped,
// and a mapping can fault only while a request holds its region, i.e. before that.
struct GuardSlot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<std::atomic<bool>*> faulted{nullptr};
};
constexpr int kGuardSlots = 4096;
GuardSlot guard_slots[kGuardSlots];
std::mutex guard_mu;
struct sigaction previous_sigbus {};

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (GuardSlot& slot : guard_slots) {
    const uintptr_t end = slot.end.load(std::memory_order_acquire);
    const uintptr_t begin = slot.begin.load(std::memory_order_relaxed);
    if (end == 0 || addr < begin || addr >= end) continue;
    // The object shrank under the mapping: zero pages from the faulting one to the mapping's
    // end (past the new end of the object, every page would fault too); the access then goes
    // on. mmap is a plain system call here, safe in a handler on Linux.
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t from = addr / page * page;
    if (mmap(reinterpret_cast<void*>(from), end - from, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
      break;  // cannot repair: fall through to the previous handler
    }
    if (std::atomic<bool>* f = slot.faulted.load(std::memory_order_relaxed)) {
      f->store(true, std::memory_order_release);
    }
    return;
  }
  // Not a client mapping: whatever handled SIGBUS before us (the default: a core dump).
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    previous_sigbus.sa_sigaction(sig, info, context);
  } else if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
    previous_sigbus.sa_handler(sig);
  } else {
    signal(SIGBUS, SIG_DFL);  // the faulting access repeats and ends the process as before
  }
}

// Claims a slot for [begin, end) and installs the handler on first use; -1 when all are taken.
int GuardMapping(uintptr_t begin, uintptr_t end, std::atomic<bool>* faulted) {
  std::lock_guard<std::mutex> lock(guard_mu);
  static const bool installed = [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, &previous_sigbus) == 0;
  }();
  if (!installed) return -1;
  for (int i = 0; i < kGuardSlots; ++i) {
    GuardSlot& slot = guard_slots[i];
    if (slot.end.load(std::memory_order_relaxed) != 0) continue;
    slot.faulted.store(faulted, std::memory_order_relaxed);
    slot.begin.store(begin, std::memory_order_relaxed);
    slot.end.store(end, std::memory_order_release);
    return i;
  }
  return -1;
}

void UnguardMapping(int i) {
  std::lock_guard<std::mutex> lock(guard_mu);
  guard_slots[i].end.store(0, std::memory_order_release);
  guard_slots[i].begin.store(0, std::memory_order_relaxed);
  guard_slots[i].faulted.store(nullptr, std::memory_order_relaxed);
}

}  // namespace

SharedMemoryRegion::~SharedMemoryRegion() {
  if (guard_slot_ >= 0) UnguardMapping(guard_slot_);
  if (map_ != nullptr) munmap(map_, map_bytes_);
  if (fd_ >= 0) close(fd_);
}

namespace {

absl::Status ShrunkInUse(const std::string& what, const std::string& name, const std::string& key) {
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": shared memory region '", Clip(name), "' (key '", Clip(key),
      "') was shrunk by its owner while in use: its bytes could not be read or written; "
      "unregister it and register it again"));
}

}  // namespace

absl::Status SharedMemoryRegion::CheckIntact(const std::string& what) const {
  struct stat st {};
  if (faulted() || fstat(fd_, &st) != 0 ||
      static_cast<uint64_t>(st.st_size) < offset_ + byte_size_) {
    return ShrunkInUse(what, name_, key_);
  }
  return absl::OkStatus();
}

absl::StatusOr<char*> SharedMemoryRegion::Span(uint64_t at, uint64_t bytes,
                                               const std::string& what) const {
  if (faulted()) return ShrunkInUse(what, name_, key_);
  if (at > byte_size_ || bytes > byte_size_ - at) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bytes [", at, ", ", at + bytes,
                                                   ") of shared memory region '", Clip(name_),
                                                   "' lie outside it (", byte_size_, " bytes)"));
  }
  struct stat st {};
  if (fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) < offset_ + at + bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": shared memory region '", Clip(name_), "' (key '", Clip(key_),
        "') was shrunk by its owner to ", st.st_size, " bytes; it needs ", offset_ + at + bytes));
  }
  return data_ + at;
}

absl::Status SharedMemoryRegistry::Register(const std::string& name, const std::string& key,
                                            uint64_t offset, uint64_t byte_size) {
  if (name.empty()) return absl::InvalidArgumentError("shared memory region name is empty");
  if (key.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", Clip(name), "': key is empty"));
  }
  if (byte_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region '", Clip(name), "': byte_size must be > 0"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.contains(name)) {
      return absl::AlreadyExistsError(
          absl::StrCat("shared memory region '", Clip(name), "' is already registered"));
    }
    if (regions_.size() >= max_regions_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("at most ", max_regions_, " shared memory regions may be registered"));
    }
  }
  auto region = std::shared_ptr<SharedMemoryRegion>(new SharedMemoryRegion());
  region->name_ = name;
  region->key_ = key;
  region->offset_ = offset;
  region->byte_size_ = byte_size;
  region->id_ = next_id_.fetch_add(1);
  region->fd_ = shm_open(key.c_str(), O_RDWR, 0);
  if (region->fd_ < 0) {
    const int err = errno;
    const std::string why =
        absl::StrCat("shared memory region '", Clip(name), "': cannot open key '", Clip(key),
                     "': ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(why);
    // The server opens the object with its own credentials: one it may not read and write
    // (another user's, or read-only) is refused as the operating system refuses it.
    if (err == EACCES) return absl::PermissionDeniedError(why);
    return absl::InvalidArgumentError(why);
  }
  struct stat st {};
  if (fstat(region->fd_, &st) != 0 || offset > static_cast<uint64_t>(st.st_size) ||
      byte_size > static_cast<uint64_t>(st.st_size) - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory region '", Clip(name), "': bytes [", offset, ", ", offset + byte_size,
        ") lie past the end of key '", Clip(key), "' (", st.st_size, " bytes)"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  region->map_bytes_ = static_cast<size_t>(offset - start + byte_size);
  void* map = mmap(nullptr, region->map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, region->fd_,
                   static_cast<off_t>(start));
  if (map == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory region '", Clip(name),
                                                   "': cannot map: ", std::strerror(errno)));
  }
  region->map_ = map;
  region->data_ = static_cast<char*>(map) + (offset - start);
  const auto begin = reinterpret_cast<uintptr_t>(map);
  region->guard_slot_ = GuardMapping(begin, begin + region->map_bytes_, &region->faulted_);
  if (region->guard_slot_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("shared memory region '", Clip(name), "': no room to guard another mapping (",
                     kGuardSlots, " regions mapped in this process)"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!regions_.Insert(name, std::move(region))) {  // registered meanwhile
    return absl::AlreadyExistsError(
        absl::StrCat("shared memory region '", Clip(name), "' is already registered"));
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Unregister(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  regions_.Remove(name);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> SharedMemoryRegistry::Find(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.Find(name);
}

absl::StatusOr<std::vector<SharedMemoryStatus>> SharedMemoryRegistry::Status(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return regions_.Statuses(name, "", [](const SharedMemoryRegion& r) {
    return SharedMemoryStatus{r.name(), r.key(), r.offset(), r.byte_size()};
  });
}

}  // namespace epserve::server
