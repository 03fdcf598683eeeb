#include "client/infer_request.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace epserve::client {

static_assert(std::endian::native == std::endian::little,
              "raw tensor contents are little-endian; big-endian hosts need a byte swap");

absl::StatusOr<common::ElementType> ParseDtype(absl::string_view text) {
  const std::string upper = absl::AsciiStrToUpper(text);
  for (common::ElementType d : kRequestDtypes) {
    if (upper == common::KServeName(d)) return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: '", text, "' is none of ",
                   absl::StrJoin(kRequestDtypes, ", ", [](std::string* out, common::ElementType d) {
                     absl::StrAppend(out, common::KServeName(d));
                   })));
}

absl::StatusOr<TokenRange> ParseTokenRange(absl::string_view text) {
  TokenRange range;
  const size_t dash = text.find('-');
  const absl::string_view lo = text.substr(0, dash);
  const absl::string_view hi = dash == absl::string_view::npos ? lo : text.substr(dash + 1);
  if (!absl::SimpleAtoi(lo, &range.min_tokens) || !absl::SimpleAtoi(hi, &range.max_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: '", text, "' is not N or A-B (e.g. 32 or 1-128)"));
  }
  if (range.min_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: minimum ", range.min_tokens, " must be >= 1"));
  }
  if (range.max_tokens < range.min_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: maximum ", range.max_tokens,
                                                   " must be >= minimum ", range.min_tokens));
  }
  return range;
}

std::string FormatTokenRange(const TokenRange& range) {
  if (range.min_tokens == range.max_tokens) return absl::StrCat(range.min_tokens);
  return absl::StrCat(range.min_tokens, "-", range.max_tokens);
}

bool AbslParseFlag(absl::string_view text, TokenRange* range, std::string* error) {
  absl::StatusOr<TokenRange> parsed = ParseTokenRange(text);
  if (!parsed.ok()) {
    *error = std::string(parsed.status().message());
    return false;
  }
  *range = *parsed;
  return true;
}

std::string AbslUnparseFlag(const TokenRange& range) { return FormatTokenRange(range); }

namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

FastRng::FastRng(uint64_t seed, uint64_t stream) {
  uint64_t state = seed ^ (stream * 0xD1B54A32D192ED03ull);
  for (uint64_t& word : s_) word = SplitMix64(state);
}

FastRng::result_type FastRng::operator()() {
  const uint64_t result = std::rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = std::rotl(s_[3], 45);
  return result;
}

double FastRng::UniformUnit() { return static_cast<double>((*this)() >> 11) * 0x1p-53; }

void FastRng::FillUniformSigned(float* dst, int64_t count) {
  // Two floats per draw, each from 24 random bits: k * 2^-23 - 1 for k in [0, 2^24) is
  // exact in float and covers [-1, 1).
  int64_t i = 0;
  for (; i + 1 < count; i += 2) {
    const uint64_t x = (*this)();
    dst[i] = static_cast<float>(static_cast<int32_t>(x >> 40)) * 0x1p-23f - 1.0f;
    dst[i + 1] = static_cast<float>(static_cast<int32_t>((x >> 16) & 0xFFFFFF)) * 0x1p-23f - 1.0f;
  }
  if (i < count)
    dst[i] = static_cast<float>(static_cast<int32_t>((*this)() >> 40)) * 0x1p-23f - 1.0f;
}

void BuildInferRequest(const RequestTemplate& tmpl, int64_t tokens, absl::string_view id,
                       FastRng& rng, inference::ModelInferRequest* request,
                       std::vector<float>* values) {
  request->Clear();
  request->set_model_name(tmpl.model_name);
  request->set_id(std::string(id));
  auto& parameters = *request->mutable_parameters();
  if (tmpl.layer.has_value()) parameters[std::string(kLayerParameter)].set_int64_param(*tmpl.layer);
  if (tmpl.timeout_us > 0) {
    parameters[std::string(kTimeoutParameter)].set_int64_param(tmpl.timeout_us);
  }
  inference::ModelInferRequest::InferInputTensor* input = request->add_inputs();
  input->set_name(std::string(kInputName));
  input->set_datatype(std::string(common::KServeName(tmpl.dtype)));
  input->add_shape(tokens);
  input->add_shape(tmpl.hidden_size);
  request->add_outputs()->set_name(std::string(kOutputName));

  const int64_t num_elements = tokens * tmpl.hidden_size;
  const int64_t element_bytes = static_cast<int64_t>(common::ElementBytes(tmpl.dtype));
  std::string* raw = request->add_raw_input_contents();
  raw->resize(static_cast<size_t>(num_elements * element_bytes));
  if (values != nullptr) values->resize(static_cast<size_t>(num_elements));
  // Generate into an aligned scratch block and copy: the string's buffer has no float
  // alignment guarantee.
  constexpr int64_t kChunk = 1024;
  float scratch[kChunk];
  uint16_t narrow[kChunk];
  char* dst = raw->data();
  std::vector<float> shaped;  // the whole request's values when tmpl.fill_rows makes them
  if (tmpl.fill_rows) {
    shaped.resize(static_cast<size_t>(num_elements));
    tmpl.fill_rows(rng, shaped.data(), tokens);
  }
  for (int64_t done = 0; done < num_elements; done += kChunk) {
    const int64_t n = std::min(kChunk, num_elements - done);
    if (tmpl.fill_rows) {
      std::copy(shaped.begin() + done, shaped.begin() + done + n, scratch);
    } else {
      rng.FillUniformSigned(scratch, n);
    }
    if (tmpl.dtype == common::ElementType::kFp32) {
      std::memcpy(dst + done * 4, scratch, static_cast<size_t>(n * 4));
    } else {
      const bool bf16 = tmpl.dtype == common::ElementType::kBf16;
      for (int64_t i = 0; i < n; ++i) {
        narrow[i] = bf16 ? FloatToBf16(scratch[i]) : FloatToFp16(scratch[i]);
        scratch[i] = bf16 ? Bf16ToFloat(narrow[i]) : Fp16ToFloat(narrow[i]);
      }
      std::memcpy(dst + done * 2, narrow, static_cast<size_t>(n * 2));
    }
    if (values != nullptr) std::copy(scratch, scratch + n, values->data() + done);
  }
}

absl::Status CheckInferResponse(const inference::ModelInferResponse& response, int64_t tokens,
                                int64_t hidden_size, absl::string_view id,
                                common::ElementType dtype, bool in_shared_memory) {
  if (!response.id().empty() && response.id() != id) {
    return absl::DataLossError(
        absl::StrCat("response id '", response.id(), "' for request id '", id, "'"));
  }
  int index = -1;
  for (int i = 0; i < response.outputs_size(); ++i) {
    if (response.outputs(i).name() == kOutputName) {
      index = i;
      break;
    }
  }
  if (index < 0) {
    return absl::DataLossError(
        absl::StrCat("no output '", kOutputName, "' among ", response.outputs_size(), " outputs"));
  }
  const auto& output = response.outputs(index);
  if (output.datatype() != common::KServeName(dtype)) {
    return absl::DataLossError(absl::StrCat(kOutputName, " datatype '", output.datatype(),
                                            "', expected ", common::KServeName(dtype)));
  }
  if (output.shape_size() != 2 || output.shape(0) != tokens || output.shape(1) != hidden_size) {
    return absl::DataLossError(absl::StrCat(kOutputName, " shape [",
                                            absl::StrJoin(output.shape(), ","), "], expected [",
                                            tokens, ",", hidden_size, "]"));
  }
  if (in_shared_memory) {
    if (index < response.raw_output_contents_size() &&
        !response.raw_output_contents(index).empty()) {
      return absl::DataLossError(absl::StrCat(kOutputName,
                                              " was asked for in shared memory but "
                                              "came inline"));
    }
    return absl::OkStatus();
  }
  if (index >= response.raw_output_contents_size()) {
    return absl::DataLossError(absl::StrCat(kOutputName, " has no raw_output_contents entry (",
                                            response.raw_output_contents_size(), " entries)"));
  }
  const size_t expected_bytes =
      static_cast<size_t>(tokens * hidden_size * common::ElementBytes(dtype));
  if (response.raw_output_contents(index).size() != expected_bytes) {
    return absl::DataLossError(absl::StrCat(kOutputName, " raw contents are ",
                                            response.raw_output_contents(index).size(),
                                            " bytes, expected ", expected_bytes));
  }
  return absl::OkStatus();
}

void DecodeOutput(const inference::ModelInferResponse& response, common::ElementType dtype,
                  std::vector<float>* out) {
  int index = 0;
  for (int i = 0; i < response.outputs_size(); ++i) {
    if (response.outputs(i).name() == kOutputName) index = i;
  }
  DecodeOutputBytes(response.raw_output_contents(index), dtype, out);
}

void DecodeOutputBytes(absl::string_view raw, common::ElementType dtype, std::vector<float>* out) {
  const size_t count = raw.size() / static_cast<size_t>(common::ElementBytes(dtype));
  out->resize(count);
  if (dtype == common::ElementType::kFp32) {
    std::memcpy(out->data(), raw.data(), count * sizeof(float));
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, raw.data() + 2 * i, 2);
    (*out)[i] = dtype == common::ElementType::kBf16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
  }
}

}  // namespace epserve::client
