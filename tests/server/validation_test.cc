#include "server/validation.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/half.h"
#include "gtest/gtest.h"
#include "server/grpc_status.h"

namespace epserve::server {
namespace {

using common::ElementType;

// H = 4, layers 3 and 7, at most 100 tokens a request, one priority level.
const ServedModel kModel{.hidden_size = 4, .layers = {3, 7}};
const RequestOptions kRequests{
    .model_name = "moe", .max_request_tokens = 100, .priority_levels = 1, .default_priority = 1};
ModelSignature Sig() { return ModelSignature(kModel, kRequests); }

inference::ModelInferRequest Good(int64_t tokens) {
  inference::ModelInferRequest r;
  r.set_model_name("moe");
  auto* in = r.add_inputs();
  in->set_name("hidden_states");
  in->set_datatype("FP32");
  in->add_shape(tokens);
  in->add_shape(4);
  r.add_raw_input_contents(std::string(tokens * 16, '\0'));
  return r;
}

TEST(ParseInfer, AcceptsRawAndTypedContentsAndPicksTheLayer) {
  absl::StatusOr<ParsedInfer> p = ParseInfer(Good(3), Sig());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->num_tokens, 3);
  EXPECT_EQ(p->layer, 3);
  EXPECT_EQ(p->layer_pos, 0);
  inference::ModelInferRequest r = Good(2);
  r.clear_raw_input_contents();
  for (int i = 0; i < 8; ++i) r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(i);
  (*r.mutable_parameters())["layer"].set_int64_param(7);
  p = ParseInfer(r, Sig());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->layer_pos, 1);
  float second;
  std::memcpy(&second, p->input + 4, 4);
  EXPECT_EQ(second, 1.0f);
}

// A 1 MiB model name, version, datatype or tensor name is quoted clipped: the error
// stays small (it travels in a gRPC trailer) and still names the field.
TEST(ParseInfer, HugeClientStringsAreClippedInErrors) {
  const std::string huge(1 << 20, 'x');
  inference::ModelInferRequest r = Good(1);
  r.set_model_name(huge);
  absl::Status s = ParseInfer(r, Sig()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_LT(s.message().size(), 512u) << s.message().substr(0, 200);
  EXPECT_NE(s.message().find("(1048576 bytes)"), std::string::npos);
  for (int field = 0; field < 4; ++field) {
    r = Good(1);
    if (field == 0) r.mutable_inputs(0)->set_datatype(huge);
    if (field == 1) r.mutable_inputs(0)->set_name(huge);
    if (field == 2) r.add_outputs()->set_name(huge);
    if (field == 3) r.set_model_version(huge);
    s = ParseInfer(r, Sig()).status();
    EXPECT_FALSE(s.ok()) << field;
    EXPECT_LT(s.message().size(), 512u) << field << ": " << s.message().substr(0, 200);
  }
  // Whatever a message quotes, the gRPC status carries at most kMaxMessageBytes of it.
  const grpc::Status g = ToGrpcStatus(absl::InvalidArgumentError(huge));
  EXPECT_LE(g.error_message().size(), kMaxMessageBytes + 32);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(ParseInfer, TheRequestIdIsBounded) {
  inference::ModelInferRequest r = Good(1);
  r.set_id(std::string(kMaxRequestIdBytes, 'i'));
  EXPECT_TRUE(ParseInfer(r, Sig()).ok());
  r.set_id(std::string(1 << 20, 'i'));
  absl::Status s = ParseInfer(r, Sig()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("id is 1048576 bytes; at most 4096"), std::string::npos)
      << s.message();
}

TEST(ParseInfer, TooManyTokensNamesTheBound) {
  absl::Status s = ParseInfer(Good(101), Sig()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("must be in [1, 100], got 101"), absl::string_view::npos) << s;
}

TEST(ParseInfer, UnknownRequestedOutputAndDuplicateInput) {
  inference::ModelInferRequest r = Good(1);
  r.add_outputs()->set_name("logits");
  EXPECT_EQ(ParseInfer(r, Sig()).status().code(), absl::StatusCode::kInvalidArgument);
  r = Good(1);
  *r.add_inputs() = r.inputs(0);
  EXPECT_EQ(ParseInfer(r, Sig()).status().code(), absl::StatusCode::kInvalidArgument);
  r = Good(1);
  r.set_model_version("2");
  EXPECT_EQ(ParseInfer(r, Sig()).status().code(), absl::StatusCode::kNotFound);
}

TEST(ParseInfer, Bf16AndFp16InputsAndTheOutputDatatype) {
  inference::ModelInferRequest r = Good(2);
  r.mutable_inputs(0)->set_datatype("BF16");
  EXPECT_NE(ParseInfer(r, Sig()).status().message().find("must hold 16 bytes"),
            absl::string_view::npos);  // 2 x 4 BF16 = 16 bytes, not 32
  r.set_raw_input_contents(0, std::string(16, '\0'));
  absl::StatusOr<ParsedInfer> p = ParseInfer(r, Sig());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->input_type, ElementType::kBf16);
  EXPECT_EQ(p->output_type, ElementType::kBf16);  // the input's unless asked otherwise
  auto* out = r.add_outputs();
  out->set_name("moe_output");
  (*out->mutable_parameters())["datatype"].set_string_param("FP32");
  p = ParseInfer(r, Sig());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->output_type, ElementType::kFp32);
  (*out->mutable_parameters())["datatype"].set_string_param("INT8");
  EXPECT_EQ(
      ParseInfer(r, Sig()).status().message(),
      "parameter 'datatype' of output 'moe_output' must be a string_param FP32, BF16 or FP16");
  // No spelling of a type the front-end does not take (nor of "no type") is a datatype.
  for (const char* bad : {"fp32", "FP8", "fp8", "<invalid>", ""}) {
    r = Good(2);
    r.mutable_inputs(0)->set_datatype(bad);
    EXPECT_EQ(
        ParseInfer(r, Sig()).status().message(),
        absl::StrCat("input 'hidden_states' datatype must be FP32, BF16 or FP16, got '", bad, "'"));
  }
  r = Good(2);
  r.mutable_inputs(0)->set_datatype("FP16");
  r.set_raw_input_contents(0, std::string(16, '\0'));
  p = ParseInfer(r, Sig());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->input_type, ElementType::kFp16);
  // FP16 has no typed contents field.
  r.clear_raw_input_contents();
  for (int i = 0; i < 8; ++i) r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(i);
  EXPECT_NE(ParseInfer(r, Sig()).status().message().find("must travel in raw_input_contents"),
            absl::string_view::npos);
}

TEST(ParseInfer, RequestedOutputsPickWhatIsAnswered) {
  absl::StatusOr<ParsedInfer> p = ParseInfer(Good(1), Sig());
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(p->want_output);
  EXPECT_FALSE(p->want_topk_ids);
  inference::ModelInferRequest r = Good(1);
  r.add_outputs()->set_name("topk_ids");
  p = ParseInfer(r, Sig());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->want_output);  // named outputs only, as Triton answers
  EXPECT_TRUE(p->want_topk_ids);
  EXPECT_FALSE(p->want_topk_weights);
  r.add_outputs()->set_name("topk_weights");
  r.add_outputs()->set_name("moe_output");
  p = ParseInfer(r, Sig());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->want_output && p->want_topk_ids && p->want_topk_weights);
  r.add_outputs()->set_name("topk_ids");
  EXPECT_NE(ParseInfer(r, Sig()).status().message().find("'topk_ids' requested twice"),
            absl::string_view::npos);
}

TEST(ParseInfer, PriorityAndTimeoutParameters) {
  RequestOptions requests = kRequests;
  requests.priority_levels = 3;
  requests.default_priority = 2;
  const ModelSignature sig(kModel, requests);
  inference::ModelInferRequest r = Good(1);
  absl::StatusOr<ParsedInfer> p = ParseInfer(r, sig);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->priority, 2u);
  EXPECT_EQ(p->timeout, absl::InfiniteDuration());
  (*r.mutable_parameters())["priority"].set_uint64_param(1);  // tritonclient's choice
  (*r.mutable_parameters())["timeout"].set_int64_param(1500);
  p = ParseInfer(r, sig);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->priority, 1u);
  EXPECT_EQ(p->timeout, absl::Microseconds(1500));
  (*r.mutable_parameters())["priority"].set_int64_param(0);
  EXPECT_EQ(ParseInfer(r, sig)->priority, 2u);
  (*r.mutable_parameters())["priority"].set_int64_param(4);
  absl::Status s = ParseInfer(r, sig).status();
  EXPECT_NE(s.message().find("'priority' must be in [0, 3]"), absl::string_view::npos) << s;
  (*r.mutable_parameters())["priority"].set_int64_param(1);
  (*r.mutable_parameters())["timeout"].set_int64_param(-1);
  EXPECT_EQ(ParseInfer(r, sig).status().code(), absl::StatusCode::kInvalidArgument);
  (*r.mutable_parameters())["timeout"].set_string_param("1s");
  EXPECT_EQ(ParseInfer(r, sig).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Dtype, RoundTripsAndRoundsToNearestEven) {
  EXPECT_EQ(common::FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(common::Bf16ToFloat(0x3f80), 1.0f);
  // 1 + 2^-8 is halfway between two BF16 values: ties go to the even one (1.0).
  EXPECT_EQ(common::FloatToBf16(1.00390625f), 0x3f80);
  EXPECT_EQ(common::FloatToBf16(1.01171875f), 0x3f82);  // 1 + 3 * 2^-8: tie, up to even
  EXPECT_TRUE(std::isnan(common::Bf16ToFloat(common::FloatToBf16(NAN))));
  EXPECT_EQ(common::FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(common::FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(common::FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(common::FloatToFp16(65520.0f), 0x7c00);            // rounds past the largest: infinity
  EXPECT_EQ(common::FloatToFp16(5.9604645e-8f), 0x0001);       // the smallest subnormal
  EXPECT_EQ(common::FloatToFp16(1.0f + 1.0f / 2048), 0x3c00);  // tie to even
  EXPECT_TRUE(std::isnan(common::Fp16ToFloat(common::FloatToFp16(NAN))));
  EXPECT_EQ(common::Fp16ToFloat(0x0001), 5.9604645e-8f);
  // Every FP16 value survives FP16 -> FP32 -> FP16.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = common::Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(common::FloatToFp16(f), h) << std::hex << h;
  }
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = common::Bf16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(common::FloatToBf16(f), b) << std::hex << b;
  }
}

}  // namespace
}  // namespace epserve::server
