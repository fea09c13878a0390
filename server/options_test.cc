// The daemon's option table: every setting parses the same from its flag
// and from its config-file key, is listed in --help, and is range-checked the
// same way on both paths.
#include "server/options.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/base/file.h"
#include "common/testing/testing.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

class OptionsTest : public ::testing::Test {
 protected:
  // Writes `json` to a config file and parses `--config FILE` + `flags`.
  absl::StatusOr<DaemonOptions> WithConfig(
      const std::string& json, std::vector<std::string> flags = {}) {
    const std::string path = JoinPath(dir_, "shardcastd.json");
    std::ofstream(path, std::ios::trunc) << json;
    flags.insert(flags.begin(), {"--config", path});
    return ParseDaemonOptions(flags);
  }

  TempRoot tmp_;
  const std::string dir_ = tmp_.path();
};

// A valid value of `o`'s kind, as flag text and as JSON.
struct Sample {
  std::string flag;
  std::string json;
};

Sample SampleOf(const DaemonOption& o) {
  switch (o.kind) {
    case OptionKind::kText:
      return {"some-text", "\"some-text\""};
    case OptionKind::kPaths:
      return {"/data/a", "[\"/data/a\"]"};
    case OptionKind::kNames:
      return {"alice", "[\"alice\"]"};
    case OptionKind::kUnixSocket:
      return {"unix:/run/x.sock", "\"unix:/run/x.sock\""};
    case OptionKind::kSwitch:
      return {"", "true"};
    case OptionKind::kInteger: {
      const std::string v = std::to_string(o.min + 1);
      return {v, v};
    }
    case OptionKind::kBytes:
      return {"3M", "3145728"};
    case OptionKind::kSeconds:
      return {"2.5", "2.5"};
    case OptionKind::kLogLevel:
      return {"warning", "\"warning\""};
    case OptionKind::kLogFormat:
      return {"json", "\"json\""};
    case OptionKind::kReadMode:
      return {"buffered", "\"buffered\""};
    case OptionKind::kPrefault:
      return {"start", "\"start\""};
    case OptionKind::kConfigFile:
      break;
  }
  return {};
}

// The value `o` set in `options`, as text, for comparisons.
std::string ValueOf(const DaemonOptions& options, const DaemonOption& o) {
  return std::visit(
      [&](auto target) -> std::string {
        using T = decltype(target);
        if constexpr (std::is_same_v<T, std::monostate>) {
          return "";
        } else {
          const auto& v = options.*target;
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, std::string>) {
            return v;
          } else if constexpr (std::is_same_v<V, std::vector<std::string>>) {
            std::string out;
            for (const std::string& s : v) out += s + ";";
            return out;
          } else {
            return std::to_string(v);
          }
        }
      },
      o.target);
}

TEST_F(OptionsTest, EverySettingParsesTheSameFromItsFlagAndItsConfigKey) {
  const DaemonOptions defaults;
  for (const DaemonOption& o : DaemonOptionTable()) {
    if (o.kind == OptionKind::kConfigFile) continue;
    ASSERT_NE(o.key, nullptr) << o.flag;
    const Sample s = SampleOf(o);
    std::vector<std::string> argv = {std::string("--") + o.flag};
    if (o.kind != OptionKind::kSwitch) argv.push_back(s.flag);
    auto from_flag = ParseDaemonOptions(argv);
    ASSERT_TRUE(from_flag.ok()) << o.flag << ": " << from_flag.status();
    auto from_file =
        WithConfig(std::string("{\"") + o.key + "\": " + s.json + "}");
    ASSERT_TRUE(from_file.ok()) << o.key << ": " << from_file.status();
    EXPECT_EQ(ValueOf(*from_flag, o), ValueOf(*from_file, o)) << o.flag;
    EXPECT_NE(ValueOf(*from_flag, o), ValueOf(defaults, o))
        << o.flag << " did not change its setting";
  }
}

TEST_F(OptionsTest, SettingsLandInTheirFields) {
  auto o = ParseDaemonOptions(
      {"--root", "/a", "--root", "/b", "--listen", "unix:/run/s.sock",
       "--queue-depth", "7", "--reservoir-bytes", "2G", "--grace-seconds",
       "0.5", "--read-mode", "direct", "--register-buffers",
       "--scan-start-delay-ms", "0", "--prefault", "off"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->roots, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(o->unix_socket, "/run/s.sock");
  EXPECT_EQ(o->queue_depth, 7);
  EXPECT_EQ(o->reservoir_bytes, 2ull << 30);
  EXPECT_EQ(o->shutdown_grace_seconds, 0.5);
  EXPECT_EQ(o->read_mode, "direct");
  EXPECT_TRUE(o->register_buffers);
  EXPECT_EQ(o->prefault, "off");
  EXPECT_EQ(o->scan_start_delay_ms, 0);
  const EngineOptions e = o->Engine();
  EXPECT_EQ(e.roots, o->roots);
  EXPECT_EQ(e.reads.queue_depth, 7u);
  EXPECT_EQ(e.reservoir.bytes, 2ull << 30);
  EXPECT_EQ(e.reservoir.slot_bytes, 4ull << 20);
  EXPECT_EQ(e.scans.read_mode, ScanReadMode::kDirect);
  EXPECT_TRUE(e.scans.register_buffers);
  EXPECT_EQ(e.reservoir.prefault, Prefault::kOff);
  EXPECT_EQ(e.scans.start_delay.count(), 0);
  EXPECT_EQ(e.limits.max_vectors_per_call, 1 << 16);  // the default
}

TEST_F(OptionsTest, PrefaultIsInTheBackgroundUnlessToldAndTakesOldBooleans) {
  auto defaults = ParseDaemonOptions({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->Engine().reservoir.prefault, Prefault::kBackground);
  // Config files written when it was a switch.
  for (const auto& [json, want] : std::vector<std::pair<std::string, Prefault>>{
           {"{\"prefault\": true}", Prefault::kStart},
           {"{\"prefault\": false}", Prefault::kOff}}) {
    auto o = WithConfig(json);
    ASSERT_TRUE(o.ok()) << json << ": " << o.status();
    EXPECT_EQ(o->Engine().reservoir.prefault, want) << json;
  }
  auto bad = ParseDaemonOptions({"--prefault", "now"});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("background, start, off"),
            std::string::npos)
      << bad.status();
}

TEST_F(OptionsTest, FlagsOverrideTheConfigFileAndRootsAreReplaced) {
  auto o = WithConfig(
      "{\"roots\": [\"/x\", \"/y\"], \"queue_depth\": 9, "
      "\"block_bytes\": \"8M\", \"log_level\": \"error\"}",
      {"--root", "/z", "--queue-depth", "3"});
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->roots, std::vector<std::string>{"/z"});
  EXPECT_EQ(o->queue_depth, 3);
  EXPECT_EQ(o->block_bytes, 8ull << 20);
  EXPECT_EQ(o->log_level, "error");
}

TEST_F(OptionsTest, ValuesOutOfRangeAreRefusedNamingFlagOrKeyAndTheRange) {
  for (const DaemonOption& o : DaemonOptionTable()) {
    if (o.kind != OptionKind::kInteger && o.kind != OptionKind::kBytes) {
      continue;
    }
    // Below the range (-1, where it means "chosen from the cores", is not).
    const int64_t below =
        o.minus_one_is_auto && o.min - 1 == -1 ? -2 : o.min - 1;
    const std::string low = std::to_string(below);
    auto flag = ParseDaemonOptions({std::string("--") + o.flag, low});
    ASSERT_FALSE(flag.ok()) << o.flag << " took " << low;
    EXPECT_EQ(flag.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(flag.status().message().find(std::string("--") + o.flag),
              std::string::npos)
        << flag.status();
    auto file = WithConfig(std::string("{\"") + o.key + "\": " + low + "}");
    ASSERT_FALSE(file.ok()) << o.key << " took " << low;
    EXPECT_NE(file.status().message().find(std::string("\"") + o.key + "\""),
              std::string::npos)
        << file.status();
    EXPECT_NE(file.status().message().find(std::to_string(o.min)),
              std::string::npos)
        << "the range is not named: " << file.status();
  }
  auto depth = ParseDaemonOptions({"--queue-depth", "4097"});
  ASSERT_FALSE(depth.ok());
  EXPECT_NE(depth.status().message().find("[1, 4096]"), std::string::npos)
      << depth.status();
}

TEST_F(OptionsTest, MalformedValuesAndUnknownNamesAreInvalidArguments) {
  const std::vector<std::vector<std::string>> bad_flags = {
      {"--no-such-flag"},
      {"--queue-depth", "many"},
      {"--reservoir-bytes", "2Q"},
      {"--reservoir-bytes", "-1"},
      {"--listen", "/run/s.sock"},
      {"--log-level", "loud"},
      {"--grace-seconds", "never"},
      {"--grace-seconds", "-1"},
      {"--queue-depth"},
      {"unexpected"},
  };
  for (const auto& argv : bad_flags) {
    auto o = ParseDaemonOptions(argv);
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument)
        << argv[0] << ": " << o.status();
  }
  const std::vector<std::string> bad_files = {
      "{\"listen_tpc\": \"x\"}",
      "{\"roots\": \"/x\"}",
      "{\"roots\": [1]}",
      "{\"queue_depth\": \"7\"}",
      "{\"queue_depth\": 7.5}",
      "{\"register_buffers\": 1}",
      "{\"read_mode\": \"fast\"}",
      "{\"prefault\": \"now\"}",
      "{\"prefault\": 1}",
      "{\"log_level\": 3}",
      "{\"shutdown_grace_seconds\": -1}",
      "{\"read_bytes\": \"lots\"}",
      "[1, 2]",
      "{\"max_vectors_per_call\": 18446744073709551615}",
  };
  for (const std::string& json : bad_files) {
    auto o = WithConfig(json);
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument)
        << json << ": " << o.status();
  }
  auto missing = ParseDaemonOptions({"--config", JoinPath(dir_, "nope.json")});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(OptionsTest, HelpListsEveryFlagWithItsConfigKey) {
  const std::string help = DaemonOptionsHelp();
  for (const DaemonOption& o : DaemonOptionTable()) {
    EXPECT_NE(help.find(std::string("--") + o.flag + " "), std::string::npos)
        << o.flag;
    if (o.key != nullptr) {
      EXPECT_NE(help.find(std::string("[") + o.key + "]"), std::string::npos)
          << o.key;
    }
  }
  EXPECT_NE(help.find("(default 2G)"), std::string::npos) << help;
}

TEST_F(OptionsTest, ValidationChecksRangesOfOptionsSetInCodeAndTheListeners) {
  DaemonOptions o;
  EXPECT_EQ(ValidateDaemonOptions(o).code(),
            absl::StatusCode::kInvalidArgument);  // no root
  o.roots = {"/data"};
  absl::Status no_listener = ValidateDaemonOptions(o);
  EXPECT_NE(no_listener.message().find("--listen"), std::string::npos)
      << no_listener;
  o.unix_socket = "/run/s.sock";
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  o.shuffle_window = 0;
  absl::Status window = ValidateDaemonOptions(o);
  EXPECT_NE(window.message().find("--shuffle-window"), std::string::npos)
      << window;
  o.shuffle_window = 1;
  o.shutdown_grace_seconds = -2;
  EXPECT_FALSE(ValidateDaemonOptions(o).ok());
  o.shutdown_grace_seconds = 1;
  o.trust_symlinks = {"/data"};
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  o.trust_symlinks = {"/elsewhere"};
  absl::Status trust = ValidateDaemonOptions(o);
  EXPECT_EQ(trust.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(trust.message().find("--trust-symlinks /elsewhere is not one of "
                                 "the --root directories"),
            std::string::npos)
      << trust;
  o.trust_symlinks.clear();
  o.remote_roots = {"/data"};
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  EXPECT_EQ(o.Engine().remote_roots.size(), 1u);
  for (const auto& [bad, says] :
       std::vector<std::pair<std::string, std::string>>{
           {"/elsewhere", "is not one of the --root directories"},
           {"=a", "expected DIR or DIR=NAME,NAME"},
           {"/data=a,", "expected DIR or DIR=NAME,NAME"},
           {"/data=trainer", "present them only with --tls-client-ca"}}) {
    o.remote_roots = {bad};
    absl::Status st = ValidateDaemonOptions(o);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find(says), std::string::npos) << st;
  }
  o.tcp_address = "127.0.0.1:0";
  o.tls_client_ca_file = "/ca.pem";
  o.tls_cert_file = "/c.pem";
  o.tls_key_file = "/c.key";
  o.remote_roots = {"/data=trainer-a,trainer-b"};
  ASSERT_TRUE(ValidateDaemonOptions(o).ok()) << ValidateDaemonOptions(o);
  const std::vector<RemoteRoot> remote = o.Engine().remote_roots;
  ASSERT_EQ(remote.size(), 1u);
  EXPECT_EQ(remote[0].root, "/data");
  EXPECT_EQ(remote[0].names,
            (std::vector<std::string>{"trainer-a", "trainer-b"}));
}

// The cores this process may use, from /proc (independent of sched.h).
int CoresFromProc() {
  std::ifstream status("/proc/self/status");
  std::string line;
  int cores = 0;
  while (std::getline(status, line)) {
    if (line.rfind("Cpus_allowed_list:", 0) != 0) continue;
    std::stringstream list(line.substr(line.find(':') + 1));
    std::string range;
    while (std::getline(list, range, ',')) {
      const size_t dash = range.find('-');
      cores += dash == std::string::npos
                   ? 1
                   : std::stoi(range.substr(dash + 1)) -
                         std::stoi(range.substr(0, dash)) + 1;
    }
  }
  return cores;
}

TEST_F(OptionsTest, QueryThreadsDefaultToHalfTheCoresBetween4And16) {
  EXPECT_EQ(DefaultQueryThreads(1), 4);
  EXPECT_EQ(DefaultQueryThreads(2), 4);
  EXPECT_EQ(DefaultQueryThreads(9), 4);
  EXPECT_EQ(DefaultQueryThreads(10), 5);
  EXPECT_EQ(DefaultQueryThreads(16), 8);
  EXPECT_EQ(DefaultQueryThreads(32), 16);
  EXPECT_EQ(DefaultQueryThreads(128), 16);
  DaemonOptions o;
  o.roots = {"/data"};
  o.unix_socket = "/run/s.sock";
  EXPECT_EQ(o.query_threads, -1);
  const int cores = CoresFromProc();
  ASSERT_GT(cores, 0);
  EXPECT_EQ(o.QueryThreads(), std::clamp(cores / 2, 4, 16));
  o.query_threads = 3;
  EXPECT_EQ(o.QueryThreads(), 3);
  o.query_threads = 0;
  absl::Status zero = ValidateDaemonOptions(o);
  EXPECT_NE(zero.message().find("--query-threads must be an integer in [1, "
                                "1024], or -1 (chosen from the cores"),
            std::string::npos)
      << zero;
  EXPECT_FALSE(ParseDaemonOptions({"--query-threads", "-2"}).ok());
  EXPECT_FALSE(ParseDaemonOptions({"--query-threads", "0"}).ok());
  absl::StatusOr<DaemonOptions> automatic =
      ParseDaemonOptions({"--query-threads", "-1"});
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_EQ(automatic->query_threads, -1);
}

// --gather-threads: -1 chooses, 0 is none; nothing below -1.
TEST_F(OptionsTest, GatherThreadsTakeMinusOneZeroAndCounts) {
  for (const char* v : {"-1", "0", "3"}) {
    absl::StatusOr<DaemonOptions> o =
        ParseDaemonOptions({"--gather-threads", v});
    ASSERT_TRUE(o.ok()) << v << ": " << o.status();
    EXPECT_EQ(o->gather_threads, std::stoi(v));
  }
  absl::StatusOr<DaemonOptions> below =
      ParseDaemonOptions({"--gather-threads", "-2"});
  ASSERT_FALSE(below.ok());
  EXPECT_NE(below.status().message().find(
                "--gather-threads must be an integer in [0, 64], or -1"),
            std::string::npos)
      << below.status();
}

TEST_F(OptionsTest, LocalQueryThreadsDefaultToHalfTheCoresBetween2And8) {
  EXPECT_EQ(DefaultLocalQueryThreads(1), 2);
  EXPECT_EQ(DefaultLocalQueryThreads(2), 2);
  EXPECT_EQ(DefaultLocalQueryThreads(5), 2);
  EXPECT_EQ(DefaultLocalQueryThreads(6), 3);
  EXPECT_EQ(DefaultLocalQueryThreads(16), 8);
  EXPECT_EQ(DefaultLocalQueryThreads(128), 8);
  DaemonOptions o;
  o.roots = {"/data"};
  o.unix_socket = "/run/s.sock";
  EXPECT_EQ(o.local_query_threads, -1);
  const int cores = CoresFromProc();
  ASSERT_GT(cores, 0);
  EXPECT_EQ(o.LocalQueryThreads(), std::clamp(cores / 2, 2, 8));
  absl::StatusOr<DaemonOptions> parsed =
      ParseDaemonOptions({"--root", "/data", "--listen", "unix:/run/s.sock",
                          "--local-query-threads", "3"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->LocalQueryThreads(), 3);
  o.local_query_threads = 0;
  absl::Status zero = ValidateDaemonOptions(o);
  EXPECT_NE(zero.message().find("--local-query-threads must be an integer in "
                                "[1, 64], or -1"),
            std::string::npos)
      << zero;
  EXPECT_FALSE(ParseDaemonOptions({"--local-query-threads", "-2"}).ok());
  EXPECT_FALSE(ParseDaemonOptions({"--local-query-threads", "65"}).ok());
}

TEST_F(OptionsTest, IncoherentTlsFlagsAreUsageErrors) {
  DaemonOptions o;
  o.roots = {"/data"};
  o.unix_socket = "/run/s.sock";
  o.tcp_address = "127.0.0.1:7000";
  auto message = [&o] {
    return std::string(ValidateDaemonOptions(o).message());
  };
  // A client CA alone used to serve plaintext with no client authentication.
  o.tls_client_ca_file = "/etc/ca.pem";
  EXPECT_NE(message().find("--tls-client-ca"), std::string::npos) << message();
  o.tls_cert_file = "/etc/cert.pem";
  EXPECT_NE(message().find("--tls-key"), std::string::npos) << message();
  o.tls_key_file = "/etc/key.pem";
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  o.insecure_tcp = true;
  EXPECT_NE(message().find("--insecure-tcp"), std::string::npos) << message();
  o.insecure_tcp = false;
  o.tcp_address.clear();
  EXPECT_NE(message().find("--listen-tcp"), std::string::npos) << message();
}

// A sweep names every node's daemon with --sweep-peer (this one's too, at
// --node-rank), needs the TCP listener its peers fetch from, and is not
// combined with node groups; its streams' shares come from it.
TEST_F(OptionsTest, ASweepNamesEveryPeerAndNeedsTheTcpListener) {
  DaemonOptions o;
  o.roots = {"/data"};
  o.unix_socket = "/run/s.sock";
  o.sweep_peers = {"a:1", "b:1", "c:1"};
  o.node_rank = 2;
  const absl::Status no_tcp = ValidateDaemonOptions(o);
  EXPECT_NE(no_tcp.message().find("a sweep needs --listen-tcp"),
            std::string::npos)
      << no_tcp;
  o.tcp_address = "0.0.0.0:7000";
  EXPECT_TRUE(ValidateDaemonOptions(o).ok());
  const EngineOptions e = o.Engine();
  EXPECT_EQ(e.sweep_share, 2);
  EXPECT_EQ(e.sweep_shares, 3);
  EXPECT_EQ(e.node_rank, 0);
  EXPECT_EQ(e.node_count, 1);
  o.node_rank = 3;
  EXPECT_NE(ValidateDaemonOptions(o).message().find(
                "--node-rank below their number (3)"),
            std::string::npos);
  o.node_rank = 0;
  o.sweep_peers = {"a:1"};
  EXPECT_EQ(ValidateDaemonOptions(o).code(),
            absl::StatusCode::kInvalidArgument);
  o.sweep_peers = {"a:1", "b:1"};
  o.node_count = 2;
  EXPECT_NE(ValidateDaemonOptions(o).message().find(
                "--sweep-peer and --node-count are two ways"),
            std::string::npos);
  auto parsed =
      ParseDaemonOptions({"--sweep-peer", "a:1", "--sweep-peer", "b:2"});
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->sweep_peers, (std::vector<std::string>{"a:1", "b:2"}));
}

}  // namespace
}  // namespace shardcast
