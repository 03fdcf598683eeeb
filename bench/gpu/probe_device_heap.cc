// Probe for a device-memory symmetric heap across processes (the GPU data path): can memory
// that one process allocates on its GPU with the CUDA driver's VMM API (cuMemCreate, POSIX
// file-descriptor handle) be imported by another process into its OpenCL context on another
// GPU (cl_khr_external_memory_opaque_fd), and how fast does that process's OpenCL then write
// and copy into it, against a plain device-to-device copy of the same bytes?
//
//   probe_device_heap [--bytes=1073741824] [--owner-gpu=1] [--user-gpu=0] [--reps=20]
//                     [--transfer=scm|pidfd]
//
// The process forks before either touches a driver. The parent (the owner) creates the memory
// on --owner-gpu and hands its file descriptor to the child (the user) over a Unix socket
// (SCM_RIGHTS), or lets the child take it with pidfd_getfd. The child imports it into an
// OpenCL context of --user-gpu and times, each over --reps runs ended by clFinish: a kernel
// that writes every word, clEnqueueCopyBuffer from a local buffer into it, and the same copy
// between two local buffers. It then writes a pattern the owner checks word for word. The
// owner times cuMemcpyPeer between buffers of the two GPUs as the baseline. One JSON object
// per figure on stdout; exit 0 when the import worked and the check passed, 1 otherwise,
// 77 where there is no usable CUDA device.
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <CL/cl_ext.h>
#include <cuda.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/flags.h"

namespace {

struct Options {
  int64_t bytes = int64_t{1} << 30;
  int64_t owner_gpu = 1;
  int64_t user_gpu = 0;
  int64_t reps = 20;
  std::string transfer = "scm";
  bool user_cuda_init = false;
  bool same_process = false;
  // 0: flags READ_WRITE and the device list; 1: flags 0 (the extension's example); 2: no
  // device list; 3: the entry point looked up through the platform instead of the loader.
  int64_t import_variant = 0;
};

// Where the user process is, on stderr at once (a crash inside a driver call says where).
void Step(const char* what) {
  std::fprintf(stderr, "user: %s\n", what);
  std::fflush(stderr);
}

#define CU_OK(call)                                                               \
  do {                                                                            \
    const CUresult r_ = (call);                                                   \
    if (r_ != CUDA_SUCCESS) {                                                     \
      const char* name_ = nullptr;                                                \
      cuGetErrorName(r_, &name_);                                                 \
      std::fprintf(stderr, "owner: %s failed: %s\n", #call, name_ ? name_ : "?"); \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

#define CL_OK(call)                                                          \
  do {                                                                       \
    const cl_int e_ = (call);                                                \
    if (e_ != CL_SUCCESS) {                                                  \
      std::fprintf(stderr, "user: %s failed: OpenCL error %d\n", #call, e_); \
      return 1;                                                              \
    }                                                                        \
  } while (0)

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Emit(const char* what, double bytes, double seconds) {
  std::printf("{\"probe\":\"%s\",\"bytes\":%.0f,\"ms\":%.3f,\"gb_per_s\":%.1f}\n", what, bytes,
              seconds * 1e3, bytes / seconds / 1e9);
  std::fflush(stdout);
}

// ---- passing the descriptor ----

bool SendFd(int sock, int fd, int64_t bytes) {
  struct msghdr msg = {};
  struct iovec iov = {&bytes, sizeof(bytes)};
  char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
  return sendmsg(sock, &msg, 0) == static_cast<ssize_t>(sizeof(bytes));
}

int ReceiveFd(int sock, int64_t* bytes) {
  struct msghdr msg = {};
  struct iovec iov = {bytes, sizeof(*bytes)};
  char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  if (recvmsg(sock, &msg, 0) != static_cast<ssize_t>(sizeof(*bytes))) return -1;
  struct cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  if (cmsg == nullptr || cmsg->cmsg_type != SCM_RIGHTS) return -1;
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(cmsg), sizeof(int));
  return fd;
}

// The owner's fd number travels as data; the user takes a copy with pidfd_getfd (Linux 5.6,
// needs ptrace rights over the owner, which a parent's child of the same user has).
int TakeFdOfPeer(pid_t pid, int remote_fd) {
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) return -1;
  const int fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, remote_fd, 0));
  close(pidfd);
  return fd;
#else
  (void)pid;
  (void)remote_fd;
  return -1;
#endif
}

// ---- the owner: CUDA on owner_gpu ----

int Owner(const Options& o, int sock) {
  CU_OK(cuInit(0));
  int count = 0;
  CU_OK(cuDeviceGetCount(&count));
  if (count <= std::max(o.owner_gpu, o.user_gpu)) {
    std::fprintf(stderr, "owner: %d CUDA devices, need %lld\n", count,
                 static_cast<long long>(std::max(o.owner_gpu, o.user_gpu) + 1));
    return 77;
  }
  CUdevice dev = 0, peer = 0;
  CU_OK(cuDeviceGet(&dev, static_cast<int>(o.owner_gpu)));
  CU_OK(cuDeviceGet(&peer, static_cast<int>(o.user_gpu)));
  int fd_ok = 0;
  CU_OK(cuDeviceGetAttribute(&fd_ok,
                             CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev));
  std::printf("{\"owner_gpu\":%lld,\"posix_fd_handles\":%d}\n", static_cast<long long>(o.owner_gpu),
              fd_ok);
  CUcontext ctx = nullptr, peer_ctx = nullptr;
  CU_OK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU_OK(cuDevicePrimaryCtxRetain(&peer_ctx, peer));
  CU_OK(cuCtxSetCurrent(ctx));

  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = static_cast<int>(o.owner_gpu);
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  CU_OK(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  const size_t size = (static_cast<size_t>(o.bytes) + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  CU_OK(cuMemCreate(&handle, size, &prop, 0));
  int fd = -1;
  CU_OK(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CUdeviceptr ptr = 0;
  CU_OK(cuMemAddressReserve(&ptr, size, 0, 0, 0));
  CU_OK(cuMemMap(ptr, size, 0, handle, 0));
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_OK(cuMemSetAccess(ptr, size, &access, 1));
  CU_OK(cuMemsetD32(ptr, 0, size / 4));
  CU_OK(cuCtxSynchronize());

  int64_t sent = static_cast<int64_t>(size);
  bool ok = o.transfer == "pidfd" ? send(sock, &fd, sizeof(fd), 0) == sizeof(fd) &&
                                        send(sock, &sent, sizeof(sent), 0) == sizeof(sent)
                                  : SendFd(sock, fd, sent);
  if (!ok) {
    std::fprintf(stderr, "owner: could not send the descriptor\n");
    return 1;
  }

  // Baseline while the user works: cuMemcpyPeer between plain buffers of the two GPUs.
  CUdeviceptr src = 0, dst = 0;
  CU_OK(cuMemAlloc(&src, size));
  if (o.owner_gpu != o.user_gpu) {
    int can = 0;
    CU_OK(cuDeviceCanAccessPeer(&can, dev, peer));
    std::printf("{\"cuda_peer_access\":%d}\n", can);
    if (can) CU_OK(cuCtxEnablePeerAccess(peer_ctx, 0));
  }
  CU_OK(cuCtxSetCurrent(peer_ctx));
  CU_OK(cuMemAlloc(&dst, size));
  if (o.owner_gpu != o.user_gpu) {
    int can = 0;
    CU_OK(cuDeviceCanAccessPeer(&can, peer, dev));
    if (can) CU_OK(cuCtxEnablePeerAccess(ctx, 0));
  }
  CU_OK(cuCtxSetCurrent(ctx));
  CU_OK(cuMemcpyPeer(dst, peer_ctx, src, ctx, size));  // warm-up
  CU_OK(cuCtxSynchronize());
  double t0 = Now();
  for (int64_t r = 0; r < o.reps; ++r) CU_OK(cuMemcpyPeer(dst, peer_ctx, src, ctx, size));
  CU_OK(cuCtxSynchronize());
  Emit("cuda_memcpy_peer_owner_to_user_gpu", static_cast<double>(size) * o.reps, Now() - t0);

  // Wait for the user's pattern, then check every word.
  char done = 0;
  if (recv(sock, &done, 1, 0) != 1 || done != 'W') {
    std::fprintf(stderr, "owner: the user did not finish (import failed?)\n");
    return 1;
  }
  std::vector<uint32_t> host(size / 4);
  CU_OK(cuMemcpyDtoH(host.data(), ptr, size));
  size_t bad = 0;
  for (size_t i = 0; i < host.size(); ++i) bad += host[i] != static_cast<uint32_t>(i * 2654435761u);
  std::printf("{\"check\":\"owner reads the user's pattern\",\"words\":%zu,\"wrong\":%zu}\n",
              host.size(), bad);
  std::fflush(stdout);
  char reply = bad == 0 ? 'K' : 'X';
  send(sock, &reply, 1, 0);
  cuMemUnmap(ptr, size);
  cuMemAddressFree(ptr, size);
  cuMemRelease(handle);
  close(fd);
  return bad == 0 ? 0 : 1;
}

// ---- the user: OpenCL on user_gpu ----

const char* kKernels = R"CL(
__kernel void fill(__global uint* p) {
  const size_t i = get_global_id(0);
  p[i] = (uint)(i * 2654435761u);
}
)CL";

int User(const Options& o, int sock, pid_t owner) {
  int64_t size = 0;
  int fd = -1;
  if (o.transfer == "pidfd") {
    int remote = -1;
    if (recv(sock, &remote, sizeof(remote), MSG_WAITALL) != sizeof(remote) ||
        recv(sock, &size, sizeof(size), MSG_WAITALL) != sizeof(size)) {
      return 1;
    }
    fd = TakeFdOfPeer(owner, remote);
  } else {
    fd = ReceiveFd(sock, &size);
  }
  std::printf("{\"transfer\":\"%s\",\"fd\":%d}\n", o.transfer.c_str(), fd);
  std::fflush(stdout);
  if (fd < 0) return 1;
  if (o.user_cuda_init) {
    Step("cuInit in the importing process");
    if (cuInit(0) != CUDA_SUCCESS) return 1;
    CUdevice d = 0;
    CUcontext c = nullptr;
    if (cuDeviceGet(&d, static_cast<int>(o.user_gpu)) != CUDA_SUCCESS ||
        cuDevicePrimaryCtxRetain(&c, d) != CUDA_SUCCESS || cuCtxSetCurrent(c) != CUDA_SUCCESS) {
      return 1;
    }
  }

  cl_uint num_platforms = 0;
  CL_OK(clGetPlatformIDs(0, nullptr, &num_platforms));
  std::vector<cl_platform_id> platforms(num_platforms);
  CL_OK(clGetPlatformIDs(num_platforms, platforms.data(), nullptr));
  cl_device_id device = nullptr;
  for (cl_platform_id p : platforms) {
    cl_uint n = 0;
    if (clGetDeviceIDs(p, CL_DEVICE_TYPE_GPU, 0, nullptr, &n) != CL_SUCCESS ||
        n <= static_cast<cl_uint>(o.user_gpu)) {
      continue;
    }
    std::vector<cl_device_id> devices(n);
    CL_OK(clGetDeviceIDs(p, CL_DEVICE_TYPE_GPU, n, devices.data(), nullptr));
    device = devices[o.user_gpu];
    break;
  }
  if (device == nullptr) {
    std::fprintf(stderr, "user: no OpenCL GPU %lld\n", static_cast<long long>(o.user_gpu));
    return 1;
  }
  char ext[16384] = {};
  CL_OK(clGetDeviceInfo(device, CL_DEVICE_EXTENSIONS, sizeof(ext) - 1, ext, nullptr));
  const bool has_fd = std::strstr(ext, "cl_khr_external_memory_opaque_fd") != nullptr;
  std::printf("{\"user_gpu\":%lld,\"cl_khr_external_memory_opaque_fd\":%d}\n",
              static_cast<long long>(o.user_gpu), has_fd ? 1 : 0);
  std::fflush(stdout);
  cl_int err = CL_SUCCESS;
  Step("clCreateContext");
  cl_context ctx = clCreateContext(nullptr, 1, &device, nullptr, nullptr, &err);
  CL_OK(err);
  Step("clCreateCommandQueueWithProperties");
  cl_command_queue q = clCreateCommandQueueWithProperties(ctx, device, nullptr, &err);
  CL_OK(err);
  Step("clCreateBufferWithProperties (import)");
  const cl_mem_properties with_list[] = {CL_EXTERNAL_MEMORY_HANDLE_OPAQUE_FD_KHR,
                                         static_cast<cl_mem_properties>(fd),
                                         CL_DEVICE_HANDLE_LIST_KHR,
                                         reinterpret_cast<cl_mem_properties>(device),
                                         CL_DEVICE_HANDLE_LIST_END_KHR,
                                         0};
  const cl_mem_properties without_list[] = {CL_EXTERNAL_MEMORY_HANDLE_OPAQUE_FD_KHR,
                                            static_cast<cl_mem_properties>(fd), 0};
  const cl_mem_properties* props = o.import_variant == 2 ? without_list : with_list;
  const cl_mem_flags flags = o.import_variant == 1 ? 0 : CL_MEM_READ_WRITE;
  using CreateFn = cl_mem(CL_API_CALL*)(cl_context, const cl_mem_properties*, cl_mem_flags, size_t,
                                        void*, cl_int*);
  CreateFn create = &clCreateBufferWithProperties;
  if (o.import_variant == 3) {
    cl_platform_id platform = nullptr;
    CL_OK(clGetDeviceInfo(device, CL_DEVICE_PLATFORM, sizeof(platform), &platform, nullptr));
    create = reinterpret_cast<CreateFn>(
        clGetExtensionFunctionAddressForPlatform(platform, "clCreateBufferWithProperties"));
    std::printf("{\"platform_entry_point\":%d}\n", create != nullptr ? 1 : 0);
    std::fflush(stdout);
    if (create == nullptr) return 1;
  }
  cl_mem imported = create(ctx, props, flags, static_cast<size_t>(size), nullptr, &err);
  std::printf("{\"import\":\"clCreateBufferWithProperties\",\"error\":%d}\n", err);
  std::fflush(stdout);
  CL_OK(err);
  cl_mem local_a = clCreateBuffer(ctx, CL_MEM_READ_WRITE, static_cast<size_t>(size), nullptr, &err);
  CL_OK(err);
  cl_mem local_b = clCreateBuffer(ctx, CL_MEM_READ_WRITE, static_cast<size_t>(size), nullptr, &err);
  CL_OK(err);
  cl_program prog = clCreateProgramWithSource(ctx, 1, &kKernels, nullptr, &err);
  CL_OK(err);
  CL_OK(clBuildProgram(prog, 1, &device, "", nullptr, nullptr));
  cl_kernel fill = clCreateKernel(prog, "fill", &err);
  CL_OK(err);
  const size_t words = static_cast<size_t>(size) / 4;
  auto time_reps = [&](auto&& enqueue) -> double {
    enqueue();  // warm-up
    clFinish(q);
    const double t0 = Now();
    for (int64_t r = 0; r < o.reps; ++r) enqueue();
    clFinish(q);
    return Now() - t0;
  };
  auto fill_into = [&](cl_mem m) {
    clSetKernelArg(fill, 0, sizeof(cl_mem), &m);
    clEnqueueNDRangeKernel(q, fill, 1, nullptr, &words, nullptr, 0, nullptr, nullptr);
  };
  const double bytes = static_cast<double>(size) * o.reps;
  Emit("opencl_kernel_writes_local", bytes, time_reps([&] { fill_into(local_a); }));
  Emit("opencl_kernel_writes_imported_peer_memory", bytes, time_reps([&] { fill_into(imported); }));
  Emit("opencl_copy_local_to_local", bytes, time_reps([&] {
         clEnqueueCopyBuffer(q, local_a, local_b, 0, 0, size, 0, nullptr, nullptr);
       }));
  Emit("opencl_copy_local_to_imported_peer_memory", bytes, time_reps([&] {
         clEnqueueCopyBuffer(q, local_a, imported, 0, 0, size, 0, nullptr, nullptr);
       }));
  Emit("opencl_copy_imported_peer_memory_to_local", bytes, time_reps([&] {
         clEnqueueCopyBuffer(q, imported, local_b, 0, 0, size, 0, nullptr, nullptr);
       }));
  fill_into(imported);  // the pattern the owner checks
  CL_OK(clFinish(q));
  const char done = 'W';
  send(sock, &done, 1, 0);
  char verdict = 0;
  recv(sock, &verdict, 1, 0);
  clReleaseKernel(fill);
  clReleaseProgram(prog);
  clReleaseMemObject(imported);
  clReleaseMemObject(local_a);
  clReleaseMemObject(local_b);
  clReleaseCommandQueue(q);
  clReleaseContext(ctx);
  close(fd);
  return verdict == 'K' ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  epserve::common::FlagSet fs("probe_device_heap",
                              "Device memory of one process's GPU imported into another "
                              "process's OpenCL context on another GPU: works? how fast?");
  fs.Add("bytes", &o.bytes, "Bytes of the shared allocation (rounded up to the granularity)");
  fs.Add("owner-gpu", &o.owner_gpu, "CUDA device index of the memory's owner");
  fs.Add("user-gpu", &o.user_gpu, "GPU index (CUDA and OpenCL order) of the importing process");
  fs.Add("reps", &o.reps, "Timed repetitions of each transfer");
  fs.Add("transfer", &o.transfer, "How the descriptor travels: scm (SCM_RIGHTS) or pidfd");
  fs.Add("import-variant", &o.import_variant,
         "0: flags READ_WRITE and a device list; 1: flags 0; 2: no device list; 3: the entry "
         "point through clGetExtensionFunctionAddressForPlatform");
  fs.Add("same-process", &o.same_process,
         "Owner and user as two threads of one process instead of two processes");
  fs.Add("user-cuda-init", &o.user_cuda_init,
         "The importing process initialises CUDA (a context on its GPU) before OpenCL");
  if (const absl::Status s = fs.Parse(argc, argv); !s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (fs.help_requested()) {
    std::printf("%s", fs.Usage().c_str());
    return 0;
  }
  if (o.bytes < 4096 || o.reps < 1 || (o.transfer != "scm" && o.transfer != "pidfd")) {
    std::fprintf(stderr, "--bytes >= 4096, --reps >= 1, --transfer scm|pidfd\n");
    return 2;
  }
  int socks[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, socks) != 0) return 1;
  const pid_t owner = getpid();
  if (o.same_process) {
    int owner_code = 1;
    std::thread owner_thread([&] { owner_code = Owner(o, socks[0]); });
    const int user_code = User(o, socks[1], owner);
    shutdown(socks[1], SHUT_RDWR);  // an owner still waiting for the user stops waiting
    owner_thread.join();
    std::printf("{\"owner_exit\":%d,\"user_exit\":%d,\"same_process\":1}\n", owner_code, user_code);
    return owner_code != 0 ? owner_code : user_code;
  }
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    close(socks[0]);
    std::_Exit(User(o, socks[1], owner));
  }
  close(socks[1]);
  const int owner_code = Owner(o, socks[0]);
  if (owner_code != 0) kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  const int user_code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  std::printf("{\"owner_exit\":%d,\"user_exit\":%d,\"user_signal\":%d}\n", owner_code, user_code,
              WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  return owner_code != 0 ? owner_code : user_code;
}
