#include "common/log.h"

#include <unistd.h>

#include <string>

#include "gtest/gtest.h"

namespace epserve::common {
namespace {

// What `fn` writes to stderr, through a pipe.
template <typename Fn>
std::string CaptureStderr(Fn fn) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0);
  const int saved = dup(STDERR_FILENO);
  dup2(fds[1], STDERR_FILENO);
  fn();
  dup2(saved, STDERR_FILENO);
  close(saved);
  close(fds[1]);
  std::string out;
  char buf[256];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) out.append(buf, n);
  close(fds[0]);
  return out;
}

TEST(Log, PrefixesTheRankAndDropsLinesBelowTheLevel) {
  SetLogLevel(LogLevel::kInfo);
  EXPECT_EQ(CaptureStderr([] { LogInfo("before the rank is known"); }),
            "[epserve] before the rank is known\n");
  SetLogRank(3);
  EXPECT_EQ(CaptureStderr([] {
              LogInfo("serving");
              LogWarning("slow");
              Log(LogLevel::kDebug, "hidden");
            }),
            "[epserve rank 3] serving\n[epserve rank 3] warning: slow\n");
  SetLogLevel(LogLevel::kError);
  EXPECT_EQ(CaptureStderr([] {
              LogInfo("dropped");
              LogError("kept");
            }),
            "[epserve rank 3] kept\n");
}

}  // namespace
}  // namespace epserve::common
