// `shardcast export safetensors`: one layer's selected vectors of a local
// saev dataset, as one safetensors file that any safetensors reader
// (safetensors, torch, numpy) opens without shardcast.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "client/cli/progress.h"
#include "common/base/checked.h"
#include "common/base/status.h"
#include "common/base/version.h"
#include "common/format/pyjson.h"
#include "common/format/reader.h"
#include "common/format/safetensors.h"
#include "nlohmann/json.hpp"

namespace shardcast {
namespace {

using OrderedJson = nlohmann::ordered_json;

constexpr size_t kChunkBytes = size_t{16} << 20;
constexpr char kCmd[] = "export";

int Usage(const std::string& message) {
  std::fprintf(stderr, "shardcast export: %s (see shardcast export --help)\n",
               message.c_str());
  return kExitUsage;
}

// What is exported: one layer, a token range of the token axis, an example
// range.
struct Selection {
  int64_t layer = 0;
  std::string tokens;       // "all", "content" or "cls", as asked
  int64_t token_begin = 0;  // token-axis indices [token_begin, token_end)
  int64_t token_end = 0;
  int64_t first = 0;  // examples [first, last)
  int64_t last = 0;
  uint64_t n_vectors = 0;
  int64_t tokens_per_example() const { return token_end - token_begin; }
};

// "A:B", "A:", ":B" or ":" -> [A, B) within [0, n). INVALID_ARGUMENT for
// anything else; OUT_OF_RANGE for a range outside the dataset.
absl::StatusOr<std::pair<int64_t, int64_t>> ParseExamples(
    const std::string& text, int64_t n) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos ||
      text.find(':', colon + 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--examples takes A:B (examples A to B-1; either may be left out), "
        "not \"",
        Quoted(text), "\""));
  }
  const std::string a = text.substr(0, colon);
  const std::string b = text.substr(colon + 1);
  int64_t first = 0;
  int64_t last = n;
  if ((!a.empty() && !absl::SimpleAtoi(a, &first)) ||
      (!b.empty() && !absl::SimpleAtoi(b, &last))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--examples: \"", Quoted(text), "\" is not A:B with integers"));
  }
  if (first < 0 || first > last || last > n) {
    return absl::OutOfRangeError(absl::StrCat(
        "--examples ", first, ":", last, " is not a range within the ", n,
        " examples of the dataset (0 <= A <= B <= ", n, ")"));
  }
  return std::pair(first, last);
}

// True when both paths name the same existing directory.
bool SameDirectory(const std::string& a, const std::string& b) {
  char* ra = ::realpath(a.c_str(), nullptr);
  char* rb = ::realpath(b.c_str(), nullptr);
  const bool same = ra != nullptr && rb != nullptr && std::strcmp(ra, rb) == 0;
  std::free(ra);
  std::free(rb);
  return same;
}

std::string ShapeJson(const std::vector<uint64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Fills `out` with one int64 per selected vector, in export order
// (example, then token), starting at vector `from`.
void FillIndices(const Selection& sel, bool token_column, uint64_t from,
                 int64_t cls_shift, int64_t* out, size_t count) {
  const uint64_t per = static_cast<uint64_t>(sel.tokens_per_example());
  for (size_t i = 0; i < count; ++i) {
    const uint64_t v = from + i;
    const int64_t example = sel.first + static_cast<int64_t>(v / per);
    const int64_t token = sel.token_begin + static_cast<int64_t>(v % per);
    // token_idx as stream batches give it: the content token index, -1 for
    // the CLS token.
    out[i] = token_column ? token - cls_shift : example;
  }
}

// Streams the selected vectors of one layer into `writer`: pread of the
// selected [tokens, D] part of each example's layer slice, coalescing
// ranges that follow each other in one shard (one layer, all tokens) into
// reads of up to kChunkBytes.
absl::Status CopyVectors(const DatasetReader& reader, const Selection& sel,
                         SafetensorsWriter* writer, Progress* progress,
                         uint64_t* done) {
  const uint64_t vector_bytes = reader.desc().vector_bytes();
  std::vector<char> buffer(kChunkBytes);
  size_t used = 0;  // bytes of `buffer` read and not yet written
  int pending_fd = -1;
  uint64_t pending_offset = 0;
  size_t pending_length = 0;  // a read not issued yet, into buffer + used
  const std::string* pending_path = nullptr;
  const auto flush_write = [&]() -> absl::Status {
    RETURN_IF_ERROR(writer->Append(buffer.data(), used));
    *done += used;
    progress->Update(*done);
    used = 0;
    return absl::OkStatus();
  };
  const auto flush_read = [&]() -> absl::Status {
    if (pending_length == 0) return absl::OkStatus();
    RETURN_IF_ERROR(PreadFull(pending_fd, buffer.data() + used, pending_length,
                              pending_offset, *pending_path));
    used += pending_length;
    pending_length = 0;
    if (used == buffer.size()) return flush_write();
    return absl::OkStatus();
  };
  for (int64_t e = sel.first; e < sel.last; ++e) {
    ASSIGN_OR_RETURN(FileRange slice, reader.LayerSliceRange(e, sel.layer));
    uint64_t offset =
        slice.offset + static_cast<uint64_t>(sel.token_begin) * vector_bytes;
    uint64_t length =
        static_cast<uint64_t>(sel.tokens_per_example()) * vector_bytes;
    while (length > 0) {
      const size_t room = buffer.size() - used - pending_length;
      if (pending_length > 0 && room > 0 && slice.fd == pending_fd &&
          offset == pending_offset + pending_length) {
        const size_t take =
            static_cast<size_t>(std::min<uint64_t>(length, room));
        pending_length += take;
        offset += take;
        length -= take;
        continue;
      }
      RETURN_IF_ERROR(flush_read());
      const size_t take =
          static_cast<size_t>(std::min<uint64_t>(length, buffer.size() - used));
      pending_fd = slice.fd;
      pending_offset = offset;
      pending_length = take;
      pending_path = slice.path;
      offset += take;
      length -= take;
    }
  }
  RETURN_IF_ERROR(flush_read());
  return flush_write();
}

int RunExport(const Args& args) {
  const auto& pos = args.positional();
  if (pos.empty()) {
    return Usage(
        "expected a format (safetensors), a dataset DIR and an "
        "output file");
  }
  if (pos[0] != "safetensors") {
    return Usage(absl::StrCat("unknown format \"", Quoted(pos[0]),
                              "\": only safetensors is supported"));
  }
  if (pos.size() != 3) {
    return Usage("expected: export safetensors DATASET_DIR OUT.safetensors");
  }
  const std::string& dir = pos[1];
  const std::string& out = pos[2];
  auto layer_arg = args.GetInt("layer", 0);
  if (!layer_arg.ok()) return Usage(std::string(layer_arg.status().message()));
  Selection sel;
  sel.tokens = args.Get("tokens", "content");
  if (sel.tokens == "special") sel.tokens = "cls";  // `stream`'s name for it
  if (sel.tokens != "all" && sel.tokens != "content" && sel.tokens != "cls") {
    return Usage("--tokens takes all, content or cls");
  }

  auto reader = DatasetReader::Open(dir);
  if (!reader.ok()) return Fail(kCmd, std::string(reader.status().message()));
  if (SameDirectory(DirName(out), dir)) {
    return Fail(kCmd, absl::StrCat(out, " is inside the dataset directory ",
                                   dir, "; write the export elsewhere"));
  }
  const DatasetInfo& info = (*reader)->info();
  const DatasetDesc& d = info.desc;
  for (const std::string& w : d.warnings) {
    std::fprintf(stderr, "warning: %s\n", w.c_str());
  }
  if (args.Has("layer")) {
    sel.layer = *layer_arg;
    auto index = d.LayerIndex(sel.layer);
    if (!index.ok()) return Fail(kCmd, std::string(index.status().message()));
  } else if (d.layers.size() == 1) {
    sel.layer = d.layers[0];
  } else {
    return Usage(absl::StrCat("the dataset records layers [",
                              absl::StrJoin(d.layers, ", "),
                              "]: choose one with --layer"));
  }
  const int64_t cls = d.cls_token ? 1 : 0;
  if (sel.tokens == "all") {
    sel.token_begin = 0;
    sel.token_end = d.tokens_per_example;
  } else if (sel.tokens == "content") {
    sel.token_begin = cls;
    sel.token_end = d.tokens_per_example;
  } else {
    if (!d.cls_token) {
      return Fail(kCmd, absl::StrCat(dir,
                                     ": --tokens cls, but the dataset has "
                                     "no CLS token (cls_token false)"));
    }
    sel.token_begin = 0;
    sel.token_end = 1;
  }
  auto range = ParseExamples(args.Get("examples", ":"), d.n_examples);
  if (!range.ok()) {
    if (range.status().code() == absl::StatusCode::kInvalidArgument) {
      return Usage(std::string(range.status().message()));
    }
    return Fail(kCmd, std::string(range.status().message()));
  }
  sel.first = range->first;
  sel.last = range->second;
  std::optional<uint64_t> n_vectors =
      CheckedMul(static_cast<uint64_t>(sel.last - sel.first),
                 static_cast<uint64_t>(sel.tokens_per_example()));
  if (!n_vectors) return Fail(kCmd, "the selection has over 2^64 vectors");
  sel.n_vectors = *n_vectors;

  SafetensorsWriterOptions o;
  o.path = out;
  const uint64_t n = sel.n_vectors;
  const uint64_t dm = static_cast<uint64_t>(d.d_model);
  // The int64 columns first: the safetensors library orders tensors by
  // alignment, widest first, so that every tensor starts aligned.
  o.tensors = {{"example_idx", SafetensorsDtype::kI64, {n}},
               {"token_idx", SafetensorsDtype::kI64, {n}},
               {"activations", SafetensorsDtype::kF32, {n, dm}}};
  o.metadata = {
      {"format", "shardcast-export"},
      {"shardcast_version", kShardcastVersion},
      {"source_path", ValidUtf8(dir)},
      {"source_hash", info.hash},
      {"source_protocol", ValidUtf8(d.protocol)},
      {"layer", absl::StrCat(sel.layer)},
      {"tokens", sel.tokens},
      {"examples", absl::StrCat(sel.first, ":", sel.last)},
      {"d_model", absl::StrCat(d.d_model)},
      {"cls_token", d.cls_token ? "true" : "false"},
      {"token_idx",
       "content token index within the example; -1 is the CLS token"},
  };
  auto writer = SafetensorsWriter::Create(o);
  if (!writer.ok()) return Fail(kCmd, std::string(writer.status().message()));

  const uint64_t total = (*writer)->data_bytes();
  Progress progress(absl::StrCat("export ", BaseName(out)), total);
  uint64_t done = 0;
  absl::Status st;
  // example_idx and token_idx, computed; then the vectors, read.
  std::vector<int64_t> column(
      static_cast<size_t>(std::min<uint64_t>(kChunkBytes / 8, n + 1)));
  for (bool token_column : {false, true}) {
    for (uint64_t v = 0; st.ok() && v < n; v += column.size()) {
      const size_t count =
          static_cast<size_t>(std::min<uint64_t>(column.size(), n - v));
      FillIndices(sel, token_column, v, cls, column.data(), count);
      st = (*writer)->Append(column.data(), count * 8);
      done += count * 8;
      progress.Update(done);
    }
  }
  if (st.ok()) st = CopyVectors(**reader, sel, writer->get(), &progress, &done);
  if (st.ok()) st = (*writer)->Finish();
  progress.Finish();
  if (!st.ok()) return Fail(kCmd, std::string(st.message()));

  const SafetensorsHeader& h = (*writer)->header();
  if (args.Has("json")) {
    OrderedJson j;
    j["path"] = out;
    j["format"] = "safetensors";
    j["source"] = dir;
    j["source_hash"] = info.hash;
    j["layer"] = sel.layer;
    j["tokens"] = sel.tokens;
    j["examples"] = {sel.first, sel.last};
    j["n_vectors"] = n;
    j["d_model"] = d.d_model;
    j["file_size"] = h.file_size;
    OrderedJson tensors = OrderedJson::array();
    for (const SafetensorsTensor& t : h.tensors) {
      tensors.push_back({{"name", t.name},
                         {"dtype", std::string(SafetensorsDtypeName(t.dtype))},
                         {"shape", t.shape},
                         {"offset", t.offset},
                         {"bytes", t.size()}});
    }
    j["tensors"] = tensors;
    std::printf("%s\n", JsonText(j, 2).c_str());
    return kExitOk;
  }
  std::printf(
      "wrote %s: %llu vectors x %lld float32 (layer %lld, %s tokens, "
      "examples %lld:%lld of %s), %.1f MiB\n",
      out.c_str(), static_cast<unsigned long long>(n),
      static_cast<long long>(d.d_model), static_cast<long long>(sel.layer),
      sel.tokens.c_str(), static_cast<long long>(sel.first),
      static_cast<long long>(sel.last), info.hash.c_str(),
      static_cast<double>(h.file_size) / (1 << 20));
  for (const SafetensorsTensor& t : h.tensors) {
    std::printf("  %-12s %-4s %-16s bytes [%llu, %llu)\n", t.name.c_str(),
                std::string(SafetensorsDtypeName(t.dtype)).c_str(),
                ShapeJson(t.shape).c_str(),
                static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.offset + t.size()));
  }
  return kExitOk;
}

}  // namespace

Command ExportCommand() {
  return {
      "export",
      "export safetensors DATASET_DIR OUT.safetensors [--layer L] "
      "[--tokens all|content|cls] [--examples A:B] [--json]",
      "write one layer's vectors of a dataset to a safetensors file",
      "Reads the selected vectors of a local dataset (any protocol variant) "
      "and writes them to OUT.safetensors in one pass, as three tensors:\n"
      "  activations  F32 [n_vectors, d_model]  the vectors, in disk order "
      "(example, then token)\n"
      "  example_idx  I64 [n_vectors]           the example of each vector\n"
      "  token_idx    I64 [n_vectors]           its content token index; -1 "
      "is the CLS token (as `stream` batches number tokens)\n"
      "and __metadata__ with the source dataset's content hash, the layer, the "
      "token selection and the example range. The file is written beside "
      "OUT under a temporary name, fsynced and renamed over OUT, so an "
      "interrupted export never leaves a partial OUT. Progress goes to stderr "
      "for long exports.",
      {{"layer", "L",
        "recorded layer value (required when the dataset has several)"},
       {"tokens", "SEL",
        "content (default: every token but CLS), cls (the CLS token only) or "
        "all"},
       {"examples", "A:B",
        "examples A to B-1 (default all; A or B may be left out)"},
       {"json", nullptr, "print machine-readable JSON"}},
      RunExport};
}

}  // namespace shardcast
