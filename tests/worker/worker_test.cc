#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/flags.h"
#include "gtest/gtest.h"
#include "worker/exchange.h"
#include "worker/heap_regions.h"
#include "worker/payload.h"
#include "worker/placement.h"
#include "worker/worker.h"

namespace epserve::worker {
namespace {

TEST(HostWorkers, IndexAmongTheWorkersOfTheHost) {
  // Ranks 0, 2, 3 and 5 on this host: rank 0 is the front-end, ranks 2, 3, 5 workers.
  const int on_host[] = {0, 2, 3, 5};
  EXPECT_EQ(WorkersOnHost(on_host, 0).index, 0);
  EXPECT_EQ(WorkersOnHost(on_host, 0).count, 1);
  for (int i = 0; i < 3; ++i) {
    const HostWorkers w = WorkersOnHost(on_host, on_host[i + 1]);
    EXPECT_EQ(w.index, i);
    EXPECT_EQ(w.count, 3);
  }
  EXPECT_TRUE(CheckWorkerCount(8, 8).ok());
  EXPECT_NE(CheckWorkerCount(9, 8).message().find("9 workers but the model has only 8 experts"),
            std::string::npos);
  EXPECT_FALSE(CheckWorkerCount(0, 8).ok());
}

TEST(ExpertPlacement, EveryExpertHasExactlyOneOwnerForAnyWorkerCount) {
  for (int experts : {1, 7, 8, 60}) {
    for (int workers = 1; workers <= experts; ++workers) {
      absl::StatusOr<ExpertPlacement> p = ExpertPlacement::Contiguous(experts, workers);
      ASSERT_TRUE(p.ok());
      int total = 0, min_count = experts, max_count = 0;
      for (int w = 0; w < workers; ++w) {
        total += p->count(w);
        min_count = std::min(min_count, p->count(w));
        max_count = std::max(max_count, p->count(w));
        for (int local = 0; local < p->count(w); ++local) {
          const int e = p->expert(w, local);
          ASSERT_EQ(p->copies(e).size(), 1u);
          EXPECT_EQ(p->copies(e)[0].worker, w);
          EXPECT_EQ(p->copies(e)[0].local, local);
          EXPECT_EQ(p->LocalIndex(w, e), local);
          if (local > 0) {
            EXPECT_EQ(e, p->expert(w, local - 1) + 1);  // contiguous
          }
        }
      }
      EXPECT_EQ(total, experts);
      EXPECT_GE(min_count, 1);
      EXPECT_LE(max_count - min_count, 1) << experts << " experts over " << workers;
    }
  }
}

TEST(ExpertPlacement, MoreWorkersThanExpertsIsAClearError) {
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::Contiguous(8, 9);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("num_experts=8"), absl::string_view::npos) << p.status();
}

TEST(ExpertPlacement, FromSlotsNamesWhatIsWrong) {
  struct Bad {
    std::vector<std::vector<int>> slots;
    const char* says;
  } bad[] = {
      {{{0, 1}, {1}}, "expert 2 has no copy"},
      {{{0, 1, 1}, {2}}, "worker 0 holds expert 1 twice"},
      {{{0, 1}, {2, 3}}, "worker 1 holds expert 3, outside [0, 3)"},
      {{{0, 1, 2}, {}}, "worker 1 holds no expert"},
  };
  for (const Bad& b : bad) {
    absl::StatusOr<ExpertPlacement> p = ExpertPlacement::FromSlots(3, b.slots);
    ASSERT_FALSE(p.ok()) << b.says;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(b.says), absl::string_view::npos) << p.status();
  }
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::FromSlots(3, {{2, 0}, {1, 2}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->redundant(), 1);
  EXPECT_EQ(p->max_local(), 2);
  ASSERT_EQ(p->copies(2).size(), 2u);
  EXPECT_EQ(p->copies(2)[0].worker, 0);
  EXPECT_EQ(p->copies(2)[0].local, 0);
  EXPECT_EQ(p->copies(2)[1].worker, 1);
  EXPECT_EQ(p->copies(2)[1].local, 1);
  EXPECT_EQ(p->LocalIndex(1, 0), -1);
  EXPECT_EQ(p->Describe(), "w0: 0 2, w1: 1-2");
}

// A sender's pairs of a replicated expert go to its copies so that the workers' pair counts
// even out; single-copy experts go to their holder; the choice is a function of the inputs.
TEST(ExpertPlacement, ChooseCopiesEvensOutTheSendersPairs) {
  // Expert 0 on both workers, 1 and 2 on worker 0, 3 on worker 1.
  absl::StatusOr<ExpertPlacement> p = ExpertPlacement::FromSlots(4, {{0, 1, 2}, {3, 0}});
  ASSERT_TRUE(p.ok()) << p.status();
  std::mt19937 rng(std::random_device{}());
  const int n = 200, k = 2;
  std::vector<int32_t> ids(n * k);
  for (int t = 0; t < n; ++t) {
    ids[t * k] = 0;  // every token: expert 0 and one of 1, 2
    ids[t * k + 1] = 1 + static_cast<int>(rng() % 2);
  }
  std::vector<int32_t> dest(n * k), local(n * k), dest2(n * k), local2(n * k);
  ChooseCopies(*p, ids.data(), n, k, 0, dest.data(), local.data());
  ChooseCopies(*p, ids.data(), n, k, 0, dest2.data(), local2.data());
  EXPECT_EQ(dest, dest2);
  EXPECT_EQ(local, local2);
  int on[2] = {0, 0};
  for (int i = 0; i < n * k; ++i) {
    ++on[dest[i]];
    EXPECT_EQ(p->expert(dest[i], local[i]), ids[i]) << i;
    if (ids[i] != 0) {
      EXPECT_EQ(dest[i], 0) << "single copy";
    }
  }
  // Worker 0 gets every second choice; expert 0 goes to worker 1 so that both get n pairs.
  EXPECT_LE(std::abs(on[0] - on[1]), 2) << on[0] << " vs " << on[1];
}

TEST(ExpertPlacement, PlacementTablesRoundTripAndBadOnesAreRefused) {
  std::vector<ExpertPlacement> layers;
  layers.push_back(*ExpertPlacement::Contiguous(5, 2));
  layers.push_back(*ExpertPlacement::FromSlots(5, {{4, 0, 1}, {2, 3, 4}}));
  const std::vector<int32_t> words = EncodePlacements(layers);
  absl::StatusOr<std::vector<ExpertPlacement>> back = DecodePlacements(words, 5, 2);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 2u);
  EXPECT_TRUE((*back)[0] == layers[0]);
  EXPECT_TRUE((*back)[1] == layers[1]);
  EXPECT_EQ((*back)[1].expert(0, 0), 4);  // slot order kept
  // Wrong worker count, cut short, one word too many, an expert out of range.
  EXPECT_FALSE(DecodePlacements(words, 5, 3).ok());
  EXPECT_FALSE(
      DecodePlacements(std::span<const int32_t>(words).first(words.size() - 1), 5, 2).ok());
  std::vector<int32_t> longer = words;
  longer.push_back(0);
  EXPECT_NE(DecodePlacements(longer, 5, 2).status().message().find("past its end"),
            absl::string_view::npos);
  std::vector<int32_t> bad = words;
  bad.back() = 7;
  EXPECT_NE(DecodePlacements(bad, 5, 2).status().message().find("outside [0, 5)"),
            absl::string_view::npos);
}

ExchangeShape TestShape() {
  return {.num_workers = 3, .num_experts = 8, .top_k = 2, .hidden = 64, .max_batch_tokens = 100};
}

TEST(HeapRegions, HeapSizeFollowsCapacityAndDtypes) {
  absl::StatusOr<ExchangePlan> plan = ExchangePlan::Make(TestShape(), {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->max_rows_per_worker(), 34);
  EXPECT_EQ(plan->shape().first_rank, 1);
  EXPECT_EQ(plan->recv_capacity(), 100);  // a receiver gets each token at most once
  const size_t bytes = HeapRegions::BytesNeeded(*plan);
  const size_t row = 64 * sizeof(float);
  // input and output (two slots of each: two batches in flight) + receive + combine (one per
  // received pair, k = 2) rows, plus the routing's two slots, metadata and alignment.
  const size_t slots = HeapRegions::kSlots;
  EXPECT_GE(bytes, (slots * (34 + 100) + 100 + 200) * row);
  EXPECT_LT(bytes, (slots * (34 + 100) + 100 + 200) * row + 12 * 4096 + slots * 100 * 7 * 4);
  EXPECT_EQ(plan->combine_capacity(), 200);
  // Redundant experts widen the per-expert counts only; more than one copy per worker of
  // every expert is refused, naming the flag.
  ExchangeShape replicated = TestShape();
  replicated.redundant_experts = 4;
  absl::StatusOr<ExchangePlan> wide = ExchangePlan::Make(replicated, {});
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_EQ(plan->max_local_experts(), 3);
  EXPECT_EQ(wide->max_local_experts(), 4);
  EXPECT_LE(HeapRegions::BytesNeeded(*wide), bytes + 4096);
  replicated.redundant_experts = 17;
  EXPECT_NE(ExchangePlan::Make(replicated, {})
                .status()
                .message()
                .find("--redundant-experts must be in [0, experts x (workers - 1) = 16]"),
            absl::string_view::npos);

  // A smaller capacity and narrower payloads shrink the heap.
  ExchangeOptions narrow;
  narrow.max_recv_tokens_per_rank = 20;
  narrow.dispatch_dtype = common::ElementType::kFp8E4m3;
  narrow.combine_dtype = common::ElementType::kBf16;
  absl::StatusOr<ExchangePlan> small = ExchangePlan::Make(TestShape(), narrow);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->recv_capacity(), 20);
  EXPECT_LT(HeapRegions::BytesNeeded(*small), bytes - 80 * row);
  EXPECT_NE(ExchangeRegions::Describe(*small).find("fp8"), std::string::npos);
  // A capacity above a batch is a batch.
  narrow.max_recv_tokens_per_rank = 1000;
  EXPECT_EQ(ExchangePlan::Make(TestShape(), narrow)->recv_capacity(), 100);
}

TEST(ExchangeOptions, BadValuesNameTheFlag) {
  ExchangeShape s = TestShape();
  s.num_workers = 4;
  s.max_batch_tokens = 64;
  const ExchangeOptions good;
  EXPECT_TRUE(good.Validate().ok());
  auto message = [&](const ExchangeOptions& o) {
    // Validate and Make say the same of the options.
    EXPECT_EQ(o.Validate(), ExchangePlan::Make(s, o).status());
    return std::string(o.Validate().message());
  };
  ExchangeOptions bad = good;
  bad.dispatch_dtype = common::ElementType::kFp16;
  EXPECT_EQ(message(bad), "--dispatch-dtype must be fp32, bf16 or fp8, got 'fp16'");
  bad = good;
  bad.combine_dtype = common::ElementType::kFp8E4m3;
  EXPECT_EQ(message(bad), "--combine-dtype must be fp32 or bf16, got 'fp8'");
  bad = good;
  bad.max_recv_tokens_per_rank = -1;
  EXPECT_NE(message(bad).find("--max-recv-tokens-per-rank"), std::string::npos);
  bad = good;
  bad.exchange_timeout_ms = 0;
  EXPECT_NE(message(bad).find("--exchange-timeout-ms"), std::string::npos);

  // The shared expert is split only where the model has one.
  bad = good;
  bad.shared_expert = SharedExpertPlacement::kSplit;
  EXPECT_FALSE(ExchangePlan::Make(s, bad)->shared_expert_split());
  s.has_shared_expert = true;
  EXPECT_TRUE(ExchangePlan::Make(s, bad)->shared_expert_split());
  bad.shared_expert = SharedExpertPlacement::kOwner;
  EXPECT_FALSE(ExchangePlan::Make(s, bad)->shared_expert_split());

  // Split rounds carry capacity / W tokens per sender: the capacity must reach W, which only
  // the plan knows.
  bad = good;
  bad.recv_overflow = OverflowPolicy::kSplit;
  bad.max_recv_tokens_per_rank = 3;
  EXPECT_TRUE(bad.Validate().ok());
  absl::StatusOr<ExchangePlan> plan = ExchangePlan::Make(s, bad);
  EXPECT_NE(plan.status().message().find("--max-recv-tokens-per-rank"), std::string::npos);
  bad.max_recv_tokens_per_rank = 4;
  plan = ExchangePlan::Make(s, bad);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->overflow(), OverflowPolicy::kSplit);
  EXPECT_EQ(plan->timeout(), absl::Milliseconds(good.exchange_timeout_ms));
  EXPECT_EQ(plan->heap_backend(), shmem::HeapBackend::kAuto);
}

// The exchange flags' parse functions (app/flags.cc binds each with FlagSet::AddTyped): each
// takes its flag's spellings, and refuses any other with the flag and what it takes.
TEST(ExchangeOptions, FlagSpellingsParseOrNameTheFlag) {
  EXPECT_EQ(*ParseDispatchDtype("fp8"), common::ElementType::kFp8E4m3);
  EXPECT_EQ(*ParseCombineDtype("bf16"), common::ElementType::kBf16);
  EXPECT_EQ(*ParseOverflowPolicy("split"), OverflowPolicy::kSplit);
  EXPECT_EQ(*ParseSharedExpertPlacement("owner"), SharedExpertPlacement::kOwner);
  EXPECT_EQ(*ParseSharedExpertPlacement("split"), SharedExpertPlacement::kSplit);
  for (SharedExpertPlacement p : {SharedExpertPlacement::kSplit, SharedExpertPlacement::kOwner}) {
    EXPECT_EQ(*ParseSharedExpertPlacement(SharedExpertPlacementName(p)), p);
  }
  for (OverflowPolicy p : {OverflowPolicy::kFail, OverflowPolicy::kSplit}) {
    EXPECT_EQ(*ParseOverflowPolicy(OverflowPolicyName(p)), p);
  }
  EXPECT_EQ(ParseDispatchDtype("fp16").status().message(),
            "--dispatch-dtype must be fp32, bf16 or fp8, got 'fp16'");
  EXPECT_EQ(ParseCombineDtype("fp8").status().message(),
            "--combine-dtype must be fp32 or bf16, got 'fp8'");
  EXPECT_EQ(ParseOverflowPolicy("drop").status().message(),
            "--recv-overflow must be fail or split, got 'drop'");
  EXPECT_EQ(ParseSharedExpertPlacement("everywhere").status().message(),
            "--shared-expert must be owner or split, got 'everywhere'");
  EXPECT_EQ(shmem::ParseHeapBackend("gpu").status().message(),
            "--heap must be auto, shm or rma, got 'gpu'");

  // Bound as flags, a bad value is refused at parsing with that message, and a good one lands
  // in the options typed.
  ExchangeOptions o;
  common::FlagSet fs("test", "");
  const auto dtype = [](const common::ElementType& t) { return std::string(common::FlagName(t)); };
  fs.AddTyped<common::ElementType>("dispatch-dtype", &o.dispatch_dtype, "", ParseDispatchDtype,
                                   dtype);
  fs.AddTyped<common::ElementType>("combine-dtype", &o.combine_dtype, "", ParseCombineDtype, dtype);
  fs.AddTyped<SharedExpertPlacement>(
      "shared-expert", &o.shared_expert, "", ParseSharedExpertPlacement,
      [](const SharedExpertPlacement& p) { return SharedExpertPlacementName(p); });
  auto parse = [&](std::vector<std::string> args) {
    args.insert(args.begin(), "test");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    return fs.Parse(static_cast<int>(argv.size()), argv.data());
  };
  EXPECT_EQ(parse({"--combine-dtype=fp8"}).message(),
            "--combine-dtype must be fp32 or bf16, got 'fp8'");
  EXPECT_EQ(parse({"--shared-expert", "both"}).message(),
            "--shared-expert must be owner or split, got 'both'");
  ASSERT_TRUE(
      parse({"--dispatch-dtype=bf16", "--combine-dtype", "bf16", "--shared-expert=owner"}).ok());
  EXPECT_EQ(o.dispatch_dtype, common::ElementType::kBf16);
  EXPECT_EQ(o.combine_dtype, common::ElementType::kBf16);
  EXPECT_EQ(o.shared_expert, SharedExpertPlacement::kOwner);
  EXPECT_TRUE(o.Validate().ok());
}

// ---- payload encodings ----

TEST(Payload, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: rounds up to even.
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  // Just above the halfway point rounds up.
  EXPECT_EQ(FloatToBf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3F81);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xC000);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(INFINITY)), INFINITY);
  // The largest float rounds to infinity, as IEEE rounding does.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(3.4028235e38f)), INFINITY);
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {  // every finite bf16 survives a round trip
    const float v = Bf16ToFloat(static_cast<uint16_t>(bits));
    if (!std::isnan(v)) {
      ASSERT_EQ(FloatToBf16(v), bits);
    }
  }
}

TEST(Payload, Fp8E4m3IsExactOnItsGridRoundsToEvenAndSaturates) {
  EXPECT_EQ(Fp8E4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4m3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.0f);
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0x7F)));
  std::vector<float> grid;
  for (int b = 0; b < 0x7F; ++b) {
    const float v = Fp8E4m3ToFloat(static_cast<uint8_t>(b));
    ASSERT_EQ(FloatToFp8E4m3(v), b) << v;
    ASSERT_EQ(FloatToFp8E4m3(-v), b == 0 ? 0x80 : (0x80 | b)) << -v;
    grid.push_back(v);
  }
  // Between two neighbours: the nearer one; at the midpoint, the one with an even code.
  for (size_t i = 0; i + 1 < grid.size(); ++i) {
    const float lo = grid[i], hi = grid[i + 1];
    const float mid = lo + (hi - lo) / 2;
    EXPECT_EQ(FloatToFp8E4m3(std::nextafter(mid, lo)), i);
    EXPECT_EQ(FloatToFp8E4m3(std::nextafter(mid, hi)), i + 1);
    EXPECT_EQ(FloatToFp8E4m3(mid), i % 2 == 0 ? i : i + 1) << lo << " " << hi;
  }
  EXPECT_EQ(FloatToFp8E4m3(460.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(1e30f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(INFINITY), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(-INFINITY), 0xFE);
  EXPECT_EQ(FloatToFp8E4m3(NAN) & 0x7F, 0x7F);
  EXPECT_EQ(FloatToFp8E4m3(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest: zero
}

TEST(Payload, RowsRoundTripWithinTheirTolerance) {
  std::mt19937 rng(7);
  for (int64_t hidden : {1, 7, 128, 300, 2048}) {
    std::vector<float> x(hidden);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (float& v : x) v = normal(rng);
    x[0] = 0.0f;
    for (common::ElementType type : kPayloadTypes) {
      const size_t bytes = PayloadRowBytes(type, hidden);
      EXPECT_EQ(bytes % 16, 0u);
      std::vector<unsigned char> row(bytes + 1, 0xAB);
      EncodeRow(type, x.data(), hidden, row.data());
      EXPECT_EQ(row[bytes], 0xAB) << "wrote past the row";
      std::vector<float> y(hidden, NAN), acc(hidden, 1.0f);
      DecodeRow(type, row.data(), hidden, y.data());
      AccumulateRow(type, row.data(), hidden, acc.data());
      for (int64_t b = 0; b < hidden; b += kFp8BlockSize) {
        float amax = 0;
        for (int64_t i = b; i < std::min(hidden, b + kFp8BlockSize); ++i)
          amax = std::max(amax, std::fabs(x[i]));
        for (int64_t i = b; i < std::min(hidden, b + kFp8BlockSize); ++i) {
          const float err = std::fabs(y[i] - x[i]);
          switch (type) {
            case common::ElementType::kFp32:
              ASSERT_EQ(y[i], x[i]);
              break;
            case common::ElementType::kBf16:
              ASSERT_LE(err, std::fabs(x[i]) * std::ldexp(1.0f, -8)) << i;
              break;
            case common::ElementType::kFp8E4m3:
              // Half a step of 3 mantissa bits relative to the value, or of the subnormal
              // step relative to the block's scale.
              ASSERT_LE(
                  err, std::max(std::fabs(x[i]) / 16, amax / 448 * std::ldexp(1.0f, -10)) * 1.0001f)
                  << "hidden " << hidden << " i " << i;
              break;
            case common::ElementType::kFp16:
              ADD_FAILURE() << "fp16 is not a payload type";
              break;
          }
          ASSERT_EQ(acc[i], 1.0f + y[i]);
        }
      }
    }
  }
}

TEST(Payload, TakesItsTypesOnly) {
  EXPECT_EQ(*ParsePayloadType("fp8", "dispatch-dtype"), common::ElementType::kFp8E4m3);
  absl::StatusOr<common::ElementType> bad = ParsePayloadType("fp16", "dispatch-dtype");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "--dispatch-dtype must be fp32, bf16 or fp8, got 'fp16'");
  EXPECT_EQ(PayloadRowBytes(common::ElementType::kFp16, 64), 0u);
  EXPECT_TRUE(CheckPayloadType(common::ElementType::kBf16, "the combine dtype").ok());
  EXPECT_EQ(CheckPayloadType(common::ElementType::kFp16, "the combine dtype").message(),
            "the combine dtype must be fp32, bf16 or fp8, got 'fp16'");
}

TEST(Payload, SumRowsEqualsDecodeThenAccumulate) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (common::ElementType type : kPayloadTypes) {
    for (int64_t hidden : {5, 130, 300}) {
      for (int parts : {0, 1, 3}) {
        for (bool accumulate : {false, true}) {
          std::vector<std::vector<unsigned char>> rows(parts);
          std::vector<const void*> ptrs;
          std::vector<float> x(hidden);
          for (auto& row : rows) {
            for (float& v : x) v = normal(rng);
            row.resize(PayloadRowBytes(type, hidden));
            EncodeRow(type, x.data(), hidden, row.data());
            ptrs.push_back(row.data());
          }
          std::vector<float> expect(hidden, 0.25f), got(hidden, 0.25f);
          if (!accumulate) std::fill(expect.begin(), expect.end(), 0.0f);
          for (int m = 0; m < parts; ++m) {
            if (m == 0 && !accumulate) {
              DecodeRow(type, ptrs[0], hidden, expect.data());
            } else {
              AccumulateRow(type, ptrs[m], hidden, expect.data());
            }
          }
          SumRows(type, ptrs.data(), parts, hidden, got.data(), accumulate);
          ASSERT_EQ(std::memcmp(expect.data(), got.data(), hidden * sizeof(float)), 0)
              << common::FlagName(type) << " hidden " << hidden << " parts " << parts;
        }
      }
    }
  }
}

TEST(Payload, Fp8BlockWithInfinitySaturatesInsteadOfPoisoningTheBlock) {
  std::vector<float> x(128, 1.0f);
  x[5] = INFINITY;
  x[6] = -INFINITY;
  std::vector<unsigned char> row(PayloadRowBytes(common::ElementType::kFp8E4m3, 128));
  EncodeRow(common::ElementType::kFp8E4m3, x.data(), 128, row.data());
  std::vector<float> y(128);
  DecodeRow(common::ElementType::kFp8E4m3, row.data(), 128, y.data());
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[5], 1.0f);
  EXPECT_EQ(y[6], -1.0f);
}

}  // namespace
}  // namespace epserve::worker

namespace epserve::worker {
namespace {

// The rows a worker takes from (and gives back through) the heap around the segments a batch
// places in clients' CUDA memory: the gaps between one direction's segments, the other's
// ignored.
TEST(HostRowRanges, AreTheGapsBetweenOneDirectionsSegments) {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(HostRowRanges(nullptr, 7, false), (Ranges{{0, 7}}));
  EXPECT_EQ(HostRowRanges(nullptr, 0, true), Ranges{});
  std::vector<char> bytes(DeviceRowTable::BytesFor(16));
  auto* t = reinterpret_cast<DeviceRowTable*>(bytes.data());
  const DeviceRowSegment segments[] = {
      {2, 3, 0, 0, {}}, {0, 4, 1, 0, {}}, {9, 1, 0, 0, {}}, {12, 4, 0, 0, {}}, {10, 6, 1, 0, {}}};
  t->count = std::size(segments);
  std::copy(std::begin(segments), std::end(segments), t->segments());
  EXPECT_EQ(HostRowRanges(t, 16, false), (Ranges{{0, 2}, {5, 9}, {10, 12}}));
  EXPECT_EQ(HostRowRanges(t, 16, true), (Ranges{{4, 10}}));
}

}  // namespace
}  // namespace epserve::worker
