#include "server/ordered_stream.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/sha256.h"
#include "common/status.h"
#include "server/uring_reader.h"

namespace shardcast {
namespace {

constexpr char kTokenMagic[4] = {'S', 'C', 'O', '1'};
constexpr size_t kTokenBytes = 4 + 8 * 4;

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

absl::StatusOr<Selection> Selection::Create(const DatasetDesc& d,
                                            const StreamSpec& spec) {
  Selection s;
  s.num_layers = d.num_layers();
  if (spec.layer.has_value()) {
    ASSIGN_OR_RETURN(s.layer_index, d.LayerIndex(*spec.layer));
    s.num_rows = d.n_examples;
  } else {
    s.layer_index = -1;
    s.num_rows = d.n_examples * d.num_layers();
  }
  const int64_t cls = d.cls_token ? 1 : 0;
  switch (spec.tokens) {
    case TokenSelection::kContent:
      s.token_begin = cls;
      s.vectors_per_row = d.content_tokens;
      break;
    case TokenSelection::kSpecial:
      if (!d.cls_token) {
        return absl::InvalidArgumentError(
            "tokens = special selects the CLS token, but this dataset has none "
            "(cls_token = false)");
      }
      s.token_begin = 0;
      s.vectors_per_row = 1;
      break;
    case TokenSelection::kAll:
      s.token_begin = 0;
      s.vectors_per_row = d.tokens_per_example;
      break;
  }
  return s;
}

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

absl::Status CheckVectorDest(VectorDest dest, int64_t batch_size,
                             uint64_t vector_bytes) {
  if (dest.capacity < static_cast<uint64_t>(batch_size) * vector_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch buffer of ", dest.capacity, " bytes is smaller than a batch (",
        batch_size, " x ", vector_bytes, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<VectorLocation> Selection::Locate(const DatasetDesc& d,
                                                 int64_t row, int64_t j) const {
  ASSIGN_OR_RETURN(VectorLocation loc, LocateExample(d, example_of(row)));
  loc.offset += (static_cast<uint64_t>(layer_of(row)) * d.tokens_per_example +
                 static_cast<uint64_t>(token_begin + j)) *
                d.vector_bytes();
  return loc;
}

absl::Status ValidateStreamSpec(const DatasetInfo& info, StreamSpec* spec) {
  if (spec->batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size must be >= 1, got ", spec->batch_size));
  }
  if (spec->epochs < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("epochs must be >= 0 (0 = endless), got ", spec->epochs));
  }
  if (spec->world_size <= 0) spec->world_size = 1;
  if (spec->rank < 0 || spec->rank >= spec->world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", spec->rank,
                     " is not in [0, world_size = ", spec->world_size, ")"));
  }
  if (!spec->exclude_labels.empty() && !info.has_labels) {
    return absl::InvalidArgumentError(
        absl::StrCat("exclude_labels filters by labels.bin, but dataset ",
                     info.dir_name, " has no labels"));
  }
  std::sort(spec->exclude_labels.begin(), spec->exclude_labels.end());
  spec->exclude_labels.erase(
      std::unique(spec->exclude_labels.begin(), spec->exclude_labels.end()),
      spec->exclude_labels.end());
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<OrderedStream>> OrderedStream::Create(
    std::shared_ptr<const DatasetReader> reader, std::string dataset_id,
    StreamSpec spec, const std::string& resume_token) {
  RETURN_IF_ERROR(ValidateStreamSpec(reader->info(), &spec));
  std::unique_ptr<OrderedStream> s(new OrderedStream());
  ASSIGN_OR_RETURN(s->sel_, Selection::Create(reader->desc(), spec));
  s->reader_ = std::move(reader);
  s->dataset_id_ = std::move(dataset_id);
  s->spec_ = spec;
  // Ranks get contiguous, disjoint ranges that together cover the selection.
  const int64_t v = s->sel_.num_vectors();
  s->lo_ = v * spec.rank / spec.world_size;
  s->hi_ = v * (spec.rank + 1) / spec.world_size;
  s->next_ = s->lo_;
  // A resume token only continues the request it came from.
  Sha256 h;
  h.Update(
      absl::StrCat("ordered|", s->dataset_id_, "|",
                   spec.layer.has_value() ? absl::StrCat(*spec.layer) : "all",
                   "|", static_cast<int>(spec.tokens), "|", spec.batch_size,
                   "|", spec.rank, "/", spec.world_size, "|", spec.drop_last,
                   "|", absl::StrJoin(spec.exclude_labels, ",")));
  for (uint8_t l : spec.exclude_labels) s->exclude_[l] = true;
  const std::string digest = h.HexDigest();
  s->fingerprint_ = std::stoull(digest.substr(0, 16), nullptr, 16);
  if (!resume_token.empty()) {
    if (resume_token.size() != kTokenBytes ||
        std::memcmp(resume_token.data(), kTokenMagic, 4) != 0) {
      return absl::InvalidArgumentError(
          "resume_token is not a shardcast ordered-stream token");
    }
    if (Get<uint64_t>(resume_token, 4) != s->fingerprint_) {
      return absl::InvalidArgumentError(
          "resume_token was issued for a different stream request (dataset, "
          "selection, batch size or partition differ)");
    }
    s->epoch_ = Get<int64_t>(resume_token, 12);
    s->next_ = Get<int64_t>(resume_token, 20);
    s->batch_index_ = Get<int64_t>(resume_token, 28);
    if (s->next_ < s->lo_ || s->next_ > s->hi_ || s->epoch_ < 0) {
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

std::string OrderedStream::ResumeToken() const {
  std::string t(kTokenMagic, 4);
  Put<uint64_t>(t, fingerprint_);
  Put<int64_t>(t, epoch_);
  Put<int64_t>(t, next_);
  Put<int64_t>(t, batch_index_);
  return t;
}

absl::StatusOr<bool> OrderedStream::Next(VectorDest dest, StreamBatch* out) {
  const DatasetDesc& d = reader_->desc();
  const uint64_t vb = d.vector_bytes();
  RETURN_IF_ERROR(CheckVectorDest(dest, spec_.batch_size, vb));
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
        if (has_labels && label_example != example) {
          RETURN_IF_ERROR(reader_->ReadLabels(
              example, reinterpret_cast<uint8_t*>(label_row.data())));
          label_example = example;
        }
        int64_t run_start = -1;  // token (row-relative) where the run began
        auto flush = [&](int64_t end) {
          if (run_start < 0) return;
          ReadOp op;
          op.fd = reader_->shard_fd(row_start.shard);
          op.path = &reader_->shard_path(row_start.shard);
          op.offset = row_start.offset + static_cast<uint64_t>(run_start) * vb;
          op.length = static_cast<size_t>(end - run_start) * vb;
          op.dest =
              dest.data + static_cast<size_t>(filled - (end - run_start)) * vb;
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
          ++filled;
        }
        flush(j);
        g += j - j0;
      }
      RETURN_IF_ERROR(ThreadReader().ReadAll(ops));
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
    // The epoch is over (nothing left, or only a short batch to drop).
    ++epoch_;
    next_ = lo_;
    batch_index_ = 0;
  }
}

}  // namespace shardcast
