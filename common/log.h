// The one logging seam of library code: a line to stderr prefixed with the process's MPI rank
// ("[epserve rank 2] ..."), at a level, below which lines are dropped. Library code logs
// through here, never printf, so that a deployment can filter or redirect it in one place.
// Thread-safe: each line is written with one write(2), so lines of several threads do not
// interleave.
#pragma once

#include <string_view>

namespace epserve::common {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// The rank every later line names (-1, the default: no rank known, "[epserve]"). Call once
// when the rank is known.
void SetLogRank(int rank);
// Lines below `level` are dropped (default kInfo; $EPSERVE_LOG_LEVEL=debug|info|warning|error
// read at the first line sets it unless this was called).
void SetLogLevel(LogLevel level);

void Log(LogLevel level, std::string_view message);
inline void LogInfo(std::string_view message) { Log(LogLevel::kInfo, message); }
inline void LogWarning(std::string_view message) { Log(LogLevel::kWarning, message); }
inline void LogError(std::string_view message) { Log(LogLevel::kError, message); }

}  // namespace epserve::common
