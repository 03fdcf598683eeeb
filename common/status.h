// Status plumbing shared by every folder.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define EPSERVE_STATUS_CONCAT_INNER(a, b) a##b
#define EPSERVE_STATUS_CONCAT(a, b) EPSERVE_STATUS_CONCAT_INNER(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK. Nests (inside a
// lambda passed to a call that is itself checked): each use names its own temporary.
#define EPSERVE_RETURN_IF_ERROR(expr) \
  EPSERVE_RETURN_IF_ERROR_IMPL(EPSERVE_STATUS_CONCAT(epserve_s_, __COUNTER__), expr)
#define EPSERVE_RETURN_IF_ERROR_IMPL(tmp, expr)             \
  do {                                                      \
    if (::absl::Status tmp = (expr); !tmp.ok()) return tmp; \
  } while (0)

// `lhs` = the value of StatusOr `expr`, or return its status from the enclosing function.
#define EPSERVE_ASSIGN_OR_RETURN(lhs, expr) \
  EPSERVE_ASSIGN_OR_RETURN_IMPL(EPSERVE_STATUS_CONCAT(epserve_so_, __COUNTER__), lhs, expr)
#define EPSERVE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = *std::move(tmp)
