#include "common/local/vector_layout.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardcast {
namespace {

constexpr char kMagic[4] = {'S', 'C', 'L', '1'};
// Magic, then n_examples, tokens, d_model, layer_file_stride,
// example_stride, layer_stride, token_stride and the three tables' sizes.
constexpr size_t kFixedBytes = 4 + 10 * 8;

template <typename T>
void Put(std::string* out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out->append(b, sizeof(T));
}

// Reads from the front of `in`, or remembers that it ran short.
struct Cursor {
  absl::string_view in;
  bool short_read = false;
  template <typename T>
  T Get() {
    T v{};
    if (in.size() < sizeof(T)) {
      short_read = true;
      return v;
    }
    std::memcpy(&v, in.data(), sizeof(T));
    in.remove_prefix(sizeof(T));
    return v;
  }
};

}  // namespace

bool VectorLayout::Find(int64_t example, int64_t layer, int64_t token,
                        Place* out) const {
  const auto li = std::find(layers.begin(), layers.end(), layer);
  if (li == layers.end()) return false;
  if (example < 0 || example >= n_examples) return false;
  if (token < 0 || token >= tokens) return false;
  const int64_t layer_index = li - layers.begin();
  const auto it =
      std::upper_bound(first_example.begin(), first_example.end(), example);
  if (it == first_example.begin()) return false;
  const int64_t s = (it - first_example.begin()) - 1;
  const int64_t file = s + layer_index * layer_file_stride;
  if (file < 0 || file >= num_files()) return false;
  out->file = file;
  out->offset =
      file_base[static_cast<size_t>(file)] +
      static_cast<uint64_t>(example - first_example[static_cast<size_t>(s)]) *
          example_stride +
      static_cast<uint64_t>(layer_index) * layer_stride +
      static_cast<uint64_t>(token) * token_stride;
  return true;
}

std::string VectorLayout::Encode() const {
  std::string out(kMagic, sizeof(kMagic));
  for (int64_t v : {n_examples, tokens, d_model, layer_file_stride}) {
    Put(&out, v);
  }
  for (uint64_t v : {example_stride, layer_stride, token_stride}) Put(&out, v);
  Put(&out, static_cast<uint64_t>(layers.size()));
  Put(&out, static_cast<uint64_t>(first_example.size()));
  Put(&out, static_cast<uint64_t>(file_base.size()));
  for (int64_t v : layers) Put(&out, v);
  for (int64_t v : first_example) Put(&out, v);
  for (uint64_t v : file_base) Put(&out, v);
  return out;
}

absl::StatusOr<VectorLayout> VectorLayout::Decode(absl::string_view bytes) {
  auto bad = [&](absl::string_view why) {
    return absl::DataLossError(
        absl::StrCat("a vector layout of ", bytes.size(), " bytes: ", why));
  };
  if (bytes.size() < kFixedBytes ||
      std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    return bad("not one (common/local/vector_layout.h)");
  }
  Cursor c{bytes.substr(sizeof(kMagic))};
  VectorLayout l;
  l.n_examples = c.Get<int64_t>();
  l.tokens = c.Get<int64_t>();
  l.d_model = c.Get<int64_t>();
  l.layer_file_stride = c.Get<int64_t>();
  l.example_stride = c.Get<uint64_t>();
  l.layer_stride = c.Get<uint64_t>();
  l.token_stride = c.Get<uint64_t>();
  const uint64_t n_layers = c.Get<uint64_t>();
  const uint64_t n_shards = c.Get<uint64_t>();
  const uint64_t n_files = c.Get<uint64_t>();
  // Each count within what is left, so that their sum cannot wrap.
  const uint64_t left = c.in.size() / 8;
  if (n_layers > left || n_shards > left || n_files > left ||
      n_layers + n_shards + n_files != left || c.in.size() % 8 != 0) {
    return bad(absl::StrCat(n_layers, " layers, ", n_shards, " shards and ",
                            n_files, " files do not match its size"));
  }
  for (uint64_t i = 0; i < n_layers; ++i) l.layers.push_back(c.Get<int64_t>());
  for (uint64_t i = 0; i < n_shards; ++i) {
    l.first_example.push_back(c.Get<int64_t>());
  }
  for (uint64_t i = 0; i < n_files; ++i) {
    l.file_base.push_back(c.Get<uint64_t>());
  }
  if (c.short_read) return bad("short");
  if (l.n_examples < 0 || l.tokens < 1 || l.d_model < 1 || n_layers == 0 ||
      n_shards == 0 || l.layer_file_stride < 0) {
    return bad(absl::StrCat(l.n_examples, " examples, ", l.tokens, " tokens, ",
                            l.d_model, " floats, ", n_layers, " layers, ",
                            n_shards, " shards"));
  }
  if (l.first_example[0] != 0 ||
      !std::is_sorted(l.first_example.begin(), l.first_example.end()) ||
      l.first_example.back() > l.n_examples) {
    return bad("its shards' first examples are not ascending from 0");
  }
  if (n_files < n_shards) return bad("fewer files than shards");
  // Every file Find() can name exists: the last layer's last shard.
  const uint64_t last_layer = n_layers - 1;
  if (l.layer_file_stride > 0 &&
      last_layer >
          (n_files - n_shards) / static_cast<uint64_t>(l.layer_file_stride)) {
    return bad("its layers' files are not all listed");
  }
  return l;
}

}  // namespace shardcast
