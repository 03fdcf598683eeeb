// common/flags.h: the integer-list flag (the benchmarks' --rows, --tokens).
#include "common/flags.h"

#include <string>
#include <vector>

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

}  // namespace
}  // namespace epserve::common
