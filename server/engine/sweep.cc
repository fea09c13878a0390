#include "server/engine/sweep.h"

#include <chrono>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/base/waiter.h"

namespace shardcast {

void BlockVectors(const Block& b, std::string* out) {
  const size_t bytes = static_cast<size_t>(b.vectors) * b.vector_bytes;
  out->resize(bytes);  // same size as the last block: nothing to do
  if (b.pieces.empty()) {
    std::memcpy(out->data(), b.data, bytes);
    return;
  }
  for (int64_t i = 0; i < b.vectors; ++i) {
    std::memcpy(out->data() + static_cast<size_t>(i) * b.vector_bytes,
                b.vector(i), b.vector_bytes);
  }
}

namespace {

// How long a delivery waits for a subscriber a full lag bound behind.
constexpr std::chrono::seconds kLaggardWait(10);

// Delivers one pass; OK at its end or on `stop`. A pass brings each block
// of the share once: one that ends short, or repeats a block, is refused
// (else a peer that ends its passes early would be asked again forever).
absl::Status DeliverPass(SharedScan& scan, int64_t share,
                         const PassReader& next,
                         const std::function<bool()>& stop, int64_t* taken) {
  const int64_t shares = scan.share_count();
  const int64_t blocks = scan.layout().num_blocks;
  const int64_t expected =
      share < blocks ? (blocks - share + shares - 1) / shares : 0;
  std::vector<bool> seen(static_cast<size_t>(expected));  // by b / shares
  int64_t received = 0;
  Waiter room;  // a waker the scan may call after this returns
  while (!stop()) {
    ASSIGN_OR_RETURN(std::optional<PeerBlock> got, next());
    if (!got.has_value()) {
      if (received == expected) return absl::OkStatus();
      return absl::InvalidArgumentError(
          absl::StrCat("the peer of share ", share, " ended a pass after ",
                       received, " of the share's ", expected, " blocks"));
    }
    if (got->block < 0 || got->block % shares != share) {
      return absl::InvalidArgumentError(
          absl::StrCat("the peer of share ", share, " sent block ", got->block,
                       ", not of that share"));
    }
    // Out of bounds is refused by Deliver, with the selection's size.
    const int64_t slot = got->block / shares;
    if (slot < expected) {
      if (seen[static_cast<size_t>(slot)]) {
        return absl::InvalidArgumentError(
            absl::StrCat("the peer of share ", share, " sent block ",
                         got->block, " twice in one pass"));
      }
      seen[static_cast<size_t>(slot)] = true;
      ++received;
    }
    const auto since = std::chrono::steady_clock::now();
    while (!stop()) {
      room.Reset();
      // A subscriber here that has not taken a block for this long is
      // left behind (it gets the block on a later pass), so that it does
      // not hold back every node of the sweep.
      const bool overdue =
          std::chrono::steady_clock::now() - since > kLaggardWait;
      ASSIGN_OR_RETURN(Delivery d, scan.Deliver(got->block, got->vectors,
                                                room.Waker(), overdue));
      if (d == Delivery::kTaken) ++*taken;
      if (d != Delivery::kFull) break;
      // A subscriber's take wakes this; a slot freed elsewhere does not, so
      // look again shortly either way.
      room.Wait(std::chrono::milliseconds(5));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FeedScan(
    SharedScan& scan, int64_t share,
    const std::function<absl::StatusOr<PassReader>()>& open_pass,
    const std::function<bool()>& stop) {
  absl::Status failed;
  Waiter needed;        // the scan wakes it when the share is needed again
  int64_t dropped = 0;  // passes the peer dropped in a row, none of use
  while (!stop() && failed.ok()) {
    // Nothing of the share needed here now: a pass would have the peer's
    // scan read for nobody. (`stop` is looked at every 100 ms.)
    needed.Reset();
    if (scan.ShareNeed(share, needed.Waker()) == 0) {
      needed.Wait(std::chrono::milliseconds(100));
      continue;
    }
    absl::StatusOr<PassReader> pass = open_pass();
    int64_t taken = 0;
    failed = pass.ok() ? DeliverPass(scan, share, *pass, stop, &taken)
                       : pass.status();
    // ABORTED, or CANCELLED by the peer: it dropped the pass, because this
    // node took nothing for its timeout while others waited there
    // (trainers here paused), or it is stopping: a new pass is asked for
    // when needed (a stopped peer then fails to open one). Three in a row
    // that brought nothing taken here are a peer out of order.
    dropped = taken > 0 ? 0 : dropped + 1;
    if ((absl::IsAborted(failed) || absl::IsCancelled(failed)) && dropped < 3) {
      LogInfo("sweep: the peer of share ", share, " of ", scan.dataset(),
              " dropped its pass (", failed.message(),
              "); a new one is asked for when needed");
      failed = absl::OkStatus();
    }
  }
  // ReadShare logs the take-over; the caller, who knows the peer, why.
  if (!failed.ok()) scan.ReadShare(share);
  return failed;
}

}  // namespace shardcast
