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

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/base/mutex.h"
#include "server/engine/scan.h"

namespace shardcast {

/// One pass over a share of a sweep scan, for a peer: a subscription that
/// needs each block of the share once (a late joiner's rules: from where the
/// scan is now, round to where it was). It reserves window + lag blocks like
/// a stream, never borrows beyond its lag bound (its backpressure is the
/// peer's), and holds a block until Next is called again. The peer asks for
/// the next pass when its own subscribers need the share again, so a scan
/// never reads ahead for a peer that needs nothing. Thread-safe.
class ShareFeed {
 public:
  explicit ShareFeed(std::unique_ptr<ScanRegistry::Subscription> sub)
      : vectors_per_block_(sub->scan()->layout().vectors_per_block),
        num_blocks_(sub->scan()->layout().num_blocks),
        hash_(sub->scan()->reader().info().hash),
        sub_(std::move(sub)) {}
  /// The next block (kBlock), kWait with `waker` called when that may have
  /// changed, or kDelivered at the end of the pass. Errors of the scan
  /// (DATA_LOSS naming the file); CANCELLED once abandoned.
  absl::StatusOr<Take> Next(std::function<void()> waker)
      ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    if (sub_ == nullptr) return absl::CancelledError("the pass was given up");
    return sub_->scan()->TakeBlock(sub_->id(), 0, std::move(waker));
  }
  /// Leaves the scan now, from any thread (the peer takes nothing: the
  /// scan, which waits for every pass, goes on without this one), even
  /// while the transport is stuck sending the last block Next handed out.
  void Abandon() ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    sub_.reset();
  }
  /// Whether another subscriber of the scan starves while this pass takes
  /// nothing: a peer that only pauses holds back nobody and is waited for.
  bool HoldsBackOthers() const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    return sub_ != nullptr && sub_->scan()->OthersStarving(sub_->id());
  }
  int64_t vectors_per_block() const { return vectors_per_block_; }
  int64_t num_blocks() const { return num_blocks_; }
  /// The dataset's content hash (its metadata's).
  const std::string& content_hash() const { return hash_; }

 private:
  const int64_t vectors_per_block_;
  const int64_t num_blocks_;
  const std::string hash_;
  mutable Mutex mu_;
  std::unique_ptr<ScanRegistry::Subscription> sub_ ABSL_GUARDED_BY(mu_);
};

/// The vectors of block `b` in order (a mapped block's gathered from its
/// pieces), as a peer is sent them, into `out`, whose buffer is reused (a
/// sender's message: no allocation per block of the usual size).
void BlockVectors(const Block& b, std::string* out);

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
/// (ReadShare) and that error is returned; OK once `stop` is set. A pass
/// that ends ABORTED or CANCELLED (the peer dropped it: this node took
/// nothing while others waited there) is asked for again when needed,
/// unless three in a row brought nothing this scan took.
absl::Status FeedScan(
    SharedScan& scan, int64_t share,
    const std::function<absl::StatusOr<PassReader>()>& open_pass,
    const std::function<bool()>& stop);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_SWEEP_H_
