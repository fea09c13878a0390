// `shardcast import pkl DIR ROOT`: converts an activation directory in the
// pickle.gz format of seed 002 (metadata.json + shard_NNNN.pkl.gz, each a
// gzip'd pickle of {"layer_<idx>": [sample dicts]}) into a saev protocol
// 2.1 dataset under ROOT, written by the crash-safe DatasetWriter.
//
// Mapping onto the saev tensor [example, layer, token, d_model]:
//   example  one seed-002 sample, in shard order (as listed in
//            metadata.json) and list order within a shard;
//   layer    the seed's layer index: key "layer_15" is layer value 15;
//   token    the sequence position, 0 .. max_seq_length - 1, no CLS token;
//            shorter sequences are padded with zero vectors whose label in
//            labels.bin is kPaddingLabel, so `exclude_labels: [255]` drops
//            them when streaming;
//   d_model  hidden_size.
// Shards are read one at a time: the compressed file is hashed and
// decompressed in one streaming pass, the digest is checked against
// metadata.json before a single byte is unpickled, and the restricted
// unpickler (common/convert/pickle.h) never runs code from the file.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "common/base/file.h"
#include "common/base/status.h"
#include "common/convert/pickle.h"
#include "common/format/pyjson.h"
#include "common/format/samples.h"
#include "common/format/sha256.h"
#include "common/format/writer.h"

namespace shardcast {
namespace {

/// labels.bin value of the padding positions added to sequences shorter
/// than max_seq_length. Real tokens are labelled kTokenLabel. 255 is the
/// largest uint8 label, so it cannot collide with small class labels.
constexpr uint8_t kPaddingLabel = 255;
constexpr uint8_t kTokenLabel = 0;

/// Sidecar written into the dataset directory (the daemon serves it later):
///   {"format": "shardcast.samples/1",
///    "source": "<absolute path of DIR>",
///    "layers": [15, 16], "tokens_per_example": 512,
///    "token_label": 0, "padding_label": 255,
///    "samples": [
///      {"example": 0,            // index on the saev example axis
///       "sample_idx": 0,         // the seed's sample_idx, or null
///       "dataset_idx": 12345,    // sample or sample["metadata"], or null
///       "seq_len": 487,          // real tokens; the rest is padding
///       "shard": "shard_0001.pkl.gz",
///       "text_preview": "...",   // when the sample has one
///       "metadata": {...},       // the sample's "metadata" dict, if any
///       "extra": {...}},         // other keys of the sample dict (16 at
///                                // most, each value cut to 4 KiB)
///      ...]}
/// One sample per line, in example order, so that it can be read as
/// JSON or scanned line by line.

/// The importer holds one example ([L, T, D] float32) in memory at least.
constexpr double kMaxExampleBytes = 16.0 * (1 << 30);

constexpr size_t kReadChunk = 8 << 20;
constexpr size_t kMaxSampleKeys = 256;
constexpr size_t kMaxExtraKeys = 16;
constexpr size_t kBatchBytes = 16 << 20;
constexpr char kCmd[] = "import";

int Usage(const std::string& message) {
  std::fprintf(stderr, "shardcast import: %s (see shardcast import --help)\n",
               message.c_str());
  return kExitUsage;
}

// ------------------------------------------------------------ the source

struct SourceShard {
  std::string filename;      // as listed in metadata.json
  std::string path;          // DIR/filename
  std::string sha256;        // lowercase hex; empty when metadata.json has none
  int64_t num_samples = -1;  // -1: not given
  std::optional<std::vector<int64_t>> layers;
  std::optional<bool> compressed;
  uint64_t file_bytes = 0;
};

struct Source {
  std::string dir;
  std::string abs_dir;
  std::vector<SourceShard> shards;
  std::optional<std::vector<int64_t>> layers;  // layers_extracted
  int64_t max_seq_length = 0;                  // 0: not given
  int64_t hidden_size = 0;                     // 0: not given
  std::string family = "unknown";
  std::string ckpt = "unknown";
  Json description = Json::object();  // goes into the saev `data` field
};

const Json* Member(const Json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

absl::StatusOr<std::vector<int64_t>> IntList(const Json& j,
                                             const std::string& where) {
  if (!j.is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " must be a list of integers, got ", j.dump()));
  }
  std::vector<int64_t> out;
  for (const Json& v : j) {
    if (!v.is_number_integer()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " must hold integers, found ", v.dump()));
    }
    out.push_back(v.get<int64_t>());
  }
  return out;
}

absl::StatusOr<int64_t> PositiveInt(const Json& j, const std::string& where) {
  if (!j.is_number_integer() || j.get<int64_t>() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " must be a positive integer, got ", j.dump()));
  }
  return j.get<int64_t>();
}

// "sha256:<hex>" or "<hex>" -> lowercase hex; "" when absent.
absl::StatusOr<std::string> ParseChecksum(const Json* j,
                                          const std::string& where) {
  if (j == nullptr) return std::string();
  if (!j->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " must be a string like \"sha256:<hex>\""));
  }
  std::string text = j->get<std::string>();
  const size_t colon = text.find(':');
  if (colon != std::string::npos) {
    const std::string algo = absl::AsciiStrToLower(text.substr(0, colon));
    if (algo != "sha256") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " uses algorithm '", Quoted(algo),
                       "'; only sha256 checksums can be verified"));
    }
    text = text.substr(colon + 1);
  }
  text = absl::AsciiStrToLower(text);
  if (text.size() != 64 ||
      text.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " = \"", Quoted(j->get<std::string>()),
                     "\" is not a sha256 digest (64 hex digits)"));
  }
  return text;
}

absl::StatusOr<Source> ReadSource(const std::string& dir) {
  Source src;
  src.dir = dir;
  char* real = ::realpath(dir.c_str(), nullptr);
  if (real == nullptr) {
    return ErrnoToStatus(errno, absl::StrCat("source directory ", dir));
  }
  src.abs_dir = real;
  ::free(real);
  const std::string meta_path = JoinPath(dir, "metadata.json");
  absl::StatusOr<std::string> text = ReadFileToString(meta_path);
  if (!text.ok()) {
    if (absl::IsNotFound(text.status())) {
      return absl::NotFoundError(absl::StrCat(
          meta_path,
          " not found: DIR must be a seed-002 activation directory "
          "(metadata.json + shard_NNNN.pkl.gz)"));
    }
    return text.status();
  }
  ASSIGN_OR_RETURN(Json meta, ParseJson(*text, meta_path));
  if (!meta.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(meta_path, ": must hold a JSON object"));
  }
  const Json* config = Member(meta, "extraction_config");
  if (const Json* l = config ? Member(*config, "layers_extracted") : nullptr) {
    ASSIGN_OR_RETURN(src.layers, IntList(*l, meta_path + ": extraction_config."
                                                         "layers_extracted"));
  } else if (const Json* stats = Member(meta, "statistics")) {
    if (const Json* sl = Member(*stats, "layers_extracted")) {
      ASSIGN_OR_RETURN(
          src.layers,
          IntList(*sl, meta_path + ": statistics.layers_extracted"));
    }
  }
  if (const Json* m = config ? Member(*config, "max_seq_length") : nullptr) {
    ASSIGN_OR_RETURN(src.max_seq_length,
                     PositiveInt(*m, meta_path + ": extraction_config."
                                                 "max_seq_length"));
  }
  if (const Json* mp = config ? Member(*config, "model_params") : nullptr) {
    if (const Json* h = Member(*mp, "hidden_size")) {
      ASSIGN_OR_RETURN(src.hidden_size,
                       PositiveInt(*h, meta_path + ": extraction_config."
                                                   "model_params.hidden_size"));
    }
  }
  src.description["format"] = "seed-002 pickle.gz activations";
  if (const Json* v = Member(meta, "version")) src.description["version"] = *v;
  if (const Json* v = Member(meta, "created_at")) {
    src.description["created_at"] = *v;
  }
  if (config != nullptr) {
    for (const char* key : {"model_name", "model_architecture", "dataset_name",
                            "dataset_config", "dataset_split"}) {
      const Json* v = Member(*config, key);
      if (v == nullptr) continue;
      src.description[key] = *v;
      if (v->is_string() && std::strcmp(key, "model_name") == 0) {
        src.ckpt = v->get<std::string>();
      }
      if (v->is_string() && std::strcmp(key, "model_architecture") == 0) {
        src.family = v->get<std::string>();
      }
    }
  }

  const Json* shards = Member(meta, "shards");
  if (shards == nullptr || !shards->is_array() || shards->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        meta_path, ": field 'shards' must be a non-empty list of shards"));
  }
  for (size_t i = 0; i < shards->size(); ++i) {
    const Json& e = (*shards)[i];
    const std::string where = absl::StrCat(meta_path, ": shards[", i, "]");
    const Json* name = Member(e, "filename");
    if (name == nullptr || !name->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has no string field 'filename'"));
    }
    SourceShard s;
    s.filename = name->get<std::string>();
    // A name from the file must stay inside DIR.
    if (s.filename.empty() || s.filename == "." || s.filename == ".." ||
        s.filename.find('/') != std::string::npos ||
        s.filename.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": filename \"", Quoted(s.filename),
                       "\" must be a plain file name inside ", dir));
    }
    s.path = JoinPath(dir, s.filename);
    ASSIGN_OR_RETURN(s.sha256,
                     ParseChecksum(Member(e, "checksum"), where + ".checksum"));
    if (const Json* n = Member(e, "num_samples")) {
      if (!n->is_number_integer() || n->get<int64_t>() < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".num_samples must be an integer >= 0, got ", n->dump()));
      }
      s.num_samples = n->get<int64_t>();
    }
    if (const Json* l = Member(e, "layers")) {
      ASSIGN_OR_RETURN(s.layers, IntList(*l, where + ".layers"));
    }
    if (const Json* c = Member(e, "compressed")) {
      if (!c->is_boolean()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".compressed must be true or false"));
      }
      s.compressed = c->get<bool>();
    }
    src.shards.push_back(std::move(s));
  }
  return src;
}

// Every shard file must be there before anything is written.
absl::Status CheckShardFiles(Source* src) {
  std::vector<std::string> problems;
  for (SourceShard& s : src->shards) {
    struct stat st;
    if (::stat(s.path.c_str(), &st) != 0) {
      problems.push_back(absl::StrCat(s.path, " (", std::strerror(errno), ")"));
    } else if (!S_ISREG(st.st_mode)) {
      problems.push_back(absl::StrCat(s.path, " (not a regular file)"));
    } else {
      s.file_bytes = static_cast<uint64_t>(st.st_size);
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat(
      "missing shard file", problems.size() > 1 ? "s" : "",
      " listed in metadata.json: ", absl::StrJoin(problems, ", ")));
}

// --------------------------------------------------------------- a shard

struct LoadStats {
  uint64_t file_bytes = 0;
  uint64_t pickle_bytes = 0;
};

// Reads the shard once: SHA-256 of the file bytes and gunzip in the same
// pass. The digest is compared before the pickle is parsed; a mismatch
// wins over a gzip error (a corrupt file is reported as corrupt).
// The most a shard may inflate to: what metadata.json says it holds when
// it says enough (num_samples x layers x max_seq_length x hidden_size, at
// 8 bytes a value, the widest dtype, plus 1 MiB a sample for its other
// fields and 64 MiB), never more than --max-shard-bytes. `why` says which,
// for the error.
uint64_t ShardBound(const Source& src, const SourceShard& s,
                    uint64_t max_shard_bytes, std::string* why) {
  *why = absl::StrCat("--max-shard-bytes = ", max_shard_bytes);
  const std::optional<std::vector<int64_t>>& layers =
      s.layers ? s.layers : src.layers;
  if (s.num_samples < 0 || !layers || src.max_seq_length <= 0 ||
      src.hidden_size <= 0) {
    return max_shard_bytes;
  }
  const double values = static_cast<double>(s.num_samples) *
                        static_cast<double>(layers->size()) *
                        static_cast<double>(src.max_seq_length) *
                        static_cast<double>(src.hidden_size);
  const double bound =
      values * 8 + static_cast<double>(s.num_samples) * (1 << 20) + (64 << 20);
  if (bound >= static_cast<double>(max_shard_bytes)) return max_shard_bytes;
  *why = absl::StrCat("the ", static_cast<uint64_t>(bound),
                      " bytes metadata.json allows (", s.num_samples,
                      " samples x ", layers->size(), " layers x ",
                      src.max_seq_length, " tokens x ", src.hidden_size,
                      " values, with room for each sample's other fields)");
  return static_cast<uint64_t>(bound);
}

absl::StatusOr<Pickle> LoadShard(const SourceShard& s, uint64_t max_bytes,
                                 const std::string& bound_why,
                                 LoadStats* stats) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(s.path));
  Sha256 sha;
  GzipDecoder gz(max_bytes);
  std::string raw;  // the pickle bytes
  std::vector<char> buf(kReadChunk);
  absl::Status gz_status;
  bool gzip = false;
  bool first = true;
  uint64_t total = 0;
  while (true) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(errno, absl::StrCat("read ", s.path));
    if (n == 0) break;
    const absl::string_view chunk(buf.data(), static_cast<size_t>(n));
    sha.Update(chunk);
    total += static_cast<uint64_t>(n);
    if (first) {
      first = false;
      gzip = LooksLikeGzip(chunk) || (n == 1 && chunk[0] == '\x1f');
      const bool want_gzip =
          s.compressed.value_or(absl::EndsWith(s.filename, ".gz"));
      if (!gzip && want_gzip) {
        gz_status = absl::InvalidArgumentError(absl::StrCat(
            "not gzip data (no 1f 8b magic) although ",
            s.compressed.has_value() ? "metadata.json says compressed: true"
                                     : "the name ends in .gz"));
      }
    }
    if (!gz_status.ok()) continue;  // keep hashing: the digest decides
    if (gzip) {
      gz_status = gz.Feed(chunk, &raw);
      if (absl::IsResourceExhausted(gz_status)) {
        gz_status = absl::ResourceExhaustedError(
            absl::StrCat("decompresses to more than ", bound_why));
      }
    } else if (raw.size() + chunk.size() > max_bytes) {
      gz_status =
          absl::ResourceExhaustedError(absl::StrCat("larger than ", bound_why));
    } else {
      raw.append(chunk.data(), chunk.size());
    }
  }
  if (gz_status.ok() && gzip) gz_status = gz.Finish();
  if (first) gz_status = absl::DataLossError("the file is empty");
  stats->file_bytes = total;
  stats->pickle_bytes = raw.size();
  if (!s.sha256.empty()) {
    const std::string actual = sha.HexDigest();
    if (actual != s.sha256) {
      return absl::DataLossError(absl::StrCat(
          s.path, ": checksum mismatch: metadata.json says sha256:", s.sha256,
          " but the file (", total, " bytes) has sha256:", actual,
          "; the shard is corrupt or was modified, nothing was imported"));
    }
  }
  if (!gz_status.ok()) return Annotate(gz_status, s.path);
  absl::StatusOr<Pickle> pickle = Unpickle(std::move(raw));
  if (!pickle.ok()) {
    return Annotate(pickle.status(),
                    absl::StrCat(s.path,
                                 " (not imported; nothing in it was "
                                 "executed)"));
  }
  return pickle;
}

std::string LayerKey(int64_t layer) { return absl::StrCat("layer_", layer); }

// The layer values a shard holds, from its "layer_<int>" keys, sorted.
std::vector<int64_t> ShardLayers(const PickleValue& root) {
  std::vector<int64_t> layers;
  for (const auto& [key, value] : root.Entries()) {
    int64_t l;
    if (key.is_str() && absl::StartsWith(key.AsString(), "layer_") &&
        absl::SimpleAtoi(key.AsString().substr(6), &l) &&
        std::find(layers.begin(), layers.end(), l) == layers.end()) {
      layers.push_back(l);
    }
  }
  std::sort(layers.begin(), layers.end());
  return layers;
}

// The sample lists of the selected layers; all must be there and equally
// long.
absl::StatusOr<std::vector<const std::vector<PickleValue>*>> LayerLists(
    const PickleValue& root, const SourceShard& s,
    const std::vector<int64_t>& layers) {
  if (!root.is_dict()) {
    return absl::InvalidArgumentError(absl::StrCat(
        s.path, ": the pickle holds a ", root.KindName(),
        "; a seed-002 shard is a dict {\"layer_<idx>\": [samples]}"));
  }
  std::vector<const std::vector<PickleValue>*> lists;
  for (int64_t l : layers) {
    const PickleValue* v = root.Get(LayerKey(l));
    if (v == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          s.path, ": no key '", LayerKey(l), "' (the shard has layers [",
          absl::StrJoin(ShardLayers(root), ", "), "])"));
    }
    if (v->kind() != PickleValue::Kind::kList &&
        v->kind() != PickleValue::Kind::kTuple) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.path, ": '", LayerKey(l), "' is a ", v->KindName(),
                       "; expected a list of sample dicts"));
    }
    if (!lists.empty() && v->Items().size() != lists.front()->size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          s.path, ": '", LayerKey(l), "' holds ", v->Items().size(),
          " samples but '", LayerKey(layers.front()), "' holds ",
          lists.front()->size()));
    }
    lists.push_back(&v->Items());
  }
  return lists;
}

// An activation array seen as [seq_len, hidden].
struct Activation {
  const NdArray* array = nullptr;
  int64_t seq_len = 0;
  int64_t hidden = 0;
};

absl::StatusOr<Activation> GetActivation(const PickleValue& sample,
                                         const std::string& where) {
  if (!sample.is_dict()) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, " is a ", sample.KindName(), "; expected a sample dict"));
  }
  // Lookups in a dict are linear: a sample dict shared by every sample
  // through the pickle memo must not make the import quadratic.
  if (sample.Entries().size() > kMaxSampleKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the sample dict has ", sample.Entries().size(),
                     " keys; a seed-002 sample has a handful (at most ",
                     kMaxSampleKeys, " are accepted)"));
  }
  const PickleValue* v = sample.Get("activation");
  if (v == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " has no 'activation'"));
  }
  if (!v->is_array()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": 'activation' is a ", v->KindName(),
                     "; expected a numpy array [seq_len, hidden_size]"));
  }
  Activation a;
  a.array = &v->AsArray();
  if (a.array->dtype != DType::kFloat32 && a.array->dtype != DType::kFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": 'activation' has dtype ", DTypeName(a.array->dtype),
        "; only float32 (and float16, widened exactly) can be imported into "
        "a float32 saev dataset"));
  }
  const std::vector<int64_t>& shape = a.array->shape;
  if (shape.size() == 2 || (shape.size() == 3 && shape[0] == 1)) {
    a.seq_len = shape[shape.size() - 2];
    a.hidden = shape[shape.size() - 1];
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": 'activation' has shape [", absl::StrJoin(shape, ", "),
        "]; expected [seq_len, hidden_size]"));
  }
  return a;
}

std::string SampleWhere(const SourceShard& s, int64_t layer, size_t item,
                        const PickleValue* sample_idx) {
  std::string w = absl::StrCat(s.path, ", ", LayerKey(layer), "[", item, "]");
  if (sample_idx != nullptr && sample_idx->is_int()) {
    absl::StrAppend(&w, " (sample_idx ", sample_idx->AsInt(), ")");
  }
  return w;
}

// For each selected layer, where sample `item` of the first layer is:
// the same position when the sample_idx agrees (the common case), else
// the position with the same sample_idx.
class SampleMatcher {
 public:
  SampleMatcher(const SourceShard& shard, const std::vector<int64_t>& layers,
                const std::vector<const std::vector<PickleValue>*>& lists)
      : shard_(shard),
        layers_(layers),
        lists_(lists),
        index_(lists.size()),
        indexed_(lists.size(), false) {}

  absl::StatusOr<const PickleValue*> Find(size_t li, size_t item,
                                          const PickleValue* sample_idx) {
    const std::vector<PickleValue>& list = *lists_[li];
    const PickleValue& same = list[item];
    if (li == 0 || sample_idx == nullptr || !sample_idx->is_int()) {
      return &same;
    }
    const PickleValue* other = same.Get("sample_idx");
    if (other != nullptr && other->is_int() &&
        other->AsInt() == sample_idx->AsInt()) {
      return &same;
    }
    auto& index = index_[li];
    if (!indexed_[li]) {
      indexed_[li] = true;
      for (size_t j = 0; j < list.size(); ++j) {
        const PickleValue* id = list[j].Get("sample_idx");
        if (id == nullptr || !id->is_int()) continue;
        if (!index.emplace(id->AsInt(), j).second) {
          return absl::InvalidArgumentError(
              absl::StrCat(SampleWhere(shard_, layers_[li], j, id),
                           ": sample_idx appears twice in this layer"));
        }
      }
    }
    auto it = index.find(sample_idx->AsInt());
    if (it == index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(shard_.path, ": sample_idx ", sample_idx->AsInt(),
                       " of '", LayerKey(layers_[0]), "' is missing from '",
                       LayerKey(layers_[li]), "'"));
    }
    return &list[it->second];
  }

 private:
  const SourceShard& shard_;
  const std::vector<int64_t>& layers_;
  const std::vector<const std::vector<PickleValue>*>& lists_;
  std::vector<std::unordered_map<int64_t, size_t>> index_;
  std::vector<bool> indexed_;
};

// ------------------------------------------------------------ the output

// Writes samples.json into the writer's temporary directory, so that it is
// renamed into place with the dataset (or removed with it on failure).
class SamplesFile {
 public:
  absl::Status Open(const std::string& path, const Source& src,
                    const std::vector<int64_t>& layers, int64_t tokens) {
    path_ = path;
    ASSIGN_OR_RETURN(fd_, OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644));
    Json head = Json::object();
    head["format"] = kSamplesFormat;
    head["source"] = src.abs_dir;
    head["layers"] = layers;
    head["tokens_per_example"] = tokens;
    head["token_label"] = kTokenLabel;
    head["padding_label"] = kPaddingLabel;
    std::string text = JsonText(head);
    text.pop_back();  // the closing brace: "samples" follows
    buffer_ = absl::StrCat(text, ",\"samples\":[\n");
    return absl::OkStatus();
  }

  absl::Status Add(const Json& sample) {
    if (count_++ > 0) buffer_ += ",\n";
    buffer_ += JsonText(sample);
    if (buffer_.size() >= (1 << 20)) return Flush();
    return absl::OkStatus();
  }

  absl::Status Close() {
    buffer_ += "\n]}\n";
    RETURN_IF_ERROR(Flush());
    RETURN_IF_ERROR(Fsync(fd_.get(), path_));
    fd_.Reset();
    return absl::OkStatus();
  }

 private:
  absl::Status Flush() {
    RETURN_IF_ERROR(
        WriteFull(fd_.get(), buffer_.data(), buffer_.size(), path_));
    buffer_.clear();
    return absl::OkStatus();
  }

  std::string path_;
  UniqueFd fd_;
  std::string buffer_;
  int64_t count_ = 0;
};

Json SampleJson(int64_t example, const PickleValue& sample, int64_t seq_len,
                const std::string& shard) {
  Json j = Json::object();
  j["example"] = example;
  const PickleValue* id = sample.Get("sample_idx");
  j["sample_idx"] = id != nullptr ? Json(PickleToJson(*id)) : Json(nullptr);
  const PickleValue* meta = sample.Get("metadata");
  const PickleValue* dataset_idx = sample.Get("dataset_idx");
  if (dataset_idx == nullptr && meta != nullptr) {
    dataset_idx = meta->Get("dataset_idx");
  }
  j["dataset_idx"] =
      dataset_idx != nullptr ? Json(PickleToJson(*dataset_idx)) : Json(nullptr);
  j["seq_len"] = seq_len;
  j["shard"] = shard;
  const PickleValue* text = sample.Get("text_preview");
  if (text == nullptr) text = sample.Get("text");
  if (text != nullptr) j["text_preview"] = Json(PickleToJson(*text));
  if (meta != nullptr) j["metadata"] = Json(PickleToJson(*meta));
  Json extra = Json::object();
  for (const auto& [key, value] : sample.Entries()) {
    if (!key.is_str()) continue;
    const absl::string_view k = key.AsString();
    if (k == "activation" || k == "shape" || k == "sample_idx" ||
        k == "dataset_idx" || k == "metadata" || k == "text_preview" ||
        k == "text") {
      continue;
    }
    // Bounded per sample: at most kMaxExtraKeys small renderings.
    if (extra.size() == kMaxExtraKeys || k.size() > 256) continue;
    extra[std::string(k)] = Json(PickleToJson(value, 8, 256, 4096));
  }
  if (!extra.empty()) j["extra"] = std::move(extra);
  return j;
}

// Leftovers of a killed import of the same dataset (same hash) whose
// process is gone are removed; the writer names its temporary directory
// .shardcast-tmp-<hash8>-<pid>-<random>.
void RemoveStaleTempDirs(const std::string& root, const std::string& hash,
                         const std::string& ours) {
  const std::string prefix =
      absl::StrCat(".shardcast-tmp-", hash.substr(0, 8), "-");
  DIR* d = ::opendir(root.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    if (absl::StartsWith(e->d_name, prefix)) names.emplace_back(e->d_name);
  }
  ::closedir(d);
  for (const std::string& name : names) {
    const std::string path = JoinPath(root, name);
    if (path == ours) continue;
    const std::string rest = name.substr(prefix.size());
    int pid = 0;
    struct stat st;
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid) || pid <= 0 ||
        ::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      continue;
    }
    if (::kill(pid, 0) == 0 || errno != ESRCH) {
      std::fprintf(stderr,
                   "shardcast import: note: %s belongs to a running process "
                   "(pid %d), left alone\n",
                   path.c_str(), pid);
      continue;
    }
    absl::Status st_rm = RemoveTree(path);
    std::fprintf(stderr,
                 "shardcast import: %s %s, left by an interrupted run "
                 "(pid %d)%s\n",
                 st_rm.ok() ? "removed" : "could not remove", path.c_str(), pid,
                 st_rm.ok() ? "" : absl::StrCat(": ", st_rm.message()).c_str());
  }
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

// ------------------------------------------------------------- the import

struct ImportOptions {
  std::vector<int64_t> layers;  // empty: all
  int64_t max_seq_length = 0;   // 0: from metadata.json or the data
  int64_t budget = 0;           // 0: default, raised to fit one example
  uint64_t max_shard_bytes = 0;
  std::string root;
};

class Importer {
 public:
  Importer(Source src, ImportOptions options)
      : src_(std::move(src)), options_(std::move(options)) {}

  absl::StatusOr<WriteResult> Run();
  const DatasetDesc& desc() const { return writer_->desc(); }

 private:
  absl::Status ChooseLayers(const PickleValue* first_root);
  absl::Status Prescan();
  absl::Status StartWriter(const Activation& first, const std::string& where);
  absl::Status ImportShard(size_t index);
  absl::Status FlushBatch();

  Source src_;
  ImportOptions options_;
  std::vector<int64_t> layers_;
  bool layers_chosen_ = false;
  std::string tokens_from_;  // where max_seq_length came from
  int64_t tokens_ = 0;
  int64_t hidden_ = 0;
  std::string hidden_from_;
  std::vector<int64_t> counts_;  // samples per shard
  int64_t n_examples_ = 0;
  int64_t example_ = 0;  // next example index

  std::unique_ptr<DatasetWriter> writer_;
  SamplesFile samples_;  // destroyed before writer_ removes its directory
  std::vector<float> batch_;
  std::vector<uint8_t> labels_;
  uint64_t bytes_read_ = 0;
  uint64_t bytes_total_ = 0;
  std::chrono::steady_clock::time_point start_;
};

absl::Status Importer::ChooseLayers(const PickleValue* first_root) {
  if (layers_chosen_) return absl::OkStatus();
  std::optional<std::vector<int64_t>> available = src_.layers;
  if (!available && !src_.shards.front().layers && first_root == nullptr) {
    return absl::OkStatus();  // decided once the first shard is loaded
  }
  if (!available) available = src_.shards.front().layers;
  if (!available) available = ShardLayers(*first_root);
  if (available->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        src_.shards.front().path, ": no 'layer_<idx>' keys in the shard"));
  }
  if (options_.layers.empty()) {
    layers_ = *available;
  } else {
    for (int64_t l : options_.layers) {
      if (std::find(available->begin(), available->end(), l) ==
          available->end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--layers: layer ", l, " is not in the source (its layers: [",
            absl::StrJoin(*available, ", "), "])"));
      }
    }
    layers_ = options_.layers;
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (std::find(layers_.begin(), layers_.begin() + static_cast<ptrdiff_t>(i),
                  layers_[i]) != layers_.begin() + static_cast<ptrdiff_t>(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layers_[i], " is selected twice"));
    }
  }
  // Shards that say which layers they hold are checked before anything is
  // read.
  for (const SourceShard& s : src_.shards) {
    if (!s.layers) continue;
    for (int64_t l : layers_) {
      if (std::find(s.layers->begin(), s.layers->end(), l) == s.layers->end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            s.path, ": metadata.json lists layers [",
            absl::StrJoin(*s.layers, ", "), "] for this shard, without ",
            LayerKey(l), " (select layers with --layers)"));
      }
    }
  }
  layers_chosen_ = true;
  return absl::OkStatus();
}

// A first pass for what metadata.json does not say: samples per shard, the
// longest sequence, or the layers.
absl::Status Importer::Prescan() {
  std::vector<std::string> missing;
  if (std::any_of(src_.shards.begin(), src_.shards.end(),
                  [](const SourceShard& s) { return s.num_samples < 0; })) {
    missing.push_back("num_samples of every shard");
  }
  if (tokens_ == 0) missing.push_back("max_seq_length");
  if (missing.empty()) {
    for (const SourceShard& s : src_.shards) counts_.push_back(s.num_samples);
    return absl::OkStatus();
  }
  std::fprintf(stderr,
               "shardcast import: metadata.json does not give %s; reading "
               "every shard in a first pass\n",
               absl::StrJoin(missing, " or ").c_str());
  int64_t longest = 0;
  for (size_t i = 0; i < src_.shards.size(); ++i) {
    const SourceShard& s = src_.shards[i];
    LoadStats stats;
    std::string why;
    const uint64_t bound = ShardBound(src_, s, options_.max_shard_bytes, &why);
    ASSIGN_OR_RETURN(Pickle p, LoadShard(s, bound, why, &stats));
    RETURN_IF_ERROR(ChooseLayers(&p.root()));
    ASSIGN_OR_RETURN(auto lists, LayerLists(p.root(), s, layers_));
    for (size_t li = 0; li < lists.size(); ++li) {
      for (size_t j = 0; j < lists[li]->size(); ++j) {
        ASSIGN_OR_RETURN(Activation a, GetActivation((*lists[li])[j],
                                                     SampleWhere(s, layers_[li],
                                                                 j, nullptr)));
        longest = std::max(longest, a.seq_len);
      }
    }
    const auto n = static_cast<int64_t>(lists.front()->size());
    if (s.num_samples >= 0 && s.num_samples != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          s.path, " holds ", n,
          " samples but metadata.json says num_samples = ", s.num_samples));
    }
    counts_.push_back(n);
    std::fprintf(stderr, "shardcast import: scanned shard %zu/%zu %s\n", i + 1,
                 src_.shards.size(), s.filename.c_str());
  }
  if (tokens_ == 0) {
    tokens_ = std::max<int64_t>(longest, 1);
    tokens_from_ = "the longest sequence in the shards";
  }
  return absl::OkStatus();
}

absl::Status Importer::StartWriter(const Activation& first,
                                   const std::string& where) {
  if (src_.hidden_size > 0) {
    hidden_ = src_.hidden_size;
    hidden_from_ = "metadata.json extraction_config.model_params.hidden_size";
  } else {
    hidden_ = first.hidden;
    hidden_from_ = absl::StrCat("the first activation, ", where);
  }
  const double example_bytes = 4.0 * static_cast<double>(hidden_) *
                               static_cast<double>(tokens_) *
                               static_cast<double>(layers_.size());
  if (example_bytes > kMaxExampleBytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "one example of ", layers_.size(), " layers x ", tokens_, " tokens x ",
        hidden_, " floats would take ",
        static_cast<uint64_t>(example_bytes / (1 << 20)),
        " MiB, more than the 16 GiB the importer buffers; select fewer layers "
        "with --layers or lower --max-seq-length"));
  }
  WriterOptions o;
  o.root = options_.root;
  o.family = src_.family;
  o.ckpt = src_.ckpt;
  o.layers = layers_;
  o.content_tokens = tokens_;
  o.cls_token = false;
  o.d_model = hidden_;
  o.n_examples = n_examples_;
  const int64_t per_example = tokens_ * static_cast<int64_t>(layers_.size());
  o.token_budget = options_.budget > 0
                       ? options_.budget
                       : std::max<int64_t>(2400000, per_example);
  Json description = src_.description;
  description["padding_label"] = kPaddingLabel;
  description["samples_file"] = kSamplesFile;
  o.data = JsonText(description);
  o.dataset = src_.abs_dir;
  o.with_labels = true;
  absl::StatusOr<std::unique_ptr<DatasetWriter>> w = DatasetWriter::Create(o);
  if (!w.ok()) return w.status();
  writer_ = std::move(*w);
  RemoveStaleTempDirs(options_.root, writer_->hash(), writer_->temp_dir());
  return samples_.Open(JoinPath(writer_->temp_dir(), kSamplesFile), src_,
                       layers_, tokens_);
}

absl::Status Importer::FlushBatch() {
  if (batch_.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(writer_->Append(batch_.data(), batch_.size() * 4));
  RETURN_IF_ERROR(writer_->AppendLabels(labels_.data(), labels_.size()));
  batch_.clear();
  labels_.clear();
  return absl::OkStatus();
}

absl::Status Importer::ImportShard(size_t index) {
  const SourceShard& s = src_.shards[index];
  const auto t0 = std::chrono::steady_clock::now();
  LoadStats stats;
  std::string why;
  const uint64_t bound = ShardBound(src_, s, options_.max_shard_bytes, &why);
  ASSIGN_OR_RETURN(Pickle p, LoadShard(s, bound, why, &stats));
  RETURN_IF_ERROR(ChooseLayers(&p.root()));
  ASSIGN_OR_RETURN(auto lists, LayerLists(p.root(), s, layers_));
  const auto n = static_cast<int64_t>(lists.front()->size());
  if (n != counts_[index]) {
    return absl::InvalidArgumentError(absl::StrCat(
        s.path, " holds ", n,
        " samples but metadata.json says num_samples = ", counts_[index]));
  }
  SampleMatcher matcher(s, layers_, lists);
  const size_t n_layers = layers_.size();
  for (size_t j = 0; j < static_cast<size_t>(n); ++j) {
    const PickleValue& first = (*lists[0])[j];
    const PickleValue* sample_idx = first.Get("sample_idx");
    int64_t seq_len = -1;
    for (size_t li = 0; li < n_layers; ++li) {
      ASSIGN_OR_RETURN(const PickleValue* sample,
                       matcher.Find(li, j, sample_idx));
      const std::string where = SampleWhere(s, layers_[li], j, sample_idx);
      ASSIGN_OR_RETURN(Activation a, GetActivation(*sample, where));
      if (writer_ == nullptr) RETURN_IF_ERROR(StartWriter(a, where));
      if (a.hidden != hidden_) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": inconsistent hidden size: the activation is [", a.seq_len,
            ", ", a.hidden, "] but the hidden size is ", hidden_, " (from ",
            hidden_from_, ")"));
      }
      if (a.seq_len > tokens_) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", a.seq_len, " tokens, more than max_seq_length = ",
            tokens_, " (from ", tokens_from_, "); rerun with --max-seq-length ",
            a.seq_len, " or more"));
      }
      if (seq_len >= 0 && a.seq_len != seq_len) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": ", a.seq_len, " tokens, but the same sample has ",
            seq_len, " tokens in ", LayerKey(layers_[0])));
      }
      seq_len = a.seq_len;
      // [T, D] float32 of this layer: the sequence, then zero padding.
      const size_t slice = static_cast<size_t>(tokens_ * hidden_);
      const size_t used = static_cast<size_t>(a.seq_len * hidden_);
      const size_t at = batch_.size();
      batch_.resize(at + slice, 0.0f);
      float* dst = batch_.data() + at;
      if (a.array->dtype == DType::kFloat32) {
        std::memcpy(dst, a.array->data.data(), used * 4);
      } else {  // float16, widened exactly
        for (size_t k = 0; k < used; ++k) {
          uint16_t h;
          std::memcpy(&h, a.array->data.data() + 2 * k, 2);
          dst[k] = Float16ToFloat32(h);
        }
      }
    }
    for (int64_t t = 0; t < tokens_; ++t) {
      labels_.push_back(t < seq_len ? kTokenLabel : kPaddingLabel);
    }
    RETURN_IF_ERROR(
        samples_.Add(SampleJson(example_, first, seq_len, s.filename)));
    ++example_;
    if (batch_.size() * 4 >= kBatchBytes) RETURN_IF_ERROR(FlushBatch());
  }
  RETURN_IF_ERROR(FlushBatch());
  bytes_read_ += stats.file_bytes;
  const double secs = Seconds(t0);
  const double total_secs = Seconds(start_);
  std::fprintf(
      stderr,
      "shardcast import: shard %zu/%zu %s: %lld samples, %.1f MB "
      "(%.1f MB unpacked) in %.1f s, %.1f MB/s; %.1f/%.1f MB done, "
      "%.1f MB/s\n",
      index + 1, src_.shards.size(), s.filename.c_str(),
      static_cast<long long>(n), static_cast<double>(stats.file_bytes) / 1e6,
      static_cast<double>(stats.pickle_bytes) / 1e6, secs,
      secs > 0 ? static_cast<double>(stats.file_bytes) / 1e6 / secs : 0.0,
      static_cast<double>(bytes_read_) / 1e6,
      static_cast<double>(bytes_total_) / 1e6,
      total_secs > 0 ? static_cast<double>(bytes_read_) / 1e6 / total_secs
                     : 0.0);
  std::fflush(stderr);
  return absl::OkStatus();
}

absl::StatusOr<WriteResult> Importer::Run() {
  start_ = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(CheckShardFiles(&src_));
  for (const SourceShard& s : src_.shards) bytes_total_ += s.file_bytes;
  for (const SourceShard& s : src_.shards) {
    if (s.sha256.empty()) {
      std::fprintf(stderr,
                   "shardcast import: warning: metadata.json gives no "
                   "checksum for %s; it is not verified\n",
                   s.filename.c_str());
    }
  }
  RETURN_IF_ERROR(ChooseLayers(nullptr));
  if (options_.max_seq_length > 0) {
    tokens_ = options_.max_seq_length;
    tokens_from_ = "--max-seq-length";
  } else if (src_.max_seq_length > 0) {
    tokens_ = src_.max_seq_length;
    tokens_from_ = "metadata.json extraction_config.max_seq_length";
  }
  RETURN_IF_ERROR(Prescan());
  for (int64_t c : counts_) n_examples_ += c;
  if (n_examples_ == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(src_.dir, ": the shards hold no samples"));
  }
  for (size_t i = 0; i < src_.shards.size(); ++i) {
    RETURN_IF_ERROR(ImportShard(i));
  }
  RETURN_IF_ERROR(samples_.Close());
  return writer_->Finish();
}

int RunImport(const Args& args) {
  const auto& pos = args.positional();
  if (pos.size() != 3) {
    return Usage("expected a source format and two directories: pkl DIR ROOT");
  }
  if (pos[0] != "pkl") {
    return Usage(absl::StrCat("unknown source format '", Quoted(pos[0]),
                              "'; supported: pkl (seed-002 pickle.gz "
                              "shards)"));
  }
  ImportOptions o;
  o.root = pos[2];
  auto layers = args.Has("layers") ? args.GetIntList("layers", "")
                                   : std::vector<int64_t>();
  auto max_seq = args.GetInt("max-seq-length", 0);
  auto budget = args.GetInt("budget", 0);
  auto max_bytes = args.GetBytes("max-shard-bytes", uint64_t{32} << 30);
  for (const absl::Status& st : {layers.status(), max_seq.status(),
                                 budget.status(), max_bytes.status()}) {
    if (!st.ok()) return Usage(std::string(st.message()));
  }
  if (*max_seq < 0 || (args.Has("max-seq-length") && *max_seq == 0)) {
    return Usage("--max-seq-length must be a positive number of tokens");
  }
  if (*budget < 0 || (args.Has("budget") && *budget == 0)) {
    return Usage("--budget must be a positive number of tokens");
  }
  o.layers = *layers;
  o.max_seq_length = *max_seq;
  o.budget = *budget;
  o.max_shard_bytes = *max_bytes;

  absl::StatusOr<Source> src = ReadSource(pos[1]);
  if (!src.ok()) return Fail(kCmd, std::string(src.status().message()));
  Importer importer(std::move(*src), std::move(o));
  absl::StatusOr<WriteResult> result = importer.Run();
  if (!result.ok()) return Fail(kCmd, std::string(result.status().message()));
  const DatasetDesc& d = importer.desc();
  const uint64_t bytes = d.data_bytes();
  if (args.Has("json")) {
    Json j = Json::object();
    j["path"] = result->path;
    j["hash"] = result->hash;
    j["reused"] = result->reused;
    j["n_examples"] = d.n_examples;
    j["layers"] = d.layers;
    j["tokens_per_example"] = d.tokens_per_example;
    j["d_model"] = d.d_model;
    j["shards"] = d.num_data_shards();
    j["bytes"] = bytes;
    j["samples_file"] = JoinPath(result->path, kSamplesFile);
    j["padding_label"] = kPaddingLabel;
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    std::printf(
        "%s %s (%lld examples x %zu layers x %lld tokens x %lld, %lld "
        "shard(s), %.1f MiB); padding tokens have label %d; per-sample "
        "metadata in %s\n",
        result->reused ? "reused identical existing dataset" : "imported into",
        result->path.c_str(), static_cast<long long>(d.n_examples),
        d.layers.size(), static_cast<long long>(d.tokens_per_example),
        static_cast<long long>(d.d_model),
        static_cast<long long>(d.num_data_shards()),
        static_cast<double>(bytes) / (1 << 20), kPaddingLabel, kSamplesFile);
  }
  return kExitOk;
}

}  // namespace

Command ImportCommand() {
  return {
      "import",
      "import pkl DIR ROOT [--layers L1,L2] [--max-seq-length N] [options]",
      "convert seed-002 pickle.gz activation shards into a saev dataset",
      "Reads DIR/metadata.json and the shard_NNNN.pkl.gz files it lists (each "
      "a gzip'd pickle of {\"layer_<idx>\": [{\"sample_idx\", "
      "\"activation\": float32 [seq_len, hidden_size], \"text_preview\", "
      "\"metadata\", ...}]}) and writes a protocol 2.1 dataset ROOT/<HASH> "
      "with the crash-safe writer.\n\n"
      "Mapping: each sample is one example (in shard order, then list "
      "order); key layer_<idx> is layer value <idx> (e.g. --layer 15 when "
      "streaming); the token axis is the sequence position 0..N-1 with no "
      "CLS token; d_model is hidden_size. N is --max-seq-length, else "
      "extraction_config.max_seq_length, else the longest sequence. Shorter "
      "sequences are padded with zero vectors, and labels.bin marks every "
      "padding position with label 255 (real tokens: 0), so streaming with "
      "exclude_labels 255 skips the padding. sample_idx, dataset_idx, "
      "seq_len, text_preview and each sample's metadata go to samples.json "
      "in the dataset directory (one sample per line, in example order).\n\n"
      "Safety: every shard's sha256 is checked against metadata.json before "
      "it is unpickled (a mismatch stops the import; nothing is left "
      "behind), and pickles are read by a restricted unpickler that accepts "
      "only numpy arrays and plain data: a pickle that names any other "
      "class or function (os.system, eval, ...) is refused, never run. One "
      "shard is in memory at a time. If the import is killed, run it again: "
      "the leftover temporary directory of the same dataset is removed.",
      {{"layers", "L1,L2,...",
        "layer indices to import, in this order (default: all, as listed in "
        "metadata.json)"},
       {"max-seq-length", "N",
        "tokens per example; longer sequences are an error (default: "
        "metadata.json's max_seq_length, else the longest sequence)"},
       {"budget", "TOKENS",
        "patches_per_shard token budget of the output shards (default "
        "2400000, raised to one example when needed)"},
       {"max-shard-bytes", "BYTES",
        "refuse shards that decompress to more than this (default 32G); "
        "where metadata.json gives num_samples, the layers, max_seq_length "
        "and hidden_size, also to more than those allow (8 bytes a value, "
        "1 MiB a sample, 64 MiB)"},
       {"json", nullptr, "print machine-readable JSON"}},
      RunImport};
}

}  // namespace shardcast
