// A stream batch as the engine assembles it: the vectors go once into memory
// the transport owns (VectorDest), the small per-row columns into a
// StreamBatch the transport puts on the wire.
#ifndef SHARDCAST_SERVER_ENGINE_BATCH_H_
#define SHARDCAST_SERVER_ENGINE_BATCH_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"

namespace shardcast {

/// A batch's vectors left where the engine holds them (reservoir slots,
/// shard maps), for a transport that can send memory without copying it
/// (gRPC slices). Each run is valid while its pin lives; the transport keeps
/// the pins until the bytes are sent.
struct VectorViews {
  struct Run {
    const char* data;
    size_t bytes;
    uint32_t pin;  // index into pins
  };
  std::vector<Run> runs;  // in batch order
  std::vector<std::shared_ptr<const void>> pins;

  /// Appends `bytes` at `data`, kept valid by `owner` (pinned once per
  /// batch however many runs it holds); merges with the run before when
  /// they are adjacent in the same owner.
  template <typename T>
  void Add(const char* data, size_t bytes, const std::shared_ptr<T>& owner) {
    const uint32_t pin = PinOf(owner.get());
    if (pin == pins.size()) pins.push_back(owner);
    AddRun(data, bytes, pin);
  }
  /// The bytes of all runs.
  size_t total_bytes() const;
  void Clear();

 private:
  // The pin of `owner`, pins.size() for one not pinned yet.
  uint32_t PinOf(const void* owner);
  void AddRun(const char* data, size_t bytes, uint32_t pin);

  std::unordered_map<const void*, uint32_t> pin_of_;
};

/// Where a batch's vectors go: memory the transport owns (a gRPC payload
/// buffer, a shared-memory slot), written once. Not owned. With `views`
/// set (only for a source whose CanView() is true), the source lists the
/// vectors there instead and `data` is not used.
struct VectorDest {
  char* data = nullptr;
  size_t capacity = 0;
  VectorViews* views = nullptr;
};

/// One batch's metadata, ready for the wire; its vectors (float32 [rows, D])
/// are in the VectorDest the batch was assembled into.
struct StreamBatch {
  int64_t epoch = 0;
  int64_t index = 0;
  int64_t rows = 0;
  std::string example_idx;  // int64 LE [rows]
  std::string token_idx;    // int32 LE [rows], -1 = CLS
  std::string layer;        // int64 LE [rows] when all layers, else empty
  std::string labels;       // uint8 [rows] when labels exist (255 = CLS)
  std::string resume_token;
  /// The stream's output type and transform (BatchShape's), for the wire:
  /// 0 float32, 1 bfloat16, 2 float16 (OutputDType's order).
  int dtype = 0;
  std::string transform;
};

/// Sizes a batch's metadata fields for `rows` vectors: the layer column only
/// when all layers are selected, labels only when the dataset has them.
void SizeBatchMetadata(StreamBatch* out, size_t rows, bool all_layers,
                       bool labels);

/// Writes row `i` of a sized batch: example, content-token index (-1 for
/// CLS), and the layer value and label when the batch has those columns.
void SetBatchRow(StreamBatch* out, size_t i, int64_t example, int32_t content,
                 int64_t layer_value, uint8_t label);

/// INVALID_ARGUMENT when `dest` cannot hold `batch_size` vectors.
absl::Status CheckVectorDest(VectorDest dest, int64_t batch_size,
                             uint64_t vector_bytes);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_BATCH_H_
