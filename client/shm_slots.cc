#include "client/shm_slots.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace epserve::client {
namespace {

void Authorize(grpc::ClientContext& ctx, const std::string& token) {
  if (!token.empty()) ctx.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemorySlots>> SharedMemorySlots::Create(
    inference::GRPCInferenceService::Stub& stub, const std::string& token, int slots,
    int64_t bytes_per_direction) {
  static std::atomic<int> counter{0};
  auto s = std::unique_ptr<SharedMemorySlots>(new SharedMemorySlots());
  s->stub_ = &stub;
  s->token_ = token;
  s->slots_ = slots;
  s->bytes_ = bytes_per_direction;
  s->name_ = absl::StrCat("epserve-load-", getpid(), "-", counter++);
  s->key_ = absl::StrCat("/", s->name_);
  s->size_ = static_cast<size_t>(2 * slots * bytes_per_direction);
  const int fd = shm_open(s->key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shm_open ", s->key_, ": ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(s->size_)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(s->key_.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot size ", s->key_, " to ", s->size_, " bytes: ", std::strerror(err)));
  }
  void* map = mmap(nullptr, s->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    shm_unlink(s->key_.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", s->key_, ": ", std::strerror(errno)));
  }
  s->base_ = static_cast<char*>(map);
  inference::SystemSharedMemoryRegisterRequest req;
  req.set_name(s->name_);
  req.set_key(s->key_);
  req.set_byte_size(s->size_);
  inference::SystemSharedMemoryRegisterResponse resp;
  grpc::ClientContext ctx;
  Authorize(ctx, token);
  grpc::Status st = stub.SystemSharedMemoryRegister(&ctx, req, &resp);
  if (!st.ok()) {
    s->stub_ = nullptr;  // nothing to unregister
    return absl::UnavailableError(
        absl::StrCat("registering shared memory region ", s->name_, ": ", st.error_message()));
  }
  return s;
}

SharedMemorySlots::~SharedMemorySlots() {
  if (stub_ != nullptr) {
    inference::SystemSharedMemoryUnregisterRequest req;
    req.set_name(name_);
    inference::SystemSharedMemoryUnregisterResponse resp;
    grpc::ClientContext ctx;
    Authorize(ctx, token_);
    stub_->SystemSharedMemoryUnregister(&ctx, req, &resp).ok();
  }
  if (base_ != nullptr) munmap(base_, size_);
  shm_unlink(key_.c_str());
}

}  // namespace epserve::client
