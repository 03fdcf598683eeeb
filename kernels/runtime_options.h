// The options of a worker's OpenCL runtime (kernels/runtime.h), in a header of their own
// without OpenCL, so that what sets them (the epserve executable's flags) needs no OpenCL
// headers. Plain data; a Runtime reads them once, when it is created.
#pragma once

#include <string>

namespace epserve::kernels {

struct RuntimeOptions {
  // "cpu", "gpu" or "<platform>:<device>". With "gpu" and several GPUs, local_rank picks one.
  std::string device = "cpu";
  int local_rank = 0;
  // Use the tensor-core expert FFN for BF16 weights where the device has one (NVIDIA, compute
  // capability 8.0 or more). false keeps the portable kernels everywhere.
  bool tensor_cores = true;
  // Use AVX512-BF16 dot products (vdpbf16ps) for BF16 weights on x86 CPU devices of PoCL whose
  // host has them (kernels/detail/ffn_layout.h, pair panels). false keeps FP32 FMAs.
  bool bf16_dot = true;
  // Spell the dot kernels' vdpbf16ps as inline assembly even where the compiler's builtin
  // builds (the form clang 16 and later need; tests compare the two forms bit for bit).
  bool bf16_dot_inline_asm = false;
  // Run the dot-product kernels' rows through AMX tiles (tdpbf16ps, 16 rows x 16 k pairs x 16
  // columns an instruction) where the host's CPU has AMX-BF16 and the kernel grants the tile
  // state (Intel Sapphire Rapids and later). false keeps vdpbf16ps.
  bool bf16_amx = true;
  // Program-binary cache folder; "" means $EPSERVE_KERNEL_CACHE, else ~/.cache/epserve/kernels.
  // The FFN tuning's choices are kept there too.
  std::string cache_dir;
  // Which built programs' binaries go into cache_dir. kAuto: every driver's but PoCL's. To
  // hand out a program's binary PoCL compiles every kernel in it to machine code (0.3-0.5 s a
  // kernel on a 2-core host, eight in the FFN program: 3 s for each FFN blocking a cold start
  // builds), a form it does not run: at a launch it compiles the kernel again for the launch's
  // work-group size. Its own cache ($POCL_CACHE_DIR, else ~/.cache/pocl) keeps each program's
  // bitcode and the machine code of the kernels that ran, which is all a warm start needs.
  // kAlways: every driver's (tests of the cache); kOff: none. Binaries found are read always.
  enum class ProgramBinaries { kAuto, kAlways, kOff };
  ProgramBinaries program_binaries = ProgramBinaries::kAuto;
  // A folder to read the kernel sources from (<name>.cl, e.g. kernels/cl) instead of the copies
  // embedded at build time, so that a kernel can be changed and timed without rebuilding;
  // "" means $EPSERVE_KERNEL_SOURCES, else the embedded sources.
  std::string source_dir;
  // The FFN kernels' forms (kernels/ffn_blocking.h): "" means $EPSERVE_FFN_BLOCKING, else
  // chosen per shape and row class (cache, or timed now when tune_ffn); a ParseFfnPlan form
  // (one form for every row class, or one per class) forces them.
  std::string ffn_blocking;
  // Time the candidates on the device when the tuning cache has no entry for a shape; false
  // takes the device default instead.
  bool tune_ffn = true;
  // Where Write and Read of large blocks go through two pinned (page-locked) staging buffers
  // of the driver's, a chunk at a time: the host-side copy of one chunk on transfer_threads
  // threads while the DMA of the other runs (drivers copy pageable memory through a staging
  // buffer of their own, on one thread, without that overlap). kAuto: on devices with memory
  // of their own (not CPUs); kAlways: on every device (tests run the path on CPUs with it);
  // kOff: the driver's blocking copies from the caller's memory.
  enum class Staging { kAuto, kAlways, kOff };
  Staging staging = Staging::kAuto;
  // Threads of the staged copies' host side; 0: common::DefaultCopyThreads().
  int transfer_threads = 0;
  // The router and the shared expert's gate in their work-group forms (many work-items per
  // token or row, for GPUs). kAuto: on devices other than CPUs; kAlways: on every device (tests
  // run them on CPUs with it).
  enum class WorkGroupForms { kAuto, kAlways };
  WorkGroupForms work_group_forms = WorkGroupForms::kAuto;
  // Whether Runtime::ForkQueue sends launches to a second queue of the device that runs beside
  // the main one (the shared expert beside the router and the routed experts). kAuto: on
  // devices other than CPUs (PoCL's kernels each take every core already); kAlways: on every
  // device (tests run the path on CPUs with it); kOff: every launch in order on one queue.
  enum class ConcurrentQueues { kAuto, kAlways, kOff };
  ConcurrentQueues concurrent_queues = ConcurrentQueues::kAuto;
  // Tiles of the tensor-core FFN with at most this many rows take a decode form (several
  // work-groups a multiprocessor, the weights streamed) instead of the 128-row tiles: 32 (one
  // form) or 64 (tiles of 33-64 rows in a wide form of their own); 0 means
  // $EPSERVE_MMA_DECODE_ROWS, else kernels::detail::kMmaWideDecodeRows (64).
  int mma_decode_rows = 0;
  // Hopper's warpgroup MMA (wgmma) for the tensor-core FFN's 128-row tiles on devices of
  // compute capability 9.0, whose PTX is then rebuilt for sm_90a (kernels/detail/ptx_patch.h):
  // mma.sync reaches about half of what their tensor cores do. kAuto: $EPSERVE_WGMMA ("0" off),
  // else on; kOff: mma.sync everywhere. Where the driver does not build the sm_90a program the
  // runtime warns and keeps mma.sync.
  enum class Wgmma { kAuto, kOff };
  Wgmma wgmma = Wgmma::kAuto;
  // Whether an expert's short last tile always goes with its full tiles to the tensor-core
  // FFN's 128-row kernels (kernels/detail/ffn_mma.h, ShortTilesWithFullOnes), not only where
  // one expert's weights exceed the device's cache: tests run that path on small shapes with it.
  bool short_tiles_with_full = false;
  // Record each launch's and transfer's device times (CL_QUEUE_PROFILING_ENABLE) for
  // Runtime::TakeCommandTimes: a timeline of the kernels, for benchmarks.
  bool profile_commands = false;
};

}  // namespace epserve::kernels
