#include "model/detail/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "model/detail/json.h"

namespace epserve::model::detail {
namespace {

// The safetensors reference implementation refuses larger headers too.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeInfo {
  const char* name;
  size_t bytes;
};
constexpr DtypeInfo kDtypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
    {"F32", 4},  {"F64", 8}, {"I64", 8}, {"U64", 8},
};

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}
absl::Status BadTensor(const std::string& path, absl::string_view tensor, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", tensor, "': ", what));
}

// A whole file mapped read-only; whoever holds it unmaps it.
struct Mapping {
  const unsigned char* data = nullptr;
  uint64_t size_bytes = 0;
};

// Maps the regular file at `path`, which must be long enough for the 8-byte header length.
absl::StatusOr<Mapping> MapFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string what = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(what) : absl::InvalidArgumentError(what);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Bad(path, "not a regular file");
  }
  const uint64_t size_bytes = static_cast<uint64_t>(st.st_size);
  if (size_bytes < 8) {
    ::close(fd);
    return Bad(path, absl::StrCat("file of ", size_bytes,
                                  " bytes is too short for a safetensors header (truncated?)"));
  }
  void* map = ::mmap(nullptr, size_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) return Bad(path, absl::StrCat("mmap failed: ", std::strerror(map_err)));
  return Mapping{static_cast<const unsigned char*>(map), size_bytes};
}

// The JSON header object of the mapped file `m`; *data_start = the offset of the first byte
// after the header.
absl::StatusOr<Json> ParseHeader(const std::string& path, const Mapping& m, uint64_t* data_start) {
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | m.data[i];
  if (header_bytes > kMaxHeaderBytes || header_bytes > m.size_bytes - 8) {
    return Bad(path, absl::StrCat("header length ", header_bytes, " exceeds the file (",
                                  m.size_bytes, " bytes): truncated or not a safetensors file"));
  }
  *data_start = 8 + header_bytes;
  absl::StatusOr<Json> header =
      ParseJson(absl::string_view(reinterpret_cast<const char*>(m.data + 8), header_bytes));
  if (!header.ok()) return Bad(path, absl::StrCat("bad header: ", header.status().message()));
  if (!header->is_object()) return Bad(path, "bad header: not a JSON object");
  return header;
}

// The entry of tensor `name` from its header object `value`, with absolute offsets. Checks
// that its data lies in the `data_bytes` bytes from `data_start` and that its size is
// dtype x shape (for a dtype DtypeBytes knows).
absl::StatusOr<TensorEntry> ParseEntry(const std::string& path, const std::string& name,
                                       const Json& value, uint64_t data_start,
                                       uint64_t data_bytes) {
  auto bad = [&](absl::string_view what) { return BadTensor(path, name, what); };
  if (!value.is_object()) return bad("header entry is not an object");
  const Json* dtype = value.Find("dtype");
  const Json* shape = value.Find("shape");
  const Json* offsets = value.Find("data_offsets");
  if (dtype == nullptr || !dtype->is_string()) return bad("header entry has no string 'dtype'");
  if (shape == nullptr || !shape->is_array()) return bad("header entry has no array 'shape'");
  if (offsets == nullptr || !offsets->is_array() || offsets->array().size() != 2)
    return bad("header entry has no 'data_offsets' [begin, end]");
  TensorEntry e;
  e.name = name;
  e.dtype_name = dtype->string();
  e.dtype = e.dtype_name == "F32"    ? Dtype::kF32
            : e.dtype_name == "F16"  ? Dtype::kF16
            : e.dtype_name == "BF16" ? Dtype::kBF16
                                     : Dtype::kOther;
  // numel with an overflow guard: no real tensor has 2^62 elements.
  int64_t numel = 1;
  for (const Json& d : shape->array()) {
    if (!d.is_integer() || d.integer() < 0) return bad("shape has a dimension that is not a size");
    e.shape.push_back(d.integer());
    if (d.integer() != 0 && numel > (int64_t{1} << 62) / d.integer())
      return bad("shape has too many elements");
    numel *= d.integer();
  }
  for (const Json& o : offsets->array())
    if (!o.is_integer() || o.integer() < 0) return bad("data_offsets are not byte offsets");
  const uint64_t begin = static_cast<uint64_t>(offsets->array()[0].integer());
  const uint64_t end = static_cast<uint64_t>(offsets->array()[1].integer());
  if (begin > end) return bad(absl::StrCat("data_offsets [", begin, ", ", end, ") are reversed"));
  if (end > data_bytes) {
    return bad(absl::StrCat("data_offsets [", begin, ", ", end, ") run past the end of the data (",
                            data_bytes, " bytes): file truncated or header wrong"));
  }
  const size_t elem = DtypeBytes(e.dtype_name);
  if (elem != 0 && static_cast<uint64_t>(numel) * elem != end - begin) {
    return bad(absl::StrCat("data_offsets [", begin, ", ", end, ") hold ", end - begin,
                            " bytes but ", e.dtype_name, " ", e.ShapeString(), " needs ",
                            static_cast<uint64_t>(numel) * elem));
  }
  e.begin = data_start + begin;
  e.end = data_start + end;
  return e;
}

// An error naming a tensor whose (non-empty) data overlaps another's; the offsets it shows
// are relative to `data_start`, as in the header.
absl::Status CheckNoOverlap(const std::string& path,
                            const std::map<std::string, TensorEntry, std::less<>>& tensors,
                            uint64_t data_start) {
  std::vector<const TensorEntry*> by_offset;
  for (const auto& [name, e] : tensors)
    if (e.end > e.begin) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorEntry* a, const TensorEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorEntry& prev = *by_offset[i - 1];
    const TensorEntry& cur = *by_offset[i];
    if (cur.begin < prev.end) {
      return BadTensor(path, cur.name,
                       absl::StrCat("data [", cur.begin - data_start, ", ", cur.end - data_start,
                                    ") overlaps tensor '", prev.name, "' [",
                                    prev.begin - data_start, ", ", prev.end - data_start, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

size_t DtypeBytes(absl::string_view name) {
  for (const DtypeInfo& d : kDtypes)
    if (name == d.name) return d.bytes;
  return 0;
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorEntry::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  EPSERVE_ASSIGN_OR_RETURN(const Mapping mapping, MapFile(path));
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());  // unmaps on every return below
  f->path_ = path;
  f->data_ = mapping.data;
  f->size_ = mapping.size_bytes;
  uint64_t data_start = 0;
  EPSERVE_ASSIGN_OR_RETURN(const Json header, ParseHeader(path, mapping, &data_start));
  for (const auto& [name, value] : header.members()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return Bad(path, "bad header: __metadata__ is not an object");
      continue;
    }
    EPSERVE_ASSIGN_OR_RETURN(TensorEntry e,
                             ParseEntry(path, name, value, data_start, f->size_ - data_start));
    if (!f->tensors_.emplace(name, std::move(e)).second)
      return BadTensor(path, name, "listed twice in the header");
  }
  EPSERVE_RETURN_IF_ERROR(CheckNoOverlap(path, f->tensors_, data_start));
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

const TensorEntry* SafetensorsFile::Find(absl::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status SafetensorsFile::ReadAsFloat(const TensorEntry& e, float* dst) const {
  const unsigned char* src = data_ + e.begin;
  const int64_t n = e.numel();
  switch (e.dtype) {
    case Dtype::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return absl::OkStatus();
    case Dtype::kBF16:
    case Dtype::kF16: {
      const bool bf16 = e.dtype == Dtype::kBF16;
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t bits = static_cast<uint16_t>(src[2 * i] | (src[2 * i + 1] << 8));
        dst[i] = bf16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
      }
      return absl::OkStatus();
    }
    case Dtype::kOther:
      break;
  }
  return BadTensor(path_, e.name,
                   absl::StrCat("dtype ", e.dtype_name, " is not supported (F32, F16, BF16)"));
}

}  // namespace epserve::model::detail
