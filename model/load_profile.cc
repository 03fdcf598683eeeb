#include "model/load_profile.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/status.h"
#include "model/detail/json.h"

namespace epserve::model {

absl::StatusOr<ExpertLoadProfile> ParseExpertLoadProfile(absl::string_view json) {
  EPSERVE_ASSIGN_OR_RETURN(detail::Json root, detail::ParseJson(json));
  if (!root.is_object()) return absl::InvalidArgumentError("an EPLB profile is a JSON object");
  const detail::Json* experts = root.Find("num_experts");
  const detail::Json* layers = root.Find("layers");
  if (experts == nullptr || !experts->is_integer() || experts->integer() < 1 ||
      experts->integer() > (1 << 20)) {
    return absl::InvalidArgumentError("\"num_experts\" must be an integer in [1, 2^20]");
  }
  if (layers == nullptr || !layers->is_object()) {
    return absl::InvalidArgumentError("\"layers\" must be an object of layer id -> loads");
  }
  ExpertLoadProfile p;
  p.num_experts = static_cast<int>(experts->integer());
  for (const auto& [key, loads] : layers->members()) {
    int layer = -1;
    if (!absl::SimpleAtoi(key, &layer) || layer < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"layers\" key '", key, "' is not a layer id (an integer >= 0)"));
    }
    if (!loads.is_array() || loads.array().size() != static_cast<size_t>(p.num_experts)) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer,
                                                     ": loads must be an array of ", p.num_experts,
                                                     " numbers (num_experts)"));
    }
    std::vector<double>& out = p.layers[layer];
    for (const detail::Json& v : loads.array()) {
      if (!v.is_number() || !std::isfinite(v.number()) || v.number() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("layer ", layer, ": every load must be a finite number >= 0"));
      }
      out.push_back(v.number());
    }
  }
  return p;
}

std::string ExpertLoadProfileJson(const ExpertLoadProfile& profile) {
  std::string s = absl::StrCat("{\"num_experts\": ", profile.num_experts, ", \"layers\": {");
  bool first_layer = true;
  for (const auto& [layer, loads] : profile.layers) {
    absl::StrAppend(&s, first_layer ? "" : ", ", "\"", layer, "\": [");
    for (size_t e = 0; e < loads.size(); ++e) absl::StrAppend(&s, e > 0 ? ", " : "", loads[e]);
    absl::StrAppend(&s, "]");
    first_layer = false;
  }
  return s + "}}\n";
}

absl::StatusOr<ExpertLoadProfile> ReadExpertLoadProfile(const std::string& path) {
  absl::StatusOr<std::string> text = common::ReadWholeFile(path);
  if (!text.ok()) {
    return absl::Status(text.status().code(),
                        absl::StrCat("--eplb-profile ", path, ": ", text.status().message()));
  }
  absl::StatusOr<ExpertLoadProfile> p = ParseExpertLoadProfile(*text);
  if (!p.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--eplb-profile ", path, ": ", p.status().message()));
  }
  return p;
}

}  // namespace epserve::model
