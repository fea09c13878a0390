// The streams being served, one entry each: who (the client id given here,
// the peer), what (dataset, order, partition, transport) and how much has
// gone out. Status (Admin.GetStatus) and /metrics read it, so throughput can
// be watched per client; logs name the same client id.
#ifndef SHARDCAST_SERVER_TRANSPORT_STREAM_BOOK_H_
#define SHARDCAST_SERVER_TRANSPORT_STREAM_BOOK_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/base/mutex.h"

namespace shardcast {

/// What a stream is, fixed when it opens.
struct StreamInfo {
  std::string client;     // "s7": unique among this daemon's streams
  std::string peer;       // "pid 1234 uid 1000 gid 1000" or "ipv4:..."
  std::string dataset;    // as requested
  std::string order;      // "shuffled" or "ordered"
  std::string transport;  // "shm" (shared-memory slots) or "grpc"
  int64_t rank = 0, world_size = 1;
  absl::Time started;
};

/// One stream's figures at one moment.
struct StreamFigures {
  StreamInfo info;
  uint64_t batches = 0;
  uint64_t bytes = 0;  // vector bytes sent in batches
};

/// Thread-safe. Entries live while their Entry handle does.
class StreamBook {
 public:
  /// A stream's place in the book; counting is lock-free.
  class Entry {
   public:
    ~Entry();
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    void CountBatch(uint64_t bytes) {
      batches_.fetch_add(1, std::memory_order_relaxed);
      bytes_.fetch_add(bytes, std::memory_order_relaxed);
    }

   private:
    friend class StreamBook;
    Entry(StreamBook* book, uint64_t key) : book_(book), key_(key) {}
    StreamBook* const book_;
    const uint64_t key_;
    std::atomic<uint64_t> batches_{0};
    std::atomic<uint64_t> bytes_{0};
  };

  StreamBook() = default;
  StreamBook(const StreamBook&) = delete;
  StreamBook& operator=(const StreamBook&) = delete;

  /// A new client id: "s1", "s2", ... (never reused while the daemon runs).
  std::string NextClientId();
  /// Enters a stream; it leaves the book when the handle is destroyed. The
  /// handle must not outlive the book.
  std::unique_ptr<Entry> Add(StreamInfo info);
  /// Every stream in the book, oldest first.
  std::vector<StreamFigures> Snapshot() const;

 private:
  void Remove(uint64_t key);

  std::atomic<uint64_t> next_id_{1};
  mutable Mutex mu_;
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::pair<StreamInfo, const Entry*>> entries_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_STREAM_BOOK_H_
