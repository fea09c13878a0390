// Integration tests: a real shardcastd process on a temporary Unix socket,
// driven through the C++ client library. Expected vectors come from the
// synthetic generator's formula evaluated at the protocol offsets, not from
// the reader or the daemon.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/file.h"
#include "common/format/synth.h"
#include "common/format/writer.h"
#include "common/local/channel.h"
#include "common/local/unix_socket.h"
#include "common/local/vector_layout.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "shardcast/client.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {
namespace {

constexpr uint64_t kSeed = 11;

std::string MakeTempDir() {
  std::string tmpl = JoinPath(::testing::TempDir(), "shardcastd_test_XXXXXX");
  char* dir = ::mkdtemp(tmpl.data());
  EXPECT_NE(dir, nullptr);
  return tmpl;
}

// Writes a dataset whose element i of [N, L, T, D] is SynthValue(seed, i).
std::string WriteDataset(const std::string& root, std::vector<int64_t> layers,
                         int64_t content, bool cls, int64_t d, int64_t n,
                         int64_t budget, bool labels, uint64_t seed) {
  WriterOptions o;
  o.root = root;
  o.layers = std::move(layers);
  o.content_tokens = content;
  o.cls_token = cls;
  o.d_model = d;
  o.n_examples = n;
  o.token_budget = budget;
  o.with_labels = labels;
  o.data = absl::StrCat("seed=", seed);
  auto w = DatasetWriter::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  const int64_t per_example =
      static_cast<int64_t>(o.layers.size()) * (content + (cls ? 1 : 0)) * d;
  std::vector<float> values(static_cast<size_t>(n * per_example));
  for (size_t i = 0; i < values.size(); ++i) values[i] = SynthValue(seed, i);
  EXPECT_TRUE((*w)->Append(values.data(), values.size() * 4).ok());
  if (labels) {
    std::vector<uint8_t> l(static_cast<size_t>(n * content));
    for (size_t i = 0; i < l.size(); ++i) l[i] = SynthLabel(seed, i);
    EXPECT_TRUE((*w)->AppendLabels(l.data(), l.size()).ok());
  }
  auto r = (*w)->Finish();
  EXPECT_TRUE(r.ok()) << r.status();
  return r->hash;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A shardcastd child process.
class DaemonProcess {
 public:
  DaemonProcess(const std::vector<std::string>& args, const std::string& log)
      : log_(log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      ::dup2(fd, 2);
      ::dup2(fd, 1);
      std::vector<char*> argv;
      std::string bin = SHARDCASTD_BIN;
      argv.push_back(bin.data());
      std::vector<std::string> copy = args;
      for (std::string& a : copy) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(bin.c_str(), argv.data());
      ::_exit(127);
    }
  }
  ~DaemonProcess() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // Waits up to `timeout` for exit; returns the wait status or -1.
  int WaitExit(std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  std::string log() const { return ReadAll(log_); }

 private:
  std::string log_;
  pid_t pid_ = -1;
  bool exited_ = false;
};

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    root_ = JoinPath(dir_, "root");
    ASSERT_EQ(::mkdir(root_.c_str(), 0755), 0);
    // 40 examples, T = 17, L = 2, budget 700 -> 20 examples per shard, 2
    // shards.
    main_id_ = WriteDataset(root_, {-2, 6}, 16, true, 32, 40, 700, true, kSeed);
    nolabels_id_ =
        WriteDataset(root_, {3}, 8, false, 16, 10, 100, false, kSeed + 1);
    const std::string bad = JoinPath(root_, "badbadbad");
    ASSERT_EQ(::mkdir(bad.c_str(), 0755), 0);
    std::ofstream(JoinPath(bad, "metadata.json")) << "{not json";
    socket_ = JoinPath(dir_, "run/shardcastd.sock");
  }

  void TearDown() override {
    daemon_.reset();
    // A sanitizer report inside a daemon process fails the test that ran it.
    const std::string log = ReadAll(JoinPath(dir_, "daemon.log"));
    for (const char* marker : {"ThreadSanitizer", "AddressSanitizer",
                               "LeakSanitizer", "runtime error:"}) {
      EXPECT_EQ(log.find(marker), std::string::npos)
          << marker << " in the daemon's log:\n"
          << log.substr(log.find(marker), 4000);
    }
    RemoveTree(dir_).IgnoreError();
  }

  std::unique_ptr<DaemonProcess> StartDaemon(
      std::vector<std::string> extra = {}, const std::string& socket = "") {
    const std::string sock = socket.empty() ? socket_ : socket;
    std::vector<std::string> args = {
        "--root",      root_,   "--listen",        "unix:" + sock,
        "--log-level", "debug", "--grace-seconds", "5"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p =
        std::make_unique<DaemonProcess>(args, JoinPath(dir_, "daemon.log"));
    // The daemon binds its Unix socket after the local channel's socket
    // beside it (SideSocketsAreBoundBeforeTheUnixSocket): once it is there,
    // so is the channel, for a test that goes straight to it.
    for (int i = 0; i < 500; ++i) {
      struct stat st;
      if (::stat(sock.c_str(), &st) == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return p;
  }

  // Options whose GetVectors go through the local channel (the
  // default on a Unix socket) or, with `local` false, over gRPC.
  static ClientOptions QueriesOver(bool local) {
    ClientOptions options;
    options.local_queries = local;
    return options;
  }

  std::unique_ptr<Client> Connect(const ClientOptions& options = {}) {
    auto c = Client::Connect("unix:" + socket_, options);
    EXPECT_TRUE(c.ok()) << c.status() << "\n"
                        << ReadAll(JoinPath(dir_, "daemon.log"));
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Expected value of (e, layer index li, token t, dim k) of the main dataset.
  static float Expected(int64_t e, int64_t li, int64_t t, int64_t k) {
    constexpr int64_t L = 2, T = 17, D = 32;
    return SynthValue(kSeed,
                      static_cast<uint64_t>(((e * L + li) * T + t) * D + k));
  }

  std::string dir_, root_, socket_, main_id_, nolabels_id_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(DaemonTest, ListsServedAndRejectedDatasets) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  auto list = client->ListDatasets();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 3u);
  int ok = 0;
  for (const auto& d : *list) {
    if (d.id == main_id_) {
      ++ok;
      EXPECT_TRUE(d.ok);
      EXPECT_EQ(d.tokens_per_example, 17);
      EXPECT_EQ(d.d_model, 32);
      EXPECT_EQ(d.n_examples, 40);
      EXPECT_EQ(d.examples_per_shard, 700 / (17 * 2));
      EXPECT_EQ(d.num_shards, 2);
      EXPECT_TRUE(d.has_labels);
      EXPECT_TRUE(d.hash_matches_dir);
    } else if (d.id == "badbadbad") {
      EXPECT_FALSE(d.ok);
      EXPECT_NE(d.error.find("metadata.json"), std::string::npos) << d.error;
    }
  }
  EXPECT_EQ(ok, 1);
  auto described = client->DescribeDataset(main_id_.substr(0, 10));
  ASSERT_TRUE(described.ok()) << described.status();
  EXPECT_EQ(described->id, main_id_);
}

TEST_F(DaemonTest, AnEmptyAddressMeansShardcastAddressAndHealthIsServing) {
  daemon_ = StartDaemon();
  ASSERT_EQ(::setenv(Client::kAddressVariable, ("unix:" + socket_).c_str(), 1),
            0);
  auto client = Client::Connect("");
  ::unsetenv(Client::kAddressVariable);
  ASSERT_TRUE(client.ok()) << client.status();
  auto health = (*client)->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, Client::Health::kServing);
  auto unset = Client::Connect("");
  ASSERT_FALSE(unset.ok());
  EXPECT_EQ(unset.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unset.status().message().find("SHARDCAST_ADDRESS"),
            std::string::npos)
      << unset.status();
}

TEST_F(DaemonTest, VectorsEqualTheGeneratorAtProtocolOffsets) {
  daemon_ = StartDaemon();
  std::mt19937_64 rng(5);
  std::vector<VectorCoord> coords;
  std::vector<int64_t> layer_index;
  const int64_t layers[] = {-2, 6};
  for (int i = 0; i < 300; ++i) {
    const int64_t li = static_cast<int64_t>(rng() % 2);
    coords.push_back({static_cast<int64_t>(rng() % 40), layers[li],
                      static_cast<int64_t>(rng() % 17)});
    layer_index.push_back(li);
  }
  for (bool local : {true, false}) {  // the local channel, then gRPC
    SCOPED_TRACE(local ? "local channel" : "gRPC");
    auto client = Connect(QueriesOver(local));
    ASSERT_NE(client, nullptr);
    auto block = client->GetVectors(main_id_, coords);
    ASSERT_TRUE(block.ok()) << block.status();
    ASSERT_EQ(block->shape, (std::vector<int64_t>{300, 32}));
    for (size_t i = 0; i < coords.size(); ++i) {
      for (int64_t k = 0; k < 32; ++k) {
        ASSERT_EQ(
            block->values[i * 32 + static_cast<size_t>(k)],
            Expected(coords[i].example, layer_index[i], coords[i].token, k))
            << "coordinate " << i;
      }
    }
  }
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  // Whole example, one layer ([T, D]) and all layers ([L, T, D]).
  auto one = client->GetExample(main_id_, 39, 6);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->shape, (std::vector<int64_t>{17, 32}));
  EXPECT_EQ(one->values[5 * 32 + 7], Expected(39, 1, 5, 7));
  auto all = client->GetExample(main_id_, 21, std::nullopt);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->shape, (std::vector<int64_t>{2, 17, 32}));
  for (int64_t li = 0; li < 2; ++li) {
    for (int64_t t = 0; t < 17; ++t) {
      ASSERT_EQ(all->values[static_cast<size_t>((li * 17 + t) * 32 + 31)],
                Expected(21, li, t, 31));
    }
  }
  auto labels = client->GetLabels(main_id_, 33);
  ASSERT_TRUE(labels.ok()) << labels.status();
  ASSERT_EQ(labels->size(), 16u);
  for (int t = 0; t < 16; ++t) {
    EXPECT_EQ(static_cast<uint8_t>((*labels)[t]),
              SynthLabel(kSeed, 33 * 16 + t));
  }
}

TEST_F(DaemonTest, VectorBlockViewsStayValidWhileAnyCopyLives) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  std::optional<VectorBlock> original;
  {
    auto block = client->GetVectors(main_id_, {{7, 6, 3}, {38, -2, 0}});
    ASSERT_TRUE(block.ok()) << block.status();
    original = std::move(*block);
  }
  ASSERT_EQ(original->shape, (std::vector<int64_t>{2, 32}));
  ASSERT_EQ(original->values.size(), 2u * 32);
  // A copy shares the reply: the same floats, no copy of them.
  VectorBlock copy = *original;
  EXPECT_EQ(copy.values.data(), original->values.data());
  EXPECT_EQ(copy.storage, original->storage);
  EXPECT_EQ(copy.storage.use_count(), 2);
  original.reset();
  EXPECT_EQ(copy.storage.use_count(), 1);
  // More replies (allocations) after the original is gone, then the client
  // itself: the copy's view stays valid.
  auto other = client->GetExample(main_id_, 0, std::nullopt);
  ASSERT_TRUE(other.ok()) << other.status();
  client.reset();
  other = VectorBlock();
  const auto check = [&](const VectorBlock& block) {
    ASSERT_EQ(block.shape, (std::vector<int64_t>{2, 32}));
    ASSERT_EQ(block.values.size(), 2u * 32);
    for (int64_t k = 0; k < 32; ++k) {
      EXPECT_EQ(block.values[static_cast<size_t>(k)], Expected(7, 1, 3, k));
      EXPECT_EQ(block.values[static_cast<size_t>(32 + k)],
                Expected(38, 0, 0, k));
    }
  };
  check(copy);
  // Moving a block moves the view and the storage with it.
  const float* data = copy.values.data();
  VectorBlock moved = std::move(copy);
  EXPECT_EQ(moved.values.data(), data);
  EXPECT_EQ(moved.storage.use_count(), 1);
  check(moved);
}

// ReadStream checks the views' sizes and values in every stream test; these
// two check what it does not see.
TEST_F(DaemonTest, BatchViewsStayValidWhenTheBatchMoves) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  // Moving a batch keeps its views valid and leaves an empty batch that the
  // stream can fill again.
  StreamRequest req;
  req.dataset = main_id_;
  req.layer = 6;
  req.batch_size = 48;
  req.order = StreamRequest::Order::kOrdered;
  auto stream = client->OpenStream(req);
  Batch first;
  ASSERT_TRUE(stream->Next(&first));
  ASSERT_EQ(first.rows(), 48);
  EXPECT_TRUE(first.layer().empty());
  EXPECT_EQ(first.labels().size(), 48u);
  const float* data = first.vectors().data();
  Batch moved = std::move(first);
  EXPECT_EQ(moved.vectors().data(), data);
  EXPECT_EQ(first.rows(), 0);  // NOLINT(bugprone-use-after-move): documented
  EXPECT_TRUE(first.vectors().empty());
  EXPECT_TRUE(first.resume_token().empty());
  ASSERT_TRUE(stream->Next(&first));
  EXPECT_EQ(first.index(), 1);
  EXPECT_EQ(moved.index(), 0);
  for (size_t i = 0; i < 48; ++i) {
    const int64_t e = moved.example_idx()[i];
    const int32_t t = moved.token_idx()[i];
    ASSERT_EQ(moved.vectors()[i * 32 + 31], Expected(e, 1, t + 1, 31));
  }
  stream->Cancel();
  while (stream->Next(&first)) {
  }
  stream->Finish().IgnoreError();
}

TEST_F(DaemonTest, BatchesOfADatasetWithoutLabelsHaveNoLabelsColumn) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  StreamRequest plain;
  plain.dataset = nolabels_id_;
  plain.order = StreamRequest::Order::kOrdered;
  plain.batch_size = 7;
  auto stream = client->OpenStream(plain);
  int64_t rows = 0;
  Batch b;
  while (stream->Next(&b)) {
    const size_t n = static_cast<size_t>(b.rows());
    ASSERT_EQ(b.d_model(), 16);
    ASSERT_EQ(b.vectors().size(), n * 16);
    ASSERT_EQ(b.example_idx().size(), n);
    ASSERT_EQ(b.token_idx().size(), n);
    ASSERT_EQ(b.layer().size(), n);  // all layers selected: its one layer
    for (int64_t layer : b.layer()) EXPECT_EQ(layer, 3);
    EXPECT_TRUE(b.labels().empty());
    for (size_t i = 0; i < n; ++i) {
      // [N, L = 1, T = 8, D = 16], no CLS, written with seed kSeed + 1.
      const int64_t e = b.example_idx()[i];
      const int32_t t = b.token_idx()[i];
      ASSERT_EQ(
          b.vectors()[i * 16 + 3],
          SynthValue(kSeed + 1, static_cast<uint64_t>((e * 8 + t) * 16 + 3)))
          << "example " << e << " token " << t;
    }
    rows += b.rows();
  }
  absl::Status st = stream->Finish();
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(rows, 10 * 8);
}

TEST_F(DaemonTest, BadRequestsGetTheirStatusCodes) {
  // 16 vectors or 1024 bytes (8 vectors of 32 floats) per call at most.
  daemon_ = StartDaemon(
      {"--max-vectors-per-call", "16", "--max-bytes-per-call", "1024"});
  for (bool local : {true, false}) {
    SCOPED_TRACE(local ? "local channel" : "gRPC");
    auto client = Connect(QueriesOver(local));
    ASSERT_NE(client, nullptr);
    auto code = [](const auto& r) { return r.status().code(); };
    EXPECT_EQ(code(client->GetVectors("0123456789abcdef", {{0, 6, 0}})),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(code(client->GetVectors(main_id_.substr(0, 4), {{0, 6, 0}})),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(code(client->GetVectors(main_id_, {{40, 6, 0}})),
              absl::StatusCode::kOutOfRange);
    EXPECT_EQ(code(client->GetVectors(main_id_, {{0, 6, 17}})),
              absl::StatusCode::kOutOfRange);
    EXPECT_EQ(code(client->GetVectors(main_id_, {{0, 7, 0}})),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(code(client->GetVectors(main_id_, std::vector<VectorCoord>(17))),
              absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(
        client->GetVectors(main_id_, std::vector<VectorCoord>(8, {0, 6, 0}))
            .ok());
    auto too_many_bytes =
        client->GetVectors(main_id_, std::vector<VectorCoord>(9, {0, 6, 0}));
    EXPECT_EQ(too_many_bytes.status().code(),
              absl::StatusCode::kResourceExhausted);
    EXPECT_NE(std::string(too_many_bytes.status().message()).find("1024"),
              std::string::npos)
        << too_many_bytes.status();
    EXPECT_EQ(code(client->GetExample(main_id_, 0,
                                      6)),  // 17 x 32 floats > 1024 bytes
              absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(code(client->GetVectors("badbadbad", {{0, 6, 0}})),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(code(client->GetLabels(nolabels_id_, 0)),
              absl::StatusCode::kNotFound);
    auto bad_layer = client->GetVectors(main_id_, {{1, 6, 1}, {0, 99, 0}});
    EXPECT_NE(std::string(bad_layer.status().message()).find("coordinates[1]"),
              std::string::npos)
        << bad_layer.status();
    auto status = client->GetStatus();
    ASSERT_TRUE(status.ok());
    EXPECT_GE(status->calls_failed, local ? 8u : 16u);
  }
}

TEST_F(DaemonTest, TruncatedShardGivesDataLossAndOthersKeepWorking) {
  daemon_ = StartDaemon();
  const std::string shard =
      JoinPath(JoinPath(root_, main_id_), "acts000001.bin");
  ASSERT_EQ(::truncate(shard.c_str(), 1000), 0);
  for (bool local : {true, false}) {
    SCOPED_TRACE(local ? "local channel" : "gRPC");
    auto client = Connect(QueriesOver(local));
    ASSERT_NE(client, nullptr);
    auto r = client->GetVectors(main_id_, {{30, 6, 3}});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_NE(std::string(r.status().message()).find("acts000001.bin"),
              std::string::npos);
    // Shard 0 is intact and so is the daemon.
    auto ok = client->GetVectors(main_id_, {{3, 6, 3}});
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(ok->values[0], Expected(3, 1, 3, 0));
    EXPECT_TRUE(client->GetVectors(nolabels_id_, {{0, 3, 0}}).ok());
  }
}

TEST_F(DaemonTest, ConcurrentClientsAllGetCorrectVectors) {
  daemon_ = StartDaemon({"--query-threads", "3"});
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0}, failed{0};
  for (int c = 0; c < 8; ++c) {
    threads.emplace_back([&, c] {
      auto client = Client::Connect("unix:" + socket_);
      if (!client.ok()) {
        failed++;
        return;
      }
      std::mt19937_64 rng(100 + c);
      for (int i = 0; i < 40; ++i) {
        const int64_t e = static_cast<int64_t>(rng() % 40);
        const int64_t t = static_cast<int64_t>(rng() % 17);
        auto r = (*client)->GetVectors(main_id_, {{e, -2, t}});
        if (!r.ok()) {
          failed++;
        } else if (r->values[9] != Expected(e, 0, t, 9)) {
          wrong++;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
}

// `threads` threads of one Client each make `requests` GetVectors calls of
// 1 to `max_n` random coordinates; every tenth request (with
// `with_bad`) has a bad last coordinate. Counts, with a test failure for
// each, the rows that differ from the generator and the requests whose
// result is not their own (an error for a good request, anything but
// OUT_OF_RANGE naming the index in its own request for a bad one).
struct SharedCallsOutcome {
  int wrong_rows = 0;
  int wrong_results = 0;
};
SharedCallsOutcome RunThreadsOfOneClient(
    Client* client, const std::string& dataset, int threads, int requests,
    int max_n, bool with_bad,
    float (*expected)(int64_t, int64_t, int64_t, int64_t)) {
  std::atomic<int> wrong_rows{0}, wrong_results{0};
  std::vector<std::thread> pool;
  for (int c = 0; c < threads; ++c) {
    pool.emplace_back([&, c] {
      std::mt19937_64 rng(500 + c);
      for (int i = 0; i < requests; ++i) {
        const int n =
            1 + static_cast<int>(rng() % static_cast<unsigned>(max_n));
        std::vector<VectorCoord> coords;
        for (int k = 0; k < n; ++k) {
          coords.push_back({static_cast<int64_t>(rng() % 40),
                            rng() % 2 == 0 ? 6 : -2,
                            static_cast<int64_t>(rng() % 17)});
        }
        const bool bad = with_bad && i % 10 == 9;
        if (bad) coords[static_cast<size_t>(n - 1)].token = 17;  // one past
        auto r = client->GetVectors(dataset, coords);
        if (bad) {
          const std::string want = absl::StrCat("coordinates[", n - 1, "]");
          if (r.ok() || r.status().code() != absl::StatusCode::kOutOfRange ||
              std::string(r.status().message()).find(want) ==
                  std::string::npos) {
            wrong_results++;
            ADD_FAILURE() << "want OUT_OF_RANGE for " << want << ": "
                          << r.status();
          }
          continue;
        }
        if (!r.ok() || r->shape != std::vector<int64_t>{n, 32}) {
          wrong_results++;
          ADD_FAILURE() << r.status();
          continue;
        }
        for (int k = 0; k < n; ++k) {
          const VectorCoord& v = coords[static_cast<size_t>(k)];
          for (int d = 0; d < 32; ++d) {
            if (r->values[static_cast<size_t>(k * 32 + d)] !=
                expected(v.example, v.layer == 6 ? 1 : 0, v.token, d)) {
              wrong_rows++;
            }
          }
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  return {wrong_rows.load(), wrong_results.load()};
}

// A stock client's view of the daemon's query methods: the generated
// stub on a plain channel to the Unix socket.
std::unique_ptr<v1::Query::Stub> StockQueryStub(const std::string& socket) {
  return v1::Query::NewStub(grpc::CreateChannel(
      "unix:" + socket, grpc::InsecureChannelCredentials()));
}

v1::GetVectorsRequest VectorsRequest(const std::string& dataset,
                                     const std::vector<VectorCoord>& coords) {
  v1::GetVectorsRequest req;
  req.set_dataset(dataset);
  for (const VectorCoord& c : coords) {
    v1::Coordinate* p = req.add_coordinates();
    p->set_example(c.example);
    p->set_layer(c.layer);
    p->set_token(c.token);
  }
  return req;
}

// The parts of a StreamVectors call put back in request order ([N, D]
// floats), or the call's status.
absl::StatusOr<std::vector<float>> StreamVectorsByStub(
    v1::Query::Stub* stub, const v1::GetVectorsRequest& req, int64_t d_model) {
  grpc::ClientContext ctx;
  auto reader = stub->StreamVectors(&ctx, req);
  const size_t n = static_cast<size_t>(req.coordinates_size());
  std::vector<float> out(n * static_cast<size_t>(d_model), -1.0f);
  std::vector<int> seen(n, 0);
  v1::VectorRows part;
  while (reader->Read(&part)) {
    for (int i = 0; i < part.rows_size(); ++i) {
      const size_t row = static_cast<size_t>(part.rows(i));
      if (row >= n) return absl::DataLossError("a row past the request");
      seen[row]++;
      std::memcpy(&out[row * static_cast<size_t>(d_model)],
                  part.data().data() + i * d_model * sizeof(float),
                  static_cast<size_t>(d_model) * sizeof(float));
    }
  }
  const grpc::Status st = reader->Finish();
  if (!st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                        st.error_message());
  }
  for (int c : seen) {
    if (c != 1) return absl::DataLossError("a row sent other than once");
  }
  return out;
}

// Every road to the daemon's vectors gives the generator's values and the
// same errors: the client library's (the session, local channel off) and a
// stock client's GetVectors and StreamVectors (which the daemon serves for
// them; the client library takes the session only).
TEST_F(DaemonTest, EveryQueryMethodGivesTheGeneratorsValues) {
  daemon_ = StartDaemon();
  std::mt19937_64 rng(17);
  std::vector<VectorCoord> coords;
  for (int i = 0; i < 500; ++i) {
    coords.push_back({static_cast<int64_t>(rng() % 40), rng() % 2 ? 6 : -2,
                      static_cast<int64_t>(rng() % 17)});
  }
  auto client = Connect(QueriesOver(false));
  ASSERT_NE(client, nullptr);
  auto stub = StockQueryStub(socket_);
  const auto check = [&](const std::vector<VectorCoord>& some,
                         absl::Span<const float> values, const char* road) {
    ASSERT_EQ(values.size(), some.size() * 32) << road;
    for (size_t i = 0; i < some.size(); ++i) {
      for (int64_t k = 0; k < 32; k += 7) {
        ASSERT_EQ(values[i * 32 + static_cast<size_t>(k)],
                  Expected(some[i].example, some[i].layer == 6 ? 1 : 0,
                           some[i].token, k))
            << road << ": coordinate " << i << " of " << some.size();
      }
    }
  };
  for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{500}}) {
    std::vector<VectorCoord> some(coords.begin(), coords.begin() + n);
    auto block = client->GetVectors(main_id_, some);
    ASSERT_TRUE(block.ok()) << block.status();
    ASSERT_EQ(block->shape,
              (std::vector<int64_t>{static_cast<int64_t>(n), 32}));
    check(some, block->values, "session");
    grpc::ClientContext ctx;
    v1::Vectors unary;
    ASSERT_TRUE(
        stub->GetVectors(&ctx, VectorsRequest(main_id_, some), &unary).ok());
    check(some,
          absl::Span<const float>(
              reinterpret_cast<const float*>(unary.data().data()),
              unary.data().size() / sizeof(float)),
          "GetVectors");
    auto streamed =
        StreamVectorsByStub(stub.get(), VectorsRequest(main_id_, some), 32);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    check(some, *streamed, "StreamVectors");
  }
  std::vector<VectorCoord> bad = coords;
  bad[77].example = 40;
  auto r = client->GetVectors(main_id_, bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("coordinates[77]"),
            std::string::npos)
      << r.status();
  grpc::ClientContext ctx;
  v1::Vectors unary;
  const grpc::Status st =
      stub->GetVectors(&ctx, VectorsRequest(main_id_, bad), &unary);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_NE(st.error_message().find("coordinates[77]"), std::string::npos);
  auto streamed =
      StreamVectorsByStub(stub.get(), VectorsRequest(main_id_, bad), 32);
  EXPECT_EQ(streamed.status().code(), absl::StatusCode::kOutOfRange)
      << streamed.status();
  const std::string log = ReadAll(JoinPath(dir_, "daemon.log"));
  EXPECT_NE(log.find("call /shardcast.v1.Query/StreamVectors"),
            std::string::npos);
  EXPECT_NE(log.find("call /shardcast.v1.Query/GetVectors"), std::string::npos);
  EXPECT_NE(log.find("call /shardcast.v1.Query/VectorsSession"),
            std::string::npos);
}

// Sixteen threads of one Client asking a few vectors each: every request
// gets the generator's values, all of them on one VectorsSession call.
TEST_F(DaemonTest, ThreadsOfOneClientShareOneQuerySession) {
  daemon_ = StartDaemon();
  auto client = Connect(QueriesOver(false));
  ASSERT_NE(client, nullptr);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int i = 0; i < 150; ++i) {
        std::vector<VectorCoord> coords(1 + rng() % 3);
        for (VectorCoord& c : coords) {
          c = {static_cast<int64_t>(rng() % 40), rng() % 2 ? 6 : -2,
               static_cast<int64_t>(rng() % 17)};
        }
        auto r = client->GetVectors(main_id_, coords);
        bool ok =
            r.ok() && r->shape == std::vector<int64_t>{
                                      static_cast<int64_t>(coords.size()), 32};
        for (size_t j = 0; ok && j < coords.size(); ++j) {
          for (int64_t k = 0; k < 32; k += 5) {
            ok = ok &&
                 r->values[j * 32 + static_cast<size_t>(k)] ==
                     Expected(coords[j].example, coords[j].layer == 6 ? 1 : 0,
                              coords[j].token, k);
          }
        }
        if (!ok) wrong++;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  const std::string log = ReadAll(JoinPath(dir_, "daemon.log"));
  size_t sessions = 0;
  for (size_t at = 0; (at = log.find("call /shardcast.v1.Query/VectorsSession",
                                     at)) != std::string::npos;
       ++at) {
    ++sessions;
  }
  EXPECT_EQ(sessions, 1u);
  EXPECT_EQ(log.find("call /shardcast.v1.Query/GetVectors"), std::string::npos);
}

// A hundred threads with no call sharing (query_calls_in_flight 0) on the
// session, 2000 vectors each: far
// more request and reply bytes than one HTTP/2 window, more requests than
// the 64 a session holds or sends at once. Every request is answered with
// the generator's values.
TEST_F(DaemonTest, ManyThreadsWithoutSharingAllGetAnswersOnOneSession) {
  daemon_ = StartDaemon();
  ClientOptions options;
  options.local_queries = false;
  options.query_calls_in_flight = 0;
  auto client = Client::Connect("unix:" + socket_, options);
  ASSERT_TRUE(client.ok()) << client.status();
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 100; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(500 + t);
      for (int i = 0; i < 5; ++i) {
        std::vector<VectorCoord> coords(2000);
        for (VectorCoord& c : coords) {
          c = {static_cast<int64_t>(rng() % 40), 6,
               static_cast<int64_t>(rng() % 17)};
        }
        auto r = (*client)->GetVectors(main_id_, coords);
        bool ok = r.ok() && r->shape == std::vector<int64_t>{2000, 32};
        for (size_t j = 0; ok && j < coords.size(); ++j) {
          ok = r->values[j * 32 + 31] ==
               Expected(coords[j].example, 1, coords[j].token, 31);
        }
        if (!ok) wrong++;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

// The daemon restarts under an open session (gRPC) and open local channel
// connections: they break, the next calls open new ones and get the right
// values.
TEST_F(DaemonTest, QuerySessionReopensAfterTheDaemonRestarts) {
  daemon_ = StartDaemon();
  std::unique_ptr<Client> clients[] = {Connect(QueriesOver(false)), Connect()};
  for (auto& client : clients) {
    ASSERT_NE(client, nullptr);
    ASSERT_TRUE(client->GetVectors(main_id_, {{2, 6, 3}}).ok());
  }
  ASSERT_EQ(::kill(daemon_->pid(), SIGTERM), 0);
  ASSERT_NE(daemon_->WaitExit(std::chrono::seconds(10)), -1)
      << "an idle session kept the daemon from exiting";
  daemon_ = StartDaemon();
  for (auto& client : clients) {
    absl::StatusOr<VectorBlock> r;
    for (int i = 0; i < 50; ++i) {
      r = client->GetVectors(main_id_, {{5, -2, 7}});
      if (r.ok()) break;
      EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable)
          << r.status();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->values[9], Expected(5, 0, 7, 9));
  }
}

// A shard that turns out short while a stock client's StreamVectors parts
// are going out: the call fails with DATA_LOSS naming the file (never a
// partial result), as does the client library's session request, and the
// daemon serves the next calls.
TEST_F(DaemonTest, TruncatedShardEndsAStreamedCallWithDataLoss) {
  daemon_ = StartDaemon();
  auto client = Connect(QueriesOver(false));
  ASSERT_NE(client, nullptr);
  auto stub = StockQueryStub(socket_);
  const std::string shard =
      JoinPath(JoinPath(root_, main_id_), "acts000001.bin");
  ASSERT_EQ(::truncate(shard.c_str(), 1000), 0);
  // Shard 0 (examples 0-19) is whole; example 30 lies in the lost part.
  // The worker has 256 reads in flight at most, so the read of example 30
  // (coordinate 300) starts after the first parts have gone out.
  std::vector<VectorCoord> coords;
  for (int64_t i = 0; i < 300; ++i) {
    coords.push_back({i % 20, i % 3 ? 6 : -2, i % 17});
  }
  coords.push_back({30, 6, 3});
  auto streamed =
      StreamVectorsByStub(stub.get(), VectorsRequest(main_id_, coords), 32);
  EXPECT_EQ(streamed.status().code(), absl::StatusCode::kDataLoss)
      << streamed.status();
  EXPECT_NE(std::string(streamed.status().message()).find("acts000001.bin"),
            std::string::npos)
      << streamed.status();
  auto r = client->GetVectors(main_id_, coords);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("acts000001.bin"),
            std::string::npos)
      << r.status();
  coords.pop_back();
  auto ok = client->GetVectors(main_id_, coords);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->values[32 * 20], Expected(0, 1, 3, 0));
}

// With one call in flight, the requests of a Client's threads that arrive
// meanwhile share a call (ClientOptions::query_calls_in_flight): fewer
// calls reach the daemon, and every request still gets exactly its own
// rows, or its own error.
TEST_F(DaemonTest, ThreadsOfOneClientShareCallsAndEachGetsItsOwnRows) {
  daemon_ = StartDaemon();
  ClientOptions options;
  options.local_queries = false;
  options.query_calls_in_flight = 1;
  auto client = Client::Connect("unix:" + socket_, options);
  ASSERT_TRUE(client.ok()) << client.status();
  constexpr int kThreads = 12, kRequests = 30;
  const SharedCallsOutcome out = RunThreadsOfOneClient(
      client->get(), main_id_, kThreads, kRequests, 5, true, &Expected);
  EXPECT_EQ(out.wrong_rows, 0);
  EXPECT_EQ(out.wrong_results, 0);
  auto status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  // Calls before GetStatus: the requests' (fewer, when shared) plus one
  // retry per request of a combined call with a bad coordinate.
  EXPECT_LT(status->calls_total, static_cast<uint64_t>(kThreads * kRequests));
}

// Combined calls over the daemon's reply limit (8 vectors here) fail; their
// requests are sent again alone and all succeed (and later groups are kept
// smaller).
TEST_F(DaemonTest, SharedCallsOverTheReplyLimitAreSentAgainAlone) {
  daemon_ = StartDaemon({"--max-bytes-per-call", "1024"});
  ClientOptions options;
  options.local_queries = false;
  options.query_calls_in_flight = 1;
  auto client = Client::Connect("unix:" + socket_, options);
  ASSERT_TRUE(client.ok()) << client.status();
  const SharedCallsOutcome out = RunThreadsOfOneClient(
      client->get(), main_id_, 6, 20, 5, false, &Expected);
  EXPECT_EQ(out.wrong_rows, 0);
  EXPECT_EQ(out.wrong_results, 0);
  // Some combined call was over the limit (and its requests sent again):
  // the path under test ran.
  auto status = (*client)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_GT(status->calls_failed, 0u);
}

// Sixteen threads of one Client on the local channel, a few vectors
// per call and every tenth call with a bad coordinate, then one call larger
// than the connection's first region: each gets the generator's values or
// its own error, and no query goes through gRPC.
TEST_F(DaemonTest, LocalQueriesAnswerThreadsWithoutGrpc) {
  daemon_ = StartDaemon();
  // Every call read by the daemon (single vectors too: see
  // LocalClientsReadSingleVectorsThemselves for those read here).
  ClientOptions options;
  options.local_direct_reads = false;
  auto client = Connect(options);
  ASSERT_NE(client, nullptr);
  const SharedCallsOutcome out =
      RunThreadsOfOneClient(client.get(), main_id_, 16, 40, 5, true, &Expected);
  EXPECT_EQ(out.wrong_rows, 0);
  EXPECT_EQ(out.wrong_results, 0);
  // 60,000 coordinates: 1.4 MB of them and 7.7 MB of vectors, more than
  // the first region (1 MiB) holds; the client asks for a larger one.
  std::vector<VectorCoord> coords;
  std::mt19937_64 rng(9);
  for (int i = 0; i < 60000; ++i) {
    coords.push_back({static_cast<int64_t>(rng() % 40), rng() % 2 ? 6 : -2,
                      static_cast<int64_t>(rng() % 17)});
  }
  auto block = client->GetVectors(main_id_, coords);
  ASSERT_TRUE(block.ok()) << block.status();
  ASSERT_EQ(block->shape, (std::vector<int64_t>{60000, 32}));
  for (size_t i = 0; i < coords.size(); i += 7) {
    ASSERT_EQ(block->values[i * 32 + 5],
              Expected(coords[i].example, coords[i].layer == 6 ? 1 : 0,
                       coords[i].token, 5))
        << "coordinate " << i;
  }
  const std::string log = ReadAll(JoinPath(dir_, "daemon.log"));
  EXPECT_EQ(log.find("call /shardcast.v1.Query/"), std::string::npos);
  auto status = client->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_GE(status->calls_total, 16u * 40u + 1u);
}

// Blocks from the local channel view the connection's query region, which
// no later call may overwrite while a block holds it: forty blocks held at
// once (the first ones views, the rest copies), more calls meanwhile, then
// the client gone; every block keeps its own values.
TEST_F(DaemonTest, LocalBlocksKeepTheirValuesWhileHeld) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  std::vector<VectorCoord> coords;
  std::vector<VectorBlock> held;
  for (int64_t i = 0; i < 40; ++i) {
    coords.push_back({i, i % 2 ? 6 : -2, i % 17});
    auto block = client->GetVectors(main_id_, {coords.back()});
    ASSERT_TRUE(block.ok()) << block.status();
    held.push_back(*std::move(block));
  }
  for (int i = 0; i < 50; ++i) {  // calls reusing the free connections
    ASSERT_TRUE(client->GetVectors(main_id_, {{i % 40, 6, 16}}).ok());
  }
  const auto check = [&](const char* when) {
    for (size_t i = 0; i < held.size(); ++i) {
      const VectorCoord& c = coords[i];
      ASSERT_EQ(held[i].shape, (std::vector<int64_t>{1, 32})) << when;
      for (int64_t k = 0; k < 32; ++k) {
        ASSERT_EQ(held[i].values[static_cast<size_t>(k)],
                  Expected(c.example, c.layer == 6 ? 1 : 0, c.token, k))
            << when << ": block " << i;
      }
    }
  };
  check("client open");
  client.reset();
  check("client gone");
  held.clear();  // the lent connections close
}

// A raw connection to the local channel (proto/shardcast/v1/local.proto,
// framed as common/local/channel.h says), to send what the client library
// never would.
class RawLocalConnection {
 public:
  explicit RawLocalConnection(const std::string& path) {
    fd_.Reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    connected_ = ::connect(fd_.get(), reinterpret_cast<sockaddr*>(&addr),
                           sizeof(addr)) == 0;
    struct timeval tv = {10, 0};  // a reply that never comes fails the test
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  RawLocalConnection(const RawLocalConnection&) = delete;
  RawLocalConnection& operator=(const RawLocalConnection&) = delete;
  ~RawLocalConnection() { Unmap(); }
  bool connected() const { return connected_; }

  // Sends `bytes` as one packet with `fds`, whatever the bytes say.
  bool SendBytes(const std::string& bytes, absl::Span<const int> fds = {}) {
    return SendWithDescriptors(fd_.get(), bytes, fds).ok();
  }
  // Sends `request` as it is (its id too) with `fds`.
  bool Send(v1::LocalRequest request, absl::Span<const int> fds = {}) {
    return local::SendMessage(fd_.get(), request, fds).ok();
  }
  // The next reply and the descriptors it carried; false when none came
  // (the daemon closed the connection, or 10 s passed).
  bool Receive(v1::LocalReply* reply, std::vector<UniqueFd>* fds = nullptr) {
    std::vector<UniqueFd> got;
    absl::StatusOr<local::Received> r =
        local::ReceiveMessage(fd_.get(), reply, &got);
    if (fds != nullptr) *fds = std::move(got);
    return r.ok() && *r == local::Received::kMessage;
  }
  // Whether the daemon has closed the connection (the next receive sees its
  // end rather than a packet or the timeout).
  bool Closed() {
    char buf[256];
    return ::recv(fd_.get(), buf, sizeof(buf), 0) == 0;
  }
  // Sends `request` with the next id; its reply, and in `fds` the
  // descriptors that came with it. No reply: code -1, which fails checks.
  v1::LocalReply Call(v1::LocalRequest request,
                      std::vector<UniqueFd>* fds = nullptr) {
    request.set_id(++id_);
    EXPECT_TRUE(Send(request));
    v1::LocalReply reply;
    if (!Receive(&reply, fds)) {
      reply.Clear();
      reply.set_code(-1);
      reply.set_message("no reply");
      return reply;
    }
    EXPECT_EQ(reply.id(), request.id());
    return reply;
  }
  // Asks for a query region of `bytes`; when the daemon hands one over,
  // maps it here read-write (in place of the last).
  v1::LocalReply QueryRegion(uint64_t bytes) {
    v1::LocalRequest request;
    request.mutable_query_region()->set_bytes(bytes);
    std::vector<UniqueFd> fds;
    v1::LocalReply reply = Call(request, &fds);
    if (reply.code() != 0) {
      EXPECT_TRUE(fds.empty());
      return reply;
    }
    EXPECT_TRUE(reply.has_query_region());
    EXPECT_EQ(fds.size(), 1u);
    if (fds.size() != 1) return reply;
    Unmap();
    const uint64_t got = reply.query_region().bytes();
    void* p = ::mmap(nullptr, got, PROT_READ | PROT_WRITE, MAP_SHARED,
                     fds[0].get(), 0);
    EXPECT_NE(p, MAP_FAILED) << std::strerror(errno);
    if (p == MAP_FAILED) return reply;
    base_ = static_cast<char*>(p);
    bytes_ = got;
    memfd_ = std::move(fds[0]);
    return reply;
  }
  // Writes `coords` at `coords_offset` of the region and asks for `count`
  // vectors from there at `out_offset`.
  v1::LocalReply Ask(const std::string& dataset,
                     const std::vector<VectorCoord>& coords,
                     uint64_t coords_offset, uint64_t out_offset,
                     uint64_t count) {
    // (Those that fit: a request may point past the region's end.)
    for (size_t i = 0; i < coords.size(); ++i) {
      const int64_t v[3] = {coords[i].example, coords[i].layer,
                            coords[i].token};
      if (coords_offset + (i + 1) * sizeof(v) > bytes_) break;
      std::memcpy(base_ + coords_offset + i * sizeof(v), v, sizeof(v));
    }
    v1::LocalRequest request;
    v1::LocalRequest::Vectors* vectors = request.mutable_vectors();
    vectors->set_dataset(dataset);
    vectors->set_count(count);
    vectors->set_coords_offset(coords_offset);
    vectors->set_out_offset(out_offset);
    return Call(request);
  }
  char* base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  int memfd() const { return memfd_.get(); }

 private:
  void Unmap() {
    if (base_ != nullptr) ::munmap(base_, bytes_);
    base_ = nullptr;
    bytes_ = 0;
  }

  UniqueFd fd_, memfd_;
  bool connected_ = false;
  char* base_ = nullptr;
  uint64_t bytes_ = 0;
  uint64_t id_ = 0;
};

TEST_F(DaemonTest, DisableLocalQueriesLeavesQueriesOnGrpc) {
  daemon_ = StartDaemon({"--disable-local-queries"});
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  // The local channel is there for shared memory, and it refuses queries.
  {
    RawLocalConnection raw(socket_ + local::kSocketSuffix);
    ASSERT_TRUE(raw.connected());
    v1::LocalReply reply = raw.QueryRegion(1 << 16);
    EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
              absl::StatusCode::kUnimplemented)
        << reply.message();
    EXPECT_NE(reply.message().find("--disable-local-queries"),
              std::string::npos)
        << reply.message();
    v1::LocalRequest layout;
    layout.mutable_layout()->set_dataset(main_id_);
    reply = raw.Call(layout);
    EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
              absl::StatusCode::kUnimplemented)
        << reply.message();
  }
  auto r = client->GetVectors(main_id_, {{4, 6, 2}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->values[3], Expected(4, 1, 2, 3));
  EXPECT_NE(ReadAll(JoinPath(dir_, "daemon.log"))
                .find("call /shardcast.v1.Query/VectorsSession"),
            std::string::npos);
}

// A dataset name that is not UTF-8 (a hostile or broken client) names no
// dataset: the reply is NOT_FOUND, and it parses, although the daemon's
// message quotes the name (found by tests/fuzz/local_channel_fuzz.cc: the
// reply's message field had to be valid UTF-8).
TEST_F(DaemonTest, ADatasetNameThatIsNotUtf8GetsAReplyThatParses) {
  daemon_ = StartDaemon();
  ASSERT_NE(Connect(), nullptr);
  RawLocalConnection c(socket_ + local::kSocketSuffix);
  ASSERT_TRUE(c.connected());
  ASSERT_EQ(c.QueryRegion(1 << 16).code(), 0);
  const std::string name = "\xff\xfe not utf-8 \xc3";
  v1::LocalRequest layout;
  layout.mutable_layout()->set_dataset(name);
  v1::LocalReply reply = c.Call(layout);
  EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
            absl::StatusCode::kNotFound)
      << reply.message();
  const std::vector<VectorCoord> coords = {{1, 6, 2}};
  reply = c.Ask(name, coords, 0, 4096, 1);
  EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
            absl::StatusCode::kNotFound)
      << reply.message();
  // Served on: a sound request on the same connection.
  reply = c.Ask(main_id_, coords, 0, 4096, 1);
  EXPECT_EQ(reply.code(), 0) << reply.message();
}

// What the client library never sends gets a clear error on the local
// channel, the daemon keeps serving, and it only ever writes into the
// sealed region it made, at the offsets asked for.
TEST_F(DaemonTest, LocalChannelRefusesBadInputAndKeepsServing) {
  daemon_ = StartDaemon();
  ASSERT_NE(Connect(), nullptr);  // the daemon is up
  const std::string path = socket_ + local::kSocketSuffix;
  const auto code = [](int32_t c) { return static_cast<absl::StatusCode>(c); };
  const auto has = [](const std::string& text, const char* part) {
    return text.find(part) != std::string::npos;
  };
  {
    SCOPED_TRACE("a packet that says it carries a descriptor and does not");
    RawLocalConnection c(path);
    ASSERT_TRUE(c.connected());
    v1::LocalRequest request;
    request.set_id(5);
    request.set_descriptors(1);
    request.mutable_query_region()->set_bytes(1 << 16);
    ASSERT_TRUE(c.SendBytes(request.SerializeAsString()));
    v1::LocalReply reply;
    ASSERT_TRUE(c.Receive(&reply));
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(has(reply.message(), "descriptors")) << reply.message();
    EXPECT_EQ(reply.id(), 0u);  // the request was not read
    EXPECT_TRUE(c.Closed());    // and the connection is closed
  }
  {
    SCOPED_TRACE("a packet that carries a descriptor it does not count");
    RawLocalConnection c(path);
    UniqueFd extra(::memfd_create("test-extra", MFD_CLOEXEC));
    ASSERT_TRUE(extra.valid());
    v1::LocalRequest request;
    request.set_id(6);
    request.mutable_query_region()->set_bytes(1 << 16);
    const int fd = extra.get();
    ASSERT_TRUE(c.SendBytes(request.SerializeAsString(), {&fd, 1}));
    v1::LocalReply reply;
    std::vector<UniqueFd> fds;
    ASSERT_TRUE(c.Receive(&reply, &fds));
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(has(reply.message(), "descriptors")) << reply.message();
    EXPECT_EQ(reply.id(), 0u);
    EXPECT_TRUE(fds.empty());
    EXPECT_TRUE(c.Closed());
  }
  {
    SCOPED_TRACE("query regions too small and too large");
    RawLocalConnection c(path);
    v1::LocalReply reply = c.QueryRegion(0);
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(has(reply.message(), "query region of 0 bytes"))
        << reply.message();
    // A region is rounded up to whole pages; the reply says the largest.
    reply = c.QueryRegion(5000);
    ASSERT_EQ(reply.code(), 0) << reply.message();
    EXPECT_EQ(reply.query_region().bytes(), 8192u);
    EXPECT_EQ(c.bytes(), 8192u);
    const uint64_t max = reply.query_region().max_region_bytes();
    EXPECT_GE(max, uint64_t{16} << 20);
    reply = c.QueryRegion(max + 4096);
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(has(reply.message(), std::to_string(max).c_str()))
        << reply.message();
    // Refusals leave the connection (and its region) usable.
    EXPECT_EQ(c.bytes(), 8192u);
    auto got = c.Ask(main_id_, {{2, 6, 4}}, 0, 4096, 1);
    ASSERT_EQ(got.code(), 0) << got.message();
    EXPECT_EQ(reinterpret_cast<const float*>(c.base() + 4096)[6],
              Expected(2, 1, 4, 6));
  }
  {
    SCOPED_TRACE("requests before a query region");
    RawLocalConnection c(path);
    auto reply = c.Ask(main_id_, {}, 0, 4096, 1);
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(has(reply.message(), "query region")) << reply.message();
    v1::LocalRequest layout;
    layout.mutable_layout()->set_dataset(main_id_);
    reply = c.Call(layout);
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(has(reply.message(), "query region")) << reply.message();
    ASSERT_EQ(c.QueryRegion(1 << 16).code(), 0);  // and then it is served
  }
  RawLocalConnection c(path);
  constexpr uint64_t kRegion = 1 << 16;  // 64 KiB
  {
    auto reply = c.QueryRegion(kRegion);
    ASSERT_EQ(reply.code(), 0) << reply.message();
    ASSERT_EQ(reply.query_region().bytes(), kRegion);
  }
  {
    SCOPED_TRACE("the region the daemon made can neither shrink nor grow");
    const int seals = ::fcntl(c.memfd(), F_GET_SEALS);
    ASSERT_GE(seals, 0) << std::strerror(errno);
    EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW),
              F_SEAL_SHRINK | F_SEAL_GROW);
    struct stat st;
    ASSERT_EQ(::fstat(c.memfd(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), kRegion);
    EXPECT_NE(::ftruncate(c.memfd(), 4096), 0);
    EXPECT_NE(::ftruncate(c.memfd(), 2 * kRegion), 0);
    EXPECT_EQ(::fstat(c.memfd(), &st), 0);
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), kRegion);
  }
  const std::vector<VectorCoord> two = {{3, 6, 5}, {39, -2, 16}};
  struct Case {
    const char* what;
    uint64_t coords_offset, out_offset, count;
    absl::StatusCode want;
    const char* says;
  };
  for (const Case& k : std::vector<Case>{
           {"coordinates past the region's end", kRegion - 24, 4096, 2,
            absl::StatusCode::kInvalidArgument,
            "do not lie in the query region"},
           {"more than a call may ask, refused before the coordinates are read",
            0, 4096, uint64_t{1} << 62, absl::StatusCode::kResourceExhausted,
            "the limit per call is"},
           {"an unaligned output", 0, 4097, 2,
            absl::StatusCode::kInvalidArgument, "not a multiple of 4096"},
           {"vectors that do not fit", 0, kRegion - 4096, 33,
            absl::StatusCode::kResourceExhausted, "need a query region of"}}) {
    SCOPED_TRACE(k.what);
    std::vector<VectorCoord> coords(33, VectorCoord{1, 6, 1});
    auto reply =
        c.Ask(main_id_, coords, k.coords_offset, k.out_offset, k.count);
    EXPECT_EQ(code(reply.code()), k.want) << reply.message();
    EXPECT_TRUE(has(reply.message(), k.says)) << reply.message();
    EXPECT_FALSE(reply.has_vectors());
    if (k.count == 33) {
      // 33 vectors of 32 floats after the output offset.
      EXPECT_EQ(reply.need_region_bytes(), kRegion - 4096 + 33 * 128);
    } else {
      EXPECT_EQ(reply.need_region_bytes(), 0u);  // no region would do
    }
  }
  {
    SCOPED_TRACE("unknown operations (a newer client's)");
    // One in a field this daemon does not know (77: length-delimited,
    // holding field 1 = 1), and one with no operation at all.
    v1::LocalRequest request;
    request.set_id(1000);
    const std::string newer =
        request.SerializeAsString() + std::string("\xea\x04\x02\x08\x01", 5);
    request.set_id(1001);
    const std::pair<std::string, uint64_t> sent[] = {
        {newer, 1000}, {request.SerializeAsString(), 1001}};
    for (const auto& [bytes, id] : sent) {
      ASSERT_TRUE(c.SendBytes(bytes));
      v1::LocalReply reply;
      ASSERT_TRUE(c.Receive(&reply));
      EXPECT_EQ(code(reply.code()), absl::StatusCode::kUnimplemented)
          << reply.message();
      EXPECT_EQ(reply.id(), id);  // and the connection stays usable
    }
  }
  {
    SCOPED_TRACE("a bad coordinate and an unknown dataset");
    auto reply = c.Ask(main_id_, {{3, 6, 5}, {3, 6, 17}}, 0, 4096, 2);
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kOutOfRange);
    EXPECT_TRUE(has(reply.message(), "coordinates[1]")) << reply.message();
    reply = c.Ask("0123456789abcdef", two, 0, 4096, 2);
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kNotFound);
  }
  {
    SCOPED_TRACE("a request carrying a descriptor it counts");
    UniqueFd extra(::memfd_create("test-extra", MFD_CLOEXEC));
    ASSERT_TRUE(extra.valid());
    v1::LocalRequest request;
    request.set_id(2000);
    request.mutable_layout()->set_dataset(main_id_);
    const int fd = extra.get();
    ASSERT_TRUE(c.Send(request, {&fd, 1}));
    v1::LocalReply reply;
    std::vector<UniqueFd> fds;
    ASSERT_TRUE(c.Receive(&reply, &fds));
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(has(reply.message(), "takes no descriptors"))
        << reply.message();
    EXPECT_EQ(reply.id(), 2000u);
    EXPECT_TRUE(fds.empty());
  }
  {
    SCOPED_TRACE("after all that, the same connection is served");
    std::vector<char> before(c.base(), c.base() + kRegion);
    auto reply = c.Ask(main_id_, two, 128, 8192, 2);
    ASSERT_EQ(reply.code(), 0) << reply.message();
    EXPECT_EQ(reply.vectors().rows(), 2u);
    EXPECT_EQ(reply.vectors().d_model(), 32u);
    for (int64_t k = 0; k < 32; ++k) {
      float v[2];
      std::memcpy(&v[0], c.base() + 8192 + k * 4, 4);
      std::memcpy(&v[1], c.base() + 8192 + 128 + k * 4, 4);
      EXPECT_EQ(v[0], Expected(3, 1, 5, k));
      EXPECT_EQ(v[1], Expected(39, 0, 16, k));
    }
    // Nothing changed but the two vectors (at 8192) and the coordinates
    // the test wrote (at 128).
    for (uint64_t i = 0; i < kRegion; ++i) {
      if ((i >= 8192 && i < 8192 + 256) || (i >= 128 && i < 128 + 48)) {
        continue;
      }
      ASSERT_EQ(c.base()[i], before[i]) << "byte " << i;
    }
  }
  {
    SCOPED_TRACE("not a local channel message ends the connection");
    ASSERT_TRUE(c.SendBytes("GET / HTTP/1.1\r\n\r\n"));
    v1::LocalReply reply;
    ASSERT_TRUE(c.Receive(&reply));
    EXPECT_EQ(code(reply.code()), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(has(reply.message(), "not a local channel message"))
        << reply.message();
    EXPECT_EQ(reply.id(), 0u);
    EXPECT_TRUE(c.Closed());
  }
  {
    SCOPED_TRACE("clients that leave in the middle of a call");
    for (int i = 0; i < 20; ++i) {
      RawLocalConnection gone(path);
      ASSERT_EQ(gone.QueryRegion(1 << 20).code(), 0);
      for (size_t j = 0; j < 2000; ++j) {
        const int64_t v[3] = {static_cast<int64_t>(j % 40), 6,
                              static_cast<int64_t>(j % 17)};
        std::memcpy(gone.base() + j * 24, v, sizeof(v));
      }
      v1::LocalRequest request;
      request.set_id(1);
      request.mutable_vectors()->set_dataset(main_id_);
      request.mutable_vectors()->set_count(2000);
      request.mutable_vectors()->set_out_offset(49152);
      ASSERT_TRUE(gone.Send(request));
    }  // closed with the call in service
  }
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  auto r = client->GetVectors(main_id_, {{6, -2, 4}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->values[30], Expected(6, 0, 4, 30));
}

// With several local channel threads, the first accepts and hands the
// connections to all of them in turn: sixteen client threads each get
// their own rows with no gRPC query; the connection limit counts the
// connections of every thread, and one closed on any thread frees a place.
TEST_F(DaemonTest, SeveralLocalQueryThreadsShareTheConnections) {
  daemon_ = StartDaemon({"--local-query-threads", "3"});
  {
    auto client = Connect();
    ASSERT_NE(client, nullptr);
    const SharedCallsOutcome out = RunThreadsOfOneClient(
        client.get(), main_id_, 16, 40, 5, true, &Expected);
    EXPECT_EQ(out.wrong_rows, 0);
    EXPECT_EQ(out.wrong_results, 0);
    const std::string log = ReadAll(JoinPath(dir_, "daemon.log"));
    EXPECT_NE(log.find("local channel on " + socket_ + local::kSocketSuffix +
                       " (3 threads; shared memory, queries)"),
              std::string::npos)
        << log;
    EXPECT_EQ(log.find("call /shardcast.v1.Query/"), std::string::npos);
  }
  daemon_.reset();
  daemon_ =
      StartDaemon({"--local-query-threads", "3", "--max-connections", "4"});
  ASSERT_NE(Connect(), nullptr);  // the daemon is up
  const std::string path = socket_ + local::kSocketSuffix;
  // Four connections: the first thread's, the second's, the third's, the
  // first's again; each answers a call with the generator's values.
  std::vector<std::unique_ptr<RawLocalConnection>> open;
  for (int64_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    open.push_back(std::make_unique<RawLocalConnection>(path));
    RawLocalConnection& c = *open.back();
    ASSERT_EQ(c.QueryRegion(1 << 16).code(), 0);
    auto reply = c.Ask(main_id_, {{i, 6, i}}, 0, 4096, 1);
    ASSERT_EQ(reply.code(), 0) << reply.message();
    float v;
    std::memcpy(&v, c.base() + 4096 + 7 * 4, 4);
    EXPECT_EQ(v, Expected(i, 1, i, 7));
  }
  {
    // Refused at its first request, with the reason, and closed.
    RawLocalConnection fifth(path);
    auto reply = fifth.QueryRegion(1 << 16);
    EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
              absl::StatusCode::kUnavailable);
    EXPECT_NE(reply.message().find("4 local channel connections open"),
              std::string::npos)
        << reply.message();
    EXPECT_TRUE(fifth.Closed());
  }
  // The second connection (served by the second thread) goes; the count the
  // first thread checks falls once the second has seen it close.
  open.erase(open.begin() + 1);
  bool admitted = false;
  for (int attempt = 0; attempt < 100 && !admitted; ++attempt) {
    RawLocalConnection next(path);
    admitted = next.QueryRegion(1 << 16).code() == 0;
    if (admitted) {
      auto reply = next.Ask(main_id_, {{9, -2, 3}}, 0, 4096, 1);
      ASSERT_EQ(reply.code(), 0) << reply.message();
      float v;
      std::memcpy(&v, next.base() + 4096, 4);
      EXPECT_EQ(v, Expected(9, 0, 3, 0));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  EXPECT_TRUE(admitted);
}

bool IsSocket(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
}

// Calls the daemon counted (GetStatus's calls_total, which counts the
// status call itself too).
uint64_t CallsCounted(Client* client) {
  auto status = client->GetStatus();
  EXPECT_TRUE(status.ok()) << status.status();
  return status.ok() ? status->calls_total : 0;
}

// Single vectors are read by the client itself, with the descriptors the
// daemon handed over: the daemon counts no call for them, and the values
// are the generator's. Larger calls, coordinates outside the dataset and a
// client that turns direct reads off go to the daemon.
TEST_F(DaemonTest, LocalClientsReadSingleVectorsThemselves) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  uint64_t before = CallsCounted(client.get());
  for (int64_t i = 0; i < 100; ++i) {  // both shards, layers and CLS
    const VectorCoord c{(i * 7) % 40, i % 2 ? 6 : -2, (i * 5) % 17};
    auto block = client->GetVectors(main_id_, {c});
    ASSERT_TRUE(block.ok()) << block.status();
    ASSERT_EQ(block->shape, (std::vector<int64_t>{1, 32}));
    for (int64_t k = 0; k < 32; ++k) {
      ASSERT_EQ(block->values[static_cast<size_t>(k)],
                Expected(c.example, c.layer == 6 ? 1 : 0, c.token, k))
          << i;
    }
  }
  uint64_t after = CallsCounted(client.get());
  EXPECT_LE(after - before, 1u) << "single vectors went to the daemon";
  EXPECT_NE(daemon_->log().find("reads " + main_id_ + " directly"),
            std::string::npos);

  // Two vectors: one call the daemon reads.
  before = after;
  auto two = client->GetVectors(main_id_, {{3, 6, 1}, {30, -2, 16}});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->values[32 + 4], Expected(30, 0, 16, 4));
  after = CallsCounted(client.get());
  EXPECT_EQ(after - before, 2u);

  // Outside the dataset: the daemon's error, as over gRPC.
  auto grpc = Connect(QueriesOver(false));
  ASSERT_NE(grpc, nullptr);
  for (const VectorCoord& bad :
       {VectorCoord{40, 6, 0}, VectorCoord{0, 7, 0}, VectorCoord{0, 6, 17}}) {
    auto local = client->GetVectors(main_id_, {bad});
    auto remote = grpc->GetVectors(main_id_, {bad});
    ASSERT_FALSE(local.ok());
    ASSERT_FALSE(remote.ok());
    EXPECT_EQ(local.status(), remote.status());
  }
  EXPECT_EQ(client->GetVectors("no-such-dataset", {{0, 6, 0}}).status().code(),
            absl::StatusCode::kNotFound);
  // A name longer than the socket's requests carry (1024 bytes) names no
  // dataset either: the same answer as over gRPC, for one vector and two.
  const std::string long_name(1025, 'z');
  for (const std::vector<VectorCoord>& coords :
       {std::vector<VectorCoord>{{0, 6, 0}},
        std::vector<VectorCoord>{{0, 6, 0}, {1, 6, 0}}}) {
    auto local = client->GetVectors(long_name, coords);
    auto remote = grpc->GetVectors(long_name, coords);
    EXPECT_EQ(local.status().code(), absl::StatusCode::kNotFound)
        << local.status();
    EXPECT_EQ(local.status(), remote.status());
  }

  // Direct reads off: the daemon reads each one.
  ClientOptions off;
  off.local_direct_reads = false;
  auto daemon_reads = Connect(off);
  ASSERT_NE(daemon_reads, nullptr);
  before = CallsCounted(daemon_reads.get());
  for (int64_t i = 0; i < 20; ++i) {
    auto block = daemon_reads->GetVectors(main_id_, {{i, 6, 2}});
    ASSERT_TRUE(block.ok()) << block.status();
    ASSERT_EQ(block->values[7], Expected(i, 1, 2, 7));
  }
  after = CallsCounted(daemon_reads.get());
  EXPECT_EQ(after - before, 21u);
}

// Once a layout is a second old, one thread of the process asks for it
// again; the others have the daemon read their vectors meanwhile. Before,
// every thread that found it old asked too (and threads that found no entry
// left opened their own files anew).
TEST_F(DaemonTest, OneThreadAsksForALayoutAgain) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  const auto count_layouts = [&] {
    const std::string log = daemon_->log();
    const std::string line = "reads " + main_id_ + " directly";
    size_t n = 0;
    for (size_t at = log.find(line); at != std::string::npos;
         at = log.find(line, at + 1)) {
      ++n;
    }
    return n;
  };
  constexpr int kThreads = 8;
  const auto start = std::chrono::steady_clock::now();
  const auto end = start + std::chrono::milliseconds(2500);
  std::atomic<int64_t> reads{0}, wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int64_t i = t; std::chrono::steady_clock::now() < end; i += 7) {
        const VectorCoord c{i % 40, 6, i % 17};
        auto block = client->GetVectors(main_id_, {c});
        if (!block.ok() ||
            block->values[5] != Expected(c.example, 1, c.token, 5)) {
          wrong++;
        }
        reads++;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(reads.load(), 100);
  // The first layout and one per second since, and one more should the last
  // second end during a refresh.
  const size_t layouts = count_layouts();
  EXPECT_GE(layouts, 1u);
  EXPECT_LE(layouts, static_cast<size_t>(seconds) + 2)
      << "in " << seconds << " s of " << kThreads << " threads reading";
}

TEST_F(DaemonTest, DisableDirectReadsKeepsEveryReadInTheDaemon) {
  daemon_ = StartDaemon({"--disable-direct-reads"});
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  const uint64_t before = CallsCounted(client.get());
  for (int64_t i = 0; i < 20; ++i) {
    auto block = client->GetVectors(main_id_, {{i, -2, 16}});
    ASSERT_TRUE(block.ok()) << block.status();
    ASSERT_EQ(block->values[31], Expected(i, 0, 16, 31));
  }
  EXPECT_EQ(CallsCounted(client.get()) - before, 21u);
  RawLocalConnection raw(socket_ + local::kSocketSuffix);
  ASSERT_EQ(raw.QueryRegion(1 << 16).code(), 0);
  v1::LocalRequest layout;
  layout.mutable_layout()->set_dataset(main_id_);
  v1::LocalReply reply = raw.Call(layout);
  EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(reply.message().find("--disable-direct-reads"), std::string::npos)
      << reply.message();
  // No descriptors either, for whatever serial.
  v1::LocalRequest open;
  open.mutable_open_files()->set_dataset(main_id_);
  open.mutable_open_files()->add_files(0);
  std::vector<UniqueFd> fds;
  reply = raw.Call(open, &fds);
  EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fds.empty());
}

// The two direct-read requests on a raw connection: the layout places a
// vector where the format's arithmetic does, the descriptor reads the
// generator's values and cannot write, and bad requests get their codes.
TEST_F(DaemonTest, DirectReadRequestsGiveTheLayoutAndReadOnlyFiles) {
  daemon_ = StartDaemon();
  RawLocalConnection raw(socket_ + local::kSocketSuffix);
  ASSERT_EQ(raw.QueryRegion(1 << 16).code(), 0);
  v1::LocalRequest layout;
  layout.mutable_layout()->set_dataset(main_id_);
  layout.mutable_layout()->set_out_offset(4096);
  v1::LocalReply reply = raw.Call(layout);
  ASSERT_EQ(reply.code(), 0) << reply.message();
  ASSERT_TRUE(reply.has_layout());
  ASSERT_LE(reply.layout().bytes(), (1u << 16) - 4096);
  absl::StatusOr<VectorLayout> l = VectorLayout::Decode(absl::string_view(
      raw.base() + 4096, static_cast<size_t>(reply.layout().bytes())));
  ASSERT_TRUE(l.ok()) << l.status();
  // Example 25 is row 5 of shard 1 (20 per shard); layer 6 is index 1 of
  // 2; T = 17, D = 32: (5 * 2 * 17 + 1 * 17 + 3) * 128 bytes.
  VectorLayout::Place place;
  ASSERT_TRUE(l->Find(25, 6, 3, &place));
  EXPECT_EQ(place.file, 1);
  EXPECT_EQ(place.offset, uint64_t{(5 * 2 * 17 + 1 * 17 + 3) * 128});

  const uint64_t s = reply.layout().serial();
  v1::LocalRequest open;
  open.mutable_open_files()->set_dataset(main_id_);
  open.mutable_open_files()->set_serial(s);
  open.mutable_open_files()->add_files(1);
  std::vector<UniqueFd> fds;
  v1::LocalReply opened = raw.Call(open, &fds);
  ASSERT_EQ(opened.code(), 0) << opened.message();
  EXPECT_TRUE(opened.has_open_files());
  EXPECT_EQ(opened.descriptors(), 1u);
  ASSERT_EQ(fds.size(), 1u);
  float v[32];
  ASSERT_EQ(
      ::pread(fds[0].get(), v, sizeof(v), static_cast<off_t>(place.offset)),
      static_cast<ssize_t>(sizeof(v)));
  for (int k = 0; k < 32; ++k) ASSERT_EQ(v[k], Expected(25, 1, 3, k)) << k;
  errno = 0;
  EXPECT_LT(::pwrite(fds[0].get(), v, sizeof(v), 0), 0);
  EXPECT_EQ(errno, EBADF);
  // Several files at once come in the order asked for: shard 0's holds
  // example 0 where shard 1's holds example 20.
  open.mutable_open_files()->clear_files();
  open.mutable_open_files()->add_files(1);
  open.mutable_open_files()->add_files(0);
  opened = raw.Call(open, &fds);
  ASSERT_EQ(opened.code(), 0) << opened.message();
  ASSERT_EQ(fds.size(), 2u);
  ASSERT_TRUE(l->Find(20, -2, 0, &place));
  ASSERT_EQ(place.file, 1);
  ASSERT_EQ(
      ::pread(fds[0].get(), v, sizeof(v), static_cast<off_t>(place.offset)),
      static_cast<ssize_t>(sizeof(v)));
  EXPECT_EQ(v[0], Expected(20, 0, 0, 0));
  ASSERT_TRUE(l->Find(0, -2, 0, &place));
  ASSERT_EQ(place.file, 0);
  ASSERT_EQ(
      ::pread(fds[1].get(), v, sizeof(v), static_cast<off_t>(place.offset)),
      static_cast<ssize_t>(sizeof(v)));
  EXPECT_EQ(v[0], Expected(0, 0, 0, 0));

  struct Bad {
    std::vector<int64_t> files;
    uint64_t serial;
    std::string dataset;
    absl::StatusCode code;
  };
  for (const Bad& b : {
           Bad{{0}, s + 1000, main_id_, absl::StatusCode::kAborted},
           Bad{{2}, s, main_id_, absl::StatusCode::kOutOfRange},
           Bad{{-1}, s, main_id_, absl::StatusCode::kOutOfRange},
           Bad{{}, s, main_id_, absl::StatusCode::kInvalidArgument},
           Bad{std::vector<int64_t>(17, 0), s, main_id_,
               absl::StatusCode::kInvalidArgument},
           Bad{{0}, s, "no-such-dataset", absl::StatusCode::kNotFound},
       }) {
    v1::LocalRequest r;
    r.mutable_open_files()->set_dataset(b.dataset);
    r.mutable_open_files()->set_serial(b.serial);
    for (int64_t f : b.files) r.mutable_open_files()->add_files(f);
    std::vector<UniqueFd> none;
    v1::LocalReply got = raw.Call(r, &none);
    EXPECT_EQ(static_cast<absl::StatusCode>(got.code()), b.code)
        << b.files.size() << " files, serial " << b.serial << ": "
        << got.message();
    EXPECT_TRUE(none.empty());
  }
  // A layout that does not fit where it is asked for.
  layout.mutable_layout()->set_out_offset((1 << 16) - 64);
  reply = raw.Call(layout);
  EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
            absl::StatusCode::kResourceExhausted);
  EXPECT_GT(reply.need_region_bytes(), uint64_t{1} << 16);
  // A rescan that finds the files unchanged keeps them open: the serial
  // still serves. One that finds a shard changed opens the dataset again:
  // the old serial is refused.
  open.mutable_open_files()->clear_files();
  open.mutable_open_files()->add_files(0);
  const auto scans = [this] {  // the catalog logs a line per scan
    const std::string log = daemon_->log();
    size_t n = 0;
    for (size_t at = log.find("catalog: "); at != std::string::npos;
         at = log.find("catalog: ", at + 1)) {
      ++n;
    }
    return n;
  };
  const size_t before = scans();
  ASSERT_EQ(::kill(daemon_->pid(), SIGHUP), 0);
  for (int i = 0; i < 500 && scans() == before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GT(scans(), before) << daemon_->log();
  std::vector<UniqueFd> kept;
  EXPECT_EQ(raw.Call(open, &kept).code(), 0) << daemon_->log();
  EXPECT_EQ(kept.size(), 1u);
  const std::string shard =
      JoinPath(JoinPath(root_, main_id_), "acts000000.bin");
  struct timespec times[2] = {{0, UTIME_OMIT}, {1234567890, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, shard.c_str(), times, 0), 0);
  ASSERT_EQ(::kill(daemon_->pid(), SIGHUP), 0);
  bool aborted = false;
  for (int i = 0; i < 200 && !aborted; ++i) {
    aborted = static_cast<absl::StatusCode>(raw.Call(open).code()) ==
              absl::StatusCode::kAborted;
    if (!aborted) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(aborted) << daemon_->log();
  // And the connection still serves vectors.
  reply = raw.Ask(main_id_, {{7, -2, 0}}, 0, 4096, 1);
  ASSERT_EQ(reply.code(), 0) << reply.message();
  EXPECT_EQ(reinterpret_cast<const float*>(raw.base() + 4096)[9],
            Expected(7, 0, 0, 9));
  // A restarted daemon opens the same datasets in the same order; their
  // serials still differ, so a client's old descriptors are not taken for
  // the new daemon's files.
  layout.mutable_layout()->set_out_offset(4096);
  reply = raw.Call(layout);
  ASSERT_EQ(reply.code(), 0) << reply.message();
  const uint64_t before_restart = reply.layout().serial();
  // Stopped cleanly, so that its sockets are gone before the next starts.
  ASSERT_EQ(::kill(daemon_->pid(), SIGTERM), 0);
  ASSERT_NE(daemon_->WaitExit(std::chrono::seconds(10)), -1);
  daemon_ = StartDaemon();
  for (int i = 0; i < 200 && !IsSocket(socket_ + local::kSocketSuffix); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  RawLocalConnection again(socket_ + local::kSocketSuffix);
  ASSERT_TRUE(again.connected());
  ASSERT_EQ(again.QueryRegion(1 << 16).code(), 0);
  reply = again.Call(layout);
  ASSERT_EQ(reply.code(), 0) << reply.message();
  EXPECT_NE(reply.layout().serial(), before_restart);
}

TEST_F(DaemonTest, SighupRescansTheRoots) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  const std::string added =
      WriteDataset(root_, {1}, 4, false, 8, 3, 100, false, 99);
  EXPECT_EQ(client->DescribeDataset(added).status().code(),
            absl::StatusCode::kNotFound);
  ASSERT_EQ(::kill(daemon_->pid(), SIGHUP), 0);
  bool seen = false;
  for (int i = 0; i < 200 && !seen; ++i) {
    seen = client->DescribeDataset(added).ok();
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(seen) << daemon_->log();
}

TEST_F(DaemonTest, SigtermExitsZeroAndRemovesTheSocket) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->GetVectors(main_id_, {{0, 6, 0}}).ok());
  ASSERT_EQ(::kill(daemon_->pid(), SIGTERM), 0);
  const int status = daemon_->WaitExit(std::chrono::seconds(10));
  ASSERT_NE(status, -1) << "daemon did not exit after SIGTERM";
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  struct stat st;
  EXPECT_NE(::stat(socket_.c_str(), &st), 0) << "socket file left behind";
}

TEST_F(DaemonTest, SecondDaemonOnTheSameSocketRefuses) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  DaemonProcess second({"--root", root_, "--listen", "unix:" + socket_},
                       JoinPath(dir_, "second.log"));
  const int status = second.WaitExit(std::chrono::seconds(10));
  ASSERT_NE(status, -1);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_NE(ReadAll(JoinPath(dir_, "second.log")).find("another shardcastd"),
            std::string::npos);
  EXPECT_TRUE(client->GetVectors(main_id_, {{0, 6, 0}}).ok());
}

TEST_F(DaemonTest, SocketIsGroupOnly) {
  daemon_ = StartDaemon();
  ASSERT_NE(Connect(), nullptr);
  struct stat st;
  ASSERT_EQ(::stat(socket_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
}

// A client that finds the Unix socket finds the local channel's socket
// beside it: bound after, a client connecting in between would stream and
// query over gRPC for as long as it runs. The directory's inotify events
// give the order in which the daemon created them.
TEST_F(DaemonTest, SideSocketsAreBoundBeforeTheUnixSocket) {
  const std::string run = DirName(socket_);
  ASSERT_EQ(::mkdir(run.c_str(), 0700), 0);
  UniqueFd watch(::inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  ASSERT_TRUE(watch.valid());
  ASSERT_GE(::inotify_add_watch(watch.get(), run.c_str(), IN_CREATE), 0);
  daemon_ = StartDaemon();
  ASSERT_NE(Connect(), nullptr);
  std::vector<std::string> created;
  alignas(struct inotify_event) char buf[16384];
  for (;;) {
    const ssize_t n = ::read(watch.get(), buf, sizeof(buf));
    if (n <= 0) break;
    for (ssize_t at = 0; at < n;) {
      const auto* e = reinterpret_cast<const struct inotify_event*>(buf + at);
      if (e->len > 0) created.emplace_back(e->name);
      at += static_cast<ssize_t>(sizeof(struct inotify_event) + e->len);
    }
  }
  const std::string base = BaseName(socket_);
  const auto at = [&created](const std::string& name) {
    return std::find(created.begin(), created.end(), name) - created.begin();
  };
  const auto main_at = at(base);
  ASSERT_LT(main_at, static_cast<ptrdiff_t>(created.size()))
      << "no creation of " << base << " seen";
  const std::string side = base + local::kSocketSuffix;
  EXPECT_EQ(side, base + ".local");
  const auto side_at = at(side);
  EXPECT_LT(side_at, static_cast<ptrdiff_t>(created.size()))
      << "no creation of " << side
      << " seen; in order: " << absl::StrJoin(created, ", ");
  EXPECT_LT(side_at, main_at)
      << side << " created after the Unix socket; in order: "
      << absl::StrJoin(created, ", ");
}

TEST_F(DaemonTest, TcpWithoutTlsNeedsExplicitInsecure) {
  DaemonProcess refused({"--root", root_, "--listen-tcp", "0.0.0.0:0"},
                        JoinPath(dir_, "tcp.log"));
  const int status = refused.WaitExit(std::chrono::seconds(10));
  ASSERT_NE(status, -1);
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_NE(ReadAll(JoinPath(dir_, "tcp.log")).find("--tls-cert"),
            std::string::npos);
  // Loopback without TLS needs --insecure-tcp too (any local user could
  // connect, past the socket group); then it serves.
  DaemonProcess plain({"--root", root_, "--listen-tcp", "127.0.0.1:0"},
                      JoinPath(dir_, "plain.log"));
  const int plain_status = plain.WaitExit(std::chrono::seconds(10));
  ASSERT_NE(plain_status, -1);
  EXPECT_EQ(WEXITSTATUS(plain_status), 1);
  EXPECT_NE(ReadAll(JoinPath(dir_, "plain.log")).find("--insecure-tcp"),
            std::string::npos);
  DaemonProcess loopback(
      {"--root", root_, "--listen-tcp", "127.0.0.1:0", "--insecure-tcp"},
      JoinPath(dir_, "loopback.log"));
  std::string log;
  for (int i = 0; i < 300; ++i) {
    log = ReadAll(JoinPath(dir_, "loopback.log"));
    if (log.find("listening on 127.0.0.1:") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_NE(log.find("listening on 127.0.0.1:"), std::string::npos) << log;
  EXPECT_EQ(loopback.WaitExit(std::chrono::milliseconds(50)), -1)
      << "exited early";
  ::kill(loopback.pid(), SIGTERM);
  EXPECT_NE(loopback.WaitExit(std::chrono::seconds(10)), -1);
}

// Makes a CA, a server certificate for localhost/127.0.0.1 and a client
// certificate in `dir` with the openssl CLI.
bool MakeCertificates(const std::string& dir) {
  const std::string script = absl::StrCat(
      "set -e; cd ", dir, "; ",
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
      "-days 1 "
      "-subj /CN=shardcast-test-ca 2>/dev/null; ",
      "for who in server client; do ",
      "openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr "
      "-subj /CN=localhost 2>/dev/null; ",
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > $who.ext; ",
      "openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
      "-out $who.pem -days 1 -extfile $who.ext 2>/dev/null; done");
  const std::string path = JoinPath(dir, "make_certs.sh");
  std::ofstream(path) << script << "\n";
  return std::system(absl::StrCat("bash ", path).c_str()) == 0;
}

// Starts a TCP daemon and returns its port parsed from the log (0 if none).
int WaitForTcpPort(const std::string& log_path) {
  for (int i = 0; i < 500; ++i) {
    const std::string log = ReadAll(log_path);
    const size_t at = log.find("listening on 127.0.0.1:");
    if (at != std::string::npos) {
      return std::atoi(log.c_str() + at +
                       std::strlen("listening on 127.0.0.1:"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return 0;
}

TEST_F(DaemonTest, TlsListenerServesClientsThatTrustItsCa) {
  ASSERT_TRUE(MakeCertificates(dir_));
  DaemonProcess tls(
      {"--root", root_, "--listen-tcp", "127.0.0.1:0", "--tls-cert",
       JoinPath(dir_, "server.pem"), "--tls-key", JoinPath(dir_, "server.key")},
      JoinPath(dir_, "tls.log"));
  const int port = WaitForTcpPort(JoinPath(dir_, "tls.log"));
  ASSERT_GT(port, 0) << ReadAll(JoinPath(dir_, "tls.log"));
  ClientOptions options;
  options.tls_ca_file = JoinPath(dir_, "ca.pem");
  options.tls_server_name = "localhost";
  auto client = Client::Connect(absl::StrCat("127.0.0.1:", port), options);
  ASSERT_TRUE(client.ok()) << client.status();
  auto r = (*client)->GetVectors(main_id_, {{2, 6, 4}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->values[0], Expected(2, 1, 4, 0));
  // A plaintext client cannot talk to the TLS port.
  ClientOptions plain;
  plain.connect_timeout_seconds = 1;
  EXPECT_FALSE(Client::Connect(absl::StrCat("127.0.0.1:", port), plain).ok());
  ::kill(tls.pid(), SIGTERM);
  EXPECT_NE(tls.WaitExit(std::chrono::seconds(10)), -1);
}

TEST_F(DaemonTest, MutualTlsRejectsClientsWithoutACertificate) {
  ASSERT_TRUE(MakeCertificates(dir_));
  DaemonProcess mtls(
      {"--root", root_, "--listen-tcp", "127.0.0.1:0", "--tls-cert",
       JoinPath(dir_, "server.pem"), "--tls-key", JoinPath(dir_, "server.key"),
       "--tls-client-ca", JoinPath(dir_, "ca.pem")},
      JoinPath(dir_, "mtls.log"));
  const int port = WaitForTcpPort(JoinPath(dir_, "mtls.log"));
  ASSERT_GT(port, 0) << ReadAll(JoinPath(dir_, "mtls.log"));
  const std::string address = absl::StrCat("127.0.0.1:", port);
  ClientOptions with_cert;
  with_cert.tls_ca_file = JoinPath(dir_, "ca.pem");
  with_cert.tls_cert_file = JoinPath(dir_, "client.pem");
  with_cert.tls_key_file = JoinPath(dir_, "client.key");
  with_cert.tls_server_name = "localhost";
  auto good = Client::Connect(address, with_cert);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE((*good)->ListDatasets().ok());
  ClientOptions no_cert = with_cert;
  no_cert.tls_cert_file.clear();
  no_cert.tls_key_file.clear();
  no_cert.connect_timeout_seconds = 2;
  auto bad = Client::Connect(address, no_cert);
  if (bad.ok()) {
    EXPECT_FALSE((*bad)->ListDatasets().ok())
        << "served a client without a certificate";
  }
  ::kill(mtls.pid(), SIGTERM);
  EXPECT_NE(mtls.WaitExit(std::chrono::seconds(10)), -1);
}

// A client certificate whose common name is `name`, signed by the CA
// MakeCertificates made in `dir`: <dir>/<name>.pem and .key.
bool MakeClientCertificate(const std::string& dir, const std::string& name) {
  const std::string script = absl::StrCat(
      "set -e; cd ", dir, "; openssl req -newkey rsa:2048 -nodes -keyout ",
      name, ".key -out ", name, ".csr -subj /CN=", name, " 2>/dev/null; ",
      "openssl x509 -req -in ", name, ".csr -CA ca.pem -CAkey ca.key ",
      "-CAcreateserial -out ", name, ".pem -days 1 2>/dev/null");
  return std::system(absl::StrCat("bash -c '", script, "'").c_str()) == 0;
}

TEST_F(DaemonTest, RemoteClientsReadOnlyTheRootsOpenToThemAndTheirNames) {
  // Two roots: the main one open to certificates named "trainer-a", the
  // other closed to remote clients. Local clients read both.
  ASSERT_TRUE(MakeCertificates(dir_));
  for (const char* name : {"trainer-a", "trainer-b"}) {
    ASSERT_TRUE(MakeClientCertificate(dir_, name)) << name;
  }
  const std::string other = JoinPath(dir_, "other");
  ASSERT_EQ(::mkdir(other.c_str(), 0755), 0);
  const std::string other_id =
      WriteDataset(other, {1}, 4, false, 8, 6, 100, false, kSeed + 2);
  daemon_ = StartDaemon({"--root", other, "--listen-tcp", "127.0.0.1:0",
                         "--tls-cert", JoinPath(dir_, "server.pem"),
                         "--tls-key", JoinPath(dir_, "server.key"),
                         "--tls-client-ca", JoinPath(dir_, "ca.pem"),
                         "--remote-root", root_ + "=trainer-a"});
  const int port = WaitForTcpPort(JoinPath(dir_, "daemon.log"));
  ASSERT_GT(port, 0) << ReadAll(JoinPath(dir_, "daemon.log"));
  auto remote = [&](const std::string& name) {
    ClientOptions o;
    o.tls_ca_file = JoinPath(dir_, "ca.pem");
    o.tls_cert_file = JoinPath(dir_, name + ".pem");
    o.tls_key_file = JoinPath(dir_, name + ".key");
    o.tls_server_name = "localhost";
    auto c = Client::Connect(absl::StrCat("127.0.0.1:", port), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  };
  std::unique_ptr<Client> a = remote("trainer-a");
  std::unique_ptr<Client> b = remote("trainer-b");
  auto r = a->GetVectors(main_id_, {{2, 6, 4}});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->values[0], Expected(2, 1, 4, 0));
  absl::Status refused = b->GetVectors(main_id_, {{2, 6, 4}}).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_NE(refused.message().find("names one of: trainer-a"),
            absl::string_view::npos)
      << refused;
  EXPECT_NE(refused.message().find("this one names trainer-b"),
            absl::string_view::npos)
      << refused;
  refused = a->GetVectors(other_id, {{0, 1, 0}}).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_NE(refused.message().find("not open to remote clients"),
            absl::string_view::npos)
      << refused;
  StreamRequest req;
  req.dataset = other_id;
  req.batch_size = 4;
  auto stream = a->OpenStream(req);
  Batch batch;
  EXPECT_FALSE(stream->Next(&batch));
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(a->DescribeDataset(other_id).status().code(),
            absl::StatusCode::kPermissionDenied);
  // On the node, both roots.
  std::unique_ptr<Client> local = Connect();
  EXPECT_TRUE(local->GetVectors(other_id, {{0, 1, 0}}).ok());
  EXPECT_TRUE(local->GetVectors(main_id_, {{2, 6, 4}}).ok());
}

// Reads a whole stream of the main dataset; returns (example, content token,
// layer) per row and checks every vector and label against the generator.
// Every batch's views must hold one entry per row (the layer column only when
// all layers are selected).
std::vector<std::tuple<int64_t, int32_t, int64_t>> ReadStream(
    Client* client, const StreamRequest& req, absl::Status* final_status) {
  std::vector<std::tuple<int64_t, int32_t, int64_t>> rows;
  auto stream = client->OpenStream(req);
  Batch b;
  while (stream->Next(&b)) {
    const size_t n = static_cast<size_t>(b.rows());
    const bool sizes_ok = b.d_model() == 32 && b.vectors().size() == n * 32 &&
                          b.example_idx().size() == n &&
                          b.token_idx().size() == n &&
                          b.layer().size() == (req.layer.has_value() ? 0 : n) &&
                          b.labels().size() == n;
    EXPECT_TRUE(sizes_ok) << "batch " << b.epoch() << "/" << b.index() << ": "
                          << n << " rows, d_model " << b.d_model() << ", "
                          << b.vectors().size() << " floats, "
                          << b.example_idx().size() << " example_idx, "
                          << b.token_idx().size() << " token_idx, "
                          << b.layer().size() << " layer, " << b.labels().size()
                          << " labels";
    if (!sizes_ok) break;
    for (int64_t i = 0; i < b.rows(); ++i) {
      const size_t r = static_cast<size_t>(i);
      const int64_t e = b.example_idx()[r];
      const int32_t t = b.token_idx()[r];
      const int64_t layer =
          !b.layer().empty() ? b.layer()[r] : req.layer.value_or(0);
      const int64_t li = layer == -2 ? 0 : 1;
      const float v = b.vectors()[r * 32 + 5];
      EXPECT_EQ(v, SynthValue(kSeed, static_cast<uint64_t>(
                                         ((e * 2 + li) * 17 + t + 1) * 32 + 5)))
          << "example " << e << " token " << t;
      EXPECT_EQ(
          b.labels()[r],
          t < 0 ? 255 : SynthLabel(kSeed, static_cast<uint64_t>(e * 16 + t)))
          << "example " << e << " token " << t;
      rows.emplace_back(e, t, layer);
    }
  }
  *final_status = stream->Finish();
  return rows;
}

TEST_F(DaemonTest, OrderedStreamDeliversEveryVectorOnceInDiskOrder) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  StreamRequest req;
  req.dataset = main_id_;
  req.order = StreamRequest::Order::kOrdered;
  req.tokens = StreamRequest::Tokens::kAll;
  req.batch_size = 100;
  req.epochs = 1;
  absl::Status st;
  auto rows = ReadStream(client.get(), req, &st);
  ASSERT_TRUE(st.ok()) << st;
  std::vector<std::tuple<int64_t, int32_t, int64_t>> want;
  for (int64_t e = 0; e < 40; ++e) {
    for (int64_t layer : {int64_t{-2}, int64_t{6}}) {
      for (int32_t t = -1; t < 16; ++t) want.emplace_back(e, t, layer);
    }
  }
  EXPECT_EQ(rows, want);
}

TEST_F(DaemonTest, FourRanksStreamingTogetherCoverTheSelectionOnce) {
  daemon_ = StartDaemon();
  std::vector<std::vector<std::tuple<int64_t, int32_t, int64_t>>> parts(4);
  std::vector<absl::Status> status(4);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 4; ++rank) {
    threads.emplace_back([&, rank] {
      auto client = Client::Connect("unix:" + socket_);
      ASSERT_TRUE(client.ok());
      StreamRequest req;
      req.dataset = main_id_;
      req.order = StreamRequest::Order::kOrdered;
      req.layer = 6;
      req.batch_size = 33;
      req.epochs = 1;
      req.rank = rank;
      req.world_size = 4;
      parts[static_cast<size_t>(rank)] =
          ReadStream(client->get(), req, &status[static_cast<size_t>(rank)]);
    });
  }
  for (auto& t : threads) t.join();
  std::vector<std::tuple<int64_t, int32_t, int64_t>> all;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(status[static_cast<size_t>(rank)].ok())
        << status[static_cast<size_t>(rank)];
    all.insert(all.end(), parts[static_cast<size_t>(rank)].begin(),
               parts[static_cast<size_t>(rank)].end());
  }
  ASSERT_EQ(all.size(), 40u * 16);
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end())
      << "a vector went to two ranks";
}

TEST_F(DaemonTest, ClientLeavingMidStreamFreesItsCallAndOthersContinue) {
  daemon_ = StartDaemon();
  auto quitter = Connect();
  auto stayer = Connect();
  ASSERT_NE(quitter, nullptr);
  StreamRequest req;
  req.dataset = main_id_;
  req.order = StreamRequest::Order::kOrdered;
  req.batch_size = 10;
  req.epochs = 0;  // endless: only cancelling ends it
  auto endless = quitter->OpenStream(req);
  Batch b;
  ASSERT_TRUE(endless->Next(&b));
  ASSERT_TRUE(endless->Next(&b));
  endless->Cancel();
  while (endless->Next(&b)) {
  }
  EXPECT_EQ(endless->Finish().code(), absl::StatusCode::kCancelled);
  // The daemon lets go of the stream: no call stays in flight.
  int64_t in_flight = -1;
  for (int i = 0; i < 1000; ++i) {
    auto status = stayer->GetStatus();
    ASSERT_TRUE(status.ok());
    in_flight = status->connected_clients;
    if (in_flight == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(in_flight, 0);
  req.epochs = 1;
  absl::Status st;
  EXPECT_EQ(ReadStream(stayer.get(), req, &st).size(), 2u * 40 * 16);
  EXPECT_TRUE(st.ok()) << st;
}

TEST_F(DaemonTest, StreamRequestErrorsHaveTheirCodes) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  StreamRequest req;
  req.dataset = main_id_;
  req.batch_size = 10;
  absl::Status st;
  req.order = StreamRequest::Order::kShuffled;
  req.resume_token = "not a token";
  ReadStream(client.get(), req, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  req.resume_token.clear();
  req.order = StreamRequest::Order::kOrdered;
  req.batch_size = 0;
  ReadStream(client.get(), req, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  req.batch_size = 10;
  req.dataset = "nosuchdataset";
  ReadStream(client.get(), req, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
}

TEST_F(DaemonTest, ConfigFileGivesTheSameSettingsAsFlags) {
  const std::string config = JoinPath(dir_, "shardcastd.json");
  std::ofstream(config) << "{\"roots\": [\"" << root_
                        << "\"], \"listen\": \"unix:" << socket_
                        << "\", \"max_vectors_per_call\": 3, "
                        << "\"query_threads\": 3, "
                        << "\"log_level\": \"warning\"}";
  daemon_ = std::make_unique<DaemonProcess>(
      std::vector<std::string>{"--config", config},
      JoinPath(dir_, "daemon.log"));
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(
      client->GetVectors(main_id_, {{0, 6, 0}, {1, 6, 0}, {2, 6, 0}}).ok());
  EXPECT_EQ(
      client->GetVectors(main_id_, std::vector<VectorCoord>(4)).status().code(),
      absl::StatusCode::kResourceExhausted);
  auto status = client->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->query_threads, 3);
}

// Without --query-threads the daemon runs half the cores it may use, 4 to
// 16 (`shardcastd --help`), and says how many in its status.
TEST_F(DaemonTest, StatusSaysHowManyQueryThreadsRun) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  cpu_set_t set;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = CPU_COUNT(&set);
  auto status = client->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->query_threads, std::clamp(cores / 2, 4, 16));
}

TEST_F(DaemonTest, BadConfigFileIsAUsageErrorNamingTheKey) {
  const std::string config = JoinPath(dir_, "bad.json");
  std::ofstream(config) << "{\"roots\": [\"" << root_
                        << "\"], \"listen_tpc\": \"x\"}";
  DaemonProcess bad({"--config", config}, JoinPath(dir_, "bad.log"));
  const int status = bad.WaitExit(std::chrono::seconds(10));
  ASSERT_NE(status, -1);
  EXPECT_EQ(WEXITSTATUS(status), 2);
  EXPECT_NE(ReadAll(JoinPath(dir_, "bad.log")).find("listen_tpc"),
            std::string::npos);
  std::ofstream(config, std::ios::trunc) << "{\"roots\": \"" << root_ << "\"}";
  DaemonProcess wrong_type({"--config", config}, JoinPath(dir_, "bad2.log"));
  ASSERT_NE(wrong_type.WaitExit(std::chrono::seconds(10)), -1);
  EXPECT_NE(ReadAll(JoinPath(dir_, "bad2.log")).find("\"roots\""),
            std::string::npos);
}

TEST_F(DaemonTest, ShuffledStreamIsAPermutationAndResumesWhereItStopped) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  StreamRequest req;
  req.dataset = main_id_;
  req.order = StreamRequest::Order::kShuffled;
  req.seed = 1234;
  req.batch_size = 50;
  req.epochs = 1;
  absl::Status st;
  auto whole = ReadStream(client.get(), req, &st);  // checks every vector
  ASSERT_TRUE(st.ok()) << st;
  auto sorted = whole;
  std::sort(sorted.begin(), sorted.end());
  ASSERT_EQ(sorted.size(), 2u * 40 * 16);
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
  EXPECT_NE(sorted, whole) << "not shuffled";
  // Alone on its scan, the same seed gives the same order.
  EXPECT_EQ(ReadStream(client.get(), req, &st), whole);
  // Interrupt after 5 batches, resume with the last token: the rest of the
  // epoch, nothing repeated, nothing skipped.
  auto stream = client->OpenStream(req);
  Batch b;
  std::string token;
  std::vector<std::tuple<int64_t, int32_t, int64_t>> rows;
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(stream->Next(&b));
    token = b.resume_token();
    for (size_t r = 0; r < static_cast<size_t>(b.rows()); ++r) {
      rows.emplace_back(b.example_idx()[r], b.token_idx()[r], b.layer()[r]);
    }
  }
  stream->Cancel();
  while (stream->Next(&b)) {
  }
  stream->Finish().IgnoreError();
  req.resume_token = token;
  auto rest = ReadStream(client.get(), req, &st);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(rest.size(), whole.size() - 250);
  rows.insert(rows.end(), rest.begin(), rest.end());
  std::sort(rows.begin(), rows.end());
  EXPECT_EQ(rows, sorted);
}

TEST_F(DaemonTest, ShuffledStreamCancelledWhileWaitingForBlocksEndsAtOnce) {
  // A long gather delay: the stream waits for its scan's first read, holding
  // no worker, and a cancel must still end it and free its reservation.
  daemon_ = StartDaemon({"--scan-start-delay-ms", "30000"});
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  StreamRequest req;
  req.dataset = main_id_;
  req.order = StreamRequest::Order::kShuffled;
  req.batch_size = 10;
  req.epochs = 0;
  const auto start = std::chrono::steady_clock::now();
  auto stream = client->OpenStream(req);
  absl::StatusOr<DaemonStatus> status;
  for (int i = 0; i < 1000; ++i) {  // until the stream has joined its scan
    status = client->GetStatus();
    ASSERT_TRUE(status.ok());
    if (status->scans.size() == 1u) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(status->scans.size(), 1u);
  EXPECT_GT(status->reservoir_bytes_reserved, 0u);
  stream->Cancel();
  Batch b;
  EXPECT_FALSE(stream->Next(&b)) << "a batch before the gather delay ended";
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20))
      << "the cancel waited for the 30 s gather delay";
  for (int i = 0; i < 1000; ++i) {
    status = client->GetStatus();
    ASSERT_TRUE(status.ok());
    // The client's shared-memory region (its lease) goes when the daemon
    // sees its side channel close, a moment after the call ends.
    if (status->scans.empty() && status->connected_clients == 0 &&
        status->reservoir_bytes_reserved == 0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(status->scans.size(), 0u);
  EXPECT_EQ(status->connected_clients, 0);
  EXPECT_EQ(status->reservoir_bytes_reserved, 0u);
}

}  // namespace
}  // namespace shardcast

namespace shardcast {
namespace {

// Every batch of a stream with all of its vectors (for comparisons).
struct Received {
  std::vector<std::vector<int64_t>> example_idx;
  std::vector<std::vector<int32_t>> token_idx;
  std::vector<std::vector<float>> vectors;
  bool shared_memory = false;
  absl::Status status;
};

Received ReadAllBatches(Client* client, const StreamRequest& req) {
  Received r;
  auto stream = client->OpenStream(req);
  r.shared_memory = stream->shared_memory();
  Batch b;
  while (stream->Next(&b)) {
    r.example_idx.emplace_back(b.example_idx().begin(), b.example_idx().end());
    r.token_idx.emplace_back(b.token_idx().begin(), b.token_idx().end());
    r.vectors.emplace_back(b.vectors().begin(), b.vectors().end());
  }
  r.status = stream->Finish();
  return r;
}

TEST_F(DaemonTest, SharedMemoryAndMessagesDeliverTheSameBatches) {
  daemon_ = StartDaemon();
  auto shm_client = Connect();
  ASSERT_NE(shm_client, nullptr);
  ClientOptions no_shm;
  no_shm.shared_memory = false;
  auto msg_client = Client::Connect("unix:" + socket_, no_shm);
  ASSERT_TRUE(msg_client.ok()) << msg_client.status();
  StreamRequest req;
  req.dataset = main_id_;
  req.layer = 6;
  req.tokens = StreamRequest::Tokens::kAll;
  req.batch_size = 96;
  req.seed = 4;
  req.epochs = 2;
  // A client alone on its scan gets an order that is a function of (seed,
  // epoch): both paths must give the very same batches.
  const Received shm = ReadAllBatches(shm_client.get(), req);
  const Received msg = ReadAllBatches(msg_client->get(), req);
  ASSERT_TRUE(shm.status.ok()) << shm.status;
  ASSERT_TRUE(msg.status.ok()) << msg.status;
  EXPECT_TRUE(shm.shared_memory);
  EXPECT_FALSE(msg.shared_memory);
  EXPECT_EQ(shm.example_idx, msg.example_idx);
  EXPECT_EQ(shm.token_idx, msg.token_idx);
  ASSERT_EQ(shm.vectors.size(), msg.vectors.size());
  // Every value of every vector against the generator (layer 6: index 1).
  size_t rows = 0;
  for (size_t i = 0; i < shm.vectors.size(); ++i) {
    ASSERT_EQ(shm.vectors[i], msg.vectors[i]) << "batch " << i;
    for (size_t r = 0; r < shm.example_idx[i].size(); ++r, ++rows) {
      const int64_t e = shm.example_idx[i][r];
      const int64_t t = shm.token_idx[i][r] + 1;  // token axis (CLS = 0)
      for (int64_t k = 0; k < 32; ++k) {
        ASSERT_EQ(shm.vectors[i][r * 32 + static_cast<size_t>(k)],
                  Expected(e, 1, t, k))
            << "example " << e << " token " << t << " dim " << k;
      }
    }
  }
  EXPECT_EQ(rows, 2u * 40 * 17) << "two epochs of 40 examples x 17 tokens";
}

TEST_F(DaemonTest, LocalChannelIsGroupOnlyAndRegionsShowInStatus) {
  daemon_ = StartDaemon();
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  struct stat st;
  const std::string local_socket = socket_ + ".local";
  ASSERT_EQ(::stat(local_socket.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  StreamRequest req;
  req.dataset = main_id_;
  req.batch_size = 64;
  req.epochs = 0;
  auto stream = client->OpenStream(req);
  Batch b;
  ASSERT_TRUE(stream->Next(&b));
  ASSERT_TRUE(stream->shared_memory());
  auto status = client->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->shm_regions, 1);
  EXPECT_EQ(status->shm_streams, 1);
  // 4 slots of 64 x 32 floats, each rounded up to whole pages.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t slot = (64 * 32 * 4 + page - 1) / page * page;
  EXPECT_EQ(status->shm_bytes, 4 * slot);
  stream->Cancel();
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kCancelled);
  // Up to 10 s: under ThreadSanitizer with a parallel ctest the stream's
  // end reached the daemon after more than 2 s once.
  for (int i = 0; i < 1000; ++i) {
    status = client->GetStatus();
    ASSERT_TRUE(status.ok());
    // The region goes first, then its lease of reservoir memory.
    if (status->shm_regions == 0 && status->reservoir_bytes_reserved == 0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(status->shm_regions, 0) << "the region outlived its stream";
  EXPECT_EQ(status->reservoir_bytes_reserved, 0u);
  ::kill(daemon_->pid(), SIGTERM);
  ASSERT_NE(daemon_->WaitExit(std::chrono::seconds(20)), -1);
  EXPECT_NE(::stat(local_socket.c_str(), &st), 0) << "socket left behind";
}

TEST_F(DaemonTest, ARegionTheReservoirCannotSpareIsRefusedNamingTheFlag) {
  // Two blocks of 4 MiB; a region of 4 slots of 4 MiB needs four (the
  // per-user cap is lifted, so that the reservoir is what refuses).
  daemon_ = StartDaemon({"--reservoir-bytes", "8M", "--block-bytes", "4M",
                         "--max-region-bytes-per-user", "1G"});
  {
    RawLocalConnection raw(socket_ + local::kSocketSuffix);
    ASSERT_TRUE(raw.connected());
    v1::LocalRequest request;
    request.mutable_batch_region()->set_slots(4);
    request.mutable_batch_region()->set_slot_bytes(4 << 20);
    std::vector<UniqueFd> fds;
    v1::LocalReply reply = raw.Call(request, &fds);
    EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
              absl::StatusCode::kResourceExhausted)
        << reply.message();
    EXPECT_NE(reply.message().find("--reservoir-bytes"), std::string::npos)
        << reply.message();
    EXPECT_TRUE(fds.empty());
  }
  // A stream whose region is refused gets its batches in messages.
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  StreamRequest req;
  req.dataset = main_id_;
  req.order = StreamRequest::Order::kOrdered;
  req.batch_size = (4 << 20) / (32 * 4);
  req.epochs = 1;
  absl::Status done;
  EXPECT_EQ(ReadStream(client.get(), req, &done).size(), 40u * 2 * 16);
  EXPECT_TRUE(done.ok()) << done;
  auto status = client->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->shm_regions, 0);
}

TEST_F(DaemonTest, WithSharedMemoryDisabledStreamsUseMessages) {
  daemon_ = StartDaemon({"--disable-shared-memory"});
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  {
    // The local channel is there for queries, and it makes no batch
    // regions.
    RawLocalConnection raw(socket_ + local::kSocketSuffix);
    ASSERT_TRUE(raw.connected());
    v1::LocalRequest request;
    request.mutable_batch_region()->set_slots(4);
    request.mutable_batch_region()->set_slot_bytes(4096);
    std::vector<UniqueFd> fds;
    v1::LocalReply reply = raw.Call(request, &fds);
    EXPECT_EQ(static_cast<absl::StatusCode>(reply.code()),
              absl::StatusCode::kUnimplemented)
        << reply.message();
    EXPECT_NE(reply.message().find("--disable-shared-memory"),
              std::string::npos)
        << reply.message();
    EXPECT_TRUE(fds.empty());
    EXPECT_EQ(raw.QueryRegion(1 << 16).code(), 0);
  }
  StreamRequest req;
  req.dataset = main_id_;
  req.batch_size = 100;
  auto stream = client->OpenStream(req);
  Batch b;
  EXPECT_TRUE(stream->Next(&b));
  EXPECT_FALSE(stream->shared_memory());
  stream->Cancel();
  stream.reset();
  client.reset();
  // With local queries off too, there is no local channel at all. (Stopped
  // cleanly, so that its sockets are gone before the next starts.)
  ASSERT_EQ(::kill(daemon_->pid(), SIGTERM), 0);
  ASSERT_NE(daemon_->WaitExit(std::chrono::seconds(10)), -1);
  daemon_ = StartDaemon({"--disable-shared-memory", "--disable-local-queries"});
  ASSERT_NE(Connect(), nullptr);
  struct stat st;
  EXPECT_NE(::stat((socket_ + ".local").c_str(), &st), 0);
}

}  // namespace
}  // namespace shardcast
