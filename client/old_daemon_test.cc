// The client library against a daemon from before Query.VectorsSession and
// Query.StreamVectors: a fake Query service that answers those two with
// UNIMPLEMENTED (what gRPC says of a method a server does not have) and
// serves unary GetVectors. Every call must still get its vectors, through
// unary calls, and the client must stop asking for the missing methods
// after the first answer.
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "shardcast/client.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {
namespace {

// Each vector is its coordinate as floats: {example, layer, token}, so a
// row shows which request it answers.
constexpr int64_t kDim = 3;

class OldQueryService final : public v1::Query::Service {
 public:
  grpc::Status GetVectors(grpc::ServerContext*,
                          const v1::GetVectorsRequest* request,
                          v1::Vectors* reply) override {
    unary_calls++;
    reply->add_shape(request->coordinates_size());
    reply->add_shape(kDim);
    std::vector<float> values;
    for (const v1::Coordinate& c : request->coordinates()) {
      values.push_back(static_cast<float>(c.example()));
      values.push_back(static_cast<float>(c.layer()));
      values.push_back(static_cast<float>(c.token()));
    }
    reply->set_data(values.data(), values.size() * sizeof(float));
    return grpc::Status::OK;
  }
  grpc::Status VectorsSession(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::SessionReply, v1::SessionRequest>*)
      override {
    session_calls++;
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
  }
  grpc::Status StreamVectors(grpc::ServerContext*, const v1::GetVectorsRequest*,
                             grpc::ServerWriter<v1::VectorRows>*) override {
    stream_calls++;
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
  }

  std::atomic<int> unary_calls{0};
  std::atomic<int> session_calls{0};
  std::atomic<int> stream_calls{0};
};

class OldDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    socket_ = ::testing::TempDir() + "old_daemon_" +
              std::to_string(::getpid()) + ".sock";
    ::unlink(socket_.c_str());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_,
                             grpc::InsecureServerCredentials());
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr) << "cannot serve on " << socket_;
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    ::unlink(socket_.c_str());
  }

  std::unique_ptr<Client> Connect() {
    absl::StatusOr<std::unique_ptr<Client>> c =
        Client::Connect("unix:" + socket_);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Checks `block` against `coords`; returns false (with a failure) if any
  // row is not its coordinate.
  static bool Matches(const absl::StatusOr<VectorBlock>& block,
                      const std::vector<VectorCoord>& coords) {
    EXPECT_TRUE(block.ok()) << block.status();
    if (!block.ok()) return false;
    const std::vector<int64_t> want_shape = {
        static_cast<int64_t>(coords.size()), kDim};
    EXPECT_EQ(block->shape, want_shape);
    if (block->shape != want_shape) return false;
    for (size_t i = 0; i < coords.size(); ++i) {
      const float* row = block->values.data() + i * kDim;
      if (row[0] != static_cast<float>(coords[i].example) ||
          row[1] != static_cast<float>(coords[i].layer) ||
          row[2] != static_cast<float>(coords[i].token)) {
        ADD_FAILURE() << "row " << i << " is (" << row[0] << ", " << row[1]
                      << ", " << row[2] << "), asked for (" << coords[i].example
                      << ", " << coords[i].layer << ", " << coords[i].token
                      << ")";
        return false;
      }
    }
    return true;
  }

  std::string socket_;
  OldQueryService service_;
  std::unique_ptr<grpc::Server> server_;
};

std::vector<VectorCoord> Coords(int64_t n, int64_t seed) {
  std::vector<VectorCoord> out;
  for (int64_t i = 0; i < n; ++i) {
    out.push_back({seed * 1000 + i, (i % 2 == 0) ? 6 : -1, (seed + i) % 257});
  }
  return out;
}

TEST_F(OldDaemonTest, SmallCallsFallBackToUnaryAndStopAskingForTheSession) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  for (int64_t call = 0; call < 5; ++call) {
    const std::vector<VectorCoord> coords = Coords(1 + call, call);
    ASSERT_TRUE(Matches(client->GetVectors("any", coords), coords));
  }
  EXPECT_EQ(service_.session_calls.load(), 1);
  EXPECT_EQ(service_.unary_calls.load(), 5);
  EXPECT_EQ(service_.stream_calls.load(), 0);
}

TEST_F(OldDaemonTest, LargeCallsFallBackFromStreamVectorsToUnary) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  for (int64_t call = 0; call < 3; ++call) {
    // At and above the library's stream_vectors_from (64).
    const std::vector<VectorCoord> coords = Coords(64 + 100 * call, call);
    ASSERT_TRUE(Matches(client->GetVectors("any", coords), coords));
  }
  EXPECT_EQ(service_.stream_calls.load(), 1);
  EXPECT_EQ(service_.unary_calls.load(), 3);
}

TEST_F(OldDaemonTest, ConcurrentThreadsAllGetTheirOwnRows) {
  std::unique_ptr<Client> client = Connect();
  ASSERT_NE(client, nullptr);
  constexpr int kThreads = 8;
  constexpr int kCalls = 40;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int c = 0; c < kCalls; ++c) {
        const std::vector<VectorCoord> coords = Coords(1 + c % 3, t * 100 + c);
        if (!Matches(client->GetVectors("any", coords), coords)) wrong++;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  // The threads that asked at once all learned it from the one refused
  // session (those that came while it was being finished waited for its
  // status instead of opening another).
  EXPECT_EQ(service_.session_calls.load(), 1);
  EXPECT_GE(service_.unary_calls.load(), 1);
  EXPECT_LE(service_.unary_calls.load(), kThreads * kCalls);
}

}  // namespace
}  // namespace shardcast
