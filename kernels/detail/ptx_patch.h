// Hopper's warpgroup MMA (wgmma) from OpenCL C. Private to kernels/.
// NVIDIA's OpenCL compiler writes PTX for `.target sm_90`, where wgmma does not assemble, and
// takes no option for sm_90a. A kernel therefore writes each such instruction as an
// inline-assembly comment that starts with kPtxSm90aMark (the compiler still fills in the
// operand registers); PtxForSm90a turns the program's PTX (CL_PROGRAM_BINARIES) into PTX for
// sm_90a with those instructions live, which clCreateProgramWithBinary then builds.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/detail/device.h"

namespace epserve::kernels::detail {

// The comment mark of an instruction for sm_90a (expert_ffn_mma.cl's WGMMA_MARK).
inline constexpr std::string_view kPtxSm90aMark = "// @W@ ";

// `ptx` (text, trailing NULs allowed) with every kPtxSm90aMark removed and its `.target sm_90`
// made `.target sm_90a`. An error when it has no mark (the program was not built with its
// sm_90a instructions) or no `.target sm_90` line (a device other than sm_90). *marks (when
// given) is set to the number of marks removed.
absl::StatusOr<std::string> PtxForSm90a(std::string_view ptx, int* marks = nullptr);

// The functions whose registers the assembler spilled to memory, by its verbose report (NVIDIA's
// `-cl-nv-verbose`, ptxas's "Function properties for NAME" then "N bytes spill stores"): each
// name with the bytes it stores. A spill in the tensor-core tiles means a register cap too low
// for them (MmaRegisterCap); a cap too high costs a work-group a multiprocessor instead, which
// no report says (docs/ARCHITECTURE.md).
std::vector<std::pair<std::string, int64_t>> SpilledFunctions(std::string_view log);

// `program` (built from source for `device`; released here whatever happens) rebuilt from its
// PTX made sm_90a's (PtxForSm90a), with `options`. The assembler's report goes to the debug
// log, or to a warning where it says the wgmma products had to be serialized or registers were
// spilled (slow but right).
// The error of a driver that does not build it carries the build log.
absl::StatusOr<cl_program> RebuildForSm90a(cl_context context, cl_device_id device,
                                           cl_program program, std::string_view name,
                                           const std::string& options);

}  // namespace epserve::kernels::detail
