// The seam between the engine and its transports. A transport (the gRPC
// Stream reactor today, a shared-memory path next) opens a BatchSource with
// Engine::OpenStream (server/engine/engine.h) and asks it for batches: each
// batch's vectors are written once, straight into memory the transport owns
// (VectorDest), and its small columns into a StreamBatch. Both stream kinds,
// ordered (disk order) and shuffled (on a shared scan), implement it; the
// transport never learns which one it has.
#ifndef SHARDCAST_SERVER_ENGINE_BATCH_SOURCE_H_
#define SHARDCAST_SERVER_ENGINE_BATCH_SOURCE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "server/engine/batch.h"
#include "server/engine/transform.h"

namespace shardcast {

/// A stream's fixed figures, known once it is open.
struct BatchShape {
  int64_t batch_size = 0;  // rows of a full batch
  int64_t d_model = 0;
  /// Bytes of one delivered vector: d_model * 4, or * 2 for 16-bit output.
  uint64_t vector_bytes = 0;
  OutputDType dtype = OutputDType::kFloat32;
  std::string transform = "float32";  // VectorTransform::name()
  /// Vectors this client gets per epoch (its partition); -1 when a label
  /// filter makes it unknown until the labels are read.
  int64_t vectors_per_epoch = 0;
  /// Bytes of a full batch's vectors: what a VectorDest must hold.
  uint64_t batch_bytes() const {
    return static_cast<uint64_t>(batch_size) * vector_bytes;
  }
};

/// One client's stream of batches. Not thread-safe: driven by one thread at
/// a time. Destroying it leaves the stream's resources (a shared scan's
/// subscription, reservoir reservation) at once.
class BatchSource {
 public:
  enum class Fill {
    kBatch,    // the destination and `out` hold a complete batch
    kPending,  // waiting for blocks: `waker` will be called
    kEnd,      // every requested epoch is done
  };

  virtual ~BatchSource() = default;

  /// Assembles the next batch: vectors into `dest` (at least
  /// shape().batch_bytes(); INVALID_ARGUMENT otherwise), metadata into `out`.
  /// On kPending the batch is partly assembled: call again with the same
  /// `dest` after `waker` runs. `waker` may run on another thread, even
  /// before Next returns, with engine locks held: it must only schedule
  /// work. DATA_LOSS naming the file when a shard turned out short or
  /// unreadable.
  virtual absl::StatusOr<Fill> Next(VectorDest dest, StreamBatch* out,
                                    std::function<void()> waker) = 0;

  /// True when Next may be given a VectorDest with `views` (batch.h): the
  /// source can hand out its vectors where they lie, with no copy (plain
  /// float32 output from blocks in memory). A transform always copies.
  virtual bool CanView() const { return false; }

  const BatchShape& shape() const { return shape_; }

  /// Applies `transform` to every vector from the next batch on (instead of
  /// the plain float32 copy); the shape's vector_bytes, dtype and transform
  /// follow it. Call before the first Next.
  void SetTransform(VectorTransform transform) {
    transform_ = std::move(transform);
    shape_.vector_bytes = transform_.out_vector_bytes(shape_.d_model);
    shape_.dtype = transform_.dtype();
    shape_.transform = transform_.name();
  }

 protected:
  BatchShape shape_;
  VectorTransform transform_;
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_BATCH_SOURCE_H_
