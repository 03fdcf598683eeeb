#include "shmem/peer_memory.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace epserve::shmem {
namespace {

constexpr int kMaxPieces = 8;

std::string Errno(const char* call) { return absl::StrCat(call, ": ", std::strerror(errno)); }

int MillisLeft(absl::Time deadline) {
  return static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(deadline - absl::Now()), 0, 1 << 30));
}

// The abstract Unix socket address of the member whose pid is `pid`.
sockaddr_un AddressOf(uint64_t pid, socklen_t* len) {
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  const std::string name = absl::StrCat("epserve-peer-memory-", pid);
  std::memcpy(addr.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

// Sends `fds` and their sizes in one message.
bool SendPieces(int sock, const std::vector<int>& fds, const std::vector<uint64_t>& sizes) {
  msghdr msg = {};
  iovec iov = {const_cast<uint64_t*>(sizes.data()), sizes.size() * sizeof(uint64_t)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPieces)] = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  return sendmsg(sock, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(iov.iov_len);
}

// Receives what SendPieces sent: `count` descriptors and sizes.
absl::Status ReceivePieces(int sock, int count, std::vector<int>* fds,
                           std::vector<uint64_t>* sizes) {
  sizes->assign(count, 0);
  msghdr msg = {};
  iovec iov = {sizes->data(), sizes->size() * sizeof(uint64_t)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxPieces)] = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t got = recvmsg(sock, &msg, MSG_WAITALL | MSG_CMSG_CLOEXEC);
  if (got != static_cast<ssize_t>(iov.iov_len)) {
    return absl::UnavailableError(got < 0 ? Errno("recvmsg") : "short message from a peer");
  }
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  if (cmsg == nullptr || cmsg->cmsg_type != SCM_RIGHTS ||
      cmsg->cmsg_len != CMSG_LEN(sizeof(int) * count)) {
    return absl::UnavailableError("a peer's message carried no descriptors");
  }
  fds->assign(count, -1);
  std::memcpy(fds->data(), CMSG_DATA(cmsg), sizeof(int) * count);
  return absl::OkStatus();
}

}  // namespace

const char* PeerMemoryKindName(PeerMemoryKind kind) {
  return kind == PeerMemoryKind::kCuda ? "cuda" : "host";
}

bool PeerMemoryKindBuilt(PeerMemoryKind kind) {
  return kind == PeerMemoryKind::kHost || CudaDevice::Built();
}

// ---- PeerMemory ----

PeerMemory::~PeerMemory() {
  for (size_t i = 0; i < maps_.size(); ++i) {
    if (maps_[i] != nullptr) munmap(maps_[i], bytes_[i % bytes_.size()]);
  }
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
}

absl::Status PeerMemory::MakeOwnPieces(int me, absl::string_view cuda_uuid) {
  if (kind_ == PeerMemoryKind::kHost) {
    for (size_t p = 0; p < bytes_.size(); ++p) {
      bytes_[p] = std::max<size_t>((bytes_[p] + 4095) / 4096 * 4096, 4096);
      const int fd = memfd_create("epserve-peer-memory", MFD_CLOEXEC);
      if (fd < 0) return absl::FailedPreconditionError(Errno("memfd_create"));
      fds_[Index(me, static_cast<int>(p))] = fd;
      if (ftruncate(fd, static_cast<off_t>(bytes_[p])) != 0) {
        return absl::ResourceExhaustedError(Errno("ftruncate of a peer memory piece"));
      }
    }
    return absl::OkStatus();
  }
  if (!CudaDevice::Built()) {
    return absl::UnimplementedError(
        "this build has no CUDA device memory (built without the CUDA toolkit's cuda.h)");
  }
  EPSERVE_ASSIGN_OR_RETURN(cuda_, CudaDevice::ByUuid(cuda_uuid));
  for (size_t p = 0; p < bytes_.size(); ++p) {
    // The descriptor is the device object's: this member's entry is a duplicate of its own.
    EPSERVE_ASSIGN_OR_RETURN(const int fd, cuda_->MakeExportable(&bytes_[p], /*map=*/false));
    fds_[Index(me, static_cast<int>(p))] = dup(fd);
    if (fds_[Index(me, static_cast<int>(p))] < 0) return absl::InternalError(Errno("dup"));
  }
  return absl::OkStatus();
}

absl::Status PeerMemory::Decline(const PeerGroup& group) {
  for (int d = 0; d < group.size; ++d) {
    if (d == group.me) continue;
    EPSERVE_RETURN_IF_ERROR(group.heap->SignalSet(
        group.first_rank + d, group.rendezvous + group.me * group.signal_stride, 1));
  }
  return absl::OkStatus();
}

namespace {

// The socket this member's peers take its descriptors from (an abstract Unix socket named by
// `pid`), or -1 with `error` set.
int ListenForPeers(uint64_t pid, int members, absl::Status& error) {
  const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  socklen_t len = 0;
  const sockaddr_un addr = AddressOf(pid, &len);
  if (listener < 0 || bind(listener, reinterpret_cast<const sockaddr*>(&addr), len) != 0 ||
      listen(listener, members) != 0) {
    error = absl::FailedPreconditionError(Errno("the peer memory socket"));
    if (listener >= 0) close(listener);
    return -1;
  }
  return listener;
}

// Serves peers' connections on `listener` (descriptors `own` of pieces of `sizes` bytes) until
// `expected` is set and that many were served, or the deadline; what went wrong in `error`.
void ServePieces(int listener, const std::vector<int>& own, const std::vector<uint64_t>& sizes,
                 absl::Time deadline, const std::atomic<int>& expected, std::string& error) {
  int served = 0;
  while (absl::Now() < deadline) {
    const int want = expected.load();
    if (want >= 0 && served >= want) return;
    pollfd pfd = {listener, POLLIN, 0};
    if (poll(&pfd, 1, std::min(MillisLeft(deadline), 50)) <= 0) continue;
    const int conn = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    if (SendPieces(conn, own, sizes)) {
      ++served;
    } else {
      error = Errno("sendmsg to a peer");
    }
    close(conn);
  }
  error = "a peer did not take this member's descriptors in time";
}

// Every peer's rendezvous word into `words` (pid + 2: its socket listens; 1: it declined);
// FAILED_PRECONDITION naming a peer that declined.
absl::Status ReadPeerWords(const PeerGroup& group, absl::Time deadline,
                           std::vector<uint64_t>& words) {
  words.assign(group.size, 0);
  for (int d = 0; d < group.size; ++d) {
    if (d == group.me) continue;
    const size_t at = group.rendezvous + d * group.signal_stride;
    EPSERVE_RETURN_IF_ERROR(group.heap->WaitSignal(at, 1, deadline, "peer memory of member", d));
    words[d] = group.heap->SignalLoad(at);
  }
  for (int d = 0; d < group.size; ++d) {
    if (d != group.me && words[d] < 2) {
      return absl::FailedPreconditionError(
          absl::StrCat("member ", d, " could not make its peer memory (its log says why)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PeerMemory::TakePeerPieces(const PeerGroup& group, const std::vector<uint64_t>& words,
                                        absl::Time deadline) {
  absl::Status status;
  for (int d = 0; d < group.size && status.ok(); ++d) {
    if (d == group.me) continue;
    const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t len = 0;
    const sockaddr_un addr = AddressOf(words[d] - 2, &len);
    timeval tv = {MillisLeft(deadline) / 1000, (MillisLeft(deadline) % 1000) * 1000};
    if (sock < 0 || setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
        connect(sock, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
      status = absl::UnavailableError(
          absl::StrCat("member ", d, "'s peer memory socket: ", Errno("connect")));
    } else {
      std::vector<int> fds;
      std::vector<uint64_t> sizes;
      status = ReceivePieces(sock, pieces(), &fds, &sizes);
      for (int p = 0; status.ok() && p < pieces(); ++p) {
        fds_[Index(d, p)] = fds[p];
        if (sizes[p] != bytes_[p]) {
          status = absl::FailedPreconditionError(absl::StrCat(
              "member ", d, "'s piece ", p, " has ", sizes[p], " bytes, this one's ", bytes_[p]));
        }
      }
    }
    if (sock >= 0) close(sock);
  }
  return status;
}

absl::Status PeerMemory::MapHostPieces() {
  maps_.assign(fds_.size(), nullptr);
  for (size_t i = 0; i < fds_.size(); ++i) {
    const size_t size = bytes_[i % bytes_.size()];
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fds_[i], 0);
    if (p == MAP_FAILED) return absl::ResourceExhaustedError(Errno("mmap of peer memory"));
    maps_[i] = p;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PeerMemory>> PeerMemory::Create(const PeerGroup& group,
                                                               PeerMemoryKind kind,
                                                               const std::vector<size_t>& bytes,
                                                               absl::string_view cuda_uuid,
                                                               absl::Time deadline) {
  if (group.heap == nullptr || group.size < 1 || group.me < 0 || group.me >= group.size ||
      bytes.empty() || bytes.size() > kMaxPieces) {
    return absl::InvalidArgumentError(absl::StrCat("peer memory: member ", group.me, " of ",
                                                   group.size, ", ", bytes.size(), " pieces (1 to ",
                                                   kMaxPieces, ")"));
  }
  std::unique_ptr<PeerMemory> m(new PeerMemory());
  m->kind_ = kind;
  m->members_ = group.size;
  m->bytes_ = bytes;
  m->fds_.assign(static_cast<size_t>(group.size) * bytes.size(), -1);

  // This member's pieces, and the socket its peers take their descriptors from.
  absl::Status mine = m->MakeOwnPieces(group.me, cuda_uuid);
  const uint64_t pid = static_cast<uint64_t>(getpid());
  const int listener = mine.ok() && group.size > 1 ? ListenForPeers(pid, group.size, mine) : -1;
  // Rendezvous word: pid + 2 once the socket listens, 1 when this member has nothing to share.
  const uint64_t word = mine.ok() ? pid + 2 : 1;
  for (int d = 0; d < group.size; ++d) {
    if (d == group.me) continue;
    absl::Status s = group.heap->SignalSet(group.first_rank + d,
                                           group.rendezvous + group.me * group.signal_stride, word);
    if (!s.ok()) {
      if (listener >= 0) close(listener);
      return s;
    }
  }

  // Serve peers' connections until every peer that made its pieces has taken ours.
  std::atomic<int> expected{-1};  // set once every peer's word was read
  std::string serve_error;
  std::thread server;
  if (listener >= 0) {
    std::vector<uint64_t> sizes(m->bytes_.begin(), m->bytes_.end());
    std::vector<int> own(m->bytes_.size());
    for (int p = 0; p < m->pieces(); ++p) own[p] = m->fd(group.me, p);
    server = std::thread(
        [&, sizes, own] { ServePieces(listener, own, sizes, deadline, expected, serve_error); });
  }

  // Every peer's word first: where one declined, every member says so (and none connects to a
  // peer that may already be closing its socket), then every peer's descriptors.
  std::vector<uint64_t> words;
  absl::Status status = mine.ok() ? ReadPeerWords(group, deadline, words) : mine;
  const int peers_ok = status.ok() ? group.size - 1 : 0;
  if (status.ok()) status = m->TakePeerPieces(group, words, deadline);
  // Peers that failed never connect; on an error here, serve those that still come until the
  // deadline would be too long: stop at once.
  expected.store(status.ok() ? peers_ok : 0);
  if (server.joinable()) server.join();
  if (listener >= 0) close(listener);
  if (!mine.ok()) return mine;
  if (!status.ok()) return status;
  if (!serve_error.empty() && expected.load() > 0) {
    return absl::UnavailableError(serve_error);
  }
  if (kind == PeerMemoryKind::kHost) EPSERVE_RETURN_IF_ERROR(m->MapHostPieces());
  return m;
}

}  // namespace epserve::shmem
