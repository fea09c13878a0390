// The daemon's own acceptor of local connections: the send buffer each
// connection gets. Expected sizes come from the kernel's rules (socket(7):
// SO_SNDBUF is capped at net.core.wmem_max and doubled; an untouched
// socket has net.core.wmem_default), read from /proc here.
#include "server/transport/grpc/local_acceptor.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/base/file.h"
#include "common/testing/testing.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

int64_t ProcValue(const std::string& name) {
  return std::stoll(ReadFile("/proc/sys/net/core/" + name));
}

class LocalAcceptorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.RegisterCallbackGenericService(&generic_);  // gRPC needs one
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (acceptor_ != nullptr) acceptor_->Stop();
    clients_.clear();
    acceptor_.reset();
    server_->Shutdown(std::chrono::system_clock::now());
  }

  // Starts an acceptor asking for `send_buffer` bytes, connects once and
  // returns the send buffer the daemon's end got (as the kernel reports it).
  int64_t SendBufferOfAConnection(int send_buffer) {
    LocalAcceptorOptions options;
    options.path = root_.File("d.sock");
    options.send_buffer_bytes = send_buffer;
    absl::StatusOr<std::unique_ptr<LocalAcceptor>> a =
        LocalAcceptor::Create(options);
    EXPECT_TRUE(a.ok()) << a.status();
    if (!a.ok()) return -1;
    acceptor_ = std::move(*a);
    acceptor_->Serve(server_.get());
    clients_.emplace_back(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    const int fd = clients_.back().get();
    EXPECT_GE(fd, 0);
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, options.path.c_str(),
                 sizeof(addr.sun_path) - 1);
    EXPECT_EQ(
        ::connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr)),
        0)
        << std::strerror(errno);
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (acceptor_->Figures().send_buffer_bytes == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return acceptor_->Figures().send_buffer_bytes;
  }

  TempRoot root_;
  grpc::CallbackGenericService generic_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<LocalAcceptor> acceptor_;
  std::vector<UniqueFd> clients_;
};

TEST_F(LocalAcceptorTest, AConnectionGetsTheSendBufferAskedUpToTheKernelCap) {
  const int asked = 1 << 20;
  EXPECT_EQ(SendBufferOfAConnection(asked),
            2 * std::min<int64_t>(asked, ProcValue("wmem_max")));
}

TEST_F(LocalAcceptorTest, ASendBufferOverTheCapGetsTheCap) {
  const int64_t cap = ProcValue("wmem_max");
  if (cap >= (1 << 30)) GTEST_SKIP() << "net.core.wmem_max is " << cap;
  EXPECT_EQ(SendBufferOfAConnection(1 << 30), 2 * cap);
}

TEST_F(LocalAcceptorTest, ZeroKeepsTheKernelsDefault) {
  EXPECT_EQ(SendBufferOfAConnection(0), ProcValue("wmem_default"));
}

}  // namespace
}  // namespace shardcast
