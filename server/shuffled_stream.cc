#include "server/shuffled_stream.h"

#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/sha256.h"
#include "common/status.h"
#include "common/synth.h"
#include "server/uring_reader.h"

namespace shardcast {
namespace {

constexpr char kTokenMagic[4] = {'S', 'C', 'S', '1'};
constexpr size_t kTokenBytes = 4 + 8 * 3;

UringReader& ThreadReader() {
  thread_local std::unique_ptr<UringReader> reader = UringReader::Create(32);
  return *reader;
}

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

template <typename T>
T Get(const std::string& in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(v));
  return v;
}

}  // namespace

uint64_t ShuffledStream::NextRandom() {
  rng_ += 0x9E3779B97F4A7C15ULL;
  return SplitMix64(rng_);
}

absl::StatusOr<std::unique_ptr<ShuffledStream>> ShuffledStream::Create(
    std::shared_ptr<const DatasetReader> reader, std::string dataset_id,
    StreamSpec spec, uint64_t seed, ShuffleOptions options,
    const std::string& resume_token) {
  if (spec.batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size must be >= 1, got ", spec.batch_size));
  }
  if (spec.epochs < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("epochs must be >= 0 (0 = endless), got ", spec.epochs));
  }
  if (spec.world_size <= 0) spec.world_size = 1;
  if (spec.rank < 0 || spec.rank >= spec.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", spec.rank,
                     " is not in [0, world_size = ", spec.world_size, ")"));
  }
  if (options.window_blocks < 1 || options.block_bytes < 1) {
    return absl::InvalidArgumentError(
        "shuffle window and block size must be >= 1");
  }
  std::unique_ptr<ShuffledStream> s(new ShuffledStream());
  ASSIGN_OR_RETURN(s->sel_, Selection::Create(reader->desc(), spec));
  s->reader_ = std::move(reader);
  s->spec_ = spec;
  s->options_ = options;
  s->seed_ = seed;
  const uint64_t row_bytes = static_cast<uint64_t>(s->sel_.vectors_per_row) *
                             s->reader_->desc().vector_bytes();
  s->rows_per_block_ = std::max<int64_t>(
      1, static_cast<int64_t>(options.block_bytes / row_bytes));
  s->num_blocks_ =
      (s->sel_.num_rows + s->rows_per_block_ - 1) / s->rows_per_block_;
  const int64_t v = s->sel_.num_vectors();
  s->per_epoch_ = v > spec.rank ? (v - spec.rank - 1) / spec.world_size + 1 : 0;
  s->slots_.resize(static_cast<size_t>(options.window_blocks));
  Sha256 h;
  h.Update(absl::StrCat(
      "shuffled|", dataset_id, "|",
      spec.layer.has_value() ? absl::StrCat(*spec.layer) : "all", "|",
      static_cast<int>(spec.tokens), "|", spec.batch_size, "|", spec.rank, "/",
      spec.world_size, "|", spec.drop_last, "|", seed, "|", options.block_bytes,
      "|", options.window_blocks));
  s->fingerprint_ = std::stoull(h.HexDigest().substr(0, 16), nullptr, 16);

  int64_t resume_epoch = 0, resume_batches = 0;
  if (!resume_token.empty()) {
    if (resume_token.size() != kTokenBytes ||
        std::memcmp(resume_token.data(), kTokenMagic, 4) != 0) {
      return absl::InvalidArgumentError(
          "resume_token is not a shardcast shuffled-stream token");
    }
    if (Get<uint64_t>(resume_token, 4) != s->fingerprint_) {
      return absl::InvalidArgumentError(
          "resume_token was issued for a different stream request (dataset, "
          "selection, seed, batch size or partition differ)");
    }
    resume_epoch = Get<int64_t>(resume_token, 12);
    resume_batches = Get<int64_t>(resume_token, 20);
    const int64_t max_batches =
        spec.drop_last
            ? s->per_epoch_ / spec.batch_size
            : (s->per_epoch_ + spec.batch_size - 1) / spec.batch_size;
    if (resume_epoch < 0 || resume_batches < 0 ||
        resume_batches > max_batches) {
      return absl::InvalidArgumentError(
          "resume_token points outside this stream");
    }
  }
  s->epoch_ = resume_epoch;
  s->StartEpoch();
  if (resume_batches > 0) {
    // Replay the epoch's bookkeeping (permutation, window, draws) without
    // reading, then read the blocks that are resident at that point.
    s->dry_ = true;
    StreamBatch scratch;
    for (int64_t b = 0; b < resume_batches; ++b) {
      ASSIGN_OR_RETURN(bool more, s->Next(&scratch));
      if (!more) break;
    }
    s->dry_ = false;
    for (Slot& slot : s->slots_) {
      if (slot.block >= 0 && slot.remaining > 0)
        RETURN_IF_ERROR(s->ReadSlot(&slot));
    }
  }
  return s;
}

void ShuffledStream::StartEpoch() {
  rng_ = SplitMix64(seed_ ^ SplitMix64(static_cast<uint64_t>(epoch_) + 1));
  order_.resize(static_cast<size_t>(num_blocks_));
  std::iota(order_.begin(), order_.end(), 0);
  for (size_t i = order_.size(); i > 1; --i) {  // Fisher-Yates, our RNG
    const size_t j = static_cast<size_t>(
        (static_cast<unsigned __int128>(NextRandom()) * i) >> 64);
    std::swap(order_[i - 1], order_[j]);
  }
  next_block_ = 0;
  pool_.clear();
  free_slots_.clear();
  for (size_t i = slots_.size(); i > 0; --i) {
    slots_[i - 1].block = -1;
    slots_[i - 1].remaining = 0;
    free_slots_.push_back(static_cast<uint32_t>(i - 1));
  }
  delivered_ = 0;
  batch_index_ = 0;
}

absl::Status ShuffledStream::LoadBlock(int64_t block, Slot* slot, bool read) {
  const uint32_t index = static_cast<uint32_t>(slot - slots_.data());
  const int64_t first_row = block * rows_per_block_;
  const int64_t rows = std::min(rows_per_block_, sel_.num_rows - first_row);
  const int64_t k = sel_.vectors_per_row;
  slot->block = block;
  slot->remaining = 0;
  for (int64_t local = 0; local < rows * k; ++local) {
    const int64_t g = first_row * k + local;
    if (g % spec_.world_size != spec_.rank) continue;
    pool_.push_back({index, static_cast<uint32_t>(local)});
    ++slot->remaining;
  }
  if (read && slot->remaining > 0) RETURN_IF_ERROR(ReadSlot(slot));
  return absl::OkStatus();
}

absl::Status ShuffledStream::ReadSlot(Slot* slot) {
  const DatasetDesc& d = reader_->desc();
  const int64_t first_row = slot->block * rows_per_block_;
  const int64_t rows = std::min(rows_per_block_, sel_.num_rows - first_row);
  const int64_t k = sel_.vectors_per_row;
  const uint64_t row_bytes = static_cast<uint64_t>(k) * d.vector_bytes();
  slot->data.resize(static_cast<size_t>(rows) * row_bytes);  // reused capacity
  const bool all_layers = sel_.layer_index < 0;
  std::vector<ReadOp> ops(static_cast<size_t>(rows));
  if (reader_->info().has_labels) {
    slot->labels.resize(static_cast<size_t>(rows * d.content_tokens));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = first_row + r;
    const int64_t example = all_layers ? row / d.num_layers() : row;
    const int64_t li = all_layers ? row % d.num_layers() : sel_.layer_index;
    ASSIGN_OR_RETURN(VectorLocation loc, LocateExample(d, example));
    ReadOp& op = ops[static_cast<size_t>(r)];
    op.fd = reader_->shard_fd(loc.shard);
    op.path = &reader_->shard_path(loc.shard);
    op.offset = loc.offset + (static_cast<uint64_t>(li) * d.tokens_per_example +
                              static_cast<uint64_t>(sel_.token_begin)) *
                                 d.vector_bytes();
    op.length = row_bytes;
    op.dest = slot->data.data() + static_cast<size_t>(r) * row_bytes;
    if (!slot->labels.empty()) {
      RETURN_IF_ERROR(reader_->ReadLabels(
          example,
          reinterpret_cast<uint8_t*>(
              &slot->labels[static_cast<size_t>(r * d.content_tokens)])));
    }
  }
  return ThreadReader().ReadAll(ops);
}

absl::Status ShuffledStream::Refill() {
  while (!free_slots_.empty() && next_block_ < order_.size()) {
    Slot* slot = &slots_[free_slots_.back()];
    free_slots_.pop_back();
    RETURN_IF_ERROR(LoadBlock(order_[next_block_++], slot, !dry_));
    if (slot->remaining == 0) {  // nothing of this partition in the block
      slot->block = -1;
      free_slots_.push_back(static_cast<uint32_t>(slot - slots_.data()));
    }
  }
  return absl::OkStatus();
}

std::string ShuffledStream::ResumeToken() const {
  std::string t(kTokenMagic, 4);
  Put<uint64_t>(t, fingerprint_);
  Put<int64_t>(t, epoch_);
  Put<int64_t>(t, batch_index_);
  return t;
}

absl::StatusOr<bool> ShuffledStream::Next(StreamBatch* out) {
  while (true) {
    if (spec_.epochs != 0 && epoch_ >= spec_.epochs) return false;
    const int64_t left = per_epoch_ - delivered_;
    if (left > 0 && !(spec_.drop_last && left < spec_.batch_size)) break;
    if (per_epoch_ == 0 && spec_.epochs == 0) return false;  // nothing, ever
    ++epoch_;
    StartEpoch();
  }
  const DatasetDesc& d = reader_->desc();
  const int64_t n = std::min(spec_.batch_size, per_epoch_ - delivered_);
  const uint64_t vb = d.vector_bytes();
  const int64_t k = sel_.vectors_per_row;
  const bool all_layers = sel_.layer_index < 0;
  const bool labels = reader_->info().has_labels;
  if (!dry_) {
    out->epoch = epoch_;
    out->index = batch_index_;
    out->rows = n;
    out->vectors = Payload(static_cast<size_t>(n) * vb);
    out->example_idx.assign(static_cast<size_t>(n) * 8, '\0');
    out->token_idx.assign(static_cast<size_t>(n) * 4, '\0');
    out->layer.assign(all_layers ? static_cast<size_t>(n) * 8 : 0, '\0');
    out->labels.assign(labels ? static_cast<size_t>(n) : 0, '\0');
  }
  for (int64_t i = 0; i < n; ++i) {
    RETURN_IF_ERROR(Refill());
    if (pool_.empty()) {
      return absl::InternalError("shuffle pool ran dry before the epoch ended");
    }
    const size_t pick = static_cast<size_t>(
        (static_cast<unsigned __int128>(NextRandom()) * pool_.size()) >> 64);
    const Entry e = pool_[pick];
    pool_[pick] = pool_.back();
    pool_.pop_back();
    Slot& slot = slots_[e.slot];
    if (!dry_) {
      const int64_t row = slot.block * rows_per_block_ + e.local / k;
      const int64_t j = e.local % k;
      const int64_t example = all_layers ? row / d.num_layers() : row;
      const int64_t li = all_layers ? row % d.num_layers() : sel_.layer_index;
      const int32_t content =
          static_cast<int32_t>(sel_.token_begin + j - (d.cls_token ? 1 : 0));
      const size_t at = static_cast<size_t>(i);
      std::memcpy(out->vectors.data() + at * vb,
                  slot.data.data() + static_cast<size_t>(e.local) * vb, vb);
      std::memcpy(&out->example_idx[at * 8], &example, 8);
      std::memcpy(&out->token_idx[at * 4], &content, 4);
      if (all_layers) {
        const int64_t value = d.layers[static_cast<size_t>(li)];
        std::memcpy(&out->layer[at * 8], &value, 8);
      }
      if (labels) {
        const int64_t r = e.local / k;
        out->labels[at] = content < 0 ? static_cast<char>(255)
                                      : slot.labels[static_cast<size_t>(
                                            r * d.content_tokens + content)];
      }
    }
    if (--slot.remaining == 0) {
      slot.block = -1;
      free_slots_.push_back(e.slot);
    }
  }
  delivered_ += n;
  ++batch_index_;
  if (!dry_) out->resume_token = ResumeToken();
  return true;
}

}  // namespace shardcast
