// Where a stream's batch vectors go and how each batch goes on the wire:
// into a pooled buffer that becomes the reply's payload slice (the gRPC
// path, for every client), or into a slot of the client's shared-memory
// region with only the slot's number in the reply (local clients, see
// batch_regions.h). The stream reactor asks its outlet for memory, has the
// engine fill it, and sends what the outlet makes of the batch.
#ifndef SHARDCAST_SERVER_TRANSPORT_GRPC_BATCH_OUTLET_H_
#define SHARDCAST_SERVER_TRANSPORT_GRPC_BATCH_OUTLET_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/base/mutex.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/engine/batch_source.h"
#include "server/transport/grpc/buffer_pool.h"
#include "server/transport/local/batch_regions.h"

namespace shardcast {

/// Acquire and Reply are called by the stream's producer (one thread at a
/// time); implementations say what else is thread-safe.
class BatchOutlet {
 public:
  virtual ~BatchOutlet() = default;
  /// Memory for the next batch's vectors, at least `bytes`: the same as
  /// last time until Reply has used it. Nothing while every piece is out
  /// (the client holds them all); the reactor is kicked when one returns.
  /// `views`: the source can hand out views (BatchSource::CanView); an
  /// outlet that can send them gives a destination with `views` set.
  virtual std::optional<VectorDest> Acquire(uint64_t bytes, bool views) = 0;
  /// The Batch message for `batch` (its columns are moved out), whose
  /// `vector_bytes` of vectors are in the memory Acquire gave.
  virtual grpc::ByteBuffer Reply(StreamBatch& batch, int64_t d_model,
                                 uint64_t vector_bytes) = 0;
};

/// The gRPC path: vectors travel in the message, as slices of the engine's
/// blocks when the source can give views (no copy on this side), else as a
/// slice of a pooled buffer returned to `pool` once sent.
class MessageOutlet final : public BatchOutlet {
 public:
  explicit MessageOutlet(BufferPool* pool) : pool_(pool) {}
  ~MessageOutlet() override;
  std::optional<VectorDest> Acquire(uint64_t bytes, bool views) override;
  grpc::ByteBuffer Reply(StreamBatch& batch, int64_t d_model,
                         uint64_t vector_bytes) override;

 private:
  BufferPool* const pool_;
  PooledBuffer* buffer_ = nullptr;  // acquired, not yet in a reply
  VectorViews views_;               // a batch being viewed
  bool viewing_ = false;            // Acquire gave views_
};

/// The shared-memory path: vectors go into the slots of the client's region
/// and the message says which. A slot is the client's from the reply that
/// names it until the client releases it; the daemon never writes into it
/// meanwhile. Release is thread-safe (called as client messages arrive).
class SlotOutlet final : public BatchOutlet {
 public:
  /// `region` is the stream's attachment (batch_regions.h).
  explicit SlotOutlet(std::shared_ptr<ShmRegion> region);
  std::optional<VectorDest> Acquire(uint64_t bytes, bool views) override
      ABSL_LOCKS_EXCLUDED(mu_);
  grpc::ByteBuffer Reply(StreamBatch& batch, int64_t d_model,
                         uint64_t vector_bytes) override
      ABSL_LOCKS_EXCLUDED(mu_);
  /// The client is done with `slot`. INVALID_ARGUMENT when the client does
  /// not hold it (out of range, never sent, or released already).
  absl::Status Release(uint32_t slot) ABSL_LOCKS_EXCLUDED(mu_);
  const ShmRegion& region() const { return *region_; }

 private:
  enum class Slot : uint8_t { kFree, kFilling, kClient };
  const std::shared_ptr<ShmRegion> region_;
  Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  int64_t filling_ ABSL_GUARDED_BY(mu_) = -1;  // the slot Acquire gave
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_GRPC_BATCH_OUTLET_H_
