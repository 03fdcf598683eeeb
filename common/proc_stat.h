// The leading fields of Linux's /proc/<pid>/stat (or /proc/<pid>/task/<tid>/stat) line.
#pragma once

#include <sys/types.h>

#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>

namespace epserve::common {

struct ProcStat {
  pid_t pid = 0;
  std::string comm;
  char state = '?';  // R running or runnable, S sleeping, D disk wait, Z zombie, ...
  pid_t ppid = 0;
  pid_t pgrp = 0;
};

// Parses "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses, so the
// fields after it start at the last ')'. nullopt for a line of another shape.
inline std::optional<ProcStat> ParseProcStat(const std::string& line) {
  const size_t open = line.find('('), close = line.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close < open) return std::nullopt;
  ProcStat p;
  p.pid = static_cast<pid_t>(std::atoi(line.c_str()));
  p.comm = line.substr(open + 1, close - open - 1);
  std::istringstream rest(line.substr(close + 1));
  rest >> p.state >> p.ppid >> p.pgrp;
  if (!rest) return std::nullopt;
  return p;
}

}  // namespace epserve::common
