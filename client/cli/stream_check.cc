#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/progress.h"
#include "client/cli/stream_check_internal.h"

namespace shardcast {
namespace {

// Problems described in full; the rest are only counted.
constexpr int64_t kMaxProblemLines = 10;
// Rows sampled for the GetVectors comparison: every kSampleStride-th row of
// the stream, plus the first row of every batch.
constexpr int64_t kSampleStride = 997;
// Largest selection the per-epoch bitmap may cover (2 GiB of bits).
constexpr int64_t kMaxCheckedVectors = int64_t{1} << 34;
// Bytes of sampled vectors compared per GetVectors call.
constexpr int64_t kSampleBytesPerCall = 8 << 20;

}  // namespace

absl::StatusOr<std::unique_ptr<StreamChecker>> StreamChecker::Create(
    Client* client, const StreamRequest& request,
    const DatasetDescription& info) {
  std::unique_ptr<StreamChecker> c(new StreamChecker());
  c->client_ = client;
  c->dataset_ = info.id;
  c->n_examples_ = info.n_examples;
  c->d_model_ = info.d_model;
  c->tokens_per_example_ = info.tokens_per_example;
  c->content_tokens_ = info.content_tokens;
  c->cls_ = info.cls_token ? 1 : 0;
  c->layers_ = info.layers;
  const int64_t num_layers = static_cast<int64_t>(c->layers_.size());

  // The selection, from the rules of shardcast.proto (not from the daemon).
  bool selectable = true;
  if (request.layer.has_value()) {
    auto it = std::find(c->layers_.begin(), c->layers_.end(), *request.layer);
    selectable = it != c->layers_.end();
    c->layer_index_ = selectable ? it - c->layers_.begin() : -2;
    c->num_rows_ = selectable ? c->n_examples_ : 0;
  } else {
    c->layer_index_ = -1;
    c->num_rows_ = c->n_examples_ * num_layers;
  }
  switch (request.tokens) {
    case StreamRequest::Tokens::kSpecial:
      c->token_begin_ = 0;
      c->k_ = c->cls_;  // no CLS: nothing is selectable
      break;
    case StreamRequest::Tokens::kAll:
      c->token_begin_ = 0;
      c->k_ = c->tokens_per_example_;
      break;
    case StreamRequest::Tokens::kContent:
      c->token_begin_ = c->cls_;
      c->k_ = c->content_tokens_;
      break;
  }
  c->num_vectors_ = c->num_rows_ * c->k_;
  if (c->num_vectors_ > kMaxCheckedVectors) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "--check keeps one bit per selected vector; this selection has ",
        c->num_vectors_, " vectors (limit ", kMaxCheckedVectors, ")"));
  }
  c->shuffled_ = request.order != StreamRequest::Order::kOrdered;
  c->world_size_ = std::max<int64_t>(1, request.world_size);
  c->rank_ = request.rank;
  // The node group (shardcast.proto, StreamRequest.node_rank): the
  // request's, else the daemon's default.
  int64_t node_rank = request.node_rank, node_count = request.node_count;
  if (node_count == 0) {
    absl::StatusOr<DaemonStatus> status = client->GetStatus();
    node_rank = status.ok() ? status->node_rank : 0;
    node_count = status.ok() ? status->node_count : 1;
  }
  node_count = std::max<int64_t>(1, node_count);
  const __int128 v = c->num_vectors_;
  const __int128 node_lo = v * node_rank / node_count;
  const __int128 node_v = v * (node_rank + 1) / node_count - node_lo;
  c->lo_ = static_cast<int64_t>(node_lo + node_v * c->rank_ / c->world_size_);
  c->hi_ =
      static_cast<int64_t>(node_lo + node_v * (c->rank_ + 1) / c->world_size_);
  // Shuffled streams of a node group get the blocks of the group: which
  // vectors those are depends on the daemon's --block-bytes, so coverage is
  // only checked over all groups (each vector still follows the rank rule).
  c->coverage_known_ = !(c->shuffled_ && node_count > 1);
  if (!c->coverage_known_) {
    c->group_note_ =
        absl::StrCat("node group ", node_rank, " of ", node_count,
                     ": repeats and the selection/rank rule checked, "
                     "coverage only over all groups");
  }
  c->batch_size_ = std::max<int64_t>(1, request.batch_size);
  c->drop_last_ = request.drop_last;
  c->epochs_ = request.epochs;
  c->resumed_ = !request.resume_token.empty();
  for (uint32_t l : request.exclude_labels) {
    if (l < 256) c->exclude_[l] = true;
    c->filter_ = true;
  }
  if (c->filter_ && selectable && c->k_ > 0) {
    // The labels the filter applies to, one GetLabels call per example.
    const int64_t ct = c->content_tokens_;
    c->labels_.reserve(static_cast<size_t>(c->n_examples_ * ct));
    Progress progress("--check: fetching labels",
                      static_cast<uint64_t>(c->n_examples_ * ct));
    for (int64_t e = 0; e < c->n_examples_; ++e) {
      absl::StatusOr<std::string> row = client->GetLabels(c->dataset_, e);
      if (!row.ok()) {
        return absl::Status(row.status().code(),
                            absl::StrCat("--check: GetLabels(example ", e,
                                         ") failed: ", row.status().message()));
      }
      if (static_cast<int64_t>(row->size()) != ct) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--check: GetLabels(example ", e, ") returned ", row->size(),
            " labels, expected content_tokens = ", ct));
      }
      c->labels_.append(*row);
      progress.Update(c->labels_.size());
    }
    progress.Finish();
  }
  const int64_t count = c->CountExpected();
  c->expected_ =
      c->drop_last_ ? count / c->batch_size_ * c->batch_size_ : count;
  c->seen_.assign(static_cast<size_t>((c->num_vectors_ + 63) / 64), 0);
  c->flush_at_ = static_cast<size_t>(std::clamp<int64_t>(
      kSampleBytesPerCall / std::max<int64_t>(1, c->d_model_ * 4), 1, 256));
  return c;
}

bool StreamChecker::InPartition(int64_t g) const {
  return shuffled_ ? g % world_size_ == rank_ : g >= lo_ && g < hi_;
}

int64_t StreamChecker::CountExpected() const {
  if (rank_ < 0 || rank_ >= world_size_) return 0;
  if (!filter_) {
    if (!shuffled_) return hi_ - lo_;
    return num_vectors_ > rank_
               ? (num_vectors_ - rank_ + world_size_ - 1) / world_size_
               : 0;
  }
  const int64_t num_layers = static_cast<int64_t>(layers_.size());
  int64_t count = 0;
  for (int64_t row = 0; row < num_rows_; ++row) {
    const int64_t example = layer_index_ == -1 ? row / num_layers : row;
    const char* labels = labels_.data() + example * content_tokens_;
    for (int64_t j = 0; j < k_; ++j) {
      if (!InPartition(row * k_ + j)) continue;
      const int64_t content = token_begin_ + j - cls_;
      if (content >= 0 && exclude_[static_cast<uint8_t>(labels[content])]) {
        continue;
      }
      ++count;
    }
  }
  return count;
}

void StreamChecker::Problem(const std::string& message) {
  if (problem_count_++ < kMaxProblemLines) problems_.push_back(message);
}

void StreamChecker::StartEpoch(int64_t epoch, bool partial_start) {
  Epoch e;
  e.epoch = epoch;
  e.partial_start = partial_start;
  epochs_seen_.push_back(e);
  std::fill(seen_.begin(), seen_.end(), 0);
  last_index_ = -1;
  short_batch_seen_ = false;
}

void StreamChecker::CloseEpoch(bool ended) {
  Epoch& e = epochs_seen_.back();
  e.ended = ended;
  if (!ended || e.partial_start || !coverage_known_) {
    e.expected.reset();
    e.complete = false;
    return;
  }
  e.expected = expected_;
  e.complete = e.distinct == expected_ && e.repeated == 0 && e.outside == 0;
  if (e.distinct < expected_) {
    Problem(absl::StrCat("epoch ", e.epoch, ": ", e.distinct, " of the ",
                         expected_, " expected vectors arrived (",
                         expected_ - e.distinct, " missing)"));
  } else if (e.distinct > expected_) {
    Problem(absl::StrCat("epoch ", e.epoch, ": ", e.distinct,
                         " distinct vectors arrived, more than the ", expected_,
                         " expected (drop_last)"));
  }
}

void StreamChecker::AddBatch(const Batch& b) {
  ++batches_;
  const int64_t epoch = b.epoch();
  if (epochs_ > 0 && epoch >= epochs_) {
    Problem(absl::StrCat("batch ", batches_, " belongs to epoch ", epoch,
                         ", but only ", epochs_, " epochs were requested"));
  }
  if (epochs_seen_.empty()) {
    // A fresh stream starts at epoch 0; epochs before the first batch's
    // (if the first batch skips ahead) delivered nothing.
    if (!resumed_) {
      for (int64_t e = 0; e < std::min<int64_t>(epoch, 1024); ++e) {
        StartEpoch(e, false);
        CloseEpoch(true);
      }
    }
    StartEpoch(epoch, resumed_);
  } else if (epoch != epochs_seen_.back().epoch) {
    const int64_t previous = epochs_seen_.back().epoch;
    CloseEpoch(true);
    if (epoch < previous) {
      Problem(absl::StrCat("batch ", batches_, ": epoch went back from ",
                           previous, " to ", epoch));
    }
    for (int64_t e = previous + 1; e < std::min(epoch, previous + 1024); ++e) {
      StartEpoch(e, false);
      CloseEpoch(true);
    }
    StartEpoch(epoch, false);
  }
  Epoch& ep = epochs_seen_.back();

  // Batch numbering and sizes: only an epoch's last batch may be short.
  if (last_index_ < 0 ? (!ep.partial_start && b.index() != 0)
                      : b.index() != last_index_ + 1) {
    Problem(absl::StrCat("epoch ", epoch, ": batch index ", b.index(),
                         " follows ", last_index_));
  }
  last_index_ = b.index();
  if (short_batch_seen_) {
    Problem(absl::StrCat("epoch ", epoch, " batch ", b.index(),
                         " follows a short batch of the same epoch"));
  }
  if (b.rows() < 1 || b.rows() > batch_size_) {
    Problem(absl::StrCat("epoch ", epoch, " batch ", b.index(), " has ",
                         b.rows(), " rows (batch size ", batch_size_, ")"));
  } else if (b.rows() < batch_size_) {
    short_batch_seen_ = true;
    if (drop_last_) {
      Problem(absl::StrCat("epoch ", epoch, " batch ", b.index(), " has ",
                           b.rows(), " rows despite drop_last"));
    }
  }
  const int64_t rows = b.rows();
  const bool d_ok = b.d_model() == d_model_;
  const bool raw = b.dtype() == StreamRequest::DType::kFloat32 &&
                   (b.transform().empty() || b.transform() == "float32");
  if (!d_ok) {
    Problem(absl::StrCat("epoch ", epoch, " batch ", b.index(), ": d_model ",
                         b.d_model(), ", the dataset has ", d_model_));
  }
  // The stream has checked the columns' sizes: layer and labels hold `rows`
  // entries or none.
  const bool all_layers = layer_index_ == -1;
  const bool has_layer_column = !b.layer().empty() || rows == 0;
  if (all_layers && !has_layer_column) {
    Problem(absl::StrCat("epoch ", epoch, " batch ", b.index(),
                         ": layer column has ", b.layer().size() * 8,
                         " bytes for ", rows, " rows"));
  }
  const bool has_label_column = !b.labels().empty();

  const int64_t vector_bytes = d_model_ * 4;
  for (int64_t i = 0; i < rows; ++i) {
    ++ep.vectors;
    const bool sample_row = i == 0 || rows_total_ % kSampleStride == 0;
    ++rows_total_;
    const int64_t example = b.example_idx()[static_cast<size_t>(i)];
    const int32_t content = b.token_idx()[static_cast<size_t>(i)];
    int64_t layer_value = 0;
    int64_t li = layer_index_;
    if (has_layer_column) {
      layer_value = b.layer()[static_cast<size_t>(i)];
      auto it = std::find(layers_.begin(), layers_.end(), layer_value);
      li = it == layers_.end() ? -3 : it - layers_.begin();
    } else if (layer_index_ >= 0) {
      layer_value = layers_[static_cast<size_t>(layer_index_)];
    } else {
      li = -3;  // all layers selected, but no layer column
    }
    const int64_t token = static_cast<int64_t>(content) + cls_;
    const auto where = [&]() {
      return absl::StrCat("epoch ", epoch, " batch ", b.index(), " row ", i,
                          " (example ", example, ", layer ",
                          li == -3 ? "?" : absl::StrCat(layer_value),
                          ", token_idx ", content, ")");
    };
    if (example < 0 || example >= n_examples_ || li == -3 || content < -1 ||
        token < 0 || token >= tokens_per_example_) {
      ++ep.outside;
      if (problem_count_ < kMaxProblemLines) {
        Problem(absl::StrCat(where(), " is outside the dataset (", n_examples_,
                             " examples, layers [", absl::StrJoin(layers_, ","),
                             "], ", content_tokens_, " content tokens",
                             cls_ ? " + CLS" : ", no CLS", ")"));
      } else {
        ++problem_count_;
      }
      continue;
    }
    const int64_t row =
        all_layers ? example * static_cast<int64_t>(layers_.size()) + li
                   : example;
    const int64_t j = token - token_begin_;
    const int64_t g = row * k_ + j;
    std::string outside;
    if (li != layer_index_ && !all_layers) {
      outside = "its layer is not the selected one";
    } else if (j < 0 || j >= k_) {
      outside = "its token is not in the token selection";
    } else if (!InPartition(g)) {
      outside = shuffled_
                    ? absl::StrCat("vector ", g, " belongs to rank ",
                                   g % world_size_, " of ", world_size_)
                    : absl::StrCat("vector ", g, " is outside rank ", rank_,
                                   "'s range [", lo_, ", ", hi_, ")");
    } else if (filter_ && content >= 0 && !labels_.empty() &&
               exclude_[static_cast<uint8_t>(labels_[static_cast<size_t>(
                   example * content_tokens_ + content)])]) {
      outside = absl::StrCat(
          "its label ",
          static_cast<int>(static_cast<uint8_t>(labels_[static_cast<size_t>(
              example * content_tokens_ + content)])),
          " is excluded");
    }
    if (has_label_column) {
      const int got = b.labels()[static_cast<size_t>(i)];
      int want = -1;
      if (content < 0) {
        want = 255;
      } else if (!labels_.empty()) {
        want = static_cast<uint8_t>(
            labels_[static_cast<size_t>(example * content_tokens_ + content)]);
      }
      if (want >= 0 && got != want) {
        Problem(
            absl::StrCat(where(), " carries label ", got, ", expected ", want));
      }
    }
    if (!outside.empty()) {
      ++ep.outside;
      if (problem_count_ < kMaxProblemLines) {
        Problem(absl::StrCat(where(), " is outside the selection: ", outside));
      } else {
        ++problem_count_;
      }
    } else {
      uint64_t& word = seen_[static_cast<size_t>(g >> 6)];
      const uint64_t bit = uint64_t{1} << (g & 63);
      if (word & bit) {
        ++ep.repeated;
        if (problem_count_ < kMaxProblemLines) {
          Problem(absl::StrCat(where(), " repeats within epoch ", epoch));
        } else {
          ++problem_count_;
        }
      } else {
        word |= bit;
        ++ep.distinct;
      }
    }
    // Transformed vectors differ from GetVectors' by design: membership
    // and coverage are still checked, values only for plain float32.
    if (sample_row && d_ok && raw) {
      Sample s;
      s.coord = {example, layer_value, token};
      s.bytes.assign(
          reinterpret_cast<const char*>(b.vectors().data() + i * d_model_),
          static_cast<size_t>(vector_bytes));
      s.epoch = epoch;
      s.batch = b.index();
      s.row = i;
      pending_.push_back(std::move(s));
    }
  }
  if (pending_.size() >= flush_at_) FlushSamples();
}

void StreamChecker::FlushSamples() {
  if (pending_.empty()) return;
  std::vector<VectorCoord> coords;
  coords.reserve(pending_.size());
  for (const Sample& s : pending_) coords.push_back(s.coord);
  absl::StatusOr<VectorBlock> got = client_->GetVectors(dataset_, coords);
  const int64_t n = static_cast<int64_t>(pending_.size());
  if (!got.ok()) {
    Problem(absl::StrCat("GetVectors for ", n,
                         " sampled vectors failed: ", got.status().message()));
  } else if (static_cast<int64_t>(got->values.size()) != n * d_model_) {
    Problem(absl::StrCat("GetVectors for ", n, " sampled vectors returned ",
                         got->values.size(), " floats, expected ",
                         n * d_model_));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const Sample& s = pending_[static_cast<size_t>(i)];
      const float* want = got->values.data() + i * d_model_;
      if (std::memcmp(want, s.bytes.data(), s.bytes.size()) == 0) continue;
      ++mismatched_;
      int64_t at = 0;
      float streamed = 0;
      for (; at < d_model_; ++at) {
        std::memcpy(&streamed, s.bytes.data() + at * 4, 4);
        if (std::memcmp(&streamed, want + at, 4) != 0) break;
      }
      Problem(
          absl::StrCat("epoch ", s.epoch, " batch ", s.batch, " row ", s.row,
                       ": streamed vector (example ", s.coord.example,
                       ", layer ", s.coord.layer, ", token ", s.coord.token,
                       ") differs from GetVectors at element ", at, " (",
                       streamed, " vs ", at < d_model_ ? want[at] : 0.0f, ")"));
    }
    sampled_ += n;
  }
  pending_.clear();
}

void StreamChecker::Finish(End end) {
  if (finished_) return;
  finished_ = true;
  FlushSamples();
  const bool complete = end == End::kComplete;
  int64_t next_epoch = resumed_ ? -1 : 0;
  if (!epochs_seen_.empty()) {
    CloseEpoch(complete);
    next_epoch = epochs_seen_.back().epoch + 1;
  }
  // Epochs the daemon ended without a single batch.
  if (complete && epochs_ > 0 && next_epoch >= 0) {
    for (int64_t e = next_epoch; e < std::min(epochs_, next_epoch + 1024);
         ++e) {
      StartEpoch(e, false);
      CloseEpoch(true);
    }
  }
  std::vector<std::string> notes;
  for (const Epoch& e : epochs_seen_) {
    if (e.partial_start) {
      notes.push_back(absl::StrCat(
          "epoch ", e.epoch,
          " began mid-epoch (--resume-token-in): only repeats and selection "
          "membership were checked"));
    } else if (!e.ended) {
      notes.push_back(
          absl::StrCat("epoch ", e.epoch,
                       " was cut short by --max-batches: only repeats and "
                       "selection membership were checked"));
    }
  }
  if (!group_note_.empty()) notes.push_back(group_note_);
  note_ = absl::StrJoin(notes, "; ");
}

nlohmann::ordered_json StreamChecker::Json() const {
  nlohmann::ordered_json j;
  j["ok"] = ok();
  nlohmann::ordered_json epochs = nlohmann::ordered_json::array();
  for (const Epoch& e : epochs_seen_) {
    nlohmann::ordered_json x;
    x["epoch"] = e.epoch;
    x["vectors"] = e.vectors;
    x["distinct"] = e.distinct;
    x["expected"] = e.expected.has_value() ? nlohmann::ordered_json(*e.expected)
                                           : nlohmann::ordered_json(nullptr);
    x["repeated"] = e.repeated;
    x["outside"] = e.outside;
    x["complete"] = e.complete;
    epochs.push_back(std::move(x));
  }
  j["epochs"] = std::move(epochs);
  j["sampled_vectors"] = sampled_;
  j["mismatched_vectors"] = mismatched_;
  j["problems"] = problems_;
  j["problem_count"] = problem_count_;
  if (!note_.empty()) j["note"] = note_;
  return j;
}

std::vector<std::string> StreamChecker::EpochLines() const {
  std::vector<std::string> lines;
  for (const Epoch& e : epochs_seen_) {
    std::string line = absl::StrCat(
        "epoch ", e.epoch, ": ", e.vectors, " vectors, ", e.distinct,
        " distinct",
        e.expected ? absl::StrCat(" of ", *e.expected, " expected")
                   : std::string(),
        ", ", e.repeated, " repeated, ", e.outside, " outside the selection");
    if (e.partial_start || !e.ended || !coverage_known_) {
      absl::StrAppend(&line, " (partial: repeats and selection checked only)");
    } else {
      absl::StrAppend(&line, e.complete ? ": complete" : ": INCOMPLETE");
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace shardcast
