#include "common/format/lmprobe.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/checked.h"
#include "common/base/file.h"
#include "common/base/limits.h"
#include "common/base/status.h"
#include "common/format/dataset.h"
#include "common/format/pyjson.h"

namespace shardcast {
namespace {

constexpr char kTensorsDir[] = "tensors";
constexpr char kIndexDir[] = "index";

absl::Status Bad(absl::string_view source, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", message));
}

std::string Q(absl::string_view text) {
  return absl::StrCat("\"", Quoted(text), "\"");
}

bool Exists(const std::string& path, bool* is_dir = nullptr) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return false;
  if (is_dir != nullptr) *is_dir = S_ISDIR(st.st_mode);
  return true;
}

// Names in `dir` (not "." and ".."); empty when it cannot be listed.
std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (struct dirent* e = ::readdir(d)) {
    absl::string_view name = e->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

// Python's format(value, spec) for the specs lmprobe patterns use: "",
// "d", "Nd", "0Nd".
absl::StatusOr<std::string> FormatInt(int64_t value, absl::string_view spec,
                                      absl::string_view pattern) {
  bool zero = false;
  if (!spec.empty() && spec.back() == 'd') spec.remove_suffix(1);
  if (!spec.empty() && spec.front() == '0') {
    zero = true;
    spec.remove_prefix(1);
  }
  int width = 0;
  if (!spec.empty()) {
    auto r = std::from_chars(spec.data(), spec.data() + spec.size(), width);
    if (r.ec != std::errc() || r.ptr != spec.data() + spec.size() ||
        width > 64) {
      return absl::InvalidArgumentError(absl::StrCat(
          "pattern ", Q(pattern), ": unsupported format spec ", Q(spec),
          " (lmprobe patterns use {name}, {name:d} or {name:0Nd})"));
    }
  }
  const std::string digits = absl::StrCat(
      value < 0 ? static_cast<uint64_t>(0) - static_cast<uint64_t>(value)
                : static_cast<uint64_t>(value));
  const std::string sign = value < 0 ? "-" : "";
  const size_t used = sign.size() + digits.size();
  const size_t pad =
      static_cast<size_t>(width) > used ? static_cast<size_t>(width) - used : 0;
  if (zero) return absl::StrCat(sign, std::string(pad, '0'), digits);
  return absl::StrCat(std::string(pad, ' '), sign, digits);
}

// A pattern's expansion must stay inside the dataset directory.
absl::Status CheckRelative(absl::string_view file, absl::string_view source) {
  if (file.empty() || file.front() == '/') {
    return Bad(source, absl::StrCat("shard file name ", Q(file),
                                    " is not a relative path"));
  }
  for (absl::string_view part : absl::StrSplit(file, '/')) {
    if (part == "..") {
      return Bad(source, absl::StrCat("shard file name ", Q(file),
                                      " leaves the dataset directory"));
    }
  }
  return absl::OkStatus();
}

// Maps a descriptor dtype ("float32", "torch.bfloat16", ...) to the
// safetensors one; nullopt for names we do not know.
std::optional<SafetensorsDtype> DescriptorDtype(absl::string_view name) {
  absl::ConsumePrefix(&name, "torch.");
  if (name == "float32" || name == "float") return SafetensorsDtype::kF32;
  if (name == "float16" || name == "half") return SafetensorsDtype::kF16;
  if (name == "bfloat16") return SafetensorsDtype::kBF16;
  if (name == "float64" || name == "double") return SafetensorsDtype::kF64;
  return ParseSafetensorsDtype(name);
}

// A non-negative integer member of `obj`, or nullopt when absent.
absl::StatusOr<std::optional<int64_t>> OptionalCount(const Json& obj,
                                                     const char* key,
                                                     absl::string_view where) {
  auto it = obj.find(key);
  if (it == obj.end()) return std::optional<int64_t>();
  if (!it->is_number_integer() ||
      (it->is_number_unsigned()
           ? it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
           : it->get<int64_t>() < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" must be a non-negative integer"));
  }
  return std::optional<int64_t>(it->get<int64_t>());
}

absl::StatusOr<std::string> OptionalString(const Json& obj, const char* key,
                                           absl::string_view where,
                                           absl::string_view fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::string(fallback);
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": \"", key, "\" must be a string"));
  }
  return it->get<std::string>();
}

// What the descriptor says about one shard.
struct ShardPlan {
  int64_t prompts = -1;  // num_prompts; -1 unknown
  int64_t tokens = -1;   // num_tokens; -1 unknown
  int64_t expected_rows = -1;
  const char* rows_field = "";  // which field expected_rows comes from
};

// Reads lmprobe_info.json's top level and hidden_layers descriptor into
// `ds` and `plan` (one entry per shard).
absl::Status ParseInfo(const Json& info, const std::string& source,
                       LmprobeDataset* ds, std::vector<ShardPlan>* plan) {
  if (!info.is_object()) return Bad(source, "must hold a JSON object");
  ASSIGN_OR_RETURN(ds->format_version,
                   OptionalString(info, "format_version", source, ""));
  if (!ds->format_version.empty()) {
    int major = 0;
    const std::string head =
        ds->format_version.substr(0, ds->format_version.find('.'));
    if (!absl::SimpleAtoi(head, &major) || major < 1 || major > 2) {
      return absl::UnimplementedError(absl::StrCat(
          source, ": format_version ", Q(ds->format_version),
          " is not one this reader knows (1.x with per_layer shards, 2.x)"));
    }
  }
  if (auto it = info.find("model"); it != info.end() && it->is_object()) {
    ASSIGN_OR_RETURN(ds->model_name, OptionalString(*it, "name", source, ""));
    ASSIGN_OR_RETURN(ds->model_revision,
                     OptionalString(*it, "revision", source, ""));
  } else {
    ASSIGN_OR_RETURN(ds->model_name,
                     OptionalString(info, "model_name", source, ""));
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> num_prompts,
                   OptionalCount(info, "num_prompts", source));
  ds->num_prompts = num_prompts.value_or(-1);

  auto tensors = info.find("tensors");
  if (tensors == info.end() || !tensors->is_object()) {
    return Bad(source, "\"tensors\" must be an object of tensor descriptors");
  }
  auto hidden_it = tensors->find("hidden_layers");
  if (hidden_it == tensors->end()) {
    return absl::UnimplementedError(absl::StrCat(
        source, ": the dataset has no hidden_layers tensors (only ",
        absl::StrJoin(tensors->items(), ", ",
                      [](std::string* out, const auto& kv) {
                        absl::StrAppend(out, Q(kv.key()));
                      }),
        "), and only hidden states are served"));
  }
  const Json& hidden = *hidden_it;
  const std::string where = absl::StrCat(source, ": tensors.hidden_layers");
  if (!hidden.is_object()) return Bad(where, "must be an object");
  ASSIGN_OR_RETURN(std::string layout,
                   OptionalString(hidden, "layout", where, "per_layer"));
  if (layout != "per_layer") {
    return absl::UnimplementedError(
        absl::StrCat(where, ": layout ", Q(layout),
                     " is not supported (only \"per_layer\" shards)"));
  }
  auto layers = hidden.find("layers");
  if (layers == hidden.end() || !layers->is_array() || layers->empty()) {
    return Bad(where, "\"layers\" must be a non-empty array of integers");
  }
  if (static_cast<int64_t>(layers->size()) > limits::kMaxLayers) {
    return Bad(where, absl::StrCat(layers->size(), " layers; at most ",
                                   limits::kMaxLayers, " are read"));
  }
  std::set<int64_t> seen;
  for (const Json& l : *layers) {
    if (!l.is_number_integer() ||
        (l.is_number_unsigned() &&
         l.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
      return Bad(where, "\"layers\" must be an array of integers");
    }
    const int64_t value = l.get<int64_t>();
    if (!seen.insert(value).second) {
      return Bad(where, absl::StrCat("layer ", value, " is listed twice"));
    }
    ds->layers.push_back(value);
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> dim,
                   OptionalCount(hidden, "dim", where));
  if (!dim || *dim < 1 || *dim > limits::kMaxDModel) {
    return Bad(where, absl::StrCat("\"dim\" must be an integer in [1, ",
                                   limits::kMaxDModel, "]"));
  }
  ds->dim = *dim;
  ASSIGN_OR_RETURN(std::string dtype,
                   OptionalString(hidden, "dtype", where, "float32"));
  std::optional<SafetensorsDtype> st_dtype = DescriptorDtype(dtype);
  if (!st_dtype) {
    return Bad(where, absl::StrCat("unknown dtype ", Q(dtype)));
  }
  ds->dtype = *st_dtype;
  ASSIGN_OR_RETURN(ds->file_pattern,
                   OptionalString(hidden, "file_pattern", where,
                                  kLmprobeDefaultFilePattern));
  ASSIGN_OR_RETURN(ds->key_pattern, OptionalString(hidden, "key_pattern", where,
                                                   kLmprobeDefaultKeyPattern));
  ASSIGN_OR_RETURN(std::string storage,
                   OptionalString(hidden, "storage", where, ""));
  if (storage == "pooled") {
    ds->storage = LmprobeStorage::kPooled;
  } else if (storage == "full_sequence") {
    ds->storage = LmprobeStorage::kFullSequence;
  } else if (storage.empty()) {
    ds->warnings.push_back(absl::StrCat(
        where, " has no \"storage\"; pooled or full_sequence is unknown"));
  } else {
    return Bad(where, absl::StrCat("storage ", Q(storage),
                                   " is neither \"pooled\" nor "
                                   "\"full_sequence\""));
  }
  ASSIGN_OR_RETURN(ds->pooling, OptionalString(hidden, "pooling", where, ""));
  ASSIGN_OR_RETURN(std::optional<int64_t> k,
                   OptionalCount(hidden, "last_token_shards", where));
  if (k && ds->storage != LmprobeStorage::kFullSequence) {
    return Bad(where,
               "\"last_token_shards\" is only meaningful with storage "
               "\"full_sequence\"");
  }
  ds->last_token_shards = k.value_or(0);

  auto shards = hidden.find("shards");
  if (shards == hidden.end() || !shards->is_array()) {
    return Bad(where, "\"shards\" must be an array of {num_prompts, ...}");
  }
  if (static_cast<int64_t>(shards->size()) > limits::kMaxShards) {
    return Bad(where, absl::StrCat(shards->size(), " shards; at most ",
                                   limits::kMaxShards, " are read"));
  }
  if (ds->last_token_shards > static_cast<int64_t>(shards->size())) {
    return Bad(where, absl::StrCat("last_token_shards is ",
                                   ds->last_token_shards, " but only ",
                                   shards->size(), " shards are listed"));
  }
  for (size_t s = 0; s < shards->size(); ++s) {
    const Json& entry = (*shards)[s];
    const std::string at = absl::StrCat(where, ".shards[", s, "]");
    if (!entry.is_object()) return Bad(at, "must be an object");
    ShardPlan p;
    ASSIGN_OR_RETURN(std::optional<int64_t> prompts,
                     OptionalCount(entry, "num_prompts", at));
    ASSIGN_OR_RETURN(std::optional<int64_t> tokens,
                     OptionalCount(entry, "num_tokens", at));
    if (!prompts) return Bad(at, "\"num_prompts\" is missing");
    p.prompts = *prompts;
    p.tokens = tokens.value_or(-1);
    const bool last_token = static_cast<int64_t>(s) < ds->last_token_shards;
    if (ds->storage == LmprobeStorage::kPooled) {
      p.expected_rows = p.prompts;
      p.rows_field = "num_prompts";
    } else if (ds->storage == LmprobeStorage::kFullSequence) {
      if (last_token && tokens && *tokens != p.prompts) {
        return Bad(at, absl::StrCat("a last-token shard holds one token per "
                                    "prompt, but num_tokens is ",
                                    *tokens, " and num_prompts ", p.prompts));
      }
      if (last_token) {
        p.expected_rows = p.prompts;
        p.rows_field = "num_prompts";
      } else if (tokens) {
        p.expected_rows = *tokens;
        p.rows_field = "num_tokens";
      }
    }
    plan->push_back(p);
  }
  auto row_bytes = hidden.find("row_bytes");
  if (row_bytes != hidden.end()) {
    const uint64_t want =
        static_cast<uint64_t>(ds->dim) *
        static_cast<uint64_t>(SafetensorsDtypeBits(ds->dtype)) / 8;
    if (!row_bytes->is_number_integer() || row_bytes->get<int64_t>() < 0 ||
        row_bytes->get<uint64_t>() != want) {
      return Bad(where,
                 absl::StrCat("row_bytes is ", row_bytes->dump(), " but dim ",
                              ds->dim, " of ", SafetensorsDtypeName(ds->dtype),
                              " is ", want, " bytes"));
    }
  }
  return absl::OkStatus();
}

// Finds shards by the default file pattern: files
// tensors/hidden_layer<L>_shard<S>.safetensors whose name the pattern
// reproduces exactly from (L, S).
absl::Status ScanShards(LmprobeDataset* ds, std::vector<ShardPlan>* plan) {
  ds->file_pattern = kLmprobeDefaultFilePattern;
  ds->key_pattern = kLmprobeDefaultKeyPattern;
  const std::string tensors_dir = JoinPath(ds->dir, kTensorsDir);
  std::map<int64_t, std::set<int64_t>> found;  // layer -> shards
  int64_t other = 0;
  int64_t files = 0;
  for (const std::string& name : ListDir(tensors_dir)) {
    if (!absl::EndsWith(name, ".safetensors")) continue;
    absl::string_view rest = name;
    int64_t layer = 0;
    int64_t shard = 0;
    bool ok = absl::ConsumePrefix(&rest, "hidden_layer") &&
              absl::ConsumeSuffix(&rest, ".safetensors");
    if (ok) {
      const size_t cut = rest.rfind("_shard");
      ok = cut != absl::string_view::npos &&
           absl::SimpleAtoi(rest.substr(0, cut), &layer) &&
           absl::SimpleAtoi(rest.substr(cut + 6), &shard) && shard >= 0 &&
           shard < limits::kMaxShards;
    }
    if (ok) {
      // Only names the pattern itself produces ("hidden_layer7_shard0" is
      // not one: the pattern pads to three digits).
      absl::StatusOr<std::string> again =
          FormatLmprobePattern(kLmprobeDefaultFilePattern, layer, shard);
      ok = again.ok() && *again == JoinPath(kTensorsDir, name);
    }
    if (!ok) {
      ++other;
      continue;
    }
    if (++files > kMaxLmprobeFiles) {
      return Bad(tensors_dir,
                 absl::StrCat("more than ", kMaxLmprobeFiles, " shard files"));
    }
    found[layer].insert(shard);
  }
  if (found.empty()) {
    return absl::NotFoundError(
        absl::StrCat(ds->dir, ": no lmprobe shards: neither ", kLmprobeInfoFile,
                     " nor files named like ", kLmprobeDefaultFilePattern));
  }
  if (static_cast<int64_t>(found.size()) > limits::kMaxLayers) {
    return Bad(tensors_dir, absl::StrCat(found.size(), " layers; at most ",
                                         limits::kMaxLayers, " are read"));
  }
  if (other > 0) {
    ds->warnings.push_back(absl::StrCat(
        other, " other .safetensors file(s) in ", tensors_dir,
        " (logits, or names the default pattern does not produce) are not "
        "described"));
  }
  int64_t n_shards = 0;
  for (const auto& [layer, shards] : found) {
    ds->layers.push_back(layer);
    n_shards = std::max(n_shards, *shards.rbegin() + 1);
  }
  for (int64_t s = 0; s < n_shards; ++s) {
    int64_t with = 0;
    for (const auto& [layer, shards] : found) with += shards.count(s);
    ShardPlan p;
    if (with == 0) {
      p.expected_rows = 0;  // in no layer: an empty shard lmprobe skipped
      ds->warnings.push_back(
          absl::StrCat("shard ", s,
                       " has no file in any layer; taken as empty (lmprobe "
                       "writes no file for an empty shard)"));
    } else if (with < static_cast<int64_t>(found.size())) {
      for (const auto& [layer, shards] : found) {
        if (shards.count(s) == 0) {
          return absl::NotFoundError(absl::StrCat(
              JoinPath(ds->dir, *FormatLmprobePattern(
                                    kLmprobeDefaultFilePattern, layer, s)),
              ": missing: shard ", s, " of layer ", layer,
              " has no file, though other layers have one"));
        }
      }
    }
    plan->push_back(p);
  }
  ds->warnings.push_back(absl::StrCat(
      "no ", kLmprobeInfoFile,
      ": storage (pooled or full_sequence), last-token shards and prompt "
      "counts are only in the parquet index's schema metadata"));
  return absl::OkStatus();
}

}  // namespace

absl::string_view LmprobeStorageName(LmprobeStorage storage) {
  switch (storage) {
    case LmprobeStorage::kPooled:
      return "pooled";
    case LmprobeStorage::kFullSequence:
      return "full_sequence";
    case LmprobeStorage::kUnknown:
      break;
  }
  return "unknown";
}

absl::StatusOr<std::string> FormatLmprobePattern(absl::string_view pattern,
                                                 int64_t layer, int64_t shard) {
  std::string out;
  for (size_t i = 0; i < pattern.size();) {
    const char c = pattern[i];
    if (c == '}') {
      if (i + 1 < pattern.size() && pattern[i + 1] == '}') {
        out.push_back('}');
        i += 2;
        continue;
      }
      return absl::InvalidArgumentError(
          absl::StrCat("pattern ", Q(pattern), ": single '}'"));
    }
    if (c != '{') {
      out.push_back(c);
      ++i;
      continue;
    }
    if (i + 1 < pattern.size() && pattern[i + 1] == '{') {
      out.push_back('{');
      i += 2;
      continue;
    }
    const size_t close = pattern.find('}', i);
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("pattern ", Q(pattern), ": unclosed '{'"));
    }
    absl::string_view field = pattern.substr(i + 1, close - i - 1);
    absl::string_view spec;
    if (const size_t colon = field.find(':');
        colon != absl::string_view::npos) {
      spec = field.substr(colon + 1);
      field = field.substr(0, colon);
    }
    int64_t value;
    if (field == "layer") {
      value = layer;
    } else if (field == "shard") {
      value = shard;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("pattern ", Q(pattern), ": unknown field ", Q(field),
                       " (lmprobe patterns use {layer} and {shard})"));
    }
    ASSIGN_OR_RETURN(std::string text, FormatInt(value, spec, pattern));
    out += text;
    i = close + 1;
  }
  return out;
}

const LmprobeLayer* LmprobeDataset::FindLayer(int64_t layer) const {
  for (const LmprobeLayer& l : tensors) {
    if (l.layer == layer) return &l;
  }
  return nullptr;
}

absl::StatusOr<LmprobeRowRange> LmprobeDataset::LocateRow(int64_t layer,
                                                          int64_t shard,
                                                          uint64_t row) const {
  const LmprobeLayer* l = FindLayer(layer);
  if (l == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, ": layer ", layer,
        " is not recorded (layers: ", absl::StrJoin(layers, ", "), ")"));
  }
  if (shard < 0 || shard >= num_shards()) {
    return absl::OutOfRangeError(absl::StrCat(
        dir, ": shard ", shard, " is outside [0, ", num_shards(), ")"));
  }
  const LmprobeShardTensor& t = l->shards[static_cast<size_t>(shard)];
  if (row >= t.rows) {
    return absl::OutOfRangeError(absl::StrCat(dir, ": row ", row, " of shard ",
                                              shard, " is outside [0, ", t.rows,
                                              ")"));
  }
  return LmprobeRowRange{&t.path, t.offset + row * row_bytes, row_bytes};
}

absl::StatusOr<LmprobeRowRange> LmprobeDataset::LocatePromptRow(
    int64_t layer, uint64_t prompt_row) const {
  int64_t end = 0;
  if (storage == LmprobeStorage::kPooled) {
    end = num_shards();
  } else if (storage == LmprobeStorage::kFullSequence) {
    end = last_token_shards;
  }
  if (end == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": no shards are known to hold one row per prompt (storage ",
        LmprobeStorageName(storage), ", ", last_token_shards,
        " last-token shards)"));
  }
  uint64_t row = prompt_row;
  for (int64_t s = 0; s < end; ++s) {
    const uint64_t rows = shard_rows[static_cast<size_t>(s)];
    if (row < rows) return LocateRow(layer, s, row);
    row -= rows;
  }
  return absl::OutOfRangeError(absl::StrCat(dir, ": prompt row ", prompt_row,
                                            " is past the ", prompt_row - row,
                                            " rows of shards [0, ", end, ")"));
}

bool LooksLikeLmprobeDir(const std::string& dir) {
  if (Exists(JoinPath(dir, kMetadataFile))) return false;
  if (Exists(JoinPath(dir, kLmprobeInfoFile))) return true;
  for (const std::string& name : ListDir(JoinPath(dir, kTensorsDir))) {
    if (absl::EndsWith(name, ".safetensors")) return true;
  }
  return false;
}

absl::StatusOr<LmprobeDataset> OpenLmprobeDataset(const std::string& dir) {
  LmprobeDataset ds;
  ds.dir = dir;
  bool is_dir = false;
  if (!Exists(dir, &is_dir) || !is_dir) {
    return absl::NotFoundError(absl::StrCat(dir, ": not a directory"));
  }
  for (const std::string& name : ListDir(JoinPath(dir, kIndexDir))) {
    if (absl::EndsWith(name, ".parquet")) ds.has_parquet_index = true;
  }

  std::vector<ShardPlan> plan;
  const std::string info_path = JoinPath(dir, kLmprobeInfoFile);
  if (Exists(info_path)) {
    ds.info_path = info_path;
    ASSIGN_OR_RETURN(std::string text,
                     ReadFileToString(info_path, limits::kMaxJsonBytes));
    ASSIGN_OR_RETURN(Json info, ParseJson(text, info_path));
    RETURN_IF_ERROR(ParseInfo(info, info_path, &ds, &plan));
  } else {
    RETURN_IF_ERROR(ScanShards(&ds, &plan));
  }
  const size_t n_shards = plan.size();
  if (static_cast<int64_t>(ds.layers.size() * n_shards) > kMaxLmprobeFiles) {
    return Bad(dir, absl::StrCat(ds.layers.size(), " layers x ", n_shards,
                                 " shards is more than the ", kMaxLmprobeFiles,
                                 " files this reader describes"));
  }

  // Every layer's tensor in every shard.
  std::optional<SafetensorsDtype> dtype;
  if (!ds.info_path.empty()) dtype = ds.dtype;
  int64_t dim = ds.info_path.empty() ? -1 : ds.dim;
  std::vector<std::optional<uint64_t>> rows(n_shards);
  std::vector<int64_t> rows_layer(n_shards, 0);  // layer that set rows[s]
  for (int64_t layer : ds.layers) {
    LmprobeLayer entry;
    entry.layer = layer;
    for (size_t s = 0; s < n_shards; ++s) {
      const ShardPlan& p = plan[s];
      LmprobeShardTensor t;
      ASSIGN_OR_RETURN(t.key, FormatLmprobePattern(ds.key_pattern, layer,
                                                   static_cast<int64_t>(s)));
      ASSIGN_OR_RETURN(t.file, FormatLmprobePattern(ds.file_pattern, layer,
                                                    static_cast<int64_t>(s)));
      RETURN_IF_ERROR(
          CheckRelative(t.file, ds.info_path.empty() ? dir : ds.info_path));
      t.path = JoinPath(dir, t.file);
      if (!Exists(t.path)) {
        if (p.expected_rows != 0) {
          return absl::NotFoundError(
              absl::StrCat(t.path, ": missing: shard ", s, " of layer ", layer,
                           p.expected_rows > 0
                               ? absl::StrCat(" should hold ", p.expected_rows,
                                              " rows (", p.rows_field, ")")
                               : std::string()));
        }
        entry.shards.push_back(std::move(t));  // empty, as lmprobe skips it
        if (!rows[s]) {
          rows[s] = 0;
          rows_layer[s] = layer;
        }
        continue;
      }
      ASSIGN_OR_RETURN(SafetensorsHeader header, ReadSafetensorsHeader(t.path));
      const SafetensorsTensor* tensor = header.Find(t.key);
      if (tensor == nullptr) {
        std::vector<std::string> names;
        for (const SafetensorsTensor& x : header.tensors) {
          if (names.size() == 8) {
            names.push_back(
                absl::StrCat("... (", header.tensors.size(), " tensors)"));
            break;
          }
          names.push_back(Q(x.name));
        }
        return Bad(t.path,
                   absl::StrCat("no tensor ", Q(t.key), " (key_pattern ",
                                Q(ds.key_pattern), "); the file holds ",
                                names.empty() ? std::string("none")
                                              : absl::StrJoin(names, ", ")));
      }
      const std::string who = absl::StrCat("tensor ", Q(t.key), ": ");
      const std::string shape =
          absl::StrCat("shape [", absl::StrJoin(tensor->shape, ", "), "]");
      if (tensor->shape.size() != 2) {
        return Bad(t.path,
                   absl::StrCat(who, shape, " is not [rows, dim] (a matrix)"));
      }
      if (dim >= 0 && tensor->shape[1] != static_cast<uint64_t>(dim)) {
        return Bad(t.path, absl::StrCat(who, shape, " is not [rows, ", dim, "]",
                                        ds.info_path.empty()
                                            ? " as in the first shard"
                                            : " (the descriptor's dim)"));
      }
      if (dim < 0) {
        if (tensor->shape[1] < 1 ||
            tensor->shape[1] > static_cast<uint64_t>(limits::kMaxDModel)) {
          return Bad(t.path,
                     absl::StrCat(who, "dim ", tensor->shape[1],
                                  " is outside [1, ", limits::kMaxDModel, "]"));
        }
        dim = static_cast<int64_t>(tensor->shape[1]);
      }
      if (dtype && tensor->dtype != *dtype) {
        return Bad(
            t.path,
            absl::StrCat(who, "dtype ", SafetensorsDtypeName(tensor->dtype),
                         " is not ", SafetensorsDtypeName(*dtype),
                         ds.info_path.empty() ? " as in the first shard"
                                              : " (the descriptor's)"));
      }
      dtype = tensor->dtype;
      t.present = true;
      t.rows = tensor->shape[0];
      t.offset = tensor->offset;
      t.bytes = tensor->size();
      if (p.expected_rows >= 0 &&
          t.rows != static_cast<uint64_t>(p.expected_rows)) {
        return Bad(t.path, absl::StrCat(who, t.rows,
                                        " rows, but the descriptor's "
                                        "shard ",
                                        s, " holds ", p.expected_rows, " (",
                                        p.rows_field, ")"));
      }
      if (!rows[s]) {
        rows[s] = t.rows;
        rows_layer[s] = layer;
      } else if (*rows[s] != t.rows) {
        return Bad(t.path, absl::StrCat(who, t.rows, " rows, but shard ", s,
                                        " of layer ", rows_layer[s], " has ",
                                        *rows[s]));
      }
      entry.shards.push_back(std::move(t));
    }
    ds.tensors.push_back(std::move(entry));
  }
  ds.dtype = dtype.value_or(ds.dtype);
  ds.dim = dim;
  const int bits = SafetensorsDtypeBits(ds.dtype);
  if ((static_cast<uint64_t>(ds.dim) * static_cast<uint64_t>(bits)) % 8 != 0) {
    return Bad(dir, absl::StrCat("a row of ", ds.dim, " ",
                                 SafetensorsDtypeName(ds.dtype),
                                 " values is not a whole number of bytes"));
  }
  ds.row_bytes =
      static_cast<uint64_t>(ds.dim) * static_cast<uint64_t>(bits) / 8;
  for (size_t s = 0; s < n_shards; ++s) {
    const uint64_t r = rows[s].value_or(0);
    ds.shard_rows.push_back(r);
    ds.shard_prompts.push_back(plan[s].prompts);
    std::optional<uint64_t> sum = CheckedAdd(ds.rows_per_layer, r);
    if (!sum) return Bad(dir, "the shards hold more than 2^64 rows");
    ds.rows_per_layer = *sum;
  }

  // Prompt counts: the shards with one row per prompt, against num_prompts.
  if (!ds.info_path.empty()) {
    const int64_t groups_end = ds.storage == LmprobeStorage::kFullSequence
                                   ? ds.last_token_shards
                                   : static_cast<int64_t>(n_shards);
    int64_t prompts = 0;
    for (int64_t s = 0; s < groups_end; ++s) {
      std::optional<int64_t> sum =
          CheckedAdd(prompts, plan[static_cast<size_t>(s)].prompts);
      if (!sum) return Bad(ds.info_path, "the shards hold over 2^63 prompts");
      prompts = *sum;
    }
    if (ds.storage != LmprobeStorage::kUnknown && groups_end > 0) {
      if (ds.num_prompts >= 0 && prompts != ds.num_prompts) {
        ds.warnings.push_back(absl::StrCat(
            ds.info_path, ": num_prompts is ", ds.num_prompts,
            " but shards [0, ", groups_end, ") hold ", prompts, " prompts"));
      } else if (ds.num_prompts < 0) {
        ds.num_prompts = prompts;
      }
    }
  }
  return ds;
}

}  // namespace shardcast
