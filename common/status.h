// Status plumbing shared by every folder.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns the status of `expr` from the enclosing function when it is not OK.
#define EPSERVE_RETURN_IF_ERROR(expr)                                            \
  do {                                                                           \
    if (::absl::Status epserve_s_ = (expr); !epserve_s_.ok()) return epserve_s_; \
  } while (0)

#define EPSERVE_STATUS_CONCAT_INNER(a, b) a##b
#define EPSERVE_STATUS_CONCAT(a, b) EPSERVE_STATUS_CONCAT_INNER(a, b)

// `lhs` = the value of StatusOr `expr`, or return its status from the enclosing function.
#define EPSERVE_ASSIGN_OR_RETURN(lhs, expr) \
  EPSERVE_ASSIGN_OR_RETURN_IMPL(EPSERVE_STATUS_CONCAT(epserve_so_, __LINE__), lhs, expr)
#define EPSERVE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = *std::move(tmp)
