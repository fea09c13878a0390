// ProcFields against text laid out as the kernel writes /proc/PID/status,
// /proc/PID/io and /proc/meminfo (proc(5)), and against the live files: the
// kernel's own sum VmRSS = RssAnon + RssFile + RssShmem.
#include "common/base/proc_fields.h"

#include <string>

#include "common/testing/testing.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

TEST(ProcFields, ReadsKibibyteAndPlainValues) {
  const ProcFields f = ProcFields::Parse(
      "Name:\tshardcastd\n"
      "Umask:\t0022\n"
      "State:\tS (sleeping)\n"
      "VmHWM:\t  204800 kB\n"
      "VmRSS:\t    1234 kB\n"
      "Threads:\t17\n"
      "rchar: 18446744073709551615\n"
      "MemTotal:       24576000 kB\n");
  EXPECT_EQ(f.Get("VmHWM"), uint64_t{204800} * 1024);
  EXPECT_EQ(f.Get("VmRSS"), uint64_t{1263616});  // 1234 * 1024
  EXPECT_EQ(f.Get("Threads"), uint64_t{17});
  EXPECT_EQ(f.Get("Umask"), uint64_t{22});  // read as decimal: not a size
  EXPECT_EQ(f.Get("rchar"), uint64_t{18446744073709551615u});
  EXPECT_EQ(f.Get("MemTotal"), uint64_t{25165824000});
}

TEST(ProcFields, SkipsLinesThatAreNotKeyNumber) {
  const ProcFields f = ProcFields::Parse(
      "Name:\tcat\n"                    // not a number
      "State:\tR (running)\n"           // not a number
      "no colon 12\n"                   // no key
      ": 7\n"                           // an empty key
      "Big: 18446744073709551615 kB\n"  // bytes past uint64
      "Huge: 99999999999999999999\n"    // past uint64
      "Empty:\n"                        // no value
      "read_bytes: 4096\n");
  EXPECT_EQ(f.Get("Name"), std::nullopt);
  EXPECT_EQ(f.Get("State"), std::nullopt);
  EXPECT_EQ(f.Get("no colon 12"), std::nullopt);
  EXPECT_EQ(f.Get(""), std::nullopt);
  EXPECT_EQ(f.Get("Big"), std::nullopt);
  EXPECT_EQ(f.Get("Huge"), std::nullopt);
  EXPECT_EQ(f.Get("Empty"), std::nullopt);
  EXPECT_EQ(f.Get("read_bytes"), uint64_t{4096});
  // A key is matched whole: neither a prefix nor a longer key.
  EXPECT_EQ(f.Get("read"), std::nullopt);
  EXPECT_EQ(f.Get("read_bytes2"), std::nullopt);
}

TEST(ProcFields, RequireNamesTheFileAndTheKey) {
  const ProcFields f = ProcFields::Parse("VmRSS: 8 kB\n", "/proc/42/status");
  EXPECT_EQ(*f.Require("VmRSS"), 8192u);
  const absl::StatusOr<uint64_t> missing = f.Require("VmHWM");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/proc/42/status"),
            std::string::npos);
  EXPECT_NE(missing.status().message().find("VmHWM"), std::string::npos);
}

TEST(ProcFields, ReadsTheLiveStatusInOneSnapshot) {
  const absl::StatusOr<ProcFields> f = ProcFields::Read("/proc/self/status");
  ASSERT_TRUE(f.ok()) << f.status();
  const std::optional<uint64_t> rss = f->Get("VmRSS");
  ASSERT_TRUE(rss.has_value());
  EXPECT_GT(*rss, 0u);
  // The kernel writes VmRSS as the sum of the three kinds (fs/proc/
  // task_mmu.c), so one read's fields add up exactly.
  EXPECT_EQ(*rss, f->Get("RssAnon").value_or(0) +
                      f->Get("RssFile").value_or(0) +
                      f->Get("RssShmem").value_or(0));
}

TEST(ProcFields, MissingAndOversizedFilesAreErrors) {
  const absl::StatusOr<ProcFields> gone =
      ProcFields::Read("/proc/self/no-such-file");
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(gone.status().message().find("/proc/self/no-such-file"),
            std::string::npos);

  TempRoot root;
  WriteFile(root.File("long"), std::string(10000, 'x'));
  const absl::StatusOr<std::string> text =
      ReadProcFile(root.File("long"), 9999);
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ReadProcFile(root.File("long"), 10000)->size(), 10000u);
}

}  // namespace
}  // namespace shardcast
