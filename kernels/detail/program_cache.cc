#include "kernels/detail/program_cache.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace epserve::kernels::detail {
namespace {

class Fnv1a64 {
 public:
  explicit Fnv1a64(uint64_t basis) : h_(basis) {}
  void Add(std::string_view bytes) {
    const uint64_t size = bytes.size();  // length prefix: fields cannot run into each other
    for (int i = 0; i < 8; ++i) Byte(static_cast<unsigned char>(size >> (8 * i)));
    for (char c : bytes) Byte(static_cast<unsigned char>(c));
  }
  uint64_t value() const { return h_; }

 private:
  void Byte(unsigned char b) {
    h_ ^= b;
    h_ *= 0x100000001b3ULL;
  }
  uint64_t h_;
};

}  // namespace

std::string ProgramCacheKey(std::string_view source, std::string_view options,
                            const DeviceInfo& device) {
  Fnv1a64 a(0xcbf29ce484222325ULL);
  Fnv1a64 b(0x84222325cbf29ce4ULL);
  for (std::string_view field :
       {source, options, std::string_view(device.platform_name),
        std::string_view(device.device_name), std::string_view(device.device_version),
        std::string_view(device.driver_version)}) {
    a.Add(field);
    b.Add(field);
  }
  return absl::StrFormat("%016x%016x", a.value(), b.value());
}

std::string ProgramCachePath(std::string_view dir, std::string_view name, std::string_view key) {
  return absl::StrCat(absl::string_view(dir.data(), dir.size()), "/",
                      absl::string_view(name.data(), name.size()), "-",
                      absl::string_view(key.data(), key.size()), ".bin");
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  std::error_code ec;
  const std::filesystem::path target(path);
  std::filesystem::create_directories(target.parent_path(), ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", target.parent_path().string(), ": ", ec.message()));
  }
  static std::atomic<int> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    }
  }
  std::filesystem::rename(tmp, target, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    return absl::UnavailableError(
        absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace epserve::kernels::detail
