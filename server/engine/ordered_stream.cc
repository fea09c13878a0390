#include "server/engine/ordered_stream.h"

#include <fcntl.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/checked.h"
#include "common/base/limits.h"
#include "common/base/status.h"
#include "server/engine/resume_token.h"
#include "server/io/uring.h"

namespace shardcast {
namespace {

constexpr char kTokenMagic[4] = {'S', 'C', 'O', '1'};
constexpr size_t kTokenBytes = 4 + 8 * 4;

}  // namespace

absl::StatusOr<std::unique_ptr<OrderedStream>> OrderedStream::Create(
    std::shared_ptr<const DatasetReader> reader, std::string dataset_id,
    StreamSpec spec, const std::string& resume_token,
    std::atomic<uint64_t>* disk_bytes) {
  RETURN_IF_ERROR(ValidateStreamSpec(reader->info(), &spec));
  std::unique_ptr<OrderedStream> s(new OrderedStream());
  ASSIGN_OR_RETURN(s->sel_, Selection::Create(reader->desc(), spec));
  s->reader_ = std::move(reader);
  s->dataset_id_ = std::move(dataset_id);
  s->spec_ = spec;
  s->disk_bytes_ = disk_bytes;
  // Node groups, then the ranks within one, get contiguous, disjoint ranges
  // that together cover the selection.
  const int64_t v = s->sel_.num_vectors();
  const int64_t node_lo = MulDiv(v, spec.node_rank, spec.node_count);
  const int64_t node_v =
      MulDiv(v, spec.node_rank + 1, spec.node_count) - node_lo;
  s->lo_ = node_lo + MulDiv(node_v, spec.rank, spec.world_size);
  s->hi_ = node_lo + MulDiv(node_v, spec.rank + 1, spec.world_size);
  s->next_ = s->lo_;
  for (uint8_t l : spec.exclude_labels) s->exclude_[l] = true;
  const DatasetDesc& d = s->reader_->desc();
  s->fds_.resize(d.shards.size());
  s->sparse_ = s->sel_.Sparse(d);
  s->shape_.batch_size = spec.batch_size;
  s->shape_.d_model = d.d_model;
  s->shape_.vector_bytes = d.vector_bytes();
  s->shape_.vectors_per_epoch = s->hi_ - s->lo_;
  // A resume token only continues the request it came from.
  s->fingerprint_ = StreamFingerprint("ordered", s->dataset_id_, spec, "");
  if (!resume_token.empty()) {
    ASSIGN_OR_RETURN(
        TokenReader token,
        TokenReader::Open(resume_token, kTokenMagic, "ordered-stream"));
    uint64_t fingerprint = 0;
    if (resume_token.size() != kTokenBytes || !token.Get(&fingerprint) ||
        !token.Get(&s->epoch_) || !token.Get(&s->next_) ||
        !token.Get(&s->batch_index_)) {
      return absl::InvalidArgumentError(
          "resume_token is not a shardcast ordered-stream token");
    }
    if (fingerprint != s->fingerprint_) {
      return absl::InvalidArgumentError(
          "resume_token was issued for a different stream request (dataset, "
          "selection, batch size or partition differ)");
    }
    if (s->next_ < s->lo_ || s->next_ > s->hi_ || s->epoch_ < 0 ||
        s->epoch_ > limits::kMaxEpochs || s->batch_index_ < 0 ||
        // Every batch took at least one position.
        s->batch_index_ > s->next_ - s->lo_) {
      return absl::InvalidArgumentError(
          "resume_token points outside this stream");
    }
    if (spec.epochs != 0 && s->epoch_ >= spec.epochs) {
      return absl::InvalidArgumentError(
          absl::StrCat("resume_token is for epoch ", s->epoch_,
                       " but the stream asks for ", spec.epochs, " epoch(s)"));
    }
  }
  return s;
}

absl::StatusOr<int> OrderedStream::ShardFd(int64_t shard) {
  UniqueFd& fd = fds_[static_cast<size_t>(shard)];
  if (fd.valid()) return fd.get();
  ASSIGN_OR_RETURN(UniqueFd own, reader_->ReopenShard(shard, 0));
  ::posix_fadvise(own.get(), 0, 0,
                  sparse_ ? POSIX_FADV_RANDOM : POSIX_FADV_SEQUENTIAL);
  fd = std::move(own);
  return fd.get();
}

void OrderedStream::Prefetch(int64_t from, int64_t vectors) {
  const DatasetDesc& d = reader_->desc();
  const uint64_t vb = d.vector_bytes();
  const int64_t k = sel_.vectors_per_row;
  for (int64_t g = from; g < std::min(hi_, from + vectors);) {
    const int64_t row = g / k;
    const int64_t j0 = g % k;
    const int64_t j1 = std::min<int64_t>(k, j0 + (hi_ - g));
    absl::StatusOr<VectorLocation> at = sel_.Locate(d, row, j0);
    if (!at.ok()) return;
    absl::StatusOr<int> fd = ShardFd(at->shard);
    if (!fd.ok()) return;  // the read itself will say why
    ::posix_fadvise(*fd, static_cast<off_t>(at->offset),
                    static_cast<off_t>(static_cast<uint64_t>(j1 - j0) * vb),
                    POSIX_FADV_WILLNEED);
    g += j1 - j0;
  }
}

std::string OrderedStream::ResumeToken() const {
  TokenWriter t(kTokenMagic);
  t.Put<uint64_t>(fingerprint_);
  t.Put<int64_t>(epoch_);
  t.Put<int64_t>(next_);
  t.Put<int64_t>(batch_index_);
  return t.Take();
}

absl::StatusOr<BatchSource::Fill> OrderedStream::Next(
    VectorDest dest, StreamBatch* out, std::function<void()> /*waker*/) {
  ASSIGN_OR_RETURN(bool more, Next(dest, out));
  return more ? Fill::kBatch : Fill::kEnd;
}

absl::StatusOr<bool> OrderedStream::Next(VectorDest dest, StreamBatch* out) {
  const DatasetDesc& d = reader_->desc();
  const uint64_t vb = d.vector_bytes();
  RETURN_IF_ERROR(CheckVectorDest(dest, spec_.batch_size, shape_.vector_bytes));
  // Reads go straight into the destination, unless the vectors are
  // transformed: then into a scratch batch, transformed into the
  // destination after the reads.
  const bool in_place = transform_.identity();
  char* into = dest.data;
  if (!in_place) {
    scratch_.resize(static_cast<size_t>(spec_.batch_size) * vb);
    row_layers_.resize(static_cast<size_t>(spec_.batch_size));
    into = scratch_.data();
  }
  const bool filter = !spec_.exclude_labels.empty();
  const bool has_labels = reader_->info().has_labels;
  const int64_t k = sel_.vectors_per_row;
  const bool all_layers = sel_.layer_index < 0;
  const int64_t cls = d.cls_token ? 1 : 0;
  std::string label_row(static_cast<size_t>(d.content_tokens), '\0');
  while (true) {
    if (spec_.epochs != 0 && epoch_ >= spec_.epochs) return false;
    if (hi_ == lo_ && spec_.epochs == 0) return false;  // nothing, ever
    const bool short_tail =
        !filter && spec_.drop_last && hi_ - next_ < spec_.batch_size;
    int64_t filled = 0;
    int64_t g = next_;
    std::vector<ReadOp> ops;
    if (!short_tail) {
      SizeBatchMetadata(out, static_cast<size_t>(spec_.batch_size), all_layers,
                        has_labels);
      int64_t label_example = -1;
      // Walk the selection from `g`, one row segment at a time; each run of
      // kept tokens becomes one read straight into the destination.
      while (filled < spec_.batch_size && g < hi_) {
        const int64_t row = g / k;
        const int64_t j0 = g % k;
        const int64_t j1 = std::min<int64_t>(k, j0 + (hi_ - g));
        const int64_t example = sel_.example_of(row);
        const int64_t layer_value =
            d.layers[static_cast<size_t>(sel_.layer_of(row))];
        ASSIGN_OR_RETURN(VectorLocation row_start, sel_.Locate(d, row, 0));
        ASSIGN_OR_RETURN(const int shard_fd, ShardFd(row_start.shard));
        if (has_labels && label_example != example) {
          ASSIGN_OR_RETURN(FileRange labels, reader_->LabelsRange(example));
          RETURN_IF_ERROR(UringReader::ThisThread().ReadAll(
              {ReadOp::Into(labels, label_row.data())}));
          label_example = example;
        }
        int64_t run_start = -1;  // token (row-relative) where the run began
        auto flush = [&](int64_t end) {
          if (run_start < 0) return;
          ReadOp op;
          op.fd = shard_fd;
          op.path = &reader_->shard_path(row_start.shard);
          op.offset = row_start.offset + static_cast<uint64_t>(run_start) * vb;
          op.length = static_cast<size_t>(end - run_start) * vb;
          op.dest = into + static_cast<size_t>(filled - (end - run_start)) * vb;
          ops.push_back(op);
          run_start = -1;
        };
        int64_t j = j0;
        for (; j < j1 && filled < spec_.batch_size; ++j) {
          const int64_t token = sel_.token_begin + j;  // token axis index
          const int32_t content = static_cast<int32_t>(token - cls);
          const uint8_t label =
              content < 0 ? 255
                          : static_cast<uint8_t>(
                                label_row[static_cast<size_t>(content)]);
          if (filter && content >= 0 && exclude_[label]) {
            flush(j);
            continue;
          }
          if (run_start < 0) run_start = j;
          SetBatchRow(out, static_cast<size_t>(filled), example, content,
                      layer_value, label);
          if (!in_place) {
            row_layers_[static_cast<size_t>(filled)] = sel_.layer_of(row);
          }
          ++filled;
        }
        flush(j);
        g += j - j0;
      }
      // The next batch's bytes start coming in while this one is read and
      // delivered: the disk never waits for the client.
      Prefetch(g, spec_.batch_size);
      RETURN_IF_ERROR(UringReader::ThisThread().ReadAll(ops));
      if (disk_bytes_ != nullptr) {
        for (const ReadOp& op : ops) *disk_bytes_ += op.length;
      }
      if (!in_place) {
        for (int64_t i = 0; i < filled; ++i) {
          transform_.Apply(
              dest.data + static_cast<size_t>(i) * shape_.vector_bytes,
              into + static_cast<size_t>(i) * vb, d.d_model,
              row_layers_[static_cast<size_t>(i)]);
        }
      }
    }
    if (filled > 0 && (filled == spec_.batch_size || !spec_.drop_last)) {
      SizeBatchMetadata(out, static_cast<size_t>(filled), all_layers,
                        has_labels);
      out->epoch = epoch_;
      out->index = batch_index_;
      out->rows = filled;
      next_ = g;
      ++batch_index_;
      out->resume_token = ResumeToken();
      return true;
    }
    // The epoch is over (nothing left, or only a short batch to drop). One
    // that delivered nothing (drop_last with fewer vectors than a batch,
    // every label excluded) will deliver nothing ever again: end.
    if (batch_index_ == 0) return false;
    ++epoch_;
    next_ = lo_;
    batch_index_ = 0;
  }
}

}  // namespace shardcast
