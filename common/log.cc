#include "common/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

namespace epserve::common {
namespace {

std::atomic<int> g_rank{-1};
std::atomic<int> g_level{-1};  // -1: not set yet (read $EPSERVE_LOG_LEVEL on first use)

int LevelFromEnv() {
  const char* env = std::getenv("EPSERVE_LOG_LEVEL");
  if (env == nullptr) return static_cast<int>(LogLevel::kInfo);
  if (std::strcmp(env, "debug") == 0) return static_cast<int>(LogLevel::kDebug);
  if (std::strcmp(env, "warning") == 0) return static_cast<int>(LogLevel::kWarning);
  if (std::strcmp(env, "error") == 0) return static_cast<int>(LogLevel::kError);
  return static_cast<int>(LogLevel::kInfo);
}

}  // namespace

void SetLogRank(int rank) { g_rank.store(rank, std::memory_order_relaxed); }

void SetLogLevel(LogLevel level) {
  g_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

void Log(LogLevel level, std::string_view message) {
  int threshold = g_level.load(std::memory_order_relaxed);
  if (threshold < 0) {
    int expected = -1;
    g_level.compare_exchange_strong(expected, LevelFromEnv(), std::memory_order_relaxed);
    threshold = g_level.load(std::memory_order_relaxed);
  }
  if (static_cast<int>(level) < threshold) return;
  const int rank = g_rank.load(std::memory_order_relaxed);
  std::string line = rank >= 0 ? "[epserve rank " + std::to_string(rank) + "] " : "[epserve] ";
  if (level == LogLevel::kWarning) line += "warning: ";
  line.append(message.data(), message.size());
  line += '\n';
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {  // one write for a line of the usual size; loop only on a short write
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) return;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace epserve::common
