// CUDA shared memory on rank 0 (server/cuda_shared_memory.h): the registry's checks, with an
// opener that stands in for the CUDA driver (the real one runs on GPU hosts:
// tests/e2e/cuda_shm_test.py), and requests that name CUDA regions (ParseInfer).
#include "server/cuda_shared_memory.h"

#include <atomic>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "server/validation.h"

namespace epserve::server {
namespace {

// Allocations of 4096 bytes, known by their first handle byte; device 0 or 1; counts the
// mappings open.
struct FakeDriver {
  std::atomic<int> open{0};
  CudaMemoryOpener Opener() {
    return [this](absl::string_view handle, int64_t device) -> absl::StatusOr<OpenedCudaMemory> {
      if (device > 1) return absl::InvalidArgumentError("device_id: no such device");
      if (handle[0] != 'A') return absl::InvalidArgumentError("not a live allocation");
      ++open;
      return OpenedCudaMemory{4096, [this] { --open; }};
    };
  }
};

std::string Handle(char first) {
  std::string h(CudaSharedMemoryRegistry::kIpcHandleBytes, '\0');
  std::mt19937 rng(std::random_device{}());
  for (char& c : h) c = static_cast<char>(rng());
  h[0] = first;
  return h;
}

TEST(CudaSharedMemoryRegistry, UnavailableSaysWhyOnEveryCall) {
  CudaSharedMemoryRegistry r("the workers are CPUs");
  for (absl::Status s :
       {r.Register("a", Handle('A'), 0, 64), r.Unregister("a"), r.Status("").status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
    EXPECT_NE(s.message().find("the workers are CPUs"), std::string::npos) << s;
  }
  EXPECT_FALSE(r.available());
}

TEST(CudaSharedMemoryRegistry, BadRegistrationsNameTheField) {
  FakeDriver driver;
  CudaSharedMemoryRegistry r("", 2);
  r.set_available(driver.Opener());
  auto expect = [](absl::Status s, absl::StatusCode code, const char* text) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(text), std::string::npos) << s;
  };
  expect(r.Register("", Handle('A'), 0, 64), absl::StatusCode::kInvalidArgument, "name");
  expect(r.Register("a", "short", 0, 64), absl::StatusCode::kInvalidArgument, "raw_handle");
  expect(r.Register("a", Handle('A'), 0, 0), absl::StatusCode::kInvalidArgument, "byte_size");
  expect(r.Register("a", Handle('A'), -1, 64), absl::StatusCode::kInvalidArgument, "device_id");
  expect(r.Register("a", Handle('A'), 7, 64), absl::StatusCode::kInvalidArgument, "device");
  expect(r.Register("a", Handle('Z'), 0, 64), absl::StatusCode::kInvalidArgument,
         "not a live allocation");
  expect(r.Register("a", Handle('A'), 0, 4097), absl::StatusCode::kInvalidArgument,
         "byte_size: 4097 bytes past the end");
  EXPECT_EQ(driver.open.load(), 0) << "a refused registration left its mapping open";
  ASSERT_TRUE(r.Register("a", Handle('A'), 1, 4096).ok());
  expect(r.Register("a", Handle('A'), 0, 64), absl::StatusCode::kAlreadyExists, "'a'");
  ASSERT_TRUE(r.Register("b", Handle('A'), 0, 64).ok());
  expect(r.Register("c", Handle('A'), 0, 64), absl::StatusCode::kResourceExhausted, "at most 2");
  EXPECT_EQ(driver.open.load(), 2);
  absl::StatusOr<std::vector<CudaRegionStatus>> all = r.Status("");
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].device_id, 1);
  EXPECT_EQ((*all)[0].byte_size, 4096u);
  EXPECT_EQ(r.Status("nobody").status().code(), absl::StatusCode::kNotFound);
}

TEST(CudaSharedMemoryRegistry, ARegionStaysOpenWhileARequestHoldsIt) {
  FakeDriver driver;
  CudaSharedMemoryRegistry r("");
  r.set_available(driver.Opener());
  ASSERT_TRUE(r.Register("a", Handle('A'), 0, 1024).ok());
  absl::StatusOr<std::shared_ptr<const CudaSharedMemoryRegion>> held = r.Find("a");
  ASSERT_TRUE(held.ok());
  EXPECT_GE((*held)->id(), 1u);
  ASSERT_TRUE(r.Unregister("a").ok());
  EXPECT_EQ(r.Find("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(driver.open.load(), 1) << "closed under a request";
  EXPECT_TRUE((*held)->CheckSpan(1000, 24, "input").ok());
  EXPECT_EQ((*held)->CheckSpan(1000, 25, "input").code(), absl::StatusCode::kInvalidArgument);
  held->reset();
  EXPECT_EQ(driver.open.load(), 0);
  // A new registration under the same name is another region.
  ASSERT_TRUE(r.Register("a", Handle('A'), 0, 64).ok());
  ASSERT_TRUE(r.Unregister("").ok());
  EXPECT_EQ(driver.open.load(), 0);
}

// H = 4; requests whose input and output name CUDA regions.
inference::ModelInferRequest CudaRequest(int64_t tokens, const std::string& region,
                                         int64_t offset) {
  inference::ModelInferRequest req;
  req.set_model_name("moe");
  auto* in = req.add_inputs();
  in->set_name("hidden_states");
  in->set_datatype("BF16");
  in->add_shape(tokens);
  in->add_shape(4);
  (*in->mutable_parameters())["shared_memory_region"].set_string_param(region);
  (*in->mutable_parameters())["shared_memory_byte_size"].set_int64_param(tokens * 8);
  (*in->mutable_parameters())["shared_memory_offset"].set_int64_param(offset);
  auto* out = req.add_outputs();
  out->set_name("moe_output");
  (*out->mutable_parameters())["shared_memory_region"].set_string_param(region);
  (*out->mutable_parameters())["shared_memory_byte_size"].set_int64_param(tokens * 8);
  return req;
}

TEST(ParseInferCuda, TensorsInCudaRegionsAreFoundAndChecked) {
  FakeDriver driver;
  CudaSharedMemoryRegistry cuda("");
  cuda.set_available(driver.Opener());
  ASSERT_TRUE(cuda.Register("g", Handle('A'), 0, 256).ok());
  SharedMemoryRegistry system;
  const ServedModel model{.hidden_size = 4, .layers = {3}};
  const RequestOptions requests{.model_name = "moe", .max_request_tokens = 100};
  const ModelSignature sig(model, requests);
  absl::StatusOr<ParsedInfer> p = ParseInfer(CudaRequest(8, "g", 64), sig, &system, &cuda);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->input, nullptr);
  ASSERT_NE(p->input_cuda.cuda, nullptr);
  EXPECT_EQ(p->input_cuda.cuda_offset, 64u);
  EXPECT_EQ(p->output_shm.cuda, p->input_cuda.cuda);
  EXPECT_EQ(p->output_type, common::ElementType::kBf16);
  // 8 tokens at offset 200 run past the region's 256 bytes.
  absl::Status s = ParseInfer(CudaRequest(8, "g", 200), sig, &system, &cuda).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("lie outside CUDA shared memory region 'g'"), std::string::npos) << s;
  // Without the CUDA registry the name is unknown.
  EXPECT_EQ(ParseInfer(CudaRequest(8, "g", 0), sig, &system).status().code(),
            absl::StatusCode::kNotFound);
  // The routing outputs cannot go to CUDA memory.
  inference::ModelInferRequest req = CudaRequest(1, "g", 0);
  auto* ids = req.add_outputs();
  ids->set_name("topk_ids");
  (*ids->mutable_parameters())["shared_memory_region"].set_string_param("g");
  (*ids->mutable_parameters())["shared_memory_byte_size"].set_int64_param(64);
  s = ParseInfer(req, sig, &system, &cuda).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("cannot go to CUDA shared memory"), std::string::npos) << s;
}

}  // namespace
}  // namespace epserve::server
