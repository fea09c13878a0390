#include "server/engine/selection.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/limits.h"
#include "common/base/status.h"

namespace shardcast {

absl::Status ValidateStreamSpec(const DatasetInfo& info, StreamSpec* spec) {
  // Bounded here, so that every product formed from them later (batch bytes,
  // partition boundaries) fits in 64 bits: common/base/limits.h.
  if (spec->batch_size < 1 || spec->batch_size > limits::kMaxBatchVectors) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size must be in [1, ", limits::kMaxBatchVectors,
                     "], got ", spec->batch_size));
  }
  if (spec->epochs < 0 || spec->epochs > limits::kMaxEpochs) {
    return absl::InvalidArgumentError(
        absl::StrCat("epochs must be in [0, ", limits::kMaxEpochs,
                     "] (0 = endless), got ", spec->epochs));
  }
  if (spec->world_size <= 0) spec->world_size = 1;
  if (spec->world_size > limits::kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size must be at most ", limits::kMaxWorldSize,
                     ", got ", spec->world_size));
  }
  if (spec->rank < 0 || spec->rank >= spec->world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", spec->rank,
                     " is not in [0, world_size = ", spec->world_size, ")"));
  }
  if (spec->node_count == 0) spec->node_count = 1;
  if (spec->node_count < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node_count must be >= 1 (0: the daemon's), got ", spec->node_count));
  }
  if (spec->node_count > limits::kMaxWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("node_count must be at most ", limits::kMaxWorldSize,
                     ", got ", spec->node_count));
  }
  if (spec->node_rank < 0 || spec->node_rank >= spec->node_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("node_rank ", spec->node_rank,
                     " is not in [0, node_count = ", spec->node_count, ")"));
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

absl::StatusOr<VectorLocation> Selection::Locate(const DatasetDesc& d,
                                                 int64_t row, int64_t j) const {
  return LocateIndex(d, example_of(row), layer_of(row), token_begin + j);
}

std::string Selection::Name(const DatasetDesc& d) const {
  return absl::StrCat(
      layer_index < 0
          ? std::string("all layers")
          : absl::StrCat("layer ", d.layers[static_cast<size_t>(layer_index)]),
      ", ",
      vectors_per_row == 1 && d.cls_token && token_begin == 0 ? "CLS token"
      : vectors_per_row == d.tokens_per_example               ? "all tokens"
                                                : "content tokens");
}

}  // namespace shardcast
