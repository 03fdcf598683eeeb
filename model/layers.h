// Which MoE layers a server serves: the --layers selection.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model/moe_config.h"
#include "model/weights.h"

namespace epserve::model {

// Applies a --layers selection to `config` (the whole model, as opened): "all" (every MoE
// layer), a layer ("3"), a list ("1,5"), an inclusive range ("2-7") or a mix ("1,4-6").
// Returns the selected layers, ascending, without duplicates. INVALID_ARGUMENT naming the
// offending index and why: a malformed item, a dense layer (every layer of a range must be
// an MoE layer), or one beyond num_hidden_layers.
absl::StatusOr<std::vector<int>> SelectLayers(const ModelConfig& config,
                                              absl::string_view selection);

// Layer indices in the compact form SelectLayers reads, e.g. "1-3,5,7-9" ("none" if empty).
std::string FormatLayers(const std::vector<int>& layers);

// Wraps `source` so that config().moe_layers is the selection; Fill of a layer outside it is
// OUT_OF_RANGE. Thread-safety as `source`.
absl::StatusOr<std::unique_ptr<WeightSource>> ServeLayers(std::unique_ptr<WeightSource> source,
                                                          absl::string_view selection);

// A view of `source` (kept alive by the caller) whose shared expert is only the slice
// common::ContiguousShare(Fs, part, parts) of its intermediate columns: the rows of
// kSharedGate and kSharedUp and the columns of kSharedDown, with config().layer.shared_ffn_size
// the slice's width; every other tensor as `source` gives it. SwiGLU acts on each
// intermediate column alone and the down projection sums over them, so the outputs of the
// `parts` slices add up to the whole shared expert's (the sigmoid gate, which scales the
// output, applies to each slice). INVALID_ARGUMENT unless 0 <= part < parts <= Fs.
absl::StatusOr<std::unique_ptr<WeightSource>> SharedExpertSlice(const WeightSource& source,
                                                                int part, int parts);

}  // namespace epserve::model
