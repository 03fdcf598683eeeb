// Fuzz target: the JSON parser and config.json interpretation. Input: a config.json; the
// checkpoint folder holds nothing else, so a config that parses must then fail cleanly on
// the missing weights.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/strings/string_view.h"
#include "model/detail/json.h"
#include "model/synthetic.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  epserve::model::detail::ParseJson(text).IgnoreError();
  static const std::string folder = [] {
    char tmpl[] = "/tmp/epserve-fuzz-config-XXXXXX";
    return std::string(mkdtemp(tmpl));
  }();
  const std::string config = folder + "/config.json";
  if (FILE* f = std::fopen(config.c_str(), "wb")) {
    std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  auto source = epserve::model::OpenModel(folder, 0);
  if (source.ok()) __builtin_trap();  // there are no weights: it cannot open
  return 0;
}
