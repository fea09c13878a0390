// Sweeps across nodes on the gRPC wire (docs/sweeps.md): the Peer service
// that sends this node's share of a sweep scan to another node's daemon,
// and the links that fetch the other nodes' shares into this node's sweep
// scans. Both adapt the engine's ShareFeed and FeedScan (server/engine/
// sweep.h); the wire carries each block's raw vectors.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_PEER_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_PEER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/base/mutex.h"
#include "common/base/stall_watch.h"
#include "grpcpp/grpcpp.h"
#include "server/engine/sweep.h"
#include "server/transport/grpc/context.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {

/// This daemon's part in a sweep: what its Peer service and its links to
/// the other nodes share.
struct SweepOptions {
  /// Every node's daemon, by TCP address, in node order.
  std::vector<std::string> peers;
  int64_t self = 0;  // this node's index in `peers`
  /// --block-bytes: every node's must be the same (Peer.Hello says it).
  uint64_t block_bytes = 0;
  /// How this daemon authenticates to its peers (mutual TLS: its own
  /// certificate, the peers' CA).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  /// A peer that sends nothing for twice this while this node waits for
  /// its share (dead, frozen, cut off) is given up: its share is read here.
  /// A pass that takes nothing this long while other subscribers of this
  /// node's scan starve is dropped (ABORTED): the peer asks again later.
  std::chrono::nanoseconds timeout = std::chrono::seconds(30);
};

/// This daemon's Peer.Hello as `caller` may see it: its place in the sweep
/// and the content hashes of the datasets `caller` may read.
v1::PeerHello SweepHello(const TransportContext& context, const Caller& caller,
                         const SweepOptions& sweep);

/// Peer.SharePass: one pass over a share of this daemon's sweep scan, and
/// Peer.Hello. A synchronous service: each call holds a thread of gRPC's while
/// it sends, and a sweep has a handful of peers. The caller must pass the
/// access rule as a remote client (Engine::CheckAccess). A pass whose receiver
/// takes nothing for `timeout` (dead, frozen, cut off) is cancelled, so that
/// this node's scan, which waits for every pass, goes on without it.
class PeerService final : public v1::Peer::Service {
 public:
  PeerService(TransportContext context, SweepOptions sweep)
      : context_(context),
        sweep_(std::move(sweep)),
        nodes_(static_cast<int64_t>(sweep_.peers.size())),
        sent_(new std::atomic<uint64_t>[sweep_.peers.size()]()),
        stalls_(sweep_.timeout) {}
  grpc::Status SharePass(grpc::ServerContext* ctx,
                         const v1::SharePassRequest* request,
                         grpc::ServerWriter<v1::ShareBlock>* writer) override;
  grpc::Status Hello(grpc::ServerContext* ctx, const v1::PeerHello* request,
                     v1::PeerHello* response) override;

  /// Bytes of blocks sent to node `node`.
  uint64_t bytes_sent(int64_t node) const {
    return sent_[static_cast<size_t>(node)].load();
  }

 private:
  const TransportContext context_;
  const SweepOptions sweep_;
  const int64_t nodes_;
  const std::unique_ptr<std::atomic<uint64_t>[]> sent_;  // by node
  StallWatch stalls_;                                    // writes to receivers
};

/// The links that bring the other nodes' shares into this node's sweep
/// scans: for each sweep scan that starts, one thread per peer runs
/// FeedScan, each pass a SharePass call. A link that fails or stalls has
/// the scan read that share itself (logged). Thread-safe.
class PeerLinks {
 public:
  explicit PeerLinks(SweepOptions options);
  /// Cancels the calls in flight and joins the threads.
  ~PeerLinks();
  PeerLinks(const PeerLinks&) = delete;
  PeerLinks& operator=(const PeerLinks&) = delete;

  /// A sweep scan started (Engine's on_sweep_scan; with the registry's lock
  /// held, so it only starts threads): fetch every other share into it
  /// until it has no subscribers left.
  void OnSweepScan(const std::shared_ptr<SharedScan>& scan,
                   const StreamSpec& spec, uint64_t seed)
      ABSL_LOCKS_EXCLUDED(mu_);

  /// Bytes of blocks fetched from node `node`.
  uint64_t bytes_received(int64_t node) const {
    return received_[static_cast<size_t>(node)].load();
  }

  /// Asks every other node's daemon who it is (Peer.Hello, all at once,
  /// each within 5 s) and compares its answer with `mine`: the node order,
  /// --block-bytes, and every dataset of `mine` (the same content hash and
  /// size there). Blocks while it asks.
  v1::CheckSweepResponse Check(const v1::PeerHello& mine) const;
  const SweepOptions& sweep() const { return options_; }

 private:
  void Run(std::weak_ptr<SharedScan> scan, size_t peer,
           v1::SharePassRequest request);

  const SweepOptions options_;
  std::vector<std::unique_ptr<v1::Peer::Stub>> stubs_;  // by peer
  std::atomic<bool> stop_{false};
  const std::unique_ptr<std::atomic<uint64_t>[]> received_;  // by node
  Mutex mu_;
  // The feeds' threads, each with its flag set as it ends (joined then, so
  // that a long-lived daemon does not keep every past scan's threads).
  struct Feed {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Feed> feeds_ ABSL_GUARDED_BY(mu_);
  std::vector<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);
  StallWatch stalls_;  // reads from peers
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_PEER_H_
