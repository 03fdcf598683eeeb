// Fuzz target: the safetensors reader. Input: a whole .safetensors file. Every tensor the
// reader accepts must convert without reading outside the file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "model/detail/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An in-memory file, opened by path like a checkpoint shard.
  const int fd = memfd_create("fuzz.safetensors", 0);
  if (fd < 0) return 0;
  size_t written = 0;
  while (written < size) {
    const ssize_t n = write(fd, data + written, size - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto file = epserve::model::detail::SafetensorsFile::Open(path);
  if (file.ok()) {
    std::vector<float> values;
    for (const auto& [name, entry] : (*file)->tensors()) {
      if (entry.numel() > (1 << 20)) continue;
      values.resize(static_cast<size_t>(entry.numel()));
      (*file)->ReadAsFloat(entry, values.data()).IgnoreError();
    }
  }
  close(fd);
  return 0;
}
