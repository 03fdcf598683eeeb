// Building the ModelInfer requests that epserve-load sends and checking the responses.
//
// An epserve MoE model takes one input "hidden_states", FP32, BF16 or FP16, shape [T, H],
// in raw_input_contents, and answers with one output "moe_output" of the same datatype and
// shape in raw_output_contents. The optional int64 request parameter "layer" picks which
// MoE layer of the model runs; "timeout" (microseconds) bounds its wait at the server.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/element_type.h"
#include "common/half.h"
#include "grpc_service.pb.h"

namespace epserve::client {

inline constexpr absl::string_view kInputName = "hidden_states";
inline constexpr absl::string_view kOutputName = "moe_output";
inline constexpr absl::string_view kLayerParameter = "layer";
inline constexpr absl::string_view kTimeoutParameter = "timeout";
// The datatype ModelMetadata reports for hidden_states (the server also takes BF16, FP16).
inline constexpr absl::string_view kDatatype = "FP32";

// Element types of the tensors a request carries (common/element_type.h), named by their
// KServe datatype strings. Conversions from float round to nearest even (the server's rule);
// NaN stays NaN.
inline constexpr common::ElementType kRequestDtypes[] = {
    common::ElementType::kFp32, common::ElementType::kBf16, common::ElementType::kFp16};
// One of kRequestDtypes by its KServe name in any case ("bf16", "FP16"). INVALID_ARGUMENT
// listing them otherwise.
absl::StatusOr<common::ElementType> ParseDtype(absl::string_view text);
using common::Bf16ToFloat;  // common/half.h
using common::FloatToBf16;
using common::FloatToFp16;
using common::Fp16ToFloat;

// Inclusive range of token rows per request; each request draws T uniformly from it.
struct TokenRange {
  int64_t min_tokens = 1;
  int64_t max_tokens = 1;
};

// Parses "N" or "A-B" with 1 <= A <= B. INVALID_ARGUMENT naming the bound otherwise.
absl::StatusOr<TokenRange> ParseTokenRange(absl::string_view text);
std::string FormatTokenRange(const TokenRange& range);

// Flag support (found by argument-dependent lookup from absl::Flag<TokenRange>).
bool AbslParseFlag(absl::string_view text, TokenRange* range, std::string* error);
std::string AbslUnparseFlag(const TokenRange& range);

// A small fast generator (xoshiro256**) for request payloads, seeded through SplitMix64
// from (seed, stream) so that each thread draws an independent sequence. Satisfies
// UniformRandomBitGenerator. Not thread-safe: one instance per thread.
class FastRng {
 public:
  using result_type = uint64_t;
  FastRng(uint64_t seed, uint64_t stream);

  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return std::numeric_limits<result_type>::max(); }
  result_type operator()();

  // Uniform in [0, 1), 53 random bits.
  double UniformUnit();
  // Fills `dst[0, count)` with floats uniform in [-1, 1) on a 2^-23 grid.
  void FillUniformSigned(float* dst, int64_t count);

 private:
  uint64_t s_[4];
};

// What every request of a run has in common.
struct RequestTemplate {
  std::string model_name;
  int64_t hidden_size = 0;       // H
  std::optional<int64_t> layer;  // sent as the int64 parameter "layer" when set
  // Of hidden_states, hence of moe_output: one of kRequestDtypes.
  common::ElementType dtype = common::ElementType::kFp32;
  int64_t timeout_us = 0;  // > 0: sent as the int64 parameter "timeout"
  // Fills a request's [tokens, H] values (e.g. SkewedRows::Fill, rows aimed at experts);
  // empty: uniform in [-1, 1). Called from several sending threads at once.
  std::function<void(FastRng& rng, float* dst, int64_t tokens)> fill_rows;
};

// Fills `request` (cleared first) with a request for `tokens` rows of fresh values (uniform
// in [-1, 1), or as tmpl.fill_rows makes them) drawn from `rng`, in tmpl.dtype, identified by `id`,
// asking for output "moe_output". When `values` is not null it receives the T x H values as the
// server reads them (after rounding to tmpl.dtype), as floats.
void BuildInferRequest(const RequestTemplate& tmpl, int64_t tokens, absl::string_view id,
                       FastRng& rng, inference::ModelInferRequest* request,
                       std::vector<float>* values = nullptr);

// OK if `response` carries output "moe_output" of `dtype`, shape [tokens, hidden_size],
// with exactly tokens * hidden_size * ElementBytes(dtype) bytes in its raw_output_contents
// entry, and echoes `id` when it sets one. Otherwise DATA_LOSS saying what was wrong.
// With `in_shared_memory` the output's bytes are in the client's shared memory region and
// its raw_output_contents entry must be empty or absent.
absl::Status CheckInferResponse(const inference::ModelInferResponse& response, int64_t tokens,
                                int64_t hidden_size, absl::string_view id,
                                common::ElementType dtype = common::ElementType::kFp32,
                                bool in_shared_memory = false);

// The values of a response's "moe_output" (already accepted by CheckInferResponse with
// the same `dtype`) as floats, into `out` (resized).
void DecodeOutput(const inference::ModelInferResponse& response, common::ElementType dtype,
                  std::vector<float>* out);
// The same for an output's bytes wherever they are (e.g. a shared memory region).
void DecodeOutputBytes(absl::string_view raw, common::ElementType dtype, std::vector<float>* out);

}  // namespace epserve::client
