// Reusable batch buffers. A stream's batch is written once into a buffer the
// transport then sends; reusing buffers spares the daemon the page faults of
// fresh memory on every batch (about 3.4 s per GiB on these VMs:
// docs/benchmarks.md).
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_BUFFER_POOL_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "common/base/mutex.h"

namespace shardcast {

class BufferPool;

/// A buffer handed out by a BufferPool; goes back with BufferPool::Return.
struct PooledBuffer {
  char* data = nullptr;
  size_t size = 0;
  BufferPool* pool = nullptr;
};

/// Thread-safe. Keeps up to `max_idle_bytes` of returned buffers for reuse
/// and frees the rest. Must outlive every buffer it handed out.
class BufferPool {
 public:
  explicit BufferPool(uint64_t max_idle_bytes) : max_idle_(max_idle_bytes) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// A buffer of exactly `size` bytes (contents undefined).
  PooledBuffer* Get(size_t size) ABSL_LOCKS_EXCLUDED(mu_);
  /// Takes back a buffer from Get; the signature fits a gRPC slice's
  /// destroy callback (user data = the PooledBuffer).
  static void Return(void* buffer);

  uint64_t idle_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Put(PooledBuffer* b) ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t max_idle_;
  mutable Mutex mu_;
  std::multimap<size_t, PooledBuffer*> idle_ ABSL_GUARDED_BY(mu_);
  uint64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_BUFFER_POOL_H_
