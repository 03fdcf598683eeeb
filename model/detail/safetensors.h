// One safetensors file, memory-mapped read-only: an 8-byte little-endian header length N,
// N bytes of JSON header ({name: {dtype, shape, data_offsets: [begin, end]}, optional
// "__metadata__"}), then the data; offsets are relative to the first byte after the header.
// Open validates every entry (offsets inside the file, sizes matching dtype x shape, no two
// ranges overlapping), so later reads never leave the mapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/half.h"

namespace epserve::model::detail {

enum class Dtype {
  kF32,
  kF16,
  kBF16,
  kOther,  // any other safetensors dtype (F64, I8, F8_E4M3, ...): listed, never converted
};

// Bytes of one element, 0 for a dtype this reader does not know.
size_t DtypeBytes(absl::string_view name);

struct TensorEntry {
  std::string name;
  std::string dtype_name;  // as written in the header, e.g. "BF16"
  Dtype dtype = Dtype::kOther;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // absolute offsets of the data in the file
  uint64_t end = 0;
  int64_t numel() const;
  std::string ShapeString() const;  // e.g. "[8, 64]"
};

// Immutable after Open; all methods are thread-safe.
class SafetensorsFile {
 public:
  // INVALID_ARGUMENT (NOT_FOUND when the file is missing) naming `path` and, where one is
  // at fault, the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size_bytes() const { return size_; }
  // The entry named `name`, or nullptr.
  const TensorEntry* Find(absl::string_view name) const;
  const std::map<std::string, TensorEntry, std::less<>>& tensors() const { return tensors_; }

  // Converts the `entry.numel()` elements of `entry` (kF32, kF16 or kBF16) to FP32 `dst`.
  // Touches only the pages of that tensor.
  absl::Status ReadAsFloat(const TensorEntry& entry, float* dst) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  const unsigned char* data_ = nullptr;  // the whole file, mapped read-only
  uint64_t size_ = 0;
  std::map<std::string, TensorEntry, std::less<>> tensors_;
};

// Half-precision conversions (common/half.h).
using common::Bf16ToFloat;
using common::FloatToBf16;
using common::FloatToFp16;
using common::Fp16ToFloat;

}  // namespace epserve::model::detail
