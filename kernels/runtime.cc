// The Runtime: context, queue, buffers, and the programs built through the binary cache (its
// transfers between host and device are kernels/transfers.cc's). Finding and choosing its device
// is kernels/device.cc's (kernels/detail/device.h).
#include "kernels/runtime.h"

#include <dlfcn.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "common/log.h"
#include "common/parallel.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/device.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/detail/program_cache.h"
#include "kernels/detail/ptx_patch.h"

namespace epserve::embedded {
// Generated from kernels/cl/*.cl at build time (see kernels/CMakeLists.txt).
extern const std::string_view kernels_cl_router;
extern const std::string_view kernels_cl_expert_ffn;
extern const std::string_view kernels_cl_combine;
extern const std::string_view kernels_cl_expert_ffn_mma;
}  // namespace epserve::embedded

namespace epserve::kernels {
namespace {

absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

std::string DefaultCacheDir(const RuntimeOptions& options) {
  if (!options.cache_dir.empty()) return options.cache_dir;
  if (const char* env = std::getenv("EPSERVE_KERNEL_CACHE"); env != nullptr && *env != '\0') {
    return env;
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return absl::StrCat(home, "/.cache/epserve/kernels");
  }
  return "";
}

// RuntimeOptions::mma_decode_rows, else $EPSERVE_MMA_DECODE_ROWS, else the default: 32 (one
// decode form) or 64 (a second, wide one).
absl::StatusOr<int64_t> MmaDecodeRows(const RuntimeOptions& options) {
  int64_t rows = options.mma_decode_rows;
  const char* env = std::getenv("EPSERVE_MMA_DECODE_ROWS");
  if (rows == 0 && env != nullptr && *env != '\0' && !absl::SimpleAtoi(env, &rows)) rows = -1;
  if (rows == 0) rows = detail::kMmaWideDecodeRows;
  if (rows != 32 && rows != 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the tensor-core decode form's rows (mma_decode_rows or $EPSERVE_MMA_DECODE_ROWS) must "
        "be 32 or 64, got ",
        options.mma_decode_rows != 0 ? absl::StrCat(options.mma_decode_rows) : std::string(env)));
  }
  return rows;
}

std::string SourceDir(const RuntimeOptions& options) {
  if (!options.source_dir.empty()) return options.source_dir;
  const char* env = std::getenv("EPSERVE_KERNEL_SOURCES");
  return env != nullptr ? env : "";
}

// Host memory for a CPU device's buffer of `bytes`, in transparent huge pages where the
// kernel offers them (asked for per mapping, so hosts whose default is "madvise" give them
// too): a CPU device reads its weights from host memory, and streaming 100+ MiB of them
// through 4 KiB pages costs a TLB miss every 4 KiB. nullptr: use the driver's allocation.
constexpr size_t kHugePageBytes = size_t{2} << 20;
void* HugePageMemory(size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* p = std::aligned_alloc(kHugePageBytes, rounded);
  if (p != nullptr) (void)madvise(p, rounded, MADV_HUGEPAGE);  // advice only
  return p;
#else
  (void)bytes;
  return nullptr;
#endif
}
void CL_CALLBACK FreeHostMemory(cl_mem, void* host) { std::free(host); }

}  // namespace

Buffer::Buffer(Buffer&& o) noexcept
    : mem_(std::exchange(o.mem_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (mem_ != nullptr) clReleaseMemObject(mem_);
    mem_ = std::exchange(o.mem_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

Buffer::~Buffer() {
  if (mem_ != nullptr) clReleaseMemObject(mem_);
}

// The embedded programs, each built on first use; kernels by name. expert_ffn (`ffn`) is
// built in parts instead (FfnKernel): once per kernel family (FfnFamily) and FFN blocking asked
// for, the kernels of those variants keyed by "<variant options>|<name>".
struct Runtime::Programs {
  struct Program {
    std::string_view name;
    std::string_view source;           // embedded at build time, or source_override
    std::string extra_options;         // device-specific, dropped if the driver refuses them
    std::string variant_options = {};  // this program's own (a variant of a shared source)
    std::string source_override = {};  // read from RuntimeOptions::source_dir
    bool sm90a = false;                // PTX rebuilt for sm_90a (its wgmma instructions live)
    cl_program program = nullptr;
  };
  std::vector<Program> programs;
  Program ffn;                       // expert_ffn's source; never built whole
  std::vector<cl_program> variants;  // expert_ffn's parts
  std::string source_dir;
  std::unordered_map<std::string, cl_kernel> kernels;
  ProgramCacheStats stats;
  std::vector<FfnChoice> ffn_choices;

  // Reads a program's source from source_dir when one is set (once).
  absl::Status LoadSource(Program& p);
  // Creates every kernel of `program` and files it under key_prefix + its name.
  absl::Status AddKernels(cl_program program, std::string_view key_prefix);

  ~Programs() {
    for (auto& [name, kernel] : kernels) clReleaseKernel(kernel);
    for (Program& p : programs) {
      if (p.program != nullptr) clReleaseProgram(p.program);
    }
    for (cl_program v : variants) clReleaseProgram(v);
  }
};

// Which part of expert_ffn.cl (its FFN_FAMILY) holds kernel `name`: 1 the FP32-weight FMA
// kernels, 2 the BF16-weight ones and the widening of BF16 rows, 3 the BF16 dot-product
// kernels and their row gather; 0: not an expert_ffn kernel. A part compiles in about half
// the time of the whole program (PoCL, 2-core host: 0.33 s against 0.69 s before its kernels'
// code generation), which a cold start pays once per blocking the tuner times.
static int FfnFamily(std::string_view name) {
  if (name.ends_with("_wf32")) return 1;
  if (name.ends_with("_wbf16") || name == "gather_bf16_rows") return 2;
  if (name.ends_with("_dot") || name == "gather_rows_to_bf16_pairs") return 3;
  return 0;
}

static std::string FfnBlockingOptions(const FfnBlocking& b) {
  // The remainder blocks: about 2/3 and 1/3 of the main block (12: 8 and 4; 6: 4 and 2).
  const int half = std::max(1, b.rows * 2 / 3);
  const int quarter = std::max(1, std::min(half, b.rows / 3));
  return absl::StrCat("-DFFN_VEC=", b.vec, " -DFFN_ROWS=", b.rows, " -DFFN_ROWS_HALF=", half,
                      " -DFFN_ROWS_QUARTER=", quarter, " -DFFN_PREFETCH_STEPS=", b.prefetch_steps);
}

// The build option of expert_ffn_mma.cl's wgmma tiles.
constexpr char kWgmmaOption[] = " -DMMA_WGMMA=1";
// The register cap (cl_nv_compiler_options, as NVIDIA's compilers spell it) of a tensor-core
// program in the form it is built on a device of `registers` a work-group (MmaRegisterCap).
static std::string MmaRegisterOptions(bool wgmma, int registers) {
  const int cap = detail::MmaRegisterCap(
      registers, wgmma ? detail::kMmaWgmmaWorkGroups : detail::kMmaWorkGroups);
  return absl::StrCat("-cl-nv-maxrregcount=", cap, "|-cl-nv-maxrregcount ", cap);
}

// Whether the tensor-core FFN's 128-row tiles take wgmma (RuntimeOptions::wgmma) on a device of
// compute capability `cc` whose tensor-core kernels run: sm_90 only (wgmma is an sm_90a
// instruction; later GPUs have other ones).
static bool WgmmaWanted(const RuntimeOptions& options, bool tensor_cores, int cc) {
  if (!tensor_cores || cc != 90 || options.wgmma == RuntimeOptions::Wgmma::kOff) return false;
  const char* env = std::getenv("EPSERVE_WGMMA");
  return env == nullptr || std::string_view(env) != "0";
}

// The embedded programs (built on first use), the tensor-core one where it runs.
void Runtime::AddEmbeddedPrograms() {
  programs_->programs = {{"router", embedded::kernels_cl_router, ""},
                         {"combine", embedded::kernels_cl_combine, ""}};
  programs_->ffn = {"expert_ffn", embedded::kernels_cl_expert_ffn, ""};
  if (tensor_cores_) {
    // The decode form of 32 rows, and with mma_decode_rows 64 a wide one of 64 rows in a
    // program of its own (the same source; expert_ffn_mma.cl says how the forms share tiles).
    // With wgmma, the 128-row tiles' program is rebuilt for sm_90a (Runtime::Kernel falls back
    // to mma.sync where that fails).
    const bool wide = mma_decode_rows_ == 64;
    programs_->programs.push_back(
        {"expert_ffn_mma",
         embedded::kernels_cl_expert_ffn_mma,
         MmaRegisterOptions(wgmma_, info_.nv_registers_per_block),
         absl::StrCat("-DMMA_DEC_BM=", detail::kMmaDecodeRows,
                      wide ? absl::StrCat(" -DMMA_LARGE_MIN=", mma_decode_rows_) : "",
                      wgmma_ ? kWgmmaOption : ""),
         {},
         wgmma_});
    if (wide) {
      programs_->programs.push_back(
          {"expert_ffn_mma", embedded::kernels_cl_expert_ffn_mma,
           MmaRegisterOptions(false, info_.nv_registers_per_block),
           absl::StrCat("-DMMA_DEC_BM=", mma_decode_rows_,
                        " -DMMA_DEC_MIN=", detail::kMmaDecodeRows, " -DMMA_DEC_WIDE=1")});
    }
  }
}

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::Create(const RuntimeOptions& options) {
  EPSERVE_ASSIGN_OR_RETURN(std::vector<detail::FoundDevice> devices, detail::EnumerateDevices());
  EPSERVE_ASSIGN_OR_RETURN(detail::FoundDevice chosen,
                           detail::ChooseDevice(devices, options.device, options.local_rank));

  std::unique_ptr<Runtime> rt(new Runtime());
  rt->device_ = chosen.id;
  rt->info_ = std::move(chosen.info);
  rt->cache_dir_ = DefaultCacheDir(options);
  rt->programs_ = std::make_unique<Programs>();
  rt->programs_->source_dir = SourceDir(options);
  rt->options_ = options;
  cl_int err = CL_SUCCESS;
  CL_CHECK((rt->context_ = clCreateContext(nullptr, 1, &rt->device_, nullptr, nullptr, &err), err));
  const cl_command_queue_properties props =
      options.profile_commands ? CL_QUEUE_PROFILING_ENABLE : 0;
  CL_CHECK((rt->queue_ = clCreateCommandQueue(rt->context_, rt->device_, props, &err), err));
  detail::ProbeCpuTarget(rt->context_, rt->device_, rt->queue_, rt->info_);
  using Binaries = RuntimeOptions::ProgramBinaries;
  rt->store_binaries_ =
      !rt->cache_dir_.empty() &&
      (options.program_binaries == Binaries::kAlways ||
       (options.program_binaries == Binaries::kAuto && !detail::IsPoclCpu(rt->info_)));
  // mma.sync with BF16 operands needs sm_80; the program is built only where it runs.
  rt->tensor_cores_ = options.tensor_cores && rt->info_.nv_compute_capability >= 80;
  rt->bf16_dot_ = options.bf16_dot && detail::HostRunsBf16Dot(rt->info_) &&
                  (rt->info_.target_isa.empty() || rt->info_.target_isa == "avx512f");
  detail::DotForm dot_form = detail::DotForm::kNone;
  if (rt->bf16_dot_) {
    // clang 16 and later take the builtin's operands as __bf16 vectors: the kernels then
    // spell the instruction out. Neither form building leaves the FP32-FMA kernels.
    std::string why;
    // clang 16 and later refuse the builtin's int operands: not probed there (the failed
    // build would only print its error count to stderr).
    dot_form =
        detail::ProbeDotForm(rt->context_, rt->device_,
                             options.bf16_dot_inline_asm || rt->info_.clang_major >= 16, &why);
    rt->bf16_dot_ = dot_form != detail::DotForm::kNone;
    if (!rt->bf16_dot_) {
      common::LogWarning(
          absl::StrCat("the device's compiler does not build the BF16 dot-product kernels (", why,
                       "); BF16 weights run on the FP32-FMA kernels"));
    }
  }
  if (rt->bf16_dot_ && options.bf16_amx) {
    std::string why;
    rt->bf16_amx_ = detail::HostRunsAmx(rt->info_, &why) &&
                    detail::ProbeAmxBuilds(rt->context_, rt->device_, &why);
    if (!rt->bf16_amx_) rt->bf16_amx_why_not_ = why;
  }
  EPSERVE_ASSIGN_OR_RETURN(rt->mma_decode_rows_, MmaDecodeRows(options));
  rt->wgmma_ = WgmmaWanted(options, rt->tensor_cores_, rt->info_.nv_compute_capability);
  rt->program_options_ = detail::ProgramBuildOptions(rt->info_.is_cpu, dot_form, rt->bf16_amx_);
  rt->default_ffn_blocking_ = FfnBlockingCandidates(rt->info_).front();
  rt->AddEmbeddedPrograms();
  rt->transfer_threads_ =
      options.transfer_threads > 0 ? options.transfer_threads : common::DefaultCopyThreads();
  using StagingMode = RuntimeOptions::Staging;
  if (options.staging == StagingMode::kAlways ||
      (options.staging == StagingMode::kAuto && !rt->info_.is_cpu)) {
    // Without pinned staging (a driver that refuses the buffers), the driver's own copies.
    if (absl::Status s = rt->MakeStaging(); !s.ok()) {
      common::LogWarning(absl::StrCat("pinned staging buffers unavailable (", s.message(),
                                      "): host<->device copies stay the driver's"));
      rt->ReleaseStaging();
    }
  }
  return rt;
}

Runtime::~Runtime() {
  for (Buffer& b : scratch_) b = Buffer();
  kept_tables_.clear();
  ReleaseFork();
  for (const Recorded& r : recorded_) clReleaseEvent(r.event);
  programs_.reset();  // kernels and programs before the context
  if (queue_ != nullptr) {
    clFinish(queue_);
    for (Pinned& p : pinned_) ReleaseOne(queue_, p.memory);
    ReleaseStaging();
    clReleaseCommandQueue(queue_);
  }
  if (side_queue_ != nullptr) {
    clFinish(side_queue_);
    ReleaseStaging(side_queue_, side_staging_);
    clReleaseCommandQueue(side_queue_);
  }
  if (context_ != nullptr) clReleaseContext(context_);
}

absl::StatusOr<Buffer> Runtime::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer();
  cl_int err = CL_SUCCESS;
  cl_mem mem = nullptr;
  if (info_.is_cpu && bytes >= kHugePageBytes) {
    // The device uses the host memory itself (CL_MEM_USE_HOST_PTR), freed with the buffer.
    if (void* host = HugePageMemory(bytes)) {
      mem = clCreateBuffer(context_, CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, bytes, host, &err);
      if (err == CL_SUCCESS &&
          clSetMemObjectDestructorCallback(mem, FreeHostMemory, host) == CL_SUCCESS) {
        return Buffer(mem, bytes);
      }
      if (err == CL_SUCCESS) clReleaseMemObject(mem);
      std::free(host);
    }
  }
  CL_CHECK((mem = clCreateBuffer(context_, CL_MEM_READ_WRITE, bytes, nullptr, &err), err));
  return Buffer(mem, bytes);
}

absl::StatusOr<Buffer> Runtime::WrapHostMemory(void* host, size_t bytes) {
  if (!info_.is_cpu) {
    return absl::FailedPreconditionError(absl::StrCat(
        info_.device_name, " has memory of its own: it cannot use host memory in place"));
  }
  if (reinterpret_cast<uintptr_t>(host) % 4096 != 0) {
    return absl::FailedPreconditionError("host memory to use in place must be 4096-byte aligned");
  }
  if (bytes == 0) return Buffer();
  cl_int err = CL_SUCCESS;
  cl_mem mem = nullptr;
  CL_CHECK(
      (mem = clCreateBuffer(context_, CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, bytes, host, &err),
       err));
  return Buffer(mem, bytes);
}

absl::StatusOr<Buffer> Runtime::ImportOpaqueFd(int fd, size_t bytes) {
  if (!info_.imports_opaque_fd) {
    return absl::UnimplementedError(absl::StrCat(info_.device_name,
                                                 " does not import memory by file descriptor "
                                                 "(no cl_khr_external_memory_opaque_fd)"));
  }
  // OpenCL 3.0's entry point, from the loader (this library builds against OpenCL 1.2's API).
  using CreateWithProperties =
      cl_mem(CL_API_CALL*)(cl_context, const cl_ulong*, cl_mem_flags, size_t, void*, cl_int*);
  static const auto create =
      reinterpret_cast<CreateWithProperties>(dlsym(RTLD_DEFAULT, "clCreateBufferWithProperties"));
  if (create == nullptr) {
    return absl::UnimplementedError(
        "the OpenCL loader has no clCreateBufferWithProperties (OpenCL 3.0)");
  }
  constexpr cl_ulong kOpaqueFd = 0x2060;    // CL_EXTERNAL_MEMORY_HANDLE_OPAQUE_FD_KHR
  constexpr cl_ulong kDeviceList = 0x2051;  // CL_DEVICE_HANDLE_LIST_KHR
  constexpr cl_ulong kListEnd = 0;          // CL_DEVICE_HANDLE_LIST_END_KHR
  const cl_ulong properties[] = {kOpaqueFd,   static_cast<cl_ulong>(fd),
                                 kDeviceList, reinterpret_cast<cl_ulong>(device_),
                                 kListEnd,    0};
  cl_int err = CL_SUCCESS;
  cl_mem mem = nullptr;
  CL_CHECK((mem = create(context_, properties, CL_MEM_READ_WRITE, bytes, nullptr, &err), err));
  return Buffer(mem, bytes);
}

absl::StatusOr<Buffer*> Runtime::Scratch(ScratchSlot slot, size_t bytes) {
  Buffer& b = forked_ ? fork_scratch_[slot] : scratch_[slot];
  if (b.bytes() < bytes) {
    b = Buffer();  // the old one first: the device may be short of memory
    // Twice what is asked, so that growing batches do not allocate each time.
    EPSERVE_ASSIGN_OR_RETURN(b, Allocate(std::max<size_t>(2 * bytes, 1 << 16)));
  }
  return &b;
}

absl::StatusOr<Buffer> Runtime::AllocateCopy(const void* src, size_t bytes) {
  if (bytes == 0) return Buffer();
  cl_int err = CL_SUCCESS;
  cl_mem mem = nullptr;
  CL_CHECK((mem = clCreateBuffer(context_, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, bytes,
                                 const_cast<void*>(src), &err),
            err));
  return Buffer(mem, bytes);
}

absl::StatusOr<const Buffer*> Runtime::KeptTable(std::string_view bytes) {
  if (auto it = kept_tables_.find(bytes); it != kept_tables_.end()) return &it->second;
  if (kept_tables_.size() >= kKeptTables) kept_tables_.clear();
  EPSERVE_ASSIGN_OR_RETURN(Buffer b, AllocateCopy(bytes.data(), bytes.size()));
  return &kept_tables_.emplace(std::string(bytes), std::move(b)).first->second;
}

absl::Status Runtime::Finish() {
  if (fork_queue_ != nullptr) {
    EPSERVE_RETURN_IF_ERROR(JoinFork());
    CL_CHECK(clFinish(fork_queue_));
  }
  CL_CHECK(clFinish(queue_));
  return absl::OkStatus();
}

const ProgramCacheStats& Runtime::cache_stats() const { return programs_->stats; }

absl::StatusOr<cl_program> Runtime::BuildProgram(std::string_view name, std::string_view source,
                                                 std::string_view extra_options,
                                                 std::string_view variant_options, bool sm90a) {
  const std::string base =
      absl::StrCat(program_options_, variant_options.empty() ? "" : " ", Sv(variant_options));
  // Alternatives are separated by '|' (drivers spell some options differently); the first
  // that builds wins.
  for (absl::string_view extra : absl::StrSplit(Sv(extra_options), '|', absl::SkipEmpty())) {
    absl::StatusOr<cl_program> program =
        BuildProgramWithOptions(name, source, absl::StrCat(base, " ", extra), sm90a);
    if (program.ok()) return program;
    programs_->stats.last_error = absl::StrCat("program '", Sv(name), "' did not build with '",
                                               extra, "': ", program.status().message());
  }
  return BuildProgramWithOptions(name, source, base, sm90a);
}

absl::StatusOr<cl_program> Runtime::BuildProgramWithOptions(std::string_view name,
                                                            std::string_view source,
                                                            const std::string& options,
                                                            bool sm90a) {
  ProgramCacheStats& stats = programs_->stats;
  std::string cache_path;
  if (!cache_dir_.empty()) {
    cache_path =
        detail::ProgramCachePath(cache_dir_, name, detail::ProgramCacheKey(source, options, info_));
    absl::StatusOr<std::string> binary = common::ReadWholeFile(cache_path);
    if (binary.ok() && !binary->empty()) {
      const size_t size = binary->size();
      const auto* bytes = reinterpret_cast<const unsigned char*>(binary->data());
      cl_int binary_status = CL_SUCCESS;
      cl_int err = CL_SUCCESS;
      cl_program program =
          clCreateProgramWithBinary(context_, 1, &device_, &size, &bytes, &binary_status, &err);
      if (err == CL_SUCCESS && binary_status == CL_SUCCESS &&
          clBuildProgram(program, 1, &device_, options.c_str(), nullptr, nullptr) == CL_SUCCESS) {
        ++stats.loaded;
        return program;
      }
      if (program != nullptr) clReleaseProgram(program);
      stats.last_error = absl::StrCat("cached binary ", cache_path, " did not load (",
                                      detail::ClErrorName(err != CL_SUCCESS ? err : binary_status),
                                      "); rebuilt from source");
    }
  }

  const char* text = source.data();
  const size_t length = source.size();
  cl_int err = CL_SUCCESS;
  cl_program program = nullptr;
  CL_CHECK((program = clCreateProgramWithSource(context_, 1, &text, &length, &err), err));
  const cl_int build_err = clBuildProgram(program, 1, &device_, options.c_str(), nullptr, nullptr);
  if (build_err != CL_SUCCESS) {
    const std::string log = detail::BuildLog(program, device_);
    clReleaseProgram(program);
    const absl::Status s = detail::ClError(build_err, "clBuildProgram", __FILE__, __LINE__);
    return absl::Status(
        s.code(), absl::StrCat("building OpenCL program '", Sv(name), "' for ", info_.device_name,
                               ": ", s.message(), "\nbuild log:\n", log));
  }
  ++stats.built;
  if (sm90a) {
    EPSERVE_ASSIGN_OR_RETURN(program,
                             detail::RebuildForSm90a(context_, device_, program, name, options));
  }

  if (store_binaries_ && !cache_path.empty()) {
    size_t size = 0;
    if (clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr) ==
            CL_SUCCESS &&
        size > 0) {
      std::string binary(size, '\0');
      unsigned char* ptr = reinterpret_cast<unsigned char*>(binary.data());
      if (clGetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof(ptr), &ptr, nullptr) ==
          CL_SUCCESS) {
        if (absl::Status s = detail::WriteFileAtomically(cache_path, binary); s.ok()) {
          ++stats.stored;
        } else {
          stats.last_error = std::string(s.message());
        }
      }
    } else {
      stats.last_error = absl::StrCat("the driver gave no binary for program '", Sv(name), "'");
    }
  }
  return program;
}

absl::Status Runtime::BuildProgramForTest(std::string_view source) {
  EPSERVE_ASSIGN_OR_RETURN(cl_program program, BuildProgram("test", source, {}, {}));
  clReleaseProgram(program);
  return absl::OkStatus();
}

absl::Status Runtime::Programs::LoadSource(Program& p) {
  if (source_dir.empty() || !p.source_override.empty()) return absl::OkStatus();
  const std::string path = absl::StrCat(source_dir, "/", Sv(p.name), ".cl");
  absl::StatusOr<std::string> text = common::ReadWholeFile(path);
  if (!text.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "kernel source '", path, "' cannot be read (EPSERVE_KERNEL_SOURCES names the folder)"));
  }
  p.source_override = *std::move(text);
  p.source = p.source_override;
  return absl::OkStatus();
}

absl::Status Runtime::Programs::AddKernels(cl_program program, std::string_view key_prefix) {
  cl_uint num_kernels = 0;
  CL_CHECK(clCreateKernelsInProgram(program, 0, nullptr, &num_kernels));
  std::vector<cl_kernel> made(num_kernels);
  CL_CHECK(clCreateKernelsInProgram(program, num_kernels, made.data(), nullptr));
  std::vector<std::string> names(num_kernels);
  for (cl_uint i = 0; i < num_kernels; ++i) {
    size_t size = 0;
    cl_int err = clGetKernelInfo(made[i], CL_KERNEL_FUNCTION_NAME, 0, nullptr, &size);
    if (err == CL_SUCCESS) {
      names[i].resize(size);
      err = clGetKernelInfo(made[i], CL_KERNEL_FUNCTION_NAME, size, names[i].data(), nullptr);
    }
    if (err != CL_SUCCESS) {
      for (cl_kernel k : made) clReleaseKernel(k);
      CL_CHECK(err);
    }
    while (!names[i].empty() && names[i].back() == '\0') names[i].pop_back();
  }
  for (cl_uint i = 0; i < num_kernels; ++i) {
    kernels.emplace(absl::StrCat(Sv(key_prefix), names[i]), made[i]);
  }
  return absl::OkStatus();
}

absl::StatusOr<cl_kernel> Runtime::Kernel(std::string_view name) {
  if (FfnFamily(name) != 0) return FfnKernel(name, default_ffn_blocking_);
  const std::string key(name);
  if (auto it = programs_->kernels.find(key); it != programs_->kernels.end()) return it->second;
  for (Programs::Program& p : programs_->programs) {
    if (p.program != nullptr) continue;
    EPSERVE_RETURN_IF_ERROR(programs_->LoadSource(p));
    absl::StatusOr<cl_program> program =
        BuildProgram(p.name, p.source, p.extra_options, p.variant_options, p.sm90a);
    if (!program.ok() && p.sm90a) {
      common::LogWarning(
          absl::StrCat("the tensor-core FFN keeps mma.sync: ", program.status().message()));
      p.sm90a = wgmma_ = false;
      p.variant_options = absl::StrReplaceAll(p.variant_options, {{kWgmmaOption, ""}});
      p.extra_options = MmaRegisterOptions(/*wgmma=*/false, info_.nv_registers_per_block);
      program = BuildProgram(p.name, p.source, p.extra_options, p.variant_options);
    }
    if (!program.ok()) return program.status();
    p.program = *program;
    EPSERVE_RETURN_IF_ERROR(programs_->AddKernels(p.program, ""));
    if (auto it = programs_->kernels.find(key); it != programs_->kernels.end()) return it->second;
  }
  return absl::NotFoundError(absl::StrCat("no OpenCL kernel named '", Sv(name), "'"));
}

absl::StatusOr<cl_kernel> Runtime::FfnKernel(std::string_view name, const FfnBlocking& blocking) {
  const int family = FfnFamily(name);
  if (family == 0) {
    return absl::NotFoundError(absl::StrCat("no expert FFN kernel named '", Sv(name), "'"));
  }
  // The dot kernels' blocking is their own: one part per DotOp (the default blocking's, an
  // FMA one, builds the default op).
  const std::string variant =
      family == 3 ? absl::StrCat("-DFFN_FAMILY=3 -DFFN_DOT_OP=",
                                 static_cast<int>(blocking.dot ? blocking.dot_op
                                                               : FfnBlocking::DotOp::kDefault))
                  : absl::StrCat(FfnBlockingOptions(blocking), " -DFFN_FAMILY=", family);
  const std::string key = absl::StrCat(variant, "|", Sv(name));
  if (auto it = programs_->kernels.find(key); it != programs_->kernels.end()) return it->second;
  Programs::Program& p = programs_->ffn;
  EPSERVE_RETURN_IF_ERROR(programs_->LoadSource(p));
  EPSERVE_ASSIGN_OR_RETURN(cl_program program,
                           BuildProgram(p.name, p.source, p.extra_options, variant));
  programs_->variants.push_back(program);
  EPSERVE_RETURN_IF_ERROR(programs_->AddKernels(program, absl::StrCat(variant, "|")));
  if (auto it = programs_->kernels.find(key); it != programs_->kernels.end()) return it->second;
  return absl::NotFoundError(absl::StrCat("no OpenCL kernel named '", Sv(name), "'"));
}

std::string Runtime::FfnProgramKeySource() {
  Programs::Program& p = programs_->ffn;
  (void)programs_->LoadSource(p);  // an unreadable override fails the build that follows instead
  return absl::StrCat(Sv(p.source), "\n", program_options_, "\n", p.extra_options);
}

const std::vector<FfnChoice>& Runtime::ffn_choices() const { return programs_->ffn_choices; }
std::vector<FfnChoice>& Runtime::mutable_ffn_choices() { return programs_->ffn_choices; }

}  // namespace epserve::kernels