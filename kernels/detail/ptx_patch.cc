#include "kernels/detail/ptx_patch.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"

namespace epserve::kernels::detail {

absl::StatusOr<std::string> PtxForSm90a(std::string_view ptx, int* marks) {
  while (!ptx.empty() && ptx.back() == '\0') ptx.remove_suffix(1);
  std::string out;
  out.reserve(ptx.size());
  int removed = 0;
  for (size_t at = 0;;) {
    const size_t mark = ptx.find(kPtxSm90aMark, at);
    if (mark == std::string_view::npos) {
      out.append(ptx.substr(at));
      break;
    }
    out.append(ptx.substr(at, mark - at));
    at = mark + kPtxSm90aMark.size();
    ++removed;
  }
  if (marks != nullptr) *marks = removed;
  if (removed == 0) {
    return absl::FailedPreconditionError("the PTX has no sm_90a instruction marks");
  }
  // The target directive names exactly sm_90 (a line of its own, perhaps with more targets
  // after a comma, e.g. ", texmode_independent").
  static constexpr std::string_view kTarget = ".target sm_90";
  for (size_t at = out.find(kTarget); at != std::string::npos; at = out.find(kTarget, at + 1)) {
    const size_t end = at + kTarget.size();
    const bool line_start =
        at == 0 || out[at - 1] == '\n' || out[at - 1] == ' ' || out[at - 1] == '\t';
    const bool name_end = end == out.size() || out[end] == '\n' || out[end] == ',' ||
                          out[end] == ' ' || out[end] == '\r' || out[end] == '\t';
    if (line_start && name_end) {
      out.insert(end, "a");
      return out;
    }
  }
  return absl::FailedPreconditionError(
      "the PTX targets no `.target sm_90` (wgmma runs only on sm_90a)");
}

std::vector<std::pair<std::string, int64_t>> SpilledFunctions(std::string_view log) {
  constexpr std::string_view kFunction = "Function properties for ";
  constexpr std::string_view kSpill = " bytes spill stores";
  std::vector<std::pair<std::string, int64_t>> out;
  for (size_t at = log.find(kFunction); at != std::string_view::npos;) {
    const size_t name_at = at + kFunction.size();
    const size_t name_end = log.find_first_of(" \t\r\n", name_at);
    const std::string_view name = log.substr(name_at, name_end - name_at);
    const size_t next = log.find(kFunction, name_at);
    // This function's spill count lies before the next function's properties.
    const size_t spill = log.substr(0, next).find(kSpill, name_at);
    if (spill != std::string_view::npos) {
      size_t digits = spill;
      while (digits > 0 && log[digits - 1] >= '0' && log[digits - 1] <= '9') --digits;
      int64_t bytes = 0;
      for (size_t i = digits; i < spill; ++i) bytes = bytes * 10 + (log[i] - '0');
      if (bytes > 0) out.emplace_back(std::string(name), bytes);
    }
    at = next;
  }
  return out;
}

absl::StatusOr<cl_program> RebuildForSm90a(cl_context context, cl_device_id device,
                                           cl_program program, std::string_view name,
                                           const std::string& options) {
  size_t size = 0;
  cl_int err = clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr);
  std::string ptx(size, '\0');
  unsigned char* ptr = reinterpret_cast<unsigned char*>(ptx.data());
  if (err == CL_SUCCESS && size > 0) {
    err = clGetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof(ptr), &ptr, nullptr);
  }
  clReleaseProgram(program);
  CL_CHECK(err);
  EPSERVE_ASSIGN_OR_RETURN(std::string patched, PtxForSm90a(ptx));
  const auto* bytes = reinterpret_cast<const unsigned char*>(patched.c_str());
  const size_t length = patched.size() + 1;
  cl_int binary_status = CL_SUCCESS;
  cl_program rebuilt =
      clCreateProgramWithBinary(context, 1, &device, &length, &bytes, &binary_status, &err);
  CL_CHECK(err);
  // -cl-nv-verbose: the assembler's report (registers, and whether it serialized wgmma).
  const std::string verbose = options + " -cl-nv-verbose";
  err = clBuildProgram(rebuilt, 1, &device, verbose.c_str(), nullptr, nullptr);
  if (err != CL_SUCCESS) {
    err = clBuildProgram(rebuilt, 1, &device, options.c_str(), nullptr, nullptr);
  }
  const std::string log = BuildLog(rebuilt, device);
  const std::string what = absl::StrCat("program '", std::string(name), "' for sm_90a");
  if (err != CL_SUCCESS) {
    clReleaseProgram(rebuilt);
    return absl::InternalError(
        absl::StrCat(what, " did not build (", ClErrorName(err), "): ", log));
  }
  if (log.find("serializ") != std::string::npos) {
    common::LogWarning(absl::StrCat(what, ": the assembler serializes its wgmma products: ", log));
  } else if (const auto spilled = SpilledFunctions(log); !spilled.empty()) {
    std::string which;
    for (const auto& [function, stored] : spilled) {
      absl::StrAppend(&which, which.empty() ? "" : ", ", function, " (", stored, " bytes)");
    }
    common::LogWarning(absl::StrCat(what, ": the assembler spilled registers to memory in ", which,
                                    ": the register cap is too low for them"));
  } else {
    common::Log(common::LogLevel::kDebug, absl::StrCat(what, ": ", log));
  }
  return rebuilt;
}

}  // namespace epserve::kernels::detail
