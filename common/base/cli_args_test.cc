#include "common/base/cli_args.h"

#include "gtest/gtest.h"

namespace shardcast {
namespace {

const std::vector<OptionSpec> kSpecs = {
    {"layer", "L", "layer"},
    {"layers", "L1,L2", "layers"},
    {"from", "F", "input", true},
    {"cls", nullptr, "flag"},
};

TEST(CliArgs, NegativeNumberIsTakenAsTheOptionValue) {
  auto args = Args::Parse({"dir", "--layer", "-2", "--layers=-2,6"}, kSpecs);
  ASSERT_TRUE(args.ok()) << args.status();
  EXPECT_EQ(*args->GetInt("layer", 0), -2);
  EXPECT_EQ(*args->GetIntList("layers", ""), (std::vector<int64_t>{-2, 6}));
  EXPECT_EQ(args->positional(), std::vector<std::string>{"dir"});
}

TEST(CliArgs, RepeatedOptionKeepsAllValuesInOrder) {
  auto args = Args::Parse({"--from", "a.npy", "--from", "b.npy"}, kSpecs);
  ASSERT_TRUE(args.ok());
  EXPECT_EQ(args->GetAll("from"), (std::vector<std::string>{"a.npy", "b.npy"}));
}

TEST(CliArgs, UnknownOptionMissingValueAndRepeatsAreErrors) {
  EXPECT_FALSE(Args::Parse({"--nope"}, kSpecs).ok());
  EXPECT_FALSE(Args::Parse({"--layer"}, kSpecs).ok());
  EXPECT_FALSE(Args::Parse({"--layer", "1", "--layer", "2"}, kSpecs).ok());
  EXPECT_FALSE(Args::Parse({"--cls=yes"}, kSpecs).ok());
}

TEST(CliArgs, NonIntegerValueIsAnError) {
  auto args = Args::Parse({"--layer", "six", "--layers", "1,x"}, kSpecs);
  ASSERT_TRUE(args.ok());
  EXPECT_FALSE(args->GetInt("layer", 0).ok());
  EXPECT_FALSE(args->GetIntList("layers", "").ok());
}

}  // namespace
}  // namespace shardcast
