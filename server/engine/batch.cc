#include "server/engine/batch.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardcast {

void SizeBatchMetadata(StreamBatch* out, size_t rows, bool all_layers,
                       bool labels) {
  out->example_idx.resize(rows * 8);
  out->token_idx.resize(rows * 4);
  out->layer.resize(all_layers ? rows * 8 : 0);
  out->labels.resize(labels ? rows : 0);
}

void SetBatchRow(StreamBatch* out, size_t i, int64_t example, int32_t content,
                 int64_t layer_value, uint8_t label) {
  std::memcpy(&out->example_idx[i * 8], &example, 8);
  std::memcpy(&out->token_idx[i * 4], &content, 4);
  if (!out->layer.empty()) std::memcpy(&out->layer[i * 8], &layer_value, 8);
  if (!out->labels.empty()) out->labels[i] = static_cast<char>(label);
}

uint32_t VectorViews::PinOf(const void* owner) {
  return pin_of_.try_emplace(owner, static_cast<uint32_t>(pins.size()))
      .first->second;
}

void VectorViews::AddRun(const char* data, size_t bytes, uint32_t pin) {
  if (!runs.empty()) {
    Run& last = runs.back();
    if (last.pin == pin && last.data + last.bytes == data) {
      last.bytes += bytes;
      return;
    }
  }
  runs.push_back({data, bytes, pin});
}

size_t VectorViews::total_bytes() const {
  size_t total = 0;
  for (const Run& r : runs) total += r.bytes;
  return total;
}

void VectorViews::Clear() {
  runs.clear();
  pins.clear();
  pin_of_.clear();
}

absl::Status CheckVectorDest(VectorDest dest, int64_t batch_size,
                             uint64_t vector_bytes) {
  if (dest.views != nullptr) return absl::OkStatus();
  if (dest.capacity < static_cast<uint64_t>(batch_size) * vector_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch buffer of ", dest.capacity, " bytes is smaller than a batch (",
        batch_size, " x ", vector_bytes, ")"));
  }
  return absl::OkStatus();
}

}  // namespace shardcast
