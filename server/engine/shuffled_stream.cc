#include "server/engine/shuffled_stream.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/limits.h"
#include "common/base/random.h"
#include "common/base/status.h"
#include "server/engine/resume_token.h"
#include "server/engine/stream_copy.h"

namespace shardcast {
namespace {

constexpr char kTokenMagic[4] = {'S', 'C', 'S', '2'};

// Reads the bitmap of an IndexSet of `n` from `token`.
absl::StatusOr<IndexSet> GetSet(TokenReader& token, int64_t n,
                                absl::string_view what) {
  absl::string_view bytes;
  if (!token.GetBytes(static_cast<size_t>((n + 7) / 8), &bytes)) {
    return MalformedToken(absl::StrCat(what, " cut short"));
  }
  absl::StatusOr<IndexSet> set = IndexSet::FromBytes(n, bytes);
  if (!set.ok()) {
    return MalformedToken(absl::StrCat(what, ": ", set.status().message()));
  }
  return set;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShuffledStream>> ShuffledStream::Create(
    ScanRegistry* registry, std::shared_ptr<const DatasetReader> reader,
    std::string dataset_id, StreamSpec spec, uint64_t seed,
    const std::string& resume_token, std::string peer, std::string client) {
  RETURN_IF_ERROR(ValidateStreamSpec(reader->info(), &spec));
  std::unique_ptr<ShuffledStream> s(new ShuffledStream());
  ASSIGN_OR_RETURN(s->layout_, registry->Layout(reader->desc(), spec));
  s->reader_ = reader;
  s->spec_ = spec;
  s->seed_ = seed;
  s->window_ = registry->options().window_blocks;
  for (uint8_t l : spec.exclude_labels) s->exclude_[l] = true;
  s->filter_ = !spec.exclude_labels.empty();
  const int64_t v = s->layout_.sel.num_vectors();
  s->per_epoch_ = s->filter_      ? -1
                  : v > spec.rank ? (v - spec.rank - 1) / spec.world_size + 1
                                  : 0;
  if (!s->filter_ && spec.node_count > 1) {
    // This node group's blocks only: their vectors of this rank.
    const BlockLayout& l = s->layout_;
    s->per_epoch_ = 0;
    for (int64_t b = spec.node_rank; b < l.num_blocks; b += spec.node_count) {
      s->per_epoch_ += l.vectors_of_rank(b, spec.rank, spec.world_size);
    }
  }
  const DatasetDesc& d = reader->desc();
  s->shape_.batch_size = spec.batch_size;
  s->shape_.d_model = d.d_model;
  s->shape_.vector_bytes = d.vector_bytes();
  s->shape_.vectors_per_epoch = s->per_epoch_;
  s->fingerprint_ =
      StreamFingerprint("shuffled2", dataset_id, spec,
                        absl::StrCat(seed, "|", s->layout_.vectors_per_block));

  SubscriberSpec sub;
  sub.peer = std::move(peer);
  sub.client = std::move(client);
  sub.rank = spec.rank;
  sub.world_size = spec.world_size;
  sub.node_rank = spec.node_rank;
  sub.node_count = spec.node_count;
  sub.epochs = spec.epochs;
  int64_t batch_index = 0;
  if (!resume_token.empty()) {
    IndexSet needed;
    RETURN_IF_ERROR(s->ParseToken(resume_token, &needed));
    if (spec.epochs != 0 && s->epoch_ >= spec.epochs) {
      return absl::InvalidArgumentError(
          absl::StrCat("resume_token is for epoch ", s->epoch_,
                       " but the stream asks for ", spec.epochs, " epoch(s)"));
    }
    sub.needed = std::move(needed);
    batch_index = s->batch_index_;
  }
  sub.epoch = s->epoch_;
  s->active_.resize(static_cast<size_t>(s->window_));
  for (int64_t i = s->window_; i > 0; --i) {
    s->free_slots_.push_back(static_cast<uint32_t>(i - 1));
  }
  s->StartEpoch(s->epoch_, batch_index);
  if (spec.epochs == 0 || s->epoch_ < spec.epochs) {
    ASSIGN_OR_RETURN(s->sub_, registry->Subscribe(reader, dataset_id, spec,
                                                  seed, std::move(sub)));
  }
  return s;
}

ShuffledStream::~ShuffledStream() {
  pool_.clear();
  active_.clear();  // blocks go back before the reservation does
  sub_.reset();
}

absl::Status ShuffledStream::ParseToken(const std::string& resume_token,
                                        IndexSet* needed) {
  ASSIGN_OR_RETURN(
      TokenReader token,
      TokenReader::Open(resume_token, kTokenMagic, "shuffled-stream"));
  uint64_t fingerprint;
  int64_t epoch, batch_index, blocks;
  if (!token.Get(&fingerprint) || !token.Get(&epoch) ||
      !token.Get(&batch_index) || !token.Get(&blocks)) {
    return MalformedToken("too short");
  }
  if (fingerprint != fingerprint_) {
    return absl::InvalidArgumentError(
        "resume_token was issued for a different stream request (dataset, "
        "selection, seed, batch size, partition, label filter or the "
        "daemon's --block-bytes differ)");
  }
  // Bounded, so that counting on from them cannot overflow.
  if (epoch < 0 || batch_index < 0 || epoch > limits::kMaxEpochs ||
      batch_index > layout_.sel.num_vectors()) {
    return MalformedToken("epoch or batch out of range");
  }
  if (blocks != layout_.num_blocks) {
    return MalformedToken(absl::StrCat(
        "it names ", blocks, " blocks, the stream has ", layout_.num_blocks));
  }
  ASSIGN_OR_RETURN(IndexSet set, GetSet(token, blocks, "block bitmap"));
  uint32_t partial = 0;
  if (!token.Get(&partial)) return MalformedToken("no partial-block count");
  for (uint32_t i = 0; i < partial; ++i) {
    int64_t block;
    uint32_t bits;
    if (!token.Get(&block) || !token.Get(&bits)) {
      return MalformedToken("partial block cut short");
    }
    if (block < 0 || block >= blocks || !set.Has(block) ||
        partial_.count(block) != 0 ||
        static_cast<int64_t>(bits) != layout_.vectors(block)) {
      return MalformedToken(absl::StrCat("bad partial block ", block));
    }
    ASSIGN_OR_RETURN(partial_[block],
                     GetSet(token, bits, "partial-block bitmap"));
  }
  if (token.remaining() != 0) return MalformedToken("trailing bytes");
  // Every batch delivered at least one vector of this stream, and a
  // delivered vector is owed no more: the batch index cannot pass the
  // stream's vectors the token no longer owes. (A stream that accepted a
  // token beyond that would issue one it refuses.)
  const int64_t w = spec_.world_size;
  int64_t not_owed = 0;
  for (int64_t b = spec_.node_rank; b < blocks; b += spec_.node_count) {
    if (!set.Has(b)) not_owed += layout_.vectors_of_rank(b, spec_.rank, w);
  }
  for (const auto& [b, remaining] : partial_) {  // blocks of `set`
    if (b % spec_.node_count != spec_.node_rank) continue;
    for (int64_t local = layout_.first_of_rank(b, spec_.rank, w);
         local < layout_.vectors(b); local += w) {
      if (!remaining.Has(local)) ++not_owed;
    }
  }
  if (batch_index > not_owed) {
    return MalformedToken(absl::StrCat("batch ", batch_index, " is past the ",
                                       not_owed, " vectors it has delivered"));
  }
  epoch_ = epoch;
  batch_index_ = batch_index;
  *needed = std::move(set);
  return absl::OkStatus();
}

std::string ShuffledStream::ResumeToken() const {
  // Blocks never taken in this epoch, plus the partly delivered ones: those
  // in the window (their vectors not drawn yet, Active::left)
  // and those a resume token gave that have not come back yet.
  IndexSet left = sub_->scan()->Untaken(sub_->id(), epoch_);
  // Block -> its vectors still owed, in block order.
  std::vector<std::pair<int64_t, const IndexSet*>> partial;
  for (const auto& [block, remaining] : partial_) {
    if (left.Has(block)) partial.emplace_back(block, &remaining);
  }
  for (const Active& a : active_) {
    if (a.block == nullptr) continue;
    partial.emplace_back(a.block->id, &a.left);
    left.Set(a.block->id);
  }
  std::sort(partial.begin(), partial.end(),
            [](const auto& x, const auto& y) { return x.first < y.first; });
  TokenWriter t(kTokenMagic);
  t.Put<uint64_t>(fingerprint_);
  t.Put<int64_t>(epoch_);
  t.Put<int64_t>(batch_index_);
  t.Put<int64_t>(layout_.num_blocks);
  t.Append(left.ToBytes());
  t.Put<uint32_t>(static_cast<uint32_t>(partial.size()));
  for (const auto& [block, remaining] : partial) {
    t.Put<int64_t>(block);
    t.Put<uint32_t>(static_cast<uint32_t>(remaining->size()));
    t.Append(remaining->ToBytes());
  }
  return t.Take();
}

void ShuffledStream::StartEpoch(int64_t epoch, int64_t batch_index) {
  epoch_ = epoch;
  batch_index_ = batch_index;
  delivered_all_ = false;
  // The draw sequence is a function of (seed, epoch, where the epoch
  // (re)started).
  rng_ = SplitMix64(seed_ ^ SplitMix64(static_cast<uint64_t>(epoch) + 1) ^
                    SplitMix64(~static_cast<uint64_t>(batch_index)));
}

void ShuffledStream::Activate(BlockRef block) {
  const uint32_t slot = free_slots_.back();
  Active& a = active_[slot];
  a.left = IndexSet(block->vectors);
  const IndexSet* partial = nullptr;
  auto it = partial_.find(block->id);
  if (it != partial_.end()) partial = &it->second;
  const DatasetDesc& d = reader_->desc();
  const Selection& sel = layout_.sel;
  const int64_t w = spec_.world_size;
  const int64_t k = sel.vectors_per_row;
  const int64_t cls = d.cls_token ? 1 : 0;
  const int64_t first = block->first_vector;
  int64_t local = layout_.first_of_rank(block->id, spec_.rank, w);
  for (; local < block->vectors; local += w) {
    if (partial != nullptr && !partial->Has(local)) continue;
    if (filter_) {
      const int64_t g = first + local;
      const int64_t content = sel.token_begin + g % k - cls;
      if (content >= 0 && exclude_[block->Label(sel.example_of(g / k), content,
                                                d.content_tokens)]) {
        continue;
      }
    }
    pool_.push_back({slot, static_cast<uint32_t>(local)});
    a.left.Set(local);
  }
  if (partial != nullptr) partial_.erase(it);
  if (a.left.count() > 0) {
    a.block = std::move(block);
    free_slots_.pop_back();
    ++active_count_;
  }
}

absl::StatusOr<ShuffledStream::Draw> ShuffledStream::EnsureDrawable(
    const std::function<void()>& waker) {
  while (active_count_ < window_ && !delivered_all_) {
    ASSIGN_OR_RETURN(Take t,
                     sub_->scan()->TakeBlock(sub_->id(), epoch_, waker));
    switch (t.kind) {
      case Take::kBlock:
        Activate(std::move(t.block));
        break;
      case Take::kWait:
        return Draw::kPending;
      case Take::kDelivered:
        delivered_all_ = true;
        break;
    }
  }
  return pool_.empty() ? Draw::kExhausted : Draw::kReady;
}

void ShuffledStream::DrawInto(VectorDest dest, StreamBatch* out, int64_t i) {
  rng_ += 0x9E3779B97F4A7C15ULL;
  const size_t pick =
      static_cast<size_t>(UniformIndex(SplitMix64(rng_), pool_.size()));
  const Entry e = pool_[pick];
  pool_[pick] = pool_.back();
  pool_.pop_back();
  Active& a = active_[e.slot];
  a.left.Clear(e.local);
  const Block& b = *a.block;
  const DatasetDesc& d = reader_->desc();
  const Selection& sel = layout_.sel;
  const size_t at = static_cast<size_t>(i);
  const int64_t g = b.first_vector + e.local;
  const int64_t row = g / sel.vectors_per_row;
  if (dest.views != nullptr) {
    dest.views->Add(b.vector(e.local), shape_.vector_bytes, a.block);
    viewed_ = true;
  } else {
    copies_.push_back({dest.data + at * shape_.vector_bytes, b.vector(e.local),
                       sel.layer_of(row)});
  }
  const int64_t example = sel.example_of(row);
  const int32_t content = static_cast<int32_t>(
      sel.token_begin + g % sel.vectors_per_row - (d.cls_token ? 1 : 0));
  SetBatchRow(out, at, example, content,
              d.layers[static_cast<size_t>(sel.layer_of(row))],
              content < 0 || out->labels.empty()
                  ? 255
                  : b.Label(example, content, d.content_tokens));
  if (a.left.count() == 0) {
    // The scan may reuse its slot once nobody holds it: after the copies.
    retired_.push_back(std::move(a.block));
    free_slots_.push_back(e.slot);
    --active_count_;
  }
}

absl::Status ShuffledStream::Copy() {
  // The sources are random vectors of a window of blocks, far larger than
  // the caches: starting the load of a vector a few ahead keeps the memory
  // busy while this one is copied; the destination is written with
  // streaming stores (stream_copy.h), fenced before the batch is handed on.
  constexpr size_t kAhead = 4;
  const size_t vb = static_cast<size_t>(layout_.vector_bytes);
  auto copy = [this, vb](size_t begin, size_t end) {
    for (size_t k = begin; k < end; ++k) {
      if (k + kAhead < end) PrefetchVector(copies_[k + kAhead].src, vb);
      if (transform_.identity()) {
        StreamCopy(copies_[k].dst, copies_[k].src, vb);
      } else {
        transform_.Apply(copies_[k].dst, copies_[k].src, shape_.d_model,
                         copies_[k].layer_index);
      }
    }
    StreamCopyFence();
  };
  // A batch of at least two parts' worth is copied in parts, on this
  // thread and the registry's helpers (gather_pool.h).
  const size_t part_bytes = std::max<size_t>(
      1, static_cast<size_t>(sub_->options().gather_part_bytes));
  GatherPool* pool = sub_->gather();
  const size_t n = copies_.size();
  const size_t parts = std::min<size_t>(
      static_cast<size_t>(pool->helpers()) + 1, n * vb / part_bytes);
  if (parts >= 2) {
    pool->Run(parts, [&copy, n, parts](size_t p) {
      copy(n * p / parts, n * (p + 1) / parts);
    });
  } else {
    copy(0, n);
  }
  const bool copied = !copies_.empty() || viewed_;
  copies_.clear();
  viewed_ = false;
  // A block served from a shard map whose file lost data since the block
  // was made (truncated under us: MappedFile) copied zeros for it: the
  // batch must not go out.
  absl::Status damaged;
  Block::FileSizes sizes;  // each file's size read once for this batch
  auto check = [&damaged, &sizes](const BlockRef& b) {
    if (damaged.ok() && b != nullptr) damaged = b->CheckMapped(&sizes);
  };
  if (copied) {
    for (const BlockRef& b : retired_) check(b);
    for (const Active& a : active_) check(a.block);
  }
  retired_.clear();
  return damaged;
}

absl::StatusOr<BatchSource::Fill> ShuffledStream::Next(
    VectorDest dest, StreamBatch* out, std::function<void()> waker) {
  absl::StatusOr<Fill> fill = Assemble(dest, out, std::move(waker));
  // The vectors drawn, whatever the outcome.
  RETURN_IF_ERROR(Copy());
  return fill;
}

absl::StatusOr<BatchSource::Fill> ShuffledStream::Assemble(
    VectorDest dest, StreamBatch* out, std::function<void()> waker) {
  RETURN_IF_ERROR(CheckVectorDest(dest, spec_.batch_size, shape_.vector_bytes));
  if (dest.views != nullptr && !CanView()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", shape_.transform,
                     " output is converted while copied: it cannot be given "
                     "as views of the blocks"));
  }
  const bool all_layers = layout_.sel.layer_index < 0;
  const bool labels = reader_->info().has_labels;
  while (true) {
    if (spec_.epochs != 0 && epoch_ >= spec_.epochs) return Fill::kEnd;
    if (!in_batch_) {
      SizeBatchMetadata(out, static_cast<size_t>(spec_.batch_size), all_layers,
                        labels);
      filled_ = 0;
      in_batch_ = true;
    }
    while (filled_ < spec_.batch_size) {
      ASSIGN_OR_RETURN(Draw st, EnsureDrawable(waker));
      if (st == Draw::kPending) return Fill::kPending;
      if (st == Draw::kExhausted) break;
      DrawInto(dest, out, filled_++);
    }
    if (filled_ == spec_.batch_size || (filled_ > 0 && !spec_.drop_last)) {
      const size_t n = static_cast<size_t>(filled_);
      SizeBatchMetadata(out, n, all_layers, labels);
      out->epoch = epoch_;
      out->index = batch_index_;
      out->rows = filled_;
      ++batch_index_;
      in_batch_ = false;
      out->resume_token = ResumeToken();
      sub_->scan()->AddDelivered(sub_->id(), n * shape_.vector_bytes);
      return Fill::kBatch;
    }
    // The epoch is over: nothing left, or only a short batch to drop.
    in_batch_ = false;
    // Nothing of a dropped batch may reach the next one, which fills the
    // same rows: neither its views (runs in front of the next batch's) nor
    // its copies not made yet (a second write to those rows, which a gather
    // helper could finish last). Its blocks stay held until Copy() as usual.
    copies_.clear();
    if (dest.views != nullptr) dest.views->Clear();
    // An epoch that delivered nothing (drop_last with fewer vectors than a
    // batch, every label excluded) will deliver nothing ever again: end
    // instead of re-reading the selection for ever.
    if (batch_index_ == 0) return Fill::kEnd;
    StartEpoch(epoch_ + 1, 0);
  }
}

}  // namespace shardcast
