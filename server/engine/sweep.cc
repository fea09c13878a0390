#include "server/engine/sweep.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace shardcast {

std::string BlockVectors(const Block& b) {
  const size_t bytes = static_cast<size_t>(b.vectors) * b.vector_bytes;
  if (b.pieces.empty()) return std::string(b.data, bytes);
  std::string out(bytes, '\0');
  for (int64_t i = 0; i < b.vectors; ++i) {
    std::memcpy(&out[static_cast<size_t>(i) * b.vector_bytes], b.vector(i),
                b.vector_bytes);
  }
  return out;
}

namespace {

// Delivers one pass; OK at its end or on `stop`.
absl::Status DeliverPass(SharedScan& scan, int64_t share,
                         const PassReader& next,
                         const std::atomic<bool>& stop) {
  struct Room {
    std::mutex mu;
    std::condition_variable cv;
    bool woken = false;
  };
  auto room = std::make_shared<Room>();
  while (!stop.load()) {
    ASSIGN_OR_RETURN(std::optional<PeerBlock> got, next());
    if (!got.has_value()) return absl::OkStatus();
    if (got->block < 0 || got->block % scan.share_count() != share) {
      return absl::InvalidArgumentError(
          absl::StrCat("the peer of share ", share, " sent block ", got->block,
                       ", not of that share"));
    }
    while (!stop.load()) {
      {
        std::lock_guard<std::mutex> lock(room->mu);
        room->woken = false;
      }
      ASSIGN_OR_RETURN(Delivery d,
                       scan.Deliver(got->block, got->vectors, [room] {
                         std::lock_guard<std::mutex> lock(room->mu);
                         room->woken = true;
                         room->cv.notify_all();
                       }));
      if (d != Delivery::kFull) break;
      // A subscriber's take wakes this; a slot freed elsewhere does not, so
      // look again shortly either way.
      std::unique_lock<std::mutex> lock(room->mu);
      room->cv.wait_for(lock, std::chrono::milliseconds(5),
                        [&] { return room->woken; });
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FeedScan(
    SharedScan& scan, int64_t share,
    const std::function<absl::StatusOr<PassReader>()>& open_pass,
    const std::atomic<bool>& stop) {
  absl::Status failed;
  while (!stop.load() && failed.ok()) {
    // Nothing of the share needed here now: a pass would have the peer's
    // scan read for nobody.
    if (scan.ShareNeed(share) == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      continue;
    }
    absl::StatusOr<PassReader> pass = open_pass();
    failed = pass.ok() ? DeliverPass(scan, share, *pass, stop) : pass.status();
  }
  if (failed.ok()) return failed;
  LogWarning("sweep: the feed of share ", share, " failed (", failed.ToString(),
             ")");
  scan.ReadShare(share);
  return failed;
}

}  // namespace shardcast
