// Typed reads of a checkpoint's config.json, for model/checkpoint.cc.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status.h"
#include "model/detail/json.h"

namespace epserve::model::detail {

// Typed access to config.json keys; a missing or null key takes the default (the value the
// family's transformers configuration class uses), a key of the wrong type is an error that
// names the file and the key.
class ConfigReader {
 public:
  ConfigReader(const Json& root, std::string path) : root_(root), path_(std::move(path)) {}

  const std::string& path() const { return path_; }
  bool Has(absl::string_view key) const {
    const Json* v = root_.Find(key);
    return v != nullptr && !v->is_null();
  }

  absl::Status Error(absl::string_view key, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": \"", key, "\" ", what));
  }

  absl::StatusOr<int64_t> Int(absl::string_view key) const {
    if (!Has(key)) return Error(key, "is missing");
    return IntOr(key, 0);
  }
  absl::StatusOr<int64_t> IntOr(absl::string_view key, int64_t def) const {
    if (!Has(key)) return def;
    const Json& v = *root_.Find(key);
    if (!v.is_integer()) return Error(key, absl::StrCat("must be an integer, got ", Describe(v)));
    return v.integer();
  }
  absl::StatusOr<double> NumberOr(absl::string_view key, double def) const {
    if (!Has(key)) return def;
    const Json& v = *root_.Find(key);
    if (!v.is_number()) return Error(key, absl::StrCat("must be a number, got ", Describe(v)));
    return v.number();
  }
  absl::StatusOr<bool> BoolOr(absl::string_view key, bool def) const {
    if (!Has(key)) return def;
    const Json& v = *root_.Find(key);
    if (!v.is_bool()) return Error(key, absl::StrCat("must be true or false, got ", Describe(v)));
    return v.bool_value();
  }
  absl::StatusOr<std::string> StringOr(absl::string_view key, std::string def) const {
    if (!Has(key)) return def;
    const Json& v = *root_.Find(key);
    if (!v.is_string()) return Error(key, absl::StrCat("must be a string, got ", Describe(v)));
    return v.string();
  }
  absl::StatusOr<std::vector<int64_t>> IntListOr(absl::string_view key) const {
    std::vector<int64_t> out;
    if (!Has(key)) return out;
    const Json& v = *root_.Find(key);
    if (!v.is_array())
      return Error(key, absl::StrCat("must be a list of integers, got ", Describe(v)));
    for (const Json& e : v.array()) {
      if (!e.is_integer()) return Error(key, "must be a list of integers");
      out.push_back(e.integer());
    }
    return out;
  }
  absl::StatusOr<std::vector<std::string>> StringListOr(absl::string_view key) const {
    std::vector<std::string> out;
    if (!Has(key)) return out;
    const Json& v = *root_.Find(key);
    if (!v.is_array())
      return Error(key, absl::StrCat("must be a list of strings, got ", Describe(v)));
    for (const Json& e : v.array()) {
      if (!e.is_string()) return Error(key, "must be a list of strings");
      out.push_back(e.string());
    }
    return out;
  }
  // A positive count that fits in int.
  absl::StatusOr<int> Count(absl::string_view key, bool required, int64_t def) const {
    EPSERVE_ASSIGN_OR_RETURN(int64_t v, required ? Int(key) : IntOr(key, def));
    if (v < 1 || v > (int64_t{1} << 30)) return Error(key, absl::StrCat("must be >= 1, got ", v));
    return static_cast<int>(v);
  }

 private:
  static std::string Describe(const Json& v) {
    if (v.is_string()) return absl::StrCat("\"", v.string(), "\"");
    if (v.is_number()) return absl::StrCat(v.number());
    return std::string(Json::TypeName(v.type()));
  }

  const Json& root_;
  std::string path_;
};

}  // namespace epserve::model::detail
