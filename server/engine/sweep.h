// Sweeps across nodes (docs/sweeps.md): the engine's two ends of a peer
// link, with no transport in them. A node's sweep scan reads its own share
// of the blocks; ShareFeed hands that share's blocks, as raw vectors, to a
// transport that sends them to a peer; FeedScan takes the blocks a peer
// sends and delivers them into this node's sweep scan.
#ifndef SHARDCAST_SERVER_ENGINE_SWEEP_H_
#define SHARDCAST_SERVER_ENGINE_SWEEP_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "server/engine/scan.h"

namespace shardcast {

/// One pass over a share of a sweep scan, for a peer: a subscription that
/// needs each block of the share once (a late joiner's rules: from where the
/// scan is now, round to where it was). It reserves window + lag blocks like
/// a stream, never borrows beyond its lag bound (its backpressure is the
/// peer's), and holds a block until Next is called again. The peer asks for
/// the next pass when its own subscribers need the share again, so a scan
/// never reads ahead for a peer that needs nothing.
class ShareFeed {
 public:
  explicit ShareFeed(std::unique_ptr<ScanRegistry::Subscription> sub)
      : sub_(std::move(sub)) {}
  /// The next block (kBlock), kWait with `waker` called when that may have
  /// changed, or kDelivered at the end of the pass. Errors of the scan
  /// (DATA_LOSS naming the file).
  absl::StatusOr<Take> Next(std::function<void()> waker) {
    return sub_->scan()->TakeBlock(sub_->id(), 0, std::move(waker));
  }
  const BlockLayout& layout() const { return sub_->scan()->layout(); }
  const DatasetReader& reader() const { return sub_->scan()->reader(); }

 private:
  std::unique_ptr<ScanRegistry::Subscription> sub_;
};

/// The vectors of block `b` in order (a mapped block's gathered from its
/// pieces), as a peer is sent them.
std::string BlockVectors(const Block& b);

/// A block as a peer sent it.
struct PeerBlock {
  int64_t block = -1;
  std::string vectors;
};

/// One pass of a peer's share feed as this node receives it: the next
/// block, nullopt at the end of the pass, or an error (the link failed).
using PassReader = std::function<absl::StatusOr<std::optional<PeerBlock>>()>;

/// Delivers share `share`, which a peer reads, into `scan` until `stop`
/// says so: whenever the scan's subscribers need blocks of the share, a pass is
/// opened with `open_pass` and its blocks delivered (again once there is
/// room: SharedScan::Deliver). When a pass cannot be opened, fails, or
/// brings what the scan refuses (a block out of bounds, of the wrong size,
/// of another share), the scan reads the share itself from then on
/// (ReadShare) and that error is returned; OK once `stop` is set.
absl::Status FeedScan(
    SharedScan& scan, int64_t share,
    const std::function<absl::StatusOr<PassReader>()>& open_pass,
    const std::function<bool()>& stop);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_SWEEP_H_
