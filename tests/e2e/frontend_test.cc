// End to end, the front-end as KServe v2 clients see it: streaming, configuration and
// statistics, datatypes, dynamic batching under load (batch growth, queue bound, priority,
// timeouts), health, TLS, mutual TLS and bearer tokens. mpirun epserve on synthetic:tiny.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "health.grpc.pb.h"
#include "server/dtype.h"
#include "tests/e2e/reference.h"
#include "tests/e2e/server_process.h"

namespace epserve::testing {
namespace {

using Stub = inference::GRPCInferenceService::Stub;
using common::ElementType;

std::shared_ptr<grpc::Channel> Channel(
    const std::string& address,
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials()) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // Tests' certificates name 127.0.0.1; connect to it whatever the address says.
  args.SetSslTargetNameOverride("127.0.0.1");
  return grpc::CreateCustomChannel(address, creds, args);
}

void SetDeadline(grpc::ClientContext& ctx, int seconds = 60) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
}

std::vector<float> Floats(const std::string& raw) {
  std::vector<float> out(raw.size() / 4);
  std::memcpy(out.data(), raw.data(), out.size() * 4);
  return out;
}

// Mean rows per batch and batches run so far, from ModelStatistics.
std::pair<double, uint64_t> BatchFigures(Stub& stub) {
  inference::ModelStatisticsRequest req;
  req.set_name("moe");
  inference::ModelStatisticsResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  EXPECT_TRUE(stub.ModelStatistics(&ctx, req, &resp).ok());
  uint64_t rows = 0, batches = 0;
  for (const auto& b : resp.model_stats(0).batch_stats()) {
    rows += b.batch_size() * b.compute_infer().count();
    batches += b.compute_infer().count();
  }
  return {static_cast<double>(rows), batches};
}

// One server for the protocol and batching tests.
class FrontEnd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<ServerProcess>> s = ServerProcess::Start(
        3, {"--max-batch-tokens=16", "--max-queue-delay-us=0", "--priority-levels=3",
            "--default-priority=2", "--max-request-tokens=512", "--max-stream-inflight=8"});
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = s->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = inference::GRPCInferenceService::NewStub(Channel(server_->grpc_address()));
  }

  static ServerProcess* server_;
  std::unique_ptr<Stub> stub_;
  Reference ref_;
  std::mt19937_64 rng_{std::random_device{}()};
};
ServerProcess* FrontEnd::server_ = nullptr;

TEST_F(FrontEnd, StreamAnswersEveryRequestWithItsIdAndErrorsInBand) {
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  auto stream = stub_->ModelStreamInfer(&ctx);
  std::map<std::string, std::vector<float>> inputs;
  const int kRequests = 30;  // more than --max-stream-inflight: reading pauses and resumes
  for (int i = 0; i < kRequests; ++i) {
    const int64_t tokens = 1 + i % 23;
    std::vector<float> x = RandomRows(tokens, rng_);
    inference::ModelInferRequest req = Request(x, tokens, absl::StrCat("s", i));
    if (i == 7) req.mutable_inputs(0)->set_datatype("INT8");  // fails alone
    inputs[req.id()] = std::move(x);
    ASSERT_TRUE(stream->Write(req));
  }
  stream->WritesDone();
  inference::ModelStreamInferResponse resp;
  int answers = 0;
  while (stream->Read(&resp)) {
    ++answers;
    const std::string& id = resp.infer_response().id();
    ASSERT_TRUE(inputs.count(id)) << "unknown id '" << id << "'";
    if (id == "s7") {
      EXPECT_NE(resp.error_message().find("datatype must be FP32, BF16 or FP16"), std::string::npos)
          << resp.error_message();
      continue;
    }
    ASSERT_EQ(resp.error_message(), "") << id;
    const std::vector<float>& x = inputs[id];
    const int64_t tokens = static_cast<int64_t>(x.size()) / kHidden;
    EXPECT_EQ(resp.infer_response().outputs(0).shape(0), tokens);
    std::vector<float> out = Floats(resp.infer_response().raw_output_contents(0));
    EXPECT_LE(ref_.RelError(x, out.data(), tokens), 1e-4) << id;
    inputs.erase(id);
  }
  grpc::Status s = stream->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(answers, kRequests);
  EXPECT_EQ(inputs.size(), 1u);  // only the failed one is left
}

TEST_F(FrontEnd, Bf16AndFp16InAndOut) {
  struct Case {
    const char* in;
    const char* out;  // "" = the input's
    double tolerance;
  };
  for (const Case& c : {Case{"BF16", "", 2e-2}, Case{"FP16", "", 4e-3}, Case{"BF16", "FP32", 2e-2},
                        Case{"FP32", "FP16", 4e-3}}) {
    const int64_t tokens = 21;  // two batches of 16 rows
    std::vector<float> x = RandomRows(tokens, rng_);
    const ElementType in = *common::ParseKServeName(c.in, "datatype", server::kRequestTypes);
    std::string raw(x.size() * common::ElementBytes(in), '\0');
    server::FromFp32(in, x.data(), raw.data(), x.size());
    server::ToFp32(in, raw.data(), x.data(), x.size());  // the input the server sees
    inference::ModelInferRequest req = Request(x, tokens, c.in);
    req.mutable_inputs(0)->set_datatype(c.in);
    req.set_raw_input_contents(0, raw);
    if (*c.out) {
      auto* o = req.add_outputs();
      o->set_name("moe_output");
      (*o->mutable_parameters())["datatype"].set_string_param(c.out);
    }
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    grpc::Status s = stub_->ModelInfer(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    const std::string want = *c.out ? c.out : c.in;
    EXPECT_EQ(resp.outputs(0).datatype(), want);
    const ElementType out_type = *common::ParseKServeName(want, "datatype", server::kRequestTypes);
    ASSERT_EQ(resp.raw_output_contents(0).size(), x.size() * common::ElementBytes(out_type));
    std::vector<float> out(x.size());
    server::ToFp32(out_type, resp.raw_output_contents(0).data(), out.data(), out.size());
    EXPECT_LE(ref_.RelError(x, out.data(), tokens), c.tolerance) << c.in << " -> " << want;
  }
}

TEST_F(FrontEnd, TopkOutputsCarryTheRoutingOfEachToken) {
  // More tokens than a batch, so the routing of a split request is reassembled too.
  const int64_t tokens = 45, k = 2;  // synthetic:tiny routes each token to 2 of 8 experts
  std::vector<float> x = RandomRows(tokens, rng_);
  model::Routing want = ref_.Route(x, tokens);
  for (bool with_output : {false, true}) {
    inference::ModelInferRequest req = Request(x, tokens);
    req.add_outputs()->set_name("topk_weights");
    req.add_outputs()->set_name("topk_ids");
    if (with_output) req.add_outputs()->set_name("moe_output");
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    grpc::Status s = stub_->ModelInfer(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.outputs_size(), with_output ? 3 : 2);
    std::map<std::string, int> at;
    for (int i = 0; i < resp.outputs_size(); ++i) at[resp.outputs(i).name()] = i;
    ASSERT_TRUE(at.count("topk_ids") && at.count("topk_weights"));
    const auto& ids_meta = resp.outputs(at["topk_ids"]);
    EXPECT_EQ(ids_meta.datatype(), "INT32");
    ASSERT_EQ(ids_meta.shape_size(), 2);
    EXPECT_EQ(ids_meta.shape(0), tokens);
    EXPECT_EQ(ids_meta.shape(1), k);
    EXPECT_EQ(resp.outputs(at["topk_weights"]).datatype(), "FP32");
    const std::string& ids_raw = resp.raw_output_contents(at["topk_ids"]);
    const std::string& w_raw = resp.raw_output_contents(at["topk_weights"]);
    ASSERT_EQ(ids_raw.size(), static_cast<size_t>(tokens * k * 4));
    ASSERT_EQ(w_raw.size(), static_cast<size_t>(tokens * k * 4));
    std::vector<int32_t> ids(tokens * k);
    std::vector<float> weights(tokens * k);
    std::memcpy(ids.data(), ids_raw.data(), ids_raw.size());
    std::memcpy(weights.data(), w_raw.data(), w_raw.size());
    int compared = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      if (want.margins[t] < 1e-5) continue;  // a near-tie may go either way
      ++compared;
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(ids[t * k + j], want.ids[t * k + j]) << "token " << t;
        EXPECT_NEAR(weights[t * k + j], want.weights[t * k + j], 1e-5) << "token " << t;
      }
    }
    EXPECT_GT(compared, tokens / 2);
    if (with_output) {
      std::vector<float> out(x.size());
      std::memcpy(out.data(), resp.raw_output_contents(at["moe_output"]).data(), out.size() * 4);
      EXPECT_LE(ref_.RelError(x, out.data(), tokens), 1e-4);
    }
  }
}

TEST_F(FrontEnd, ConfigMetadataStatisticsAndUnimplemented) {
  {
    inference::ModelConfigRequest req;
    req.set_name("moe");
    inference::ModelConfigResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->ModelConfig(&ctx, req, &resp).ok());
    const inference::ModelConfig& c = resp.config();
    EXPECT_EQ(c.name(), "moe");
    EXPECT_EQ(c.max_batch_size(), 0);
    ASSERT_EQ(c.input_size(), 1);
    EXPECT_EQ(c.input(0).name(), "hidden_states");
    EXPECT_EQ(c.input(0).data_type(), inference::TYPE_FP32);
    ASSERT_EQ(c.input(0).dims_size(), 2);
    EXPECT_EQ(c.input(0).dims(0), -1);
    EXPECT_EQ(c.input(0).dims(1), kHidden);
    ASSERT_EQ(c.output_size(), 3);
    EXPECT_EQ(c.output(0).name(), "moe_output");
    EXPECT_EQ(c.output(1).name(), "topk_ids");
    EXPECT_EQ(c.output(1).data_type(), inference::TYPE_INT32);
    EXPECT_EQ(c.output(1).dims(1), 2);  // tiny's top-k
    EXPECT_EQ(c.output(2).name(), "topk_weights");
    ASSERT_TRUE(c.has_dynamic_batching());
    EXPECT_EQ(c.dynamic_batching().max_queue_delay_microseconds(), 0u);
    EXPECT_EQ(c.dynamic_batching().priority_levels(), 3u);
    EXPECT_EQ(c.dynamic_batching().default_priority_level(), 2u);
    EXPECT_EQ(c.instance_group(0).count(), 2);
  }
  {
    inference::ServerMetadataResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->ServerMetadata(&ctx, {}, &resp).ok());
    std::vector<std::string> ext(resp.extensions().begin(), resp.extensions().end());
    EXPECT_NE(std::find(ext.begin(), ext.end(), "model_configuration"), ext.end());
    EXPECT_NE(std::find(ext.begin(), ext.end(), "statistics"), ext.end());
  }
  for (int i = 0; i < 3; ++i) {
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    ASSERT_TRUE(stub_->ModelInfer(&ctx, Request(RandomRows(20, rng_), 20), &resp).ok());
  }
  {
    inference::ModelStatisticsRequest req;  // "" asks for every model
    inference::ModelStatisticsResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->ModelStatistics(&ctx, req, &resp).ok());
    ASSERT_EQ(resp.model_stats_size(), 1);
    const inference::ModelStatistics& m = resp.model_stats(0);
    EXPECT_EQ(m.name(), "moe");
    EXPECT_GE(m.inference_count(), 3u);
    EXPECT_GE(m.execution_count(), 6u);  // 20 rows: two batches of at most 16
    const inference::InferStatistics& s = m.inference_stats();
    EXPECT_EQ(s.success().count(), m.inference_count());
    EXPECT_EQ(s.queue().count(), s.success().count());
    EXPECT_EQ(s.compute_infer().count(), s.success().count());
    EXPECT_GT(s.success().ns(), s.compute_infer().ns() / 2);
    EXPECT_GT(s.compute_infer().ns(), 0u);
    EXPECT_GT(m.batch_stats_size(), 0);
    EXPECT_GT(m.last_inference(), 0u);
  }
  {
    inference::RepositoryIndexResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->RepositoryIndex(&ctx, {}, &resp).ok());
    ASSERT_EQ(resp.models_size(), 1);
    EXPECT_EQ(resp.models(0).name(), "moe");
    EXPECT_EQ(resp.models(0).state(), "READY");
  }
  for (const auto& [model, code] :
       {std::pair{"synthetic:qwen1.5-moe-a2.7b", grpc::StatusCode::FAILED_PRECONDITION},
        {"synthetic:tiny", grpc::StatusCode::OK}}) {
    // Another shape is refused; the served model again (the server's seed, so the weights
    // the later tests' reference holds) is loaded and swapped in.
    inference::RepositoryModelLoadRequest req;
    req.set_model_name("moe");
    (*req.mutable_parameters())["model"].set_string_param(model);
    inference::RepositoryModelLoadResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    EXPECT_EQ(stub_->RepositoryModelLoad(&ctx, req, &resp).error_code(), code) << model;
    std::vector<float> x = RandomRows(9, rng_);
    inference::ModelInferResponse answer;
    grpc::ClientContext infer_ctx;
    SetDeadline(infer_ctx);
    ASSERT_TRUE(stub_->ModelInfer(&infer_ctx, Request(x, 9, "after-load"), &answer).ok());
    EXPECT_LE(ref_.RelError(x, Floats(answer.raw_output_contents(0)).data(), 9), 1e-4);
  }
  {
    inference::TraceSettingResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(stub_->TraceSetting(&ctx, {}, &resp).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
}

TEST_F(FrontEnd, HealthIsServing) {
  auto health = grpc::health::v1::Health::NewStub(Channel(server_->grpc_address()));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  {
    req.set_service("inference.GRPCInferenceService");
    grpc::ClientContext ctx;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  {
    req.set_service("nope");
    grpc::ClientContext ctx;
    EXPECT_EQ(health->Check(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    req.set_service("");
    grpc::ClientContext ctx;
    SetDeadline(ctx, 10);
    auto watch = health->Watch(&ctx, req);
    ASSERT_TRUE(watch->Read(&resp));
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
    ctx.TryCancel();
    watch->Finish().IgnoreError();
  }
}

TEST_F(FrontEnd, ATimeoutThatExpiresIsDeadlineExceeded) {
  inference::ModelInferRequest req = Request(RandomRows(4, rng_), 4);
  (*req.mutable_parameters())["timeout"].set_int64_param(1);  // microseconds
  inference::ModelInferResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  grpc::Status s = stub_->ModelInfer(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  // A generous one is honoured.
  (*req.mutable_parameters())["timeout"].set_int64_param(30'000'000);
  grpc::ClientContext ctx2;
  SetDeadline(ctx2);
  EXPECT_TRUE(stub_->ModelInfer(&ctx2, req, &resp).ok());
}

// Many clients of mixed sizes: every answer right and its own; batches grow with load.
TEST_F(FrontEnd, BatchesGrowWithLoadAndEveryAnswerIsItsOwn) {
  auto [rows0, batches0] = BatchFigures(*stub_);
  for (int i = 0; i < 30; ++i) {  // one client, one token at a time
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    ASSERT_TRUE(stub_->ModelInfer(&ctx, Request(RandomRows(1, rng_), 1), &resp).ok());
  }
  auto [rows1, batches1] = BatchFigures(*stub_);
  const double light = (rows1 - rows0) / static_cast<double>(batches1 - batches0);

  const uint64_t seed = rng_();
  std::atomic<int> wrong{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 24; ++c) {
    clients.emplace_back([&, c] {
      auto stub = inference::GRPCInferenceService::NewStub(Channel(server_->grpc_address()));
      std::mt19937_64 rng(seed + c);
      Reference ref;
      for (int i = 0; i < 12; ++i) {
        const int64_t tokens = (c + i) % 5 == 0 ? 37 : 1 + (c * 7 + i) % 5;
        std::vector<float> x = RandomRows(tokens, rng);
        const std::string id = absl::StrCat(c, "/", i);
        inference::ModelInferResponse resp;
        grpc::ClientContext ctx;
        SetDeadline(ctx);
        grpc::Status s = stub->ModelInfer(&ctx, Request(x, tokens, id), &resp);
        if (!s.ok() || resp.id() != id ||
            ref.RelError(x, Floats(resp.raw_output_contents(0)).data(), tokens) > 1e-4) {
          ++wrong;
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(wrong.load(), 0);
  auto [rows2, batches2] = BatchFigures(*stub_);
  const double heavy = (rows2 - rows1) / static_cast<double>(batches2 - batches1);
  std::cerr << "mean rows per batch: " << light << " at 1 client, " << heavy << " at 24 clients\n";
  EXPECT_LT(light, 1.5);
  EXPECT_GT(heavy, 2 * light);
}

// Under load, a priority-1 request overtakes queued priority-3 requests.
TEST_F(FrontEnd, PriorityChangesTheOrderUnderLoad) {
  std::mutex mu;
  std::vector<std::string> order;
  auto send = [&](const std::string& id, int priority, int64_t tokens) {
    auto stub = inference::GRPCInferenceService::NewStub(Channel(server_->grpc_address()));
    std::mt19937_64 rng(std::hash<std::string>{}(id));
    inference::ModelInferRequest req = Request(RandomRows(tokens, rng), tokens, id);
    (*req.mutable_parameters())["priority"].set_int64_param(priority);
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(id);
  };
  const int kLow = 24;  // 24 x 512 rows: 768 batches of 16
  std::vector<std::thread> threads;
  for (int i = 0; i < kLow; ++i) threads.emplace_back(send, absl::StrCat("low", i), 3, 512);
  absl::SleepFor(absl::Milliseconds(30));
  size_t done_before = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    done_before = order.size();
  }
  threads.emplace_back(send, "high", 1, 16);
  for (auto& t : threads) t.join();
  ASSERT_LT(done_before, kLow / 2u) << "the load was too light to queue anything";
  const size_t pos = std::find(order.begin(), order.end(), "high") - order.begin();
  std::cerr << "the priority-1 request finished " << pos + 1 << " of " << order.size() << "; "
            << done_before << " low ones had finished before it was sent\n";
  // Low requests started before it all have rows in flight; most must finish after it.
  EXPECT_LT(pos - done_before, (kLow - done_before) / 2);
}

TEST(Limits, AFullQueueIsResourceExhaustedAndAcceptedRequestsComplete) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(2, {"--max-batch-tokens=16", "--max-queue-tokens=64",
                               "--max-request-tokens=64", "--max-queue-delay-us=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 12; ++c) {
    clients.emplace_back([&, c] {
      auto stub = inference::GRPCInferenceService::NewStub(Channel((*server)->grpc_address()));
      std::mt19937_64 rng(c);
      Reference ref;
      for (int i = 0; i < 6; ++i) {
        std::vector<float> x = RandomRows(48, rng);
        inference::ModelInferResponse resp;
        grpc::ClientContext ctx;
        SetDeadline(ctx);
        grpc::Status s = stub->ModelInfer(&ctx, Request(x, 48), &resp);
        if (s.ok() && ref.RelError(x, Floats(resp.raw_output_contents(0)).data(), 48) <= 1e-4) {
          ++ok;
        } else if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          EXPECT_NE(s.error_message().find("--max-queue-tokens=64"), std::string::npos);
          ++exhausted;
        } else {
          ++other;
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  std::cerr << "OK " << ok << ", RESOURCE_EXHAUSTED " << exhausted << "\n";
  EXPECT_GT(ok.load(), 0);
  EXPECT_GT(exhausted.load(), 0);
  EXPECT_EQ(other.load(), 0);
  // A request larger than --max-request-tokens is refused by validation.
  auto stub = inference::GRPCInferenceService::NewStub(Channel((*server)->grpc_address()));
  std::mt19937_64 rng(1);
  inference::ModelInferResponse resp;
  grpc::ClientContext ctx;
  grpc::Status s = stub->ModelInfer(&ctx, Request(RandomRows(65, rng), 65), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("must be in [1, 64], got 65"), std::string::npos);
}

// The value of series `name` (with its labels, exactly as exposed) at `address`/metrics; -1
// when absent or unreachable.
double ScrapeValue(const std::string& address, const std::string& name) {
  const size_t colon = address.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  const std::string req = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return -1;
  }
  std::string body;
  char buf[65536];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) body.append(buf, n);
  close(fd);
  const size_t at = body.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(body.substr(at + name.size() + 2));
}

// --max-inflight-bytes bounds what rank 0 holds: a request whose message and answer do not
// fit is refused with the flag's name, smaller ones pass one after another (each answer
// releases its bytes), and a stream whose client stops reading is closed at --answer-timeout.
TEST(Limits, TheMemoryBudgetRefusesWhatDoesNotFitAndFreesWhatIsAnswered) {
  // tiny: H = 64, a token row is 256 bytes in FP32 each way.
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(
      3, {"--max-inflight-bytes=65536", "--answer-timeout=1s", "--max-request-tokens=512"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = inference::GRPCInferenceService::NewStub(Channel((*server)->grpc_address()));
  std::mt19937_64 rng(std::random_device{}());
  Reference ref;
  {
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    grpc::Status s = stub->ModelInfer(&ctx, Request(RandomRows(200, rng), 200), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("--max-inflight-bytes=65536"), std::string::npos)
        << s.error_message();
  }
  // 12 KiB each way: two fit at once, three do not. One after another they all pass, so each
  // answer releases its bytes. gRPC reports a call done just after its client has the answer,
  // so the calls before may still be held when the next arrives (two of them on a loaded
  // 2-core host): a refused call is sent again until those are released, within 2 s. Were
  // answered calls never released, every call from the third on would be refused.
  int refused = 0;
  for (int i = 0; i < 40; ++i) {
    std::vector<float> x = RandomRows(48, rng);
    inference::ModelInferResponse resp;
    grpc::Status s;
    for (int attempt = 0; attempt < 100; ++attempt) {
      resp.Clear();
      resp.add_raw_output_contents(std::string(48 * 64 * 4, '\xff'));  // poison
      grpc::ClientContext ctx;
      SetDeadline(ctx);
      s = stub->ModelInfer(&ctx, Request(x, 48), &resp);
      if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) break;
      ++refused;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_TRUE(s.ok()) << i << ": " << s.error_message();
    EXPECT_LE(ref.RelError(x, Floats(resp.raw_output_contents(0)).data(), 48), 1e-4);
  }
  std::cerr << "calls sent again while earlier answers were still held: " << refused << "\n";
  EXPECT_EQ(ScrapeValue((*server)->metrics_address(), "epserve_held_bytes_limit"), 65536);
  double held = -1;
  for (int i = 0; i < 50 && held != 0; ++i) {
    held = ScrapeValue((*server)->metrics_address(), "epserve_held_bytes");
    if (held != 0) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(held, 0);
}

// A stream whose client stops reading is closed about --answer-timeout after the first answer
// that could not be written, and what it held is released.
TEST(Limits, AStreamWhoseAnswersAreNotTakenIsClosedAtTheAnswerTimeout) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(
      3, {"--answer-timeout=1s", "--max-request-tokens=512", "--max-stream-inflight=200"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = inference::GRPCInferenceService::NewStub(Channel((*server)->grpc_address()));
  std::mt19937_64 rng(std::random_device{}());
  grpc::ClientContext ctx;
  SetDeadline(ctx);
  auto stream = stub->ModelStreamInfer(&ctx);
  std::vector<float> x = RandomRows(512, rng);  // 128 KiB answers, 25 MiB in all
  int written = 0;
  for (; written < 200; ++written) {
    if (!stream->Write(Request(x, 512))) break;
  }
  const std::string closed = "epserve_grpc_calls_closed_total{reason=\"answer_timeout\"}";
  double n = 0;
  for (int i = 0; i < 100 && n < 1; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    n = ScrapeValue((*server)->metrics_address(), closed);
  }
  EXPECT_GE(n, 1) << "no call closed at the answer timeout; " << written << " requests written";
  stream->WritesDone();
  inference::ModelStreamInferResponse r;
  int read = 0;
  while (stream->Read(&r)) ++read;
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_LT(read, written);
  std::cerr << written << " requests written, " << read << " answers read before the server "
            << "closed the stream\n";
  double held = -1;
  for (int i = 0; i < 50 && held != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    held = ScrapeValue((*server)->metrics_address(), "epserve_held_bytes");
  }
  EXPECT_EQ(held, 0) << "what the closed stream held was not released";
}

// ---------------------------------------------------------------- security

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl.
struct Certs {
  std::string dir;
  std::string ca, server_cert, server_key, client_cert, client_key;
  static std::optional<Certs> Make() {
    char tmpl[] = "/tmp/epserve-certs-XXXXXX";
    Certs c;
    c.dir = mkdtemp(tmpl);
    const std::string d = c.dir;
    const std::string script = absl::StrCat(
        "set -e; cd ", d, "; exec >openssl.log 2>&1\n",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
        "-subj /CN=epserve-test-ca\n",
        "printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext\n", "for who in server client; do\n",
        "  openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr -subj /CN=$who\n",
        "  openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out $who.pem -days 2 -extfile san.ext\n",
        "done\n");
    if (std::system(absl::StrCat("bash -c '", absl::StrReplaceAll(script, {{"'", "'\\''"}}), "'")
                        .c_str()) != 0) {
      std::cerr << ReadFile(d + "/openssl.log");
      return std::nullopt;
    }
    c.ca = ReadFile(d + "/ca.pem");
    c.server_cert = d + "/server.pem";
    c.server_key = d + "/server.key";
    c.client_cert = ReadFile(d + "/client.pem");
    c.client_key = ReadFile(d + "/client.key");
    return c;
  }
};

grpc::Status Live(Stub& stub, const std::string& token = "") {
  inference::ServerLiveResponse resp;
  grpc::ClientContext ctx;
  SetDeadline(ctx, 10);
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  return stub.ServerLive(&ctx, {}, &resp);
}

TEST(Security, TlsAndBearerToken) {
  std::optional<Certs> certs = Certs::Make();
  ASSERT_TRUE(certs) << "openssl failed";
  { std::ofstream(certs->dir + "/token") << "s3cret-token\n"; }
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(2, {"--tls-cert=" + certs->server_cert, "--tls-key=" + certs->server_key,
                               "--auth-token-file=" + certs->dir + "/token"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->grpc_address();

  // Plaintext against TLS fails.
  auto plain = inference::GRPCInferenceService::NewStub(Channel(address));
  EXPECT_EQ(Live(*plain, "s3cret-token").error_code(), grpc::StatusCode::UNAVAILABLE);

  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = certs->ca;
  auto channel = Channel(address, grpc::SslCredentials(ssl));
  auto stub = inference::GRPCInferenceService::NewStub(channel);
  EXPECT_TRUE(Live(*stub, "s3cret-token").ok());
  grpc::Status missing = Live(*stub);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::UNAUTHENTICATED) << missing.error_message();
  EXPECT_EQ(Live(*stub, "guess").error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // Inference needs the token too; health does not.
  std::mt19937_64 rng(3);
  for (const std::string token : {"", "s3cret-token"}) {
    inference::ModelInferResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    grpc::Status s = stub->ModelInfer(&ctx, Request(RandomRows(3, rng), 3), &resp);
    EXPECT_EQ(s.error_code(),
              token.empty() ? grpc::StatusCode::UNAUTHENTICATED : grpc::StatusCode::OK)
        << s.error_message();
  }
  {
    grpc::ClientContext ctx;
    SetDeadline(ctx);
    auto stream = stub->ModelStreamInfer(&ctx);
    stream->WritesDone();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckResponse hr;
  grpc::ClientContext hctx;
  EXPECT_TRUE(health->Check(&hctx, {}, &hr).ok());
  EXPECT_EQ(hr.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST(Security, MutualTlsNeedsAClientCertificate) {
  std::optional<Certs> certs = Certs::Make();
  ASSERT_TRUE(certs) << "openssl failed";
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start(2, {"--tls-cert=" + certs->server_cert, "--tls-key=" + certs->server_key,
                               "--tls-client-ca=" + certs->dir + "/ca.pem"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->grpc_address();
  grpc::SslCredentialsOptions without;
  without.pem_root_certs = certs->ca;
  auto anonymous =
      inference::GRPCInferenceService::NewStub(Channel(address, grpc::SslCredentials(without)));
  EXPECT_EQ(Live(*anonymous).error_code(), grpc::StatusCode::UNAVAILABLE);
  grpc::SslCredentialsOptions with = without;
  with.pem_cert_chain = certs->client_cert;
  with.pem_private_key = certs->client_key;
  auto known =
      inference::GRPCInferenceService::NewStub(Channel(address, grpc::SslCredentials(with)));
  grpc::Status s = Live(*known);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST(Drain, HealthTurnsNotServingAndRankZeroLeavesCleanly) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(2, {});
  ASSERT_TRUE(server.ok()) << server.status();
  auto health = grpc::health::v1::Health::NewStub(Channel((*server)->grpc_address()));
  grpc::ClientContext ctx;
  SetDeadline(ctx, 30);
  auto watch = health->Watch(&ctx, {});
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(watch->Read(&resp));
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  std::thread stopper([&] {
    absl::StatusOr<ServerExit> exit = (*server)->Stop(SIGTERM, absl::Seconds(15));
    ASSERT_TRUE(exit.ok()) << exit.status();
    // mpirun itself exits 1 after forwarding a signal (Open MPI); rank 0 must have drained
    // and left cleanly.
    const std::string log = (*server)->Log();
    EXPECT_NE(log.find("[epserve rank 0] stopped serving in"), std::string::npos) << log;
    EXPECT_NE(log.find("[epserve rank 0] left the heap"), std::string::npos) << log;
    EXPECT_EQ(log.find("did not stop cleanly"), std::string::npos) << log;
  });
  ASSERT_TRUE(watch->Read(&resp));
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  while (watch->Read(&resp)) {
  }
  watch->Finish().IgnoreError();
  stopper.join();
}

}  // namespace
}  // namespace epserve::testing
