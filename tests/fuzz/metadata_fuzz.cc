// Fuzz target: the dataset description files of every protocol variant
// (common/format/pyjson.h, common/format/metadata.h). The input is
// metadata.json's bytes, optionally followed by a NUL byte and shards.json's
// bytes. It runs ParseJson -> ParseMetadata -> (if a second part) ParseJson ->
// ParseShards, prints the parsed JSON as Python would (PyJsonDumps in each
// mode, which the content hash is computed from) and, on a description that
// parses, asks it what a reader asks: ContentHash, LayerIndex, LocateExample
// and Locate at the corners of the dataset and just outside them.
//
// Checks: no crash, leak, sanitizer report or hang (deep JSON, huge numbers,
// odd Unicode); every refusal is a Status; and for a metadata + shards pair
// that parses, the protocol's geometry holds: shard entries add up to
// n_examples, and every vector inside the dataset is located in a listed
// shard that holds its example, within the bytes of a full shard, while
// coordinates outside are OUT_OF_RANGE / INVALID_ARGUMENT.
//
// Run (tests/fuzz/run.sh builds and runs every target):
//   build-asan/metadata_fuzz -max_total_time=60 -timeout=10 \
//       CORPUS_COPY tests/fuzz/corpus/metadata
// Seeds: tests/fuzz/corpus/metadata/ (make_corpus.sh): metadata.json NUL
// shards.json of datasets written by `shardcast synth` in each variant.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/format/metadata.h"
#include "common/format/pyjson.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using namespace shardcast;  // NOLINT: test code
using fuzz::Fail;

void Expect(absl::StatusCode want, const absl::Status& got,
            absl::string_view what) {
  if (got.code() != want) {
    Fail(absl::StrCat(what, ": ", got.ToString(), ", want code ",
                      static_cast<int>(want)));
  }
}

// Every vector of example `e` (first and last layer, first and last token)
// is in a listed shard that holds the example, inside a full shard's bytes.
void CheckExample(const DatasetDesc& d, int64_t e) {
  const unsigned __int128 shard_bytes =
      static_cast<unsigned __int128>(d.examples_per_shard) * d.example_bytes();
  for (int64_t layer : {d.layers.front(), d.layers.back()}) {
    for (int64_t t : {int64_t{0}, d.tokens_per_example - 1}) {
      absl::StatusOr<VectorLocation> loc = Locate(d, e, layer, t);
      if (!loc.ok()) {
        Fail(absl::StrCat("Locate(", e, ", ", layer, ", ", t,
                          ") inside the dataset: ", loc.status().ToString()));
      }
      if (loc->shard < 0 ||
          loc->shard >= static_cast<int64_t>(d.shards.size()) ||
          d.shards[static_cast<size_t>(loc->shard)].n_examples <=
              e % d.examples_per_shard ||
          loc->offset + static_cast<unsigned __int128>(d.vector_bytes()) >
              shard_bytes) {
        Fail(absl::StrCat("Locate(", e, ", ", layer, ", ", t, ") = shard ",
                          loc->shard, " offset ", loc->offset,
                          ", outside what shards.json lists"));
      }
    }
  }
}

void Exercise(const DatasetDesc& d, bool with_shards) {
  (void)d.ContentHash();
  (void)VariantName(d.variant);
  (void)d.num_data_shards();
  for (int64_t layer : d.layers) {
    absl::StatusOr<int64_t> li = d.LayerIndex(layer);
    if (!li.ok() || d.layers[static_cast<size_t>(*li)] != layer) {
      Fail(absl::StrCat("LayerIndex(", layer, ") of a recorded layer"));
    }
  }
  if (d.layers.empty() || d.n_examples <= 0 || d.examples_per_shard <= 0 ||
      d.tokens_per_example <= 0) {
    return;  // nothing to locate
  }
  const int64_t n = d.n_examples;
  const int64_t layer = d.layers.front();
  Expect(absl::StatusCode::kOutOfRange, Locate(d, -1, layer, 0).status(),
         "example -1");
  Expect(absl::StatusCode::kOutOfRange, Locate(d, n, layer, 0).status(),
         "example n_examples");
  Expect(absl::StatusCode::kOutOfRange,
         Locate(d, 0, layer, d.tokens_per_example).status(), "token T");
  Expect(absl::StatusCode::kOutOfRange, Locate(d, 0, layer, -1).status(),
         "token -1");
  (void)LocateExample(d, n - 1);
  if (!with_shards) {
    (void)Locate(d, n - 1, d.layers.back(), d.tokens_per_example - 1);
    return;
  }
  int64_t sum = 0;
  for (const ShardEntry& s : d.shards) sum += s.n_examples;
  if (sum != n) Fail(absl::StrCat("shards hold ", sum, " examples, not ", n));
  for (int64_t e :
       {int64_t{0}, n / 2, n - 1, n - 1 - (n - 1) % d.examples_per_shard}) {
    CheckExample(d, e);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const absl::string_view meta_text = input.substr(0, nul);
  absl::StatusOr<Json> meta = ParseJson(meta_text, "metadata.json");
  if (!meta.ok()) return 0;
  // What the content hash is computed from, in every mode it can be.
  for (bool sort_keys : {false, true}) {
    for (bool ascii : {false, true}) {
      PyJsonOptions o;
      o.sort_keys = sort_keys;
      o.ensure_ascii = ascii;
      (void)PyJsonDumps(*meta, o);
    }
  }
  PyJsonOptions indented;
  indented.indent = 2;
  (void)PyJsonDumps(*meta, indented);
  (void)JsonText(*meta, 2);
  (void)SortedKeyHash(*meta);
  (void)FileOrderHash8(*meta);

  absl::StatusOr<DatasetDesc> desc = ParseMetadata(*meta, "metadata.json");
  if (!desc.ok()) return 0;
  Exercise(*desc, false);
  if (nul == absl::string_view::npos) return 0;
  absl::StatusOr<Json> shards = ParseJson(input.substr(nul + 1), "shards.json");
  if (!shards.ok()) return 0;
  (void)PyJsonDumps(*shards);
  if (!ParseShards(*shards, "shards.json", &*desc).ok()) return 0;
  Exercise(*desc, true);
  return 0;
}
