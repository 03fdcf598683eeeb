#include "server/validation.h"

#include <cstring>

#include "gtest/gtest.h"

namespace epserve::server {
namespace {

ModelSignature Sig() { return ModelSignature{"moe", 4, {3, 7}, 100}; }

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

}  // namespace
}  // namespace epserve::server
