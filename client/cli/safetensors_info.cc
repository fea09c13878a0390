// `shardcast info` on what is not a saev dataset directory: one safetensors
// file (its validated header) or an lmprobe dataset directory (its shards,
// described without the parquet index).
#include <sys/stat.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "common/format/lmprobe.h"
#include "common/format/pyjson.h"
#include "common/format/safetensors.h"
#include "nlohmann/json.hpp"

namespace shardcast {
namespace {

using OrderedJson = nlohmann::ordered_json;

double MiB(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::string Shape(const std::vector<uint64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int InfoSafetensorsFile(const char* command, const std::string& path,
                        bool json) {
  auto h = ReadSafetensorsHeader(path);
  if (!h.ok()) return Fail(command, std::string(h.status().message()));
  if (json) {
    OrderedJson j;
    j["path"] = path;
    j["format"] = "safetensors";
    j["header_bytes"] = h->header_bytes;
    j["data_offset"] = h->data_offset;
    j["file_size"] = h->file_size;
    OrderedJson tensors = OrderedJson::array();
    for (const SafetensorsTensor& t : h->tensors) {
      tensors.push_back({{"name", t.name},
                         {"dtype", std::string(SafetensorsDtypeName(t.dtype))},
                         {"shape", t.shape},
                         {"data_offsets", {t.begin, t.end}},
                         {"offset", t.offset},
                         {"bytes", t.size()}});
    }
    j["tensors"] = tensors;
    OrderedJson metadata = OrderedJson::object();
    for (const auto& [k, v] : h->metadata) metadata[k] = v;
    j["metadata"] = h->has_metadata ? metadata : OrderedJson(nullptr);
    std::printf("%s\n", JsonText(j, 2).c_str());
    return kExitOk;
  }
  std::printf("path        %s\n", path.c_str());
  std::printf(
      "format      safetensors: %llu-byte header, data from byte %llu, "
      "%llu bytes in all\n",
      static_cast<unsigned long long>(h->header_bytes),
      static_cast<unsigned long long>(h->data_offset),
      static_cast<unsigned long long>(h->file_size));
  std::printf("tensors     %zu (file byte ranges)\n", h->tensors.size());
  for (const SafetensorsTensor& t : h->tensors) {
    std::printf("  %-24s %-6s %-20s [%llu, %llu)\n", JsonText(t.name).c_str(),
                std::string(SafetensorsDtypeName(t.dtype)).c_str(),
                Shape(t.shape).c_str(),
                static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.offset + t.size()));
  }
  if (h->has_metadata) {
    std::printf("metadata    %zu entr%s\n", h->metadata.size(),
                h->metadata.size() == 1 ? "y" : "ies");
    for (const auto& [k, v] : h->metadata) {
      std::printf("  %s = %s\n", JsonText(k).c_str(), JsonText(v).c_str());
    }
  }
  return kExitOk;
}

// What a reader of this directory cannot know without the parquet index.
std::vector<std::string> NotAvailable(const LmprobeDataset& ds) {
  std::vector<std::string> out = {
      "prompt text, labels, num_tokens and the other per-prompt columns "
      "(index/*.parquet)"};
  switch (ds.storage) {
    case LmprobeStorage::kPooled:
      out.push_back(
          "which prompt each row is: lmprobe writes rows in index order "
          "(row r of the shards in order is index row r), but only the "
          "index's shard_index/row_offset columns say so");
      break;
    case LmprobeStorage::kFullSequence:
      out.push_back(
          "which prompt each last-token row is (index shard_index/row_offset; "
          "lmprobe writes them in index order)");
      out.push_back(
          "which prompt and token position each row of the sequence shards "
          "is (index token_shard_ids/token_shard_offsets), so per-token "
          "vectors cannot be tied to prompts");
      break;
    case LmprobeStorage::kUnknown:
      out.push_back(
          "whether storage is pooled or full_sequence, which shards hold "
          "last-token rows, the prompt counts, and which prompt (and token) "
          "each row is (the index's schema metadata and addressing columns)");
      break;
  }
  return out;
}

// "pooled", "last_token", "sequence" or "unknown" for shard s.
const char* ShardKind(const LmprobeDataset& ds, int64_t s) {
  switch (ds.storage) {
    case LmprobeStorage::kPooled:
      return "pooled";
    case LmprobeStorage::kFullSequence:
      return s < ds.last_token_shards ? "last_token" : "sequence";
    case LmprobeStorage::kUnknown:
      break;
  }
  return "unknown";
}

int InfoLmprobe(const char* command, const std::string& dir, bool json) {
  auto ds = OpenLmprobeDataset(dir);
  if (!ds.ok()) return Fail(command, std::string(ds.status().message()));
  for (const std::string& w : ds->warnings) {
    std::fprintf(stderr, "warning: %s\n", w.c_str());
  }
  const std::vector<std::string> missing = NotAvailable(*ds);
  const uint64_t layer_bytes = ds->rows_per_layer * ds->row_bytes;
  if (json) {
    OrderedJson j;
    j["path"] = dir;
    j["format"] = "lmprobe";
    j["info_file"] = ds->info_path.empty() ? OrderedJson(nullptr)
                                           : OrderedJson(ds->info_path);
    j["format_version"] = ds->format_version.empty()
                              ? OrderedJson(nullptr)
                              : OrderedJson(ds->format_version);
    j["model"] = {{"name", ds->model_name}, {"revision", ds->model_revision}};
    j["storage"] = std::string(LmprobeStorageName(ds->storage));
    j["pooling"] = ds->pooling;
    j["last_token_shards"] = ds->last_token_shards;
    j["layers"] = ds->layers;
    j["dim"] = ds->dim;
    j["dtype"] = std::string(SafetensorsDtypeName(ds->dtype));
    j["row_bytes"] = ds->row_bytes;
    j["num_prompts"] = ds->num_prompts >= 0 ? OrderedJson(ds->num_prompts)
                                            : OrderedJson(nullptr);
    OrderedJson shards = OrderedJson::array();
    for (int64_t s = 0; s < ds->num_shards(); ++s) {
      const int64_t prompts = ds->shard_prompts[static_cast<size_t>(s)];
      shards.push_back({{"shard", s},
                        {"kind", ShardKind(*ds, s)},
                        {"rows", ds->shard_rows[static_cast<size_t>(s)]},
                        {"num_prompts", prompts >= 0 ? OrderedJson(prompts)
                                                     : OrderedJson(nullptr)}});
    }
    j["shards"] = shards;
    j["rows_per_layer"] = ds->rows_per_layer;
    j["bytes_per_layer"] = layer_bytes;
    j["file_pattern"] = ds->file_pattern;
    j["key_pattern"] = ds->key_pattern;
    j["has_parquet_index"] = ds->has_parquet_index;
    OrderedJson tensors = OrderedJson::array();
    for (const LmprobeLayer& layer : ds->tensors) {
      for (size_t s = 0; s < layer.shards.size(); ++s) {
        const LmprobeShardTensor& t = layer.shards[s];
        tensors.push_back({{"layer", layer.layer},
                           {"shard", s},
                           {"file", t.file},
                           {"key", t.key},
                           {"present", t.present},
                           {"rows", t.rows},
                           {"offset", t.offset},
                           {"bytes", t.bytes}});
      }
    }
    j["tensors"] = tensors;
    j["not_available"] = missing;
    j["warnings"] = ds->warnings;
    std::printf("%s\n", JsonText(j, 2).c_str());
    return kExitOk;
  }
  std::printf("path        %s\n", dir.c_str());
  if (ds->info_path.empty()) {
    std::printf(
        "format      lmprobe (no %s: shards found by the default file "
        "pattern)\n",
        kLmprobeInfoFile);
  } else {
    std::printf("format      lmprobe %s (descriptor from %s)\n",
                ds->format_version.empty() ? "(version not given)"
                                           : ds->format_version.c_str(),
                kLmprobeInfoFile);
  }
  if (!ds->model_name.empty()) {
    std::printf("model       %s%s%s\n", ds->model_name.c_str(),
                ds->model_revision.empty() ? "" : " @ ",
                ds->model_revision.c_str());
  }
  switch (ds->storage) {
    case LmprobeStorage::kPooled:
      std::printf("storage     pooled%s%s: one row per prompt per layer\n",
                  ds->pooling.empty() ? "" : ", pooling ", ds->pooling.c_str());
      break;
    case LmprobeStorage::kFullSequence:
      if (ds->last_token_shards > 0) {
        std::printf(
            "storage     full_sequence: shards [0, %lld) hold each prompt's "
            "last token, shards [%lld, %lld) its other tokens\n",
            static_cast<long long>(ds->last_token_shards),
            static_cast<long long>(ds->last_token_shards),
            static_cast<long long>(ds->num_shards()));
      } else {
        std::printf(
            "storage     full_sequence: every shard holds all tokens of its "
            "prompts (no last-token shards)\n");
      }
      break;
    case LmprobeStorage::kUnknown:
      std::printf(
          "storage     unknown (pooled or full_sequence is recorded only in "
          "the parquet index)\n");
      break;
  }
  std::printf("layers      [%s] (%zu)\n",
              absl::StrJoin(ds->layers, ", ").c_str(), ds->layers.size());
  std::printf("dim         %lld x %s = %llu bytes per row\n",
              static_cast<long long>(ds->dim),
              std::string(SafetensorsDtypeName(ds->dtype)).c_str(),
              static_cast<unsigned long long>(ds->row_bytes));
  if (ds->num_prompts >= 0) {
    std::printf("prompts     %lld\n", static_cast<long long>(ds->num_prompts));
  } else {
    std::printf("prompts     unknown\n");
  }
  std::printf("shards      %lld per layer, rows %s = %llu per layer\n",
              static_cast<long long>(ds->num_shards()),
              absl::StrJoin(ds->shard_rows, " + ").c_str(),
              static_cast<unsigned long long>(ds->rows_per_layer));
  std::printf("size        %.1f MiB per layer, %.1f MiB in all\n",
              MiB(layer_bytes), MiB(layer_bytes) * ds->layers.size());
  std::printf("index       %s\n",
              ds->has_parquet_index
                  ? "index/*.parquet present (not read: no parquet reader)"
                  : "no index/*.parquet here");
  std::printf(
      "tensors     every layer's tensor in every shard (file bytes):\n");
  std::printf("  %6s %6s %-10s %10s  %-26s %s\n", "layer", "shard", "kind",
              "rows", "bytes", "file [key]");
  for (const LmprobeLayer& layer : ds->tensors) {
    for (size_t s = 0; s < layer.shards.size(); ++s) {
      const LmprobeShardTensor& t = layer.shards[s];
      const std::string range =
          t.present ? absl::StrCat("[", t.offset, ", ", t.offset + t.bytes, ")")
                    : std::string("(no file: empty)");
      std::printf("  %6lld %6zu %-10s %10llu  %-26s %s [%s]\n",
                  static_cast<long long>(layer.layer), s,
                  ShardKind(*ds, static_cast<int64_t>(s)),
                  static_cast<unsigned long long>(t.rows), range.c_str(),
                  t.file.c_str(), t.key.c_str());
    }
  }
  std::printf("not available without the parquet index:\n");
  for (const std::string& m : missing) std::printf("  - %s\n", m.c_str());
  return kExitOk;
}

}  // namespace

bool IsSafetensorsOrLmprobe(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return false;
  if (S_ISREG(st.st_mode)) return true;
  return S_ISDIR(st.st_mode) && LooksLikeLmprobeDir(path);
}

int InfoSafetensorsOrLmprobe(const char* command, const std::string& path,
                             bool json) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return InfoLmprobe(command, path, json);
  }
  return InfoSafetensorsFile(command, path, json);
}

}  // namespace shardcast
