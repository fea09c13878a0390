// Test helpers shared by the stream tests (test code only): a small
// synthetic dataset and expectations computed from the protocol and the
// generator's formula, never from the code under test.
#ifndef SHARDCAST_SERVER_ENGINE_STREAM_TEST_UTIL_H_
#define SHARDCAST_SERVER_ENGINE_STREAM_TEST_UTIL_H_

#include <algorithm>
#include <cstring>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "common/format/synth.h"
#include "common/format/writer.h"
#include "gtest/gtest.h"
#include "server/engine/ordered_stream.h"

namespace shardcast {
namespace stream_test {

constexpr uint64_t kSeed = 21;
// 23 examples, layers {-2, 6}, 5 content tokens + CLS (T = 6), D = 4,
// budget 60 -> 5 examples per shard (5 shards, the last partial), labels.
constexpr int64_t kN = 23, kL = 2, kT = 6, kP = 5, kD = 4;

struct Row {
  int64_t example;
  int32_t token;  // content index, -1 = CLS
  int64_t layer;  // layer value
  bool operator<(const Row& o) const {
    return std::tie(example, layer, token) <
           std::tie(o.example, o.layer, o.token);
  }
  bool operator==(const Row& o) const {
    return example == o.example && token == o.token && layer == o.layer;
  }
};

inline void PrintTo(const Row& r, std::ostream* os) {
  *os << "(example " << r.example << ", layer " << r.layer << ", token "
      << r.token << ")";
}

inline uint8_t LabelOf(const Row& r) {
  return r.token < 0 ? 255 : SynthLabel(kSeed, r.example * kP + r.token);
}

/// Writes the dataset under `root` with the project's writer; returns its
/// directory (fails the test on error).
inline std::string WriteTestDataset(const std::string& root) {
  WriterOptions o;
  o.root = root;
  o.layers = {-2, 6};
  o.content_tokens = kP;
  o.cls_token = true;
  o.d_model = kD;
  o.n_examples = kN;
  o.token_budget = 60;
  o.with_labels = true;
  auto w = DatasetWriter::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return "";
  std::vector<float> v(kN * kL * kT * kD);
  for (size_t i = 0; i < v.size(); ++i) v[i] = SynthValue(kSeed, i);
  EXPECT_TRUE((*w)->Append(v.data(), v.size() * 4).ok());
  std::vector<uint8_t> labels(kN * kP);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = SynthLabel(kSeed, i);
  EXPECT_TRUE((*w)->AppendLabels(labels.data(), labels.size()).ok());
  auto r = (*w)->Finish();
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->path : "";
}

/// Row `i` of a batch whose vectors are at `vectors`, after checking its
/// vector against the generator at the protocol offset and its label
/// against the generator's labels. `single_layer` is the layer value when
/// the batch carries none (one layer selected).
inline Row CheckedRow(const StreamBatch& b, const char* vectors, int64_t i,
                      int64_t single_layer) {
  Row r;
  std::memcpy(&r.example, b.example_idx.data() + i * 8, 8);
  std::memcpy(&r.token, b.token_idx.data() + i * 4, 4);
  r.layer = single_layer;
  if (!b.layer.empty()) std::memcpy(&r.layer, b.layer.data() + i * 8, 8);
  const int64_t li = r.layer == -2 ? 0 : 1;
  const int64_t raw = r.token + 1;  // CLS is token-axis index 0
  const float* vec = reinterpret_cast<const float*>(vectors) + i * kD;
  for (int64_t k = 0; k < kD; ++k) {
    const uint64_t index =
        static_cast<uint64_t>(((r.example * kL + li) * kT + raw) * kD + k);
    EXPECT_EQ(vec[k], SynthValue(kSeed, index))
        << "example " << r.example << " token " << r.token;
  }
  EXPECT_EQ(static_cast<uint8_t>(b.labels[static_cast<size_t>(i)]), LabelOf(r));
  return r;
}

/// The selection in disk order, computed from the protocol.
inline std::vector<Row> Expected(std::optional<int64_t> layer,
                                 TokenSelection tokens) {
  std::vector<Row> out;
  for (int64_t e = 0; e < kN; ++e) {
    for (int64_t layer_value : {int64_t{-2}, int64_t{6}}) {
      if (layer.has_value() && *layer != layer_value) continue;
      for (int32_t t = -1; t < kP; ++t) {
        if (tokens == TokenSelection::kContent && t < 0) continue;
        if (tokens == TokenSelection::kSpecial && t >= 0) continue;
        out.push_back({e, t, layer_value});
      }
    }
  }
  return out;
}

inline std::vector<Row> Sorted(std::vector<Row> rows) {
  std::sort(rows.begin(), rows.end());
  return rows;
}

}  // namespace stream_test
}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_STREAM_TEST_UTIL_H_
