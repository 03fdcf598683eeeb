// common/flags.h: the integer-list flag (the benchmarks' --rows, --tokens), byte counts and typed
// flags.
#include "common/flags.h"

#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace epserve::common {
namespace {

absl::Status ParseArgs(FlagSet& fs, std::vector<std::string> args) {
  args.insert(args.begin(), "prog");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return fs.Parse(static_cast<int>(argv.size()), argv.data());
}

TEST(FlagSetTest, IntegerListReplacesTheDefault) {
  std::vector<int64_t> rows = {1, 2};
  FlagSet fs("prog", "test");
  fs.Add("rows", &rows, "rows");
  EXPECT_NE(fs.Usage().find("\"1,2\""), std::string::npos) << fs.Usage();
  ASSERT_TRUE(ParseArgs(fs, {"--rows=128,-3,8192"}).ok());
  EXPECT_EQ(rows, (std::vector<int64_t>{128, -3, 8192}));
  ASSERT_TRUE(ParseArgs(fs, {"--rows", "7"}).ok());
  EXPECT_EQ(rows, (std::vector<int64_t>{7}));
  ASSERT_TRUE(ParseArgs(fs, {"--rows="}).ok());
  EXPECT_TRUE(rows.empty());
}

TEST(FlagSetTest, IntegerListRejectsANonInteger) {
  std::vector<int64_t> rows = {1};
  FlagSet fs("prog", "test");
  fs.Add("rows", &rows, "rows");
  const absl::Status s = ParseArgs(fs, {"--rows=4,x"});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rows"), std::string::npos) << s;
}

TEST(FlagSetTest, BytesTakeBinarySuffixesAndEmptyIsZero) {
  int64_t limit = 0;
  FlagSet fs("prog", "test");
  fs.AddBytes("memory-limit", &limit, "bytes");
  EXPECT_NE(fs.Usage().find("(default: \"\")"), std::string::npos) << fs.Usage();
  ASSERT_TRUE(ParseArgs(fs, {"--memory-limit=64G"}).ok());
  EXPECT_EQ(limit, int64_t{64} << 30);
  ASSERT_TRUE(ParseArgs(fs, {"--memory-limit=1.5k"}).ok());
  EXPECT_EQ(limit, 1536);
  ASSERT_TRUE(ParseArgs(fs, {"--memory-limit=1048576"}).ok());
  EXPECT_EQ(limit, 1048576);
  ASSERT_TRUE(ParseArgs(fs, {"--memory-limit="}).ok());
  EXPECT_EQ(limit, 0);
  for (const char* bad : {"--memory-limit=x", "--memory-limit=-1G", "--memory-limit=G"}) {
    const absl::Status s = ParseArgs(fs, {bad});
    EXPECT_NE(s.message().find("--memory-limit must be bytes with an optional K/M/G/T suffix"),
              std::string::npos)
        << s;
  }
}

enum class Mode { kAuto, kOff };

TEST(FlagSetTest, TypedFlagsParseOnceWithTheirOwnWords) {
  Mode mode = Mode::kAuto;
  FlagSet fs("prog", "test");
  fs.AddTyped<Mode>(
      "mode", &mode, "mode",
      [](absl::string_view text) -> absl::StatusOr<Mode> {
        if (text == "auto") return Mode::kAuto;
        if (text == "off") return Mode::kOff;
        return absl::InvalidArgumentError(
            absl::StrCat("--mode must be auto or off; got '", text, "'"));
      },
      [](const Mode& m) { return std::string(m == Mode::kAuto ? "auto" : "off"); });
  EXPECT_NE(fs.Usage().find("(default: auto)"), std::string::npos) << fs.Usage();
  ASSERT_TRUE(ParseArgs(fs, {"--mode=off"}).ok());
  EXPECT_EQ(mode, Mode::kOff);
  EXPECT_EQ(ParseArgs(fs, {"--mode=on"}).message(), "--mode must be auto or off; got 'on'");
  EXPECT_EQ(mode, Mode::kOff);

  // A switch: --x, --no-x and --x=false reach the parser as "true" / "false".
  bool seen_true = false;
  FlagSet sw("prog", "test");
  sw.AddTyped<Mode>(
      "pinned", &mode, "switch",
      [&](absl::string_view text) -> absl::StatusOr<Mode> {
        bool on = false;
        if (!absl::SimpleAtob(text, &on)) return absl::InvalidArgumentError("");
        seen_true |= on;
        return on ? Mode::kAuto : Mode::kOff;
      },
      [](const Mode& m) { return std::string(m == Mode::kAuto ? "true" : "false"); },
      /*switch_flag=*/true);
  ASSERT_TRUE(ParseArgs(sw, {"--pinned"}).ok());
  EXPECT_EQ(mode, Mode::kAuto);
  EXPECT_TRUE(seen_true);
  ASSERT_TRUE(ParseArgs(sw, {"--no-pinned"}).ok());
  EXPECT_EQ(mode, Mode::kOff);
  EXPECT_EQ(ParseArgs(sw, {"--pinned=maybe"}).message(),
            "bad value 'maybe' for --pinned (default false)");
}

}  // namespace
}  // namespace epserve::common
