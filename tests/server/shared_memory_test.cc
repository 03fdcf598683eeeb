#include "server/shared_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace epserve::server {
namespace {

// A POSIX shared memory object of `bytes` random bytes, unlinked at the end of the test.
class ShmObject {
 public:
  explicit ShmObject(size_t bytes) : key_(absl::StrCat("/epserve_shm_test_", getpid(), "_", n_++)) {
    fd_ = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
    std::mt19937_64 rng(std::random_device{}());
    bytes_.resize(bytes);
    for (char& c : bytes_) c = static_cast<char>(rng());
    EXPECT_EQ(pwrite(fd_, bytes_.data(), bytes, 0), static_cast<ssize_t>(bytes));
  }
  ~ShmObject() {
    close(fd_);
    shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  const std::string& bytes() const { return bytes_; }
  void Truncate(size_t bytes) { EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }

 private:
  static inline int n_ = 0;
  std::string key_, bytes_;
  int fd_ = -1;
};

TEST(SharedMemoryRegistry, MapsTheRegisteredBytesAndChecksEveryUse) {
  ShmObject obj(10000);
  SharedMemoryRegistry reg;
  ASSERT_TRUE(reg.Register("r", obj.key(), 4097, 5000).ok());  // not page-aligned
  auto r = reg.Find("r");
  ASSERT_TRUE(r.ok()) << r.status();
  auto span = (*r)->Span(10, 100, "input 'x'");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(std::memcmp(*span, obj.bytes().data() + 4097 + 10, 100), 0);
  auto past = (*r)->Span(4990, 11, "input 'x'");
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(past.status().message().find("lie outside it (5000 bytes)"), std::string::npos)
      << past.status();
  auto status = reg.Status("");
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(status->size(), 1u);
  EXPECT_EQ((*status)[0].offset, 4097u);
  EXPECT_EQ((*status)[0].key, obj.key());
  // The owner shrinks the object: uses past its new end are refused, not SIGBUS.
  obj.Truncate(4097 + 50);
  EXPECT_TRUE((*r)->Span(0, 50, "input 'x'").ok());
  auto shrunk = (*r)->Span(0, 51, "input 'x'");
  EXPECT_NE(shrunk.status().message().find("shrunk by its owner"), std::string::npos)
      << shrunk.status();
}

TEST(SharedMemoryRegistry, BadRegistrationsAreClearErrors) {
  ShmObject obj(4096);
  SharedMemoryRegistry reg(2);
  EXPECT_EQ(reg.Register("", obj.key(), 0, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Register("a", "", 0, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Register("a", obj.key(), 0, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Register("a", "/epserve_no_such_key", 0, 10).code(), absl::StatusCode::kNotFound);
  absl::Status past = reg.Register("a", obj.key(), 4000, 97);
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(past.message().find("past the end"), std::string::npos) << past;
  EXPECT_TRUE(reg.Register("a", obj.key(), 0, 10).ok());
  EXPECT_EQ(reg.Register("a", obj.key(), 0, 10).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(reg.Register("b", obj.key(), 0, 10).ok());
  EXPECT_EQ(reg.Register("c", obj.key(), 0, 10).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(reg.Find("zzz").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg.Status("zzz").status().code(), absl::StatusCode::kNotFound);
}

// A region in use stays mapped after it is unregistered (and after its object is unlinked):
// the request holding it finishes with valid memory; new uses no longer find the name.
TEST(SharedMemoryRegistry, UnregisterWhileInUseKeepsTheMappingForItsUsers) {
  auto obj = std::make_unique<ShmObject>(8192);
  const std::string expect = obj->bytes().substr(0, 8192);
  SharedMemoryRegistry reg;
  ASSERT_TRUE(reg.Register("r", obj->key(), 0, 8192).ok());
  auto held = reg.Find("r");
  ASSERT_TRUE(held.ok());
  EXPECT_TRUE(reg.Unregister("r").ok());
  EXPECT_TRUE(reg.Unregister("r").ok());  // unknown names are no error (Triton's rule)
  EXPECT_EQ(reg.Find("r").status().code(), absl::StatusCode::kNotFound);
  obj.reset();  // unlinked by its owner
  auto span = (*held)->Span(0, 8192, "input 'x'");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_EQ(std::memcmp(*span, expect.data(), 8192), 0);
  std::memset(*span, 0x5a, 8192);  // still writable
}

// The owner shrinks its object after a request was checked and before its rows are read and
// written: rank 0 must survive the accesses past the new end (SIGBUS otherwise), the region
// must say it faulted (so the request is answered with an error) and be refused from then
// on, and the bytes still inside the object, and other regions, are untouched.
TEST(SharedMemoryRegistry, ShrunkWhileInUseFaultsTheRegionNotTheProcess) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = 3 * page + 100;
  ShmObject obj(bytes), other(page);
  SharedMemoryRegistry reg;
  ASSERT_TRUE(reg.Register("r", obj.key(), 0, bytes).ok());
  ASSERT_TRUE(reg.Register("o", other.key(), 0, page).ok());
  auto r = reg.Find("r");
  auto o = reg.Find("o");
  ASSERT_TRUE(r.ok() && o.ok());
  auto span = (*r)->Span(0, bytes, "input 'x'");
  ASSERT_TRUE(span.ok()) << span.status();
  EXPECT_FALSE((*r)->faulted());
  obj.Truncate(page);  // after the check
  std::string read(bytes, '\0');
  std::memcpy(read.data(), *span, bytes);         // reads past the new end
  std::memset(*span + page + 7, 0x5a, 2 * page);  // and writes past it
  EXPECT_TRUE((*r)->faulted());
  EXPECT_EQ(std::memcmp(read.data(), obj.bytes().data(), page), 0);  // inside: as it was
  EXPECT_NE((*r)->CheckIntact("input 'x'").message().find("shrunk by its owner while in use"),
            std::string::npos);
  auto again = (*r)->Span(0, 10, "input 'x'");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("shrunk by its owner while in use"), std::string::npos)
      << again.status();
  EXPECT_FALSE((*o)->faulted());
  EXPECT_TRUE((*o)->CheckIntact("input 'y'").ok());
  // A shrink within the last page faults nothing, yet the region is no longer whole.
  other.Truncate(page - 1);
  EXPECT_FALSE((*o)->CheckIntact("input 'y'").ok());
  other.Truncate(page);  // (its last byte now reads as zero)
  auto fine = (*o)->Span(0, page, "input 'y'");
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(std::memcmp(*fine, other.bytes().data(), page - 1), 0);
}

// The server opens a key with its own credentials: an object it may not open for reading and
// writing is PERMISSION_DENIED. (Run as another user in a child, since root may open anything.)
TEST(SharedMemoryRegistry, AnObjectTheServerMayNotOpenIsPermissionDenied) {
  if (geteuid() != 0) GTEST_SKIP() << "switching to another user needs root";
  ShmObject obj(4096);  // mode 0600, this user's
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    SharedMemoryRegistry reg;
    _exit(reg.Register("r", obj.key(), 0, 16).code() == absl::StatusCode::kPermissionDenied ? 0
                                                                                            : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: not PERMISSION_DENIED, 2: could not switch users";
}

// The handler only repairs registered mappings: any other SIGBUS still ends the process.
TEST(SharedMemoryRegistryDeathTest, OtherFaultsStillEndTheProcess) {
  ShmObject obj(4096), mapped(8192);
  SharedMemoryRegistry reg;
  ASSERT_TRUE(reg.Register("r", obj.key(), 0, 4096).ok());  // installs the handler
  const int fd = shm_open(mapped.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  auto* p = static_cast<volatile char*>(mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd, 0));
  ASSERT_NE(p, MAP_FAILED);
  mapped.Truncate(0);
  // Killed by SIGBUS, or, under AddressSanitizer (whose handler ours chains to), by its
  // report's abort.
  EXPECT_EXIT({ (void)p[4096]; },
              [](int status) {
                return WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
              },
              "");
  munmap(const_cast<char*>(p), 8192);
  close(fd);
}

}  // namespace
}  // namespace epserve::server
