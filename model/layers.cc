#include "model/layers.h"

#include <algorithm>
#include <memory>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/share.h"

namespace epserve::model {
namespace {

absl::Status Bad(absl::string_view selection, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("--layers=", selection, ": ", what));
}

// A non-negative decimal index, digits only.
bool ParseIndex(absl::string_view text, int64_t* out) {
  if (text.empty() || text.size() > 9) return false;
  for (char ch : text)
    if (!absl::ascii_isdigit(static_cast<unsigned char>(ch))) return false;
  return absl::SimpleAtoi(text, out);
}

// The shared expert's intermediate columns [begin, begin + width) of `inner`.
class SharedSlice final : public WeightSource {
 public:
  SharedSlice(const WeightSource& inner, int64_t begin, int64_t width)
      : inner_(inner),
        config_(inner.config()),
        begin_(begin),
        full_(config_.layer.shared_ffn_size) {
    config_.layer.shared_ffn_size = width;
  }
  const ModelConfig& config() const override { return config_; }
  absl::Status Fill(int layer, TensorKind kind, int expert, float* dst) const override {
    if (kind != TensorKind::kSharedGate && kind != TensorKind::kSharedUp &&
        kind != TensorKind::kSharedDown) {
      return inner_.Fill(layer, kind, expert, dst);
    }
    const int64_t hidden = config_.layer.hidden_size;
    const int64_t width = config_.layer.shared_ffn_size;
    std::vector<float> whole(static_cast<size_t>(full_ * hidden));
    if (absl::Status s = inner_.Fill(layer, kind, expert, whole.data()); !s.ok()) return s;
    if (kind == TensorKind::kSharedDown) {  // [H, Fs] -> [H, width]
      for (int64_t r = 0; r < hidden; ++r) {
        std::copy_n(whole.data() + r * full_ + begin_, width, dst + r * width);
      }
    } else {  // [Fs, H] -> [width, H]
      std::copy_n(whole.data() + begin_ * hidden, width * hidden, dst);
    }
    return absl::OkStatus();
  }

 private:
  const WeightSource& inner_;
  ModelConfig config_;
  const int64_t begin_;
  const int64_t full_;
};

class LayerSubset final : public WeightSource {
 public:
  LayerSubset(std::unique_ptr<WeightSource> inner, std::vector<int> layers)
      : inner_(std::move(inner)), config_(inner_->config()) {
    config_.moe_layers = std::move(layers);
  }
  const ModelConfig& config() const override { return config_; }
  absl::Status Fill(int layer, TensorKind kind, int expert, float* dst) const override {
    if (!std::binary_search(config_.moe_layers.begin(), config_.moe_layers.end(), layer)) {
      return absl::OutOfRangeError(absl::StrCat(
          "layer ", layer, " is not served (--layers=", FormatLayers(config_.moe_layers), ")"));
    }
    return inner_->Fill(layer, kind, expert, dst);
  }

 private:
  std::unique_ptr<WeightSource> inner_;
  ModelConfig config_;
};

}  // namespace

absl::StatusOr<std::vector<int>> SelectLayers(const ModelConfig& config,
                                              absl::string_view selection) {
  const absl::string_view text = absl::StripAsciiWhitespace(selection);
  if (text.empty()) return Bad(selection, "empty selection (use \"all\" or e.g. \"1,3-5\")");
  if (text == "all") return config.moe_layers;
  const int64_t num_layers = config.num_layers > 0
                                 ? config.num_layers
                                 : (config.moe_layers.empty() ? 0 : config.moe_layers.back() + 1);
  const std::string moe_list = FormatLayers(config.moe_layers);
  std::set<int> chosen;
  auto beyond = [&](int64_t layer) {
    return Bad(selection, absl::StrCat("layer ", layer, " is beyond the model's num_hidden_layers=",
                                       num_layers, " (MoE layers: ", moe_list, ")"));
  };
  auto dense = [&](int64_t layer) {
    return Bad(selection,
               absl::StrCat("layer ", layer,
                            " is a dense layer, not an MoE layer (MoE layers: ", moe_list, ")"));
  };
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    const absl::string_view item = absl::StripAsciiWhitespace(raw);
    if (item.empty()) return Bad(selection, "empty item in the list");
    const size_t dash = item.find('-');
    int64_t first = 0, last = 0;
    if (dash == absl::string_view::npos) {
      if (!ParseIndex(item, &first))
        return Bad(selection,
                   absl::StrCat("\"", item, "\" is not a layer index, a range a-b or \"all\""));
      last = first;
    } else {
      if (!ParseIndex(absl::StripAsciiWhitespace(item.substr(0, dash)), &first) ||
          !ParseIndex(absl::StripAsciiWhitespace(item.substr(dash + 1)), &last)) {
        return Bad(selection, absl::StrCat("\"", item, "\" is not a range a-b of layer indices"));
      }
      if (first > last)
        return Bad(selection,
                   absl::StrCat("range \"", item, "\" is empty (", first, " > ", last, ")"));
    }
    if (last >= num_layers) return beyond(first >= num_layers ? first : last);
    for (int64_t l = first; l <= last; ++l) {
      if (!std::binary_search(config.moe_layers.begin(), config.moe_layers.end(), l))
        return dense(l);
      chosen.insert(static_cast<int>(l));
    }
  }
  return std::vector<int>(chosen.begin(), chosen.end());
}

std::string FormatLayers(const std::vector<int>& layers) {
  if (layers.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < layers.size();) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!out.empty()) out += ",";
    absl::StrAppend(&out, layers[i]);
    if (j > i) absl::StrAppend(&out, "-", layers[j]);
    i = j + 1;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<WeightSource>> ServeLayers(std::unique_ptr<WeightSource> source,
                                                          absl::string_view selection) {
  absl::StatusOr<std::vector<int>> layers = SelectLayers(source->config(), selection);
  if (!layers.ok()) return layers.status();
  return std::make_unique<LayerSubset>(std::move(source), *std::move(layers));
}

absl::StatusOr<std::unique_ptr<WeightSource>> SharedExpertSlice(const WeightSource& source,
                                                                int part, int parts) {
  const int64_t full = source.config().layer.shared_ffn_size;
  if (parts < 1 || part < 0 || part >= parts || parts > full) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared expert slice ", part, " of ", parts,
        ": needs 0 <= part < parts <= ", "the shared expert's intermediate size (", full, ")"));
  }
  const common::Share slice = common::ContiguousShare(full, part, parts);
  return std::make_unique<SharedSlice>(source, slice.begin, slice.size());
}

}  // namespace epserve::model
