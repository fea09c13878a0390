#include "server/transport/grpc/batch_outlet.h"

#include "absl/strings/str_cat.h"
#include "server/transport/grpc/grpc_wire.h"

namespace shardcast {

MessageOutlet::~MessageOutlet() {
  if (buffer_ != nullptr) BufferPool::Return(buffer_);
}

std::optional<VectorDest> MessageOutlet::Acquire(uint64_t bytes, bool views) {
  // A source's CanView does not change between batches, so a batch under
  // way (kPending) gets the same destination again.
  viewing_ = views;
  if (views) return VectorDest{nullptr, 0, &views_};
  if (buffer_ == nullptr) buffer_ = pool_->Get(static_cast<size_t>(bytes));
  return VectorDest{buffer_->data, buffer_->size};
}

grpc::ByteBuffer MessageOutlet::Reply(StreamBatch& batch, int64_t d_model,
                                      uint64_t vector_bytes) {
  if (viewing_) return ViewsBatchReply(batch, d_model, &views_);
  grpc::ByteBuffer reply = BatchReply(batch, d_model, buffer_, vector_bytes);
  buffer_ = nullptr;  // the reply's slice owns it now
  return reply;
}

SlotOutlet::SlotOutlet(std::shared_ptr<ShmRegion> region)
    : region_(std::move(region)), slots_(region_->slots(), Slot::kFree) {}

std::optional<VectorDest> SlotOutlet::Acquire(uint64_t bytes, bool /*views*/) {
  MutexLock lock(&mu_);
  if (bytes > region_->slot_bytes()) return std::nullopt;  // Open checks it
  if (filling_ < 0) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i] == Slot::kFree) {
        slots_[i] = Slot::kFilling;
        filling_ = static_cast<int64_t>(i);
        break;
      }
    }
    if (filling_ < 0) return std::nullopt;
  }
  return VectorDest{region_->slot_data(static_cast<uint32_t>(filling_)),
                    static_cast<size_t>(region_->slot_bytes())};
}

grpc::ByteBuffer SlotOutlet::Reply(StreamBatch& batch, int64_t d_model,
                                   uint64_t /*vector_bytes*/) {
  uint32_t slot;
  {
    MutexLock lock(&mu_);
    slot = static_cast<uint32_t>(filling_);
    slots_[static_cast<size_t>(filling_)] = Slot::kClient;
    filling_ = -1;
  }
  return SlotBatchReply(batch, d_model, slot);
}

absl::Status SlotOutlet::Release(uint32_t slot) {
  MutexLock lock(&mu_);
  if (slot >= slots_.size() || slots_[slot] != Slot::kClient) {
    return absl::InvalidArgumentError(
        absl::StrCat("release of slot ", slot,
                     ", which the client does not hold (the "
                     "region has ",
                     slots_.size(),
                     " slots; a slot is the client's from "
                     "the batch that names it until it is released once)"));
  }
  slots_[slot] = Slot::kFree;
  return absl::OkStatus();
}

}  // namespace shardcast
