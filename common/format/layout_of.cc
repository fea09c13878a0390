#include "common/format/layout_of.h"

#include <algorithm>

namespace shardcast {

VectorLayout LayoutOf(const DatasetDesc& d) {
  VectorLayout l;
  l.n_examples = d.n_examples;
  l.tokens = d.tokens_per_example;
  l.d_model = d.d_model;
  l.layers = d.layers;
  l.token_stride = d.vector_bytes();
  if (d.external != nullptr) {
    const ExternalLayout& x = *d.external;
    l.first_example = x.first_example;
    l.layer_file_stride = x.num_shards();
    l.file_base = x.tensor_offset;
    l.example_stride = d.vector_bytes();
    l.layer_stride = 0;
    return l;
  }
  // Shard s holds examples [s * S, (s + 1) * S) (LocateExample).
  const int64_t per = std::max<int64_t>(1, d.examples_per_shard);
  const int64_t shards = std::max<int64_t>(1, (d.n_examples + per - 1) / per);
  for (int64_t s = 0; s < shards; ++s) l.first_example.push_back(s * per);
  l.file_base.assign(static_cast<size_t>(shards), 0);
  l.layer_file_stride = 0;
  l.example_stride = d.example_bytes();
  l.layer_stride = d.layer_slice_bytes();
  return l;
}

}  // namespace shardcast
