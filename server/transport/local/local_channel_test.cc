// The shared-memory side channel: a region's reply does not wait for its
// pages to be populated (trainers launched together reach their stream
// calls together), and the pages are populated afterwards. Regions are
// asked for by the client library's own code (client/shared_memory.cc).
#include "server/transport/local/shm_service.h"

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

#include "client/shared_memory_internal.h"
#include "common/testing/testing.h"
#include "gtest/gtest.h"
#include "server/engine/engine.h"

namespace shardcast {
namespace {

using internal_client::ClientRegion;

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

class ShmServiceTest : public ::testing::Test {
 protected:
  void Start(std::function<void(char*, uint64_t)> populate,
             int max_connections = 256) {
    EngineOptions o;
    o.roots = {tmp_.path()};
    o.reservoir.slot_bytes = kMiB;
    o.reservoir.bytes = 64 * kMiB;
    auto e = Engine::Start(o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
    ShmServiceOptions so;
    so.path = socket_;
    so.populate = std::move(populate);
    so.max_connections = max_connections;
    auto s = ShmService::Start(so, engine_.get());
    ASSERT_TRUE(s.ok()) << s.status();
    service_ = std::move(*s);
  }
  void TearDown() override {
    service_.reset();
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

  TempRoot tmp_;
  const std::string socket_ = tmp_.File("d.sock.shm");
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ShmService> service_;
};

TEST_F(ShmServiceTest, RegionsAreHandedOutBeforeTheirPagesArePopulated) {
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
  EXPECT_EQ(service_->Figures().regions, 3);
}

TEST_F(ShmServiceTest, TheDefaultPopulationFaultsInTheWholeRegion) {
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
TEST_F(ShmServiceTest, AConnectionOverTheLimitIsToldWhy) {
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
  bool served = false;  // once the daemon has seen the close
  for (int i = 0; i < 200 && !served; ++i) {
    served = ClientRegion::Open(socket_, 2, kMiB).ok();
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(served);
}

}  // namespace
}  // namespace shardcast
