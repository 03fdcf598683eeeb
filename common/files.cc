#include "common/files.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace epserve::common {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return std::move(bytes).str();
}

}  // namespace epserve::common
