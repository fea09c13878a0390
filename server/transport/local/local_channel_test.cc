// The local channel: a batch region's reply does not wait for its pages to
// be populated (trainers launched together reach their stream calls
// together), and the pages are populated afterwards; the framing refuses
// what is not a message, and an operation the daemon does not know leaves
// the connection usable. Regions are asked for by the client library's own
// code (client/shared_memory.cc). Queries are tested against a real daemon
// (tests/integration/daemon_test.cc).
#include "server/transport/local/local_channel.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "client/local_channel_internal.h"
#include "client/shared_memory_internal.h"
#include "common/base/status.h"
#include "common/local/channel.h"
#include "common/testing/testing.h"
#include "gtest/gtest.h"
#include "server/engine/engine.h"

namespace shardcast {
namespace {

using internal_client::ClientRegion;
using internal_client::LocalConnection;

constexpr uint64_t kMiB = 1 << 20;

// Populations the service asked for, held until Release().
class GatedPopulate {
 public:
  void operator()(char* base, uint64_t bytes) {
    std::unique_lock<std::mutex> lock(mu_);
    calls_.push_back({base, bytes});
    changed_.notify_all();
    changed_.wait(lock, [this] { return released_; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    changed_.notify_all();
  }
  // Waits (up to 30 s) until `n` populations have been asked for.
  std::vector<std::pair<char*, uint64_t>> WaitForCalls(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait_for(lock, std::chrono::seconds(30),
                      [&] { return calls_.size() >= n; });
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<std::pair<char*, uint64_t>> calls_;
  bool released_ = false;
};

class LocalChannelTest : public ::testing::Test {
 protected:
  using Tweak = std::function<void(LocalChannelOptions*, BatchRegionsOptions*)>;
  void Start(std::function<void(char*, uint64_t)> populate,
             int max_connections = 256, bool attach = false,
             const Tweak& tweak = nullptr) {
    EngineOptions o;
    o.roots = {tmp_.path()};
    o.reservoir.slot_bytes = kMiB;
    o.reservoir.bytes = 64 * kMiB;
    auto e = Engine::Start(o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    BatchRegionsOptions ro;
    ro.populate = std::move(populate);
    LocalChannelOptions co;
    co.path = socket_;
    co.max_connections = max_connections;
    if (attach) {
      co.attach = [this](std::shared_ptr<const DatasetFiles> files)
          -> absl::StatusOr<std::string> {
        ASSIGN_OR_RETURN(auto entry, engine_->Attach(std::move(files)));
        return entry->id;
      };
    }
    if (tweak) tweak(&co, &ro);
    regions_ = std::make_unique<BatchRegions>(ro, engine_.get());
    // No queries here: their requests are answered UNIMPLEMENTED.
    auto s = LocalChannel::Start(co, nullptr, regions_.get(), &metrics_);
    ASSERT_TRUE(s.ok()) << s.status();
    channel_ = std::move(*s);
  }
  void TearDown() override {
    channel_.reset();
    regions_.reset();
    engine_.reset();
  }

  // Resident kB of this process's mappings of shardcast regions, by size.
  static std::vector<std::pair<uint64_t, uint64_t>> RegionMappings() {
    std::vector<std::pair<uint64_t, uint64_t>> out;  // (bytes, rss kB)
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    bool region = false;
    uint64_t bytes = 0;
    while (std::getline(smaps, line)) {
      unsigned long lo = 0, hi = 0;
      // A mapping's first line: "lo-hi perms offset dev inode path".
      if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
        region = line.find("memfd:shardcast-region") != std::string::npos;
        bytes = hi - lo;
      } else if (region && line.rfind("Rss:", 0) == 0) {
        out.push_back({bytes, std::stoull(line.substr(4))});
      }
    }
    return out;
  }

  // Whether a new region is served within 2 s (once the daemon has seen a
  // connection close).
  bool ServedAgain() const {
    for (int i = 0; i < 200; ++i) {
      if (ClientRegion::Open(socket_, 2, kMiB).ok()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  TempRoot tmp_;
  const std::string socket_ = tmp_.File("d.sock.local");
  std::unique_ptr<Engine> engine_;
  Metrics metrics_;
  std::unique_ptr<BatchRegions> regions_;
  std::unique_ptr<LocalChannel> channel_;
};

TEST_F(LocalChannelTest, RegionsAreHandedOutBeforeTheirPagesArePopulated) {
  GatedPopulate gate;
  Start([&gate](char* base, uint64_t bytes) { gate(base, bytes); });
  // Three clients in a row, while the first region's population is held:
  // every reply comes anyway.
  std::vector<std::shared_ptr<const ClientRegion>> regions;
  for (int i = 0; i < 3; ++i) {
    auto r = ClientRegion::Open(socket_, 4, kMiB);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    regions.push_back(*r);
  }
  EXPECT_EQ(gate.WaitForCalls(1).size(), 1u);  // the other two are queued
  gate.Release();
  const auto calls = gate.WaitForCalls(3);
  ASSERT_EQ(calls.size(), 3u);
  for (const auto& [base, bytes] : calls) {
    EXPECT_NE(base, nullptr);
    EXPECT_EQ(bytes, 4 * kMiB);  // 4 slots of 1 MiB, whole pages
  }
  EXPECT_EQ(regions_->Figures().regions, 3);
}

TEST_F(LocalChannelTest, TheDefaultPopulationFaultsInTheWholeRegion) {
  Start(nullptr);
  auto r = ClientRegion::Open(socket_, 2, 4 * kMiB);
  ASSERT_TRUE(r.ok()) << r.status();
  // Two mappings of 8 MiB: the daemon's (populated) and the client's (not
  // touched). Wait for the daemon's to be resident.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(30);
  uint64_t best = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    best = 0;
    for (const auto& [bytes, rss_kb] : RegionMappings()) {
      EXPECT_EQ(bytes, 8 * kMiB);
      best = std::max(best, rss_kb);
    }
    if (best == 8 * 1024) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(best, 8 * 1024u) << "kB resident of the daemon's 8 MiB mapping";
}

// Over max_connections, a client is told why at its request: a refusal
// sent at accept, its request unread, then a close reached it as
// ECONNRESET, with the reason lost. Once a connection closes, a new one is
// served.
TEST_F(LocalChannelTest, AConnectionOverTheLimitIsToldWhy) {
  Start(nullptr, 2);
  std::vector<std::shared_ptr<const ClientRegion>> regions;
  for (int i = 0; i < 2; ++i) {
    auto r = ClientRegion::Open(socket_, 2, kMiB);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    regions.push_back(*r);
  }
  for (int i = 0; i < 3; ++i) {
    auto over = ClientRegion::Open(socket_, 2, kMiB);
    ASSERT_FALSE(over.ok());
    EXPECT_EQ(over.status().code(), absl::StatusCode::kUnavailable)
        << over.status();
    EXPECT_NE(over.status().message().find("its limit"), std::string::npos)
        << over.status();
  }
  regions[0]->Disconnect();
  EXPECT_TRUE(ServedAgain());
}

// One user cannot take every connection: past max_connections_per_user its
// next connection is told the limit and its count; others are not counted
// against it.
TEST_F(LocalChannelTest,
       AUserOverTheirConnectionLimitIsToldTheLimitAndTheirCount) {
  Start(nullptr, 256, false, [](LocalChannelOptions* co, BatchRegionsOptions*) {
    co->max_connections_per_user = 2;
  });
  std::vector<std::shared_ptr<const ClientRegion>> regions;
  for (int i = 0; i < 2; ++i) {
    auto r = ClientRegion::Open(socket_, 2, kMiB);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    regions.push_back(*r);
  }
  auto over = ClientRegion::Open(socket_, 2, kMiB);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted)
      << over.status();
  EXPECT_NE(over.status().message().find(absl::StrCat(
                "uid ", ::getuid(), " has 2 local channel connections open")),
            std::string::npos)
      << over.status();
  EXPECT_NE(over.status().message().find("--max-connections-per-user 2"),
            std::string::npos)
      << over.status();
  regions[0]->Disconnect();
  EXPECT_TRUE(ServedAgain());
}

// A connection that never asks is closed after first_request_seconds; one
// that asked stays.
TEST_F(LocalChannelTest, AConnectionThatNeverAsksIsClosed) {
  Start(nullptr, 256, false, [](LocalChannelOptions* co, BatchRegionsOptions*) {
    co->first_request_seconds = 1;
  });
  auto asked = ClientRegion::Open(socket_, 2, kMiB);
  ASSERT_TRUE(asked.ok()) << asked.status();
  UniqueFd silent(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket_.data(), socket_.size());
  ASSERT_EQ(
      ::connect(silent.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
      0);
  const auto start = std::chrono::steady_clock::now();
  struct timeval tv = {10, 0};
  ::setsockopt(silent.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char c;
  ssize_t got;
  do {
    got = ::recv(silent.get(), &c, 1, 0);
  } while (got < 0 && errno == EINTR);
  EXPECT_EQ(got, 0) << "not closed: " << std::strerror(errno);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_GE(waited, 0.9);
  EXPECT_LT(waited, 5);
  // The one that asked is still served: its region is attachable.
  EXPECT_TRUE(regions_->Attach((*asked)->token()).ok());
}

// One user's regions cannot take the reservoir: past max_bytes_per_user
// they are told what they hold; a region no stream attached in time is
// dropped and its memory freed.
TEST_F(LocalChannelTest,
       RegionsAreCappedPerUserAndDroppedWhenNoStreamAttaches) {
  Start(nullptr, 256, false, [](LocalChannelOptions*, BatchRegionsOptions* ro) {
    ro->max_bytes_per_user = 6 * kMiB;
    ro->attach_within_seconds = 1;
  });
  auto first = ClientRegion::Open(socket_, 4, kMiB);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ClientRegion::Open(socket_, 4, kMiB);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(second.status().message().find(absl::StrCat(
                "uid ", ::getuid(),
                " holds 1 shared-memory region(s) of 4 MiB; another of 4 MiB "
                "would pass the 6 MiB one user may hold")),
            std::string::npos)
      << second.status();
  // Attached in time, a region stays past the deadline.
  auto handle = regions_->Attach((*first)->token());
  ASSERT_TRUE(handle.ok()) << handle.status();
  auto idle = ClientRegion::Open(socket_, 2, kMiB);
  ASSERT_TRUE(idle.ok()) << idle.status();  // 4 + 2 MiB: at the cap
  EXPECT_EQ(regions_->Figures().regions, 2);
  for (int i = 0; i < 500 && regions_->Figures().regions != 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(regions_->Figures().regions, 1);  // the idle one went
  EXPECT_EQ(regions_->Attach((*idle)->token()).status().code(),
            absl::StatusCode::kNotFound);
  handle->reset();
  // Its bytes are the user's again.
  EXPECT_TRUE(ClientRegion::Open(socket_, 2, kMiB).ok());
}

// Regions are leased in pages: small regions share the reservoir's blocks
// (4 regions of 256 KiB hold one 1 MiB block, not four) and the blocks go
// back when the regions do.
TEST_F(LocalChannelTest, SmallRegionsShareReservoirBlocks) {
  Start(nullptr);
  auto reserved = [this] {
    return engine_->Figures().reservoir_bytes_reserved;
  };
  std::vector<std::shared_ptr<const ClientRegion>> regions;
  for (int i = 0; i < 4; ++i) {
    auto r = ClientRegion::Open(socket_, 1, 256 * 1024);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status();
    regions.push_back(*r);
  }
  EXPECT_EQ(reserved(), kMiB);
  // A region of 5 pages more than fits: the next block.
  auto odd = ClientRegion::Open(socket_, 1, 5 * 4096 - 100);
  ASSERT_TRUE(odd.ok()) << odd.status();
  EXPECT_EQ((*odd)->slot_bytes(), 5 * 4096u);
  EXPECT_EQ(reserved(), 2 * kMiB);
  odd->reset();
  for (int i = 0; i < 500 && reserved() != kMiB; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(reserved(), kMiB);
  regions.clear();
  for (int i = 0; i < 500 && reserved() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(reserved(), 0u);
}

// A raw connection to the channel, for packets the client library never
// sends.
UniqueFd RawConnect(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(
      ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// The reply to one raw packet, and whether the daemon closed after it.
v1::LocalReply ReplyTo(const std::string& path, absl::string_view packet,
                       bool* closed) {
  UniqueFd fd = RawConnect(path);
  EXPECT_EQ(::send(fd.get(), packet.data(), packet.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(packet.size()));
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  auto got = local::ReceiveMessage(fd.get(), &reply, &fds);
  EXPECT_TRUE(got.ok()) << got.status();
  // The daemon closes right after its reply: wait for it (up to 10 s).
  struct timeval tv = {10, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char c;
  *closed = ::recv(fd.get(), &c, 1, 0) == 0;
  return reply;
}

TEST_F(LocalChannelTest, APacketThatIsNotAMessageIsRefusedAndDisconnected) {
  Start(nullptr);
  bool closed = false;
  // Field 1 as a length-delimited string running past the packet.
  const v1::LocalReply reply = ReplyTo(socket_, "\x0a\x7fshort", &closed);
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(reply.message().find("not a local channel message"),
            std::string::npos)
      << reply.message();
  EXPECT_TRUE(closed);
}

TEST_F(LocalChannelTest, AMessageMustCarryTheDescriptorsItSays) {
  Start(nullptr);
  v1::LocalRequest request;
  request.set_id(7);
  request.set_descriptors(2);  // and carries none
  request.mutable_batch_region()->set_slots(2);
  request.mutable_batch_region()->set_slot_bytes(4096);
  bool closed = false;
  const v1::LocalReply reply =
      ReplyTo(socket_, request.SerializeAsString(), &closed);
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(reply.message().find("says it carries 2 descriptors and carries 0"),
            std::string::npos)
      << reply.message();
  EXPECT_TRUE(closed);
  EXPECT_EQ(regions_->Figures().regions, 0);
}

// A newer client's operation (a field of the oneof this daemon lacks) is
// answered UNIMPLEMENTED, and the same connection goes on being served.
TEST_F(LocalChannelTest, AnUnknownOperationLeavesTheConnectionUsable) {
  Start(nullptr);
  auto c = LocalConnection::Connect(socket_);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::LocalRequest unknown;
  // Field 99, length-delimited and empty: unknown to this daemon.
  unknown.GetReflection()->MutableUnknownFields(&unknown)->AddLengthDelimited(
      99, "");
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  ASSERT_TRUE(c->Ask(unknown, &reply, &fds).ok());
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kUnimplemented));
  v1::LocalRequest region;
  region.mutable_batch_region()->set_slots(2);
  region.mutable_batch_region()->set_slot_bytes(4096);
  ASSERT_TRUE(c->AskOk(region, &reply, &fds, "").ok()) << reply.message();
  EXPECT_EQ(fds.size(), 1u);
  EXPECT_EQ(reply.batch_region().region_bytes(), 2 * 4096u);
  // One batch region per connection.
  const absl::Status again = c->AskOk(region, &reply, &fds, "");
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
}

TEST_F(LocalChannelTest, QueriesOffAreAnsweredUnimplemented) {
  Start(nullptr);
  auto c = LocalConnection::Connect(socket_);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::LocalRequest request;
  request.mutable_query_region()->set_bytes(1 << 20);
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  const absl::Status status = c->AskOk(request, &reply, &fds, "");
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
  EXPECT_NE(status.message().find("--disable-local-queries"), std::string::npos)
      << status;
  EXPECT_TRUE(fds.empty());
}

TEST_F(LocalChannelTest,
       AnAttachThatDoesNotAddUpIsRefusedAndTheConnectionStays) {
  Start(nullptr, 256, /*attach=*/true);
  auto c = LocalConnection::Connect(socket_);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  UniqueFd file(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int raw[] = {file.get()};
  struct Case {
    const char* what;
    std::function<void(v1::LocalRequest::Attach*)> fill;
    std::vector<int> send;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"names without errors",
       [](auto* a) { a->add_names("metadata.json"); },
       {},
       "names but"},
      {"a descriptor it does not count",
       [](auto* a) {
         a->add_names("metadata.json");
         a->add_errors(2);
       },
       {raw[0]},
       "descriptors carried"},
      {"a name that is a path",
       [](auto* a) {
         a->add_names("../etc/passwd");
         a->add_errors(2);
       },
       {},
       "is not a file name"},
      {"a name given twice",
       [](auto* a) {
         a->add_names("x.bin");
         a->add_errors(2);
         a->add_names("x.bin");
         a->add_errors(2);
       },
       {},
       "given twice"},
      {"no path", [](auto* a) { a->set_path(""); }, {}, "path and name"},
  };
  for (const Case& k : cases) {
    v1::LocalRequest request;
    v1::LocalRequest::Attach* a = request.mutable_attach();
    a->set_path("/p");
    a->set_dir_name("p");
    k.fill(a);
    const absl::Status status = c->AskOk(request, &reply, &fds, "", 0, k.send);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument)
        << k.what << ": " << status;
    EXPECT_NE(status.message().find(k.says), std::string::npos)
        << k.what << ": " << status;
  }
  // Still usable: a well-formed attach of a directory without a dataset.
  v1::LocalRequest request;
  request.mutable_attach()->set_path("/user/dir");
  request.mutable_attach()->set_dir_name("dir");
  const absl::Status status = c->AskOk(request, &reply, &fds, "");
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_NE(status.message().find("/user/dir/metadata.json"), std::string::npos)
      << status;
}

TEST_F(LocalChannelTest, AttachOffIsAnsweredUnimplemented) {
  Start(nullptr);
  auto c = LocalConnection::Connect(socket_);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::LocalRequest request;
  request.mutable_attach()->set_path("/p");
  request.mutable_attach()->set_dir_name("p");
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  EXPECT_EQ(c->AskOk(request, &reply, &fds, "").code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace shardcast
