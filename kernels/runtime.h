// The OpenCL runtime of one worker: one device, one context, one in-order queue (and on GPUs a
// second that work can fork to, ForkQueue). Only kernels/ includes OpenCL headers' types in its
// public API.
#pragma once

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dtype.h"
#include "kernels/ffn_blocking.h"
#include "kernels/runtime_options.h"

namespace epserve::kernels {

struct DeviceInfo {
  int platform_index = 0;
  int device_index = 0;
  std::string platform_name;
  std::string device_name;
  std::string device_version;
  std::string driver_version;
  bool is_gpu = false;
  bool is_cpu = false;
  // NVIDIA's compute capability as major * 10 + minor (cl_nv_device_attribute_query), e.g. 90
  // for Hopper; 0 on other devices.
  int nv_compute_capability = 0;
  // The registers a work-group may hold (CL_DEVICE_REGISTERS_PER_BLOCK_NV, a multiprocessor's
  // 64 Ki on every NVIDIA device of compute capability 8.0 to 9.0); 0 on other devices.
  int nv_registers_per_block = 0;
  // CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT (PoCL: 8 on AVX2 hosts, 16 on AVX-512 ones) and
  // CL_DEVICE_MAX_COMPUTE_UNITS; the FFN blocking's candidates follow from them.
  int native_float_width = 1;
  int compute_units = 1;
  // CL_DEVICE_GLOBAL_MEM_CACHE_SIZE in bytes (a GPU's L2), 0 where the driver does not say.
  uint64_t cache_bytes = 0;
  // What the device's compiler builds for, from its predefined macros (a probe kernel run at
  // start-up on CPU devices): "avx512f", "avx2", "avx", "sse" on x86, "" elsewhere or where
  // the probe did not run. PoCL told to build for an older CPU (POCL_LLVM_CPU_NAME=haswell on
  // an AVX-512 host) still reports the host's vector width; native_float_width is capped to
  // what the build target has (8 without AVX-512), and the BF16 dot products need avx512f.
  std::string target_isa;
  // The major version of clang where the device's compiler is clang (PoCL: its LLVM), read by
  // the same probe; 0 unknown.
  int clang_major = 0;
  // The device's UUID, 16 raw bytes (cl_khr_device_uuid; "" without it): how another API's
  // device (CUDA's) is matched to this one.
  std::string uuid;
  // Whether the device imports memory of other APIs by opaque file descriptor
  // (cl_khr_external_memory_opaque_fd; Runtime::ImportOpaqueFd).
  bool imports_opaque_fd = false;
  std::string Describe() const;  // "0:0 Portable Computing Language / pthread-... (driver 3.1)"
};

// Every OpenCL device of every platform.
absl::StatusOr<std::vector<DeviceInfo>> ListDevices();

// An expert FFN's shape, as FFN plans are chosen for: hidden size, intermediate size (the
// columns of this runtime's experts: a slice's where the shared expert is split) and the
// weights' element type.
struct FfnShape {
  int64_t hidden = 0;
  int64_t ffn = 0;
  common::ElementType dtype = common::ElementType::kFp32;
};

// The FFN plan (a form per row class) chosen for one expert shape on a runtime, and how.
struct FfnChoice {
  int64_t hidden = 0;
  int64_t ffn = 0;
  common::ElementType dtype = common::ElementType::kFp32;
  FfnPlan plan;
  FfnBlockingOrigin origin = FfnBlockingOrigin::kDefault;
  double seconds = 0;  // spent choosing (tuning, or reading the cache)
  // "rows 1: pair-fma-direct; 2-8: dot-direct; 9-64: dot; 65+: dot (tuned now in 3.10 s) for
  // H=2048 F=1408 bf16 weights".
  std::string Describe() const;
};

// A device buffer. Move-only; releases the cl_mem when destroyed.
class Buffer {
 public:
  Buffer() = default;
  Buffer(cl_mem mem, size_t bytes) : mem_(mem), bytes_(bytes) {}
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  cl_mem mem() const { return mem_; }
  size_t bytes() const { return bytes_; }

 private:
  cl_mem mem_ = nullptr;
  size_t bytes_ = 0;
};

// What the program-binary cache did for one Runtime (counts of programs).
struct ProgramCacheStats {
  int loaded = 0;          // programs created from a cached binary
  int built = 0;           // programs compiled from source
  int stored = 0;          // binaries written to the cache
  std::string last_error;  // why the cache was last bypassed (unreadable, unwritable), or ""
};

// One command's times on the device's clock (RuntimeOptions::profile_commands): a kernel's
// launch (its function's name) or a transfer ("write", "read"), on the main queue or the
// forked one (Runtime::ForkQueue).
struct CommandTime {
  std::string name;
  uint64_t queued_ns = 0;  // when the host queued it
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
  bool forked = false;
};

// Not thread-safe: one thread drives a Runtime.
class Runtime {
 public:
  static absl::StatusOr<std::unique_ptr<Runtime>> Create(const RuntimeOptions& options);
  ~Runtime();

  const DeviceInfo& device_info() const { return info_; }
  cl_context context() const { return context_; }
  cl_command_queue queue() const { return queue_; }
  cl_device_id device() const { return device_; }
  // The queue kernels are launched on: the forked one between ForkQueue and EndFork, else the
  // main queue.
  cl_command_queue launch_queue() const { return forked_ ? fork_queue_ : queue_; }

  // A fork of the main queue, for work that needs none of what the main queue runs next (the
  // shared expert beside the router and the routed experts). After ForkQueue, launches (and
  // Scratch's buffers) go to a second in-order queue of the device, where they start once
  // every command the main queue holds at ForkQueue has ended; after EndFork they go to the
  // main queue again and run beside the forked ones (devices run two queues at once where
  // they can); after JoinFork the main queue's commands wait for the forked ones. Where
  // concurrent_queues() is false the three do nothing and every launch stays in order on the
  // main queue. Finish waits for both queues and ends a fork left open (an error between
  // ForkQueue and EndFork).
  bool concurrent_queues() const;
  absl::Status ForkQueue();
  absl::Status EndFork();
  absl::Status JoinFork();
  // ForkQueue, `launches`, EndFork: the fork ends whatever `launches` returns (its error
  // first), so that no later launch goes to the forked queue by mistake.
  absl::Status Forked(const std::function<absl::Status()>& launches);

  // With RuntimeOptions::profile_commands: every launch and unstaged transfer since the last
  // call, in the order they were queued, with their device times; it waits for both queues
  // first. Empty without profiling.
  absl::StatusOr<std::vector<CommandTime>> TakeCommandTimes();
  bool profiles_commands() const { return options_.profile_commands; }
  bool short_tiles_with_full() const { return options_.short_tiles_with_full; }
  // Keeps `event` (the command's, from a launch or transfer while profiling; the Runtime
  // releases it) with what ran: `kernel`'s name, else `what`.
  void RecordCommand(cl_event event, cl_kernel kernel, const char* what = "");
  // Whether BF16 expert weights uploaded through this runtime use the tensor-core kernels.
  bool tensor_cores() const { return tensor_cores_; }
  // The most rows a tensor-core tile of the decode form has (RuntimeOptions::mma_decode_rows).
  int64_t mma_decode_rows() const { return mma_decode_rows_; }
  // Whether the tensor-core FFN's 128-row tiles run on wgmma (RuntimeOptions::wgmma): decided
  // at Create, and false again if the sm_90a program then does not build (mma.sync runs).
  bool wgmma() const { return wgmma_; }
  // Whether the router and the shared expert's gate take their work-group forms
  // (RuntimeOptions::work_group_forms).
  bool work_group_forms() const {
    return !info_.is_cpu || options_.work_group_forms == RuntimeOptions::WorkGroupForms::kAlways;
  }
  // Whether this runtime has the BF16 dot-product kernels: BF16 expert weights take the
  // pair-panel layout where ChooseFfnPlan picks its forms for their shape.
  bool bf16_dot() const { return bf16_dot_; }
  // Whether the dot-product kernels run on AMX tiles (RuntimeOptions::bf16_amx), and if not,
  // why (empty where AMX was not asked for).
  bool bf16_amx() const { return bf16_amx_; }
  const std::string& bf16_amx_why_not() const { return bf16_amx_why_not_; }

  // A read-write buffer of `bytes` (contents undefined); bytes == 0 gives an empty Buffer
  // whose mem() is nullptr.
  // On CPU devices, buffers of 2 MiB or more live in host memory asked for in transparent
  // huge pages.
  absl::StatusOr<Buffer> Allocate(size_t bytes);
  // A buffer over host memory [host, host + bytes) that a CPU device reads and writes in place
  // (CL_MEM_USE_HOST_PTR): memory shared with other processes (a peer's mapping of the same
  // pages sees what kernels write once Finish returned). The memory must stay mapped while the
  // buffer lives; FAILED_PRECONDITION on devices with memory of their own, or where the driver
  // would copy instead (`host` not aligned to 4096 bytes).
  absl::StatusOr<Buffer> WrapHostMemory(void* host, size_t bytes);
  // A buffer over memory another API made (CUDA's cuMemCreate, possibly another process's, on
  // this GPU or a peer), imported by the opaque file descriptor `fd` it exported
  // (cl_khr_external_memory_opaque_fd, OpenCL 3.0's clCreateBufferWithProperties); `fd` stays
  // the caller's. UNIMPLEMENTED where the device or the OpenCL loader lacks the import.
  absl::StatusOr<Buffer> ImportOpaqueFd(int fd, size_t bytes);
  // A read-only buffer holding a copy of src[0, bytes), made before this returns.
  absl::StatusOr<Buffer> AllocateCopy(const void* src, size_t bytes);
  // A read-only buffer holding `bytes`, which the Runtime keeps for later calls with the same
  // bytes: a small table of a launch's that repeats from batch to batch (the shared expert's
  // work tiles follow from its row count alone) then costs no allocation and no copy. At most
  // kKeptTables are kept (all dropped when one more is asked for; the device keeps a dropped
  // one until the launches that read it have run). Valid until the next call.
  absl::StatusOr<const Buffer*> KeptTable(std::string_view bytes);
  static constexpr size_t kKeptTables = 1024;
  // A device buffer of at least `bytes` that the kernels of this Runtime use between their
  // launches (one per slot: the router's logits, the partial sums of split GEMMs), grown as
  // batches need; valid until the next Scratch of the same slot. Like every call of a Runtime,
  // from one thread.
  enum ScratchSlot { kRouterLogitsScratch, kSplitKScratch, kNumScratchSlots };
  absl::StatusOr<Buffer*> Scratch(ScratchSlot slot, size_t bytes);
  // Blocking copies between host memory and a buffer (staged through pinned memory where
  // RuntimeOptions::staging says, for blocks of at least kStagedTransferMin bytes).
  absl::Status Write(const Buffer& dst, size_t offset, const void* src, size_t bytes);
  absl::Status Read(const Buffer& src, size_t offset, void* dst, size_t bytes);
  // Write through a second in-order queue of the device (with staging buffers of its own),
  // beside whatever the main queue runs: an upload that overlaps the main queue's kernels and
  // transfers (devices run the two queues at once where they can). Blocking like Write. It may
  // be called from another thread than the one driving the Runtime (one call at a time), as
  // long as `dst` is not in use by the main queue meanwhile.
  absl::Status WriteBeside(const Buffer& dst, size_t offset, const void* src, size_t bytes);
  // `bytes` of pinned host memory (CL_MEM_ALLOC_HOST_PTR, mapped), valid for the Runtime's
  // life: tables the host builds in place and uploads with WriteAsync.
  absl::StatusOr<void*> AllocatePinnedHost(size_t bytes);
  // Queues a copy of src[0, bytes), which lies in memory from AllocatePinnedHost, into dst at
  // `offset`, and returns without waiting for it; commands queued after it on the main queue
  // see the bytes, and src must stay unchanged until the copy has run (Finish). For small
  // tables a pass uploads before its kernels: a blocking Write from pageable memory waits for
  // the queue and for its own copy. INVALID_ARGUMENT where src is not pinned memory of this
  // Runtime's.
  absl::Status WriteAsync(const Buffer& dst, size_t offset, const void* src, size_t bytes);
  // The other way: queues a copy of src[offset, offset + bytes) into dst, which lies in memory
  // from AllocatePinnedHost, and returns without waiting; dst holds the bytes once the queue
  // has run the copy (Finish, or any blocking command queued after it). Several small reads
  // then cost one wait for the device instead of one each.
  absl::Status ReadAsync(const Buffer& src, size_t offset, void* dst, size_t bytes);
  // Staged transfers: the chunk (each of the two staging buffers' size) and the smallest block
  // staged. A chunk of 8 MiB is large enough that a transfer's fixed cost (tens of
  // microseconds) is a few percent of its DMA at any PCIe speed, and splits over up to 8 host
  // threads of 1 MiB each (common::ParallelCopy's grain); below 2 chunks there is no overlap.
  static constexpr size_t kStagingChunk = size_t{8} << 20;
  static constexpr size_t kStagedTransferMin = 2 * kStagingChunk;
  // Whether Write and Read stage large blocks (RuntimeOptions::staging, and the staging
  // buffers could be made).
  bool stages_transfers() const { return staging_[0].host != nullptr; }
  absl::Status Finish();
  // Submits what both queues hold to the device without waiting for it: commands queued
  // before a host step then run during it.
  absl::Status Flush();

  // The kernel `name` of the embedded programs, built (or loaded from the cache) on first use.
  // The cl_kernel stays owned by the Runtime; its arguments are whatever the last caller set.
  absl::StatusOr<cl_kernel> Kernel(std::string_view name);

  // The expert FFN kernel `name` (kernels/cl/expert_ffn.cl) built for form `blocking`: the
  // part of the program that holds it, built on first use of that part and form (the
  // pair-panel kernels' part follows only the form's DotOp). Kernel(name) gives the device
  // default blocking's.
  absl::StatusOr<cl_kernel> FfnKernel(std::string_view name, const FfnBlocking& blocking);
  // The forms of the FFN kernels for experts of this shape and weight dtype on this device,
  // one per row class (kernels/ffn_blocking.h): made on first use of the shape (which may time
  // the candidate forms on the device for a few seconds), the same afterwards. A forced FMA
  // blocking applies to BF16 weights too.
  absl::StatusOr<FfnPlan> ChooseFfnPlan(int64_t hidden, int64_t ffn, common::ElementType dtype);
  // ChooseFfnPlan for each shape, the shapes another process of the host is tuning (holding
  // the shape's cache lock) after the others, so that the workers of a host that serve the
  // same shapes tune different ones at once instead of one after another (their candidates'
  // builds split between them, their timed rounds one at a time: kernels/ffn_tuner.cc).
  absl::Status ChooseFfnPlans(std::span<const FfnShape> shapes);
  // The forms the tuner times for weights of `dtype` on this device: the FMA blockings, or for
  // BF16 weights where bf16_dot() the pair-panel forms (kernels/ffn_tuner.cc says why not
  // both); the first is the untimed default's layout.
  std::vector<FfnBlocking> FfnFormCandidates(common::ElementType dtype) const;
  // Every choice made so far, for logs.
  const std::vector<FfnChoice>& ffn_choices() const;
  // The blocking taken without tuning (the first of FfnBlockingCandidates(device_info())).
  const FfnBlocking& default_ffn_blocking() const { return default_ffn_blocking_; }

  // The folder binaries are cached in ("" when no cache folder could be found).
  const std::string& cache_dir() const { return cache_dir_; }
  const ProgramCacheStats& cache_stats() const;
  // Whether built programs' binaries are written to cache_dir (RuntimeOptions::program_binaries).
  bool stores_program_binaries() const { return store_binaries_; }
  // Builds `source` the way embedded programs are built (same options, same cache) and
  // releases it. Errors carry the build log. For tests of the build path.
  absl::Status BuildProgramForTest(std::string_view source);

 private:
  Runtime() = default;
  // Creates and builds program `name` from `source`, through the binary cache, with the
  // common options plus `extra_options` (without them if the driver refuses them); `sm90a`:
  // its PTX rebuilt for sm_90a (kernels/detail/ptx_patch.h). The caller owns the returned
  // program.
  absl::StatusOr<cl_program> BuildProgram(std::string_view name, std::string_view source,
                                          std::string_view extra_options,
                                          std::string_view variant_options, bool sm90a = false);
  absl::StatusOr<cl_program> BuildProgramWithOptions(std::string_view name, std::string_view source,
                                                     const std::string& options, bool sm90a);
  struct Programs;
  // ChooseFfnPlan, or nullopt (nothing chosen) where `defer_when_busy` and another process
  // holds the shape's cache lock.
  absl::StatusOr<std::optional<FfnPlan>> ChooseFfnPlan(const FfnShape& shape, bool defer_when_busy);
  // The text ChooseFfnPlan's cache key hashes for the expert_ffn program: its source and
  // the options every variant shares.
  std::string FfnProgramKeySource();
  std::vector<FfnChoice>& mutable_ffn_choices();
  DeviceInfo info_;
  RuntimeOptions options_;
  FfnBlocking default_ffn_blocking_;
  cl_device_id device_ = nullptr;
  cl_context context_ = nullptr;
  cl_command_queue queue_ = nullptr;
  cl_command_queue side_queue_ = nullptr;  // WriteBeside's, made on first use
  std::string cache_dir_;
  bool store_binaries_ = false;
  bool tensor_cores_ = false;
  int64_t mma_decode_rows_ = 0;
  bool wgmma_ = false;
  bool bf16_dot_ = false;
  bool bf16_amx_ = false;
  std::string bf16_amx_why_not_;
  // The options every program is built with (detail::ProgramBuildOptions), fixed at Create.
  std::string program_options_;
  std::unique_ptr<Programs> programs_;
  Buffer scratch_[kNumScratchSlots];
  // Pinned staging (RuntimeOptions::staging): two driver buffers made with
  // CL_MEM_ALLOC_HOST_PTR and mapped for the Runtime's life, and the event of each one's last
  // transfer.
  struct Staging {
    cl_mem mem = nullptr;
    void* host = nullptr;
    cl_event busy = nullptr;
  };
  void AddEmbeddedPrograms();
  absl::Status MakeStaging();
  absl::Status MakeStaging(cl_command_queue queue, Staging (&pair)[2]);
  // Unmaps and frees whatever MakeStaging made (staging off afterwards).
  void ReleaseStaging();
  void ReleaseStaging(cl_command_queue queue, Staging (&pair)[2]);
  absl::Status WaitStaging(Staging& s);
  // WriteAsync's and ReadAsync's copy between `buffer` and pinned `host` memory.
  absl::Status QueuePinned(const Buffer& buffer, size_t offset, void* host, size_t bytes,
                           bool write);
  absl::Status WriteOn(cl_command_queue queue, Staging (&pair)[2], const Buffer& dst, size_t offset,
                       const void* src, size_t bytes);
  absl::Status StagedWrite(cl_command_queue queue, Staging (&pair)[2], const Buffer& dst,
                           size_t offset, const void* src, size_t bytes);
  absl::Status StagedRead(const Buffer& src, size_t offset, void* dst, size_t bytes);
  Staging staging_[2];
  Staging side_staging_[2];  // WriteBeside's
  struct Pinned {
    Staging memory;
    size_t bytes = 0;
  };
  std::vector<Pinned> pinned_;  // AllocatePinnedHost's
  // Makes `s` `bytes` of pinned host memory (CL_MEM_ALLOC_HOST_PTR) mapped on `queue`
  // (nothing kept where that fails); ReleaseOne unmaps and frees it.
  absl::Status MapPinned(cl_command_queue queue, size_t bytes, Staging& s);
  void ReleaseOne(cl_command_queue queue, Staging& s);
  int transfer_threads_ = 1;
  // ForkQueue's queue (made on first use), whether launches go there now, the marker of its
  // last forked commands that the main queue has not joined yet, and the scratch buffers of
  // its launches.
  cl_command_queue fork_queue_ = nullptr;
  bool forked_ = false;
  cl_event fork_end_ = nullptr;
  Buffer fork_scratch_[kNumScratchSlots];
  void ReleaseFork();
  // The events RecordCommand keeps until TakeCommandTimes.
  struct Recorded {
    cl_event event;
    cl_kernel kernel;
    const char* what;
    bool forked;
  };
  std::vector<Recorded> recorded_;
  std::map<std::string, Buffer, std::less<>> kept_tables_;  // KeptTable's
};

}  // namespace epserve::kernels
