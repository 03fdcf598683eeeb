#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/clip.h"

namespace epserve::server {

SharedMemoryRegion::~SharedMemoryRegion() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<char*> SharedMemoryRegion::Span(uint64_t at, uint64_t bytes,
                                               const std::string& what) const {
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
    if (regions_.count(name) > 0) {
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
  region->fd_ = shm_open(key.c_str(), O_RDWR, 0);
  if (region->fd_ < 0) {
    const int err = errno;
    const std::string why =
        absl::StrCat("shared memory region '", Clip(name), "': cannot open key '", Clip(key),
                     "': ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(why) : absl::InvalidArgumentError(why);
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
  std::lock_guard<std::mutex> lock(mu_);
  if (!regions_.emplace(name, std::move(region)).second) {  // registered meanwhile
    return absl::AlreadyExistsError(
        absl::StrCat("shared memory region '", Clip(name), "' is already registered"));
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Unregister(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (name.empty()) {
    regions_.clear();
    return absl::OkStatus();
  }
  regions_.erase(name);  // an unknown name is no error (Triton's rule)
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> SharedMemoryRegistry::Find(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no shared memory region '", Clip(name), "' is registered"));
  }
  return it->second;
}

absl::StatusOr<std::vector<SharedMemoryStatus>> SharedMemoryRegistry::Status(
    const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<SharedMemoryStatus> out;
  for (const auto& [n, r] : regions_) {
    if (!name.empty() && n != name) continue;
    out.push_back({r->name(), r->key(), r->offset(), r->byte_size()});
  }
  if (!name.empty() && out.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no shared memory region '", Clip(name), "' is registered"));
  }
  return out;
}

}  // namespace epserve::server
