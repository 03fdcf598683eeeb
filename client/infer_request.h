// Building the ModelInfer requests that epserve-load sends and checking the responses.
//
// An epserve MoE model takes one input "hidden_states", FP32, shape [T, H], in
// raw_input_contents, and answers with one output "moe_output" of the same datatype and
// shape in raw_output_contents. The optional int64 request parameter "layer" picks which
// MoE layer of the model runs.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpc_service.pb.h"

namespace epserve::client {

inline constexpr absl::string_view kInputName = "hidden_states";
inline constexpr absl::string_view kOutputName = "moe_output";
inline constexpr absl::string_view kLayerParameter = "layer";
inline constexpr absl::string_view kDatatype = "FP32";
inline constexpr int64_t kBytesPerElement = 4;

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
};

// Fills `request` (cleared first) with a request for `tokens` rows of fresh values uniform
// in [-1, 1) drawn from `rng`, identified by `id`, asking for output "moe_output".
void BuildInferRequest(const RequestTemplate& tmpl, int64_t tokens, absl::string_view id,
                       FastRng& rng, inference::ModelInferRequest* request);

// OK if `response` carries output "moe_output", FP32, shape [tokens, hidden_size], with
// exactly tokens * hidden_size * 4 bytes in its raw_output_contents entry, and echoes
// `id` when it sets one. Otherwise an error whose message says what was wrong.
absl::Status CheckInferResponse(const inference::ModelInferResponse& response, int64_t tokens,
                                int64_t hidden_size, absl::string_view id);

}  // namespace epserve::client
