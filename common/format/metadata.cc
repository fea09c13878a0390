#include "common/format/metadata.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/checked.h"
#include "common/base/limits.h"
#include "common/base/status.h"
#include "common/format/sha256.h"

namespace shardcast {
namespace {

// How each variant spells the fields that matter for reading.
struct FieldNames {
  const char* content_tokens;
  const char* d_model;
  const char* n_examples;
  const char* budget;
};

FieldNames NamesFor(Variant variant) {
  switch (variant) {
    case Variant::kV1:
      return {"n_patches_per_img", "d_vit", "n_imgs", "max_patches_per_shard"};
    case Variant::kV2Spec:
      return {"patches_per_ex", "d_model", "n_examples", "patches_per_shard"};
    case Variant::kV2Saev:
      return {"content_tokens_per_example", "d_model", "n_examples",
              "max_tokens_per_shard"};
  }
  return {};
}

absl::StatusOr<const Json*> Field(const Json& obj, absl::string_view source,
                                  const char* name) {
  auto it = obj.find(name);
  if (it == obj.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": required field '", name, "' is missing"));
  }
  return &*it;
}

// An integer field in [min_value, max_value]; the bounds come from
// common/base/limits.h so that the geometry's products are checked once, here.
absl::StatusOr<int64_t> IntField(const Json& obj, absl::string_view source,
                                 const char* name, int64_t min_value,
                                 int64_t max_value) {
  ASSIGN_OR_RETURN(const Json* v, Field(obj, source, name));
  if (!v->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field '", name, "' must be an integer, got ",
                     JsonTypeName(*v), " (", v->dump(), ")"));
  }
  if (v->is_number_unsigned() &&
      v->get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": field '", name, "' = ", v->dump(), " is too large"));
  }
  const int64_t value = v->get<int64_t>();
  if (value < min_value) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": field '", name, "' = ", value, " must be >= ", min_value));
  }
  if (value > max_value) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field '", name, "' = ", value,
                     " is larger than this build reads (at most ", max_value,
                     ", common/base/limits.h)"));
  }
  return value;
}

absl::StatusOr<std::string> StringField(const Json& obj,
                                        absl::string_view source,
                                        const char* name) {
  ASSIGN_OR_RETURN(const Json* v, Field(obj, source, name));
  if (!v->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field '", name, "' must be a string, got ",
                     JsonTypeName(*v), " (", v->dump(), ")"));
  }
  return v->get<std::string>();
}

// Decides the variant from which fields are present; mixing is an error.
absl::StatusOr<Variant> DetectVariant(const Json& m, absl::string_view source) {
  const bool v1 = m.contains("n_patches_per_img") || m.contains("d_vit") ||
                  m.contains("n_imgs") || m.contains("max_patches_per_shard");
  const bool spec =
      m.contains("patches_per_ex") || m.contains("patches_per_shard");
  const bool saev = m.contains("content_tokens_per_example") ||
                    m.contains("max_tokens_per_shard");
  const int count = int{v1} + int{spec} + int{saev};
  if (count == 1) {
    if (v1) return Variant::kV1;
    if (spec) return Variant::kV2Spec;
    return Variant::kV2Saev;
  }
  if (count == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        source,
        ": not saev shard metadata: none of the token-count fields "
        "'n_patches_per_img' (protocol 1.x), 'patches_per_ex' (2.1) or "
        "'content_tokens_per_example' (2.1 as saev writes it) is present"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      source,
      ": fields of different protocol variants are mixed (for example "
      "'n_patches_per_img' with 'patches_per_ex'); cannot tell how to read "
      "it"));
}

}  // namespace

absl::string_view VariantName(Variant variant) {
  switch (variant) {
    case Variant::kV1:
      return "1.0.0";
    case Variant::kV2Spec:
      return "2.1";
    case Variant::kV2Saev:
      return "2.1-saev";
  }
  return "unknown";
}

absl::StatusOr<Variant> ParseVariantName(absl::string_view name) {
  for (Variant v : {Variant::kV1, Variant::kV2Spec, Variant::kV2Saev}) {
    if (name == VariantName(v)) return v;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown variant '", name, "'; expected 1.0.0, 2.1 or 2.1-saev"));
}

int64_t DatasetDesc::num_data_shards() const {
  int64_t n = 0;
  for (const ShardEntry& s : shards) n += s.n_examples > 0 ? 1 : 0;
  return n;
}

absl::StatusOr<int64_t> DatasetDesc::LayerIndex(int64_t layer) const {
  auto it = std::find(layers.begin(), layers.end(), layer);
  if (it == layers.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer,
                     " is not recorded in this dataset; "
                     "recorded layers: [",
                     absl::StrJoin(layers, ", "), "]"));
  }
  return it - layers.begin();
}

std::string DatasetDesc::ContentHash() const {
  if (external != nullptr) return "";  // named by its directory only
  return variant == Variant::kV2Saev ? FileOrderHash8(metadata)
                                     : SortedKeyHash(metadata);
}

absl::StatusOr<DatasetDesc> ParseMetadata(const Json& m,
                                          absl::string_view source) {
  if (!m.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": must hold a JSON object, got ", JsonTypeName(m)));
  }
  DatasetDesc d;
  d.metadata = m;
  ASSIGN_OR_RETURN(d.variant, DetectVariant(m, source));
  const FieldNames names = NamesFor(d.variant);

  // Protocol: major must match the field family; an unknown minor is served
  // with a warning (protocol §5: minor versions are backward compatible).
  ASSIGN_OR_RETURN(d.protocol, StringField(m, source, "protocol"));
  std::vector<std::string> parts = absl::StrSplit(d.protocol, '.');
  int major = -1;
  if (parts.empty() || !absl::SimpleAtoi(parts[0], &major)) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field 'protocol' = \"", d.protocol,
                     "\" is not a version number like \"2.1\""));
  }
  if (major != 1 && major != 2) {
    return absl::UnimplementedError(absl::StrCat(
        source, ": protocol \"", d.protocol, "\" has major version ", major,
        "; this build reads protocol 1.x and 2.x only"));
  }
  const int expected_major = d.variant == Variant::kV1 ? 1 : 2;
  if (major != expected_major) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": protocol \"", d.protocol,
        "\" but the fields are those of "
        "protocol ",
        expected_major, ".x (for example '", names.content_tokens, "')"));
  }
  const bool known_minor =
      d.variant == Variant::kV1
          ? (d.protocol == "1.0.0" || d.protocol == "1.0" ||
             d.protocol == "1.1" || d.protocol == "1.1.0")
          : (d.protocol == "2.1" || d.protocol == "2.1.0");
  if (!known_minor) {
    d.warnings.push_back(
        absl::StrCat(source, ": protocol \"", d.protocol,
                     "\" is a version this build does not know; reading it as ",
                     expected_major, ".x"));
  }

  ASSIGN_OR_RETURN(std::string dtype, StringField(m, source, "dtype"));
  if (dtype != "float32") {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field 'dtype' = \"", dtype,
                     "\"; only \"float32\" exists "
                     "in the protocol"));
  }

  ASSIGN_OR_RETURN(const Json* layers, Field(m, source, "layers"));
  if (!layers->is_array() || layers->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": field 'layers' must be a non-empty array of integers, got ",
        layers->dump()));
  }
  for (const Json& l : *layers) {
    if (!l.is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": field 'layers' must hold integers, found ", l.dump()));
    }
    if (l.is_number_unsigned() &&
        l.get<uint64_t>() >
            static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": field 'layers' value ", l.dump(), " is too large"));
    }
    const int64_t value = l.get<int64_t>();
    if (static_cast<int64_t>(d.layers.size()) == limits::kMaxLayers) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": field 'layers' lists more than ",
                       limits::kMaxLayers, " layers (common/base/limits.h)"));
    }
    if (std::find(d.layers.begin(), d.layers.end(), value) != d.layers.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": field 'layers' lists layer ", value,
          " twice; layer values must be unique to be addressable"));
    }
    d.layers.push_back(value);
  }

  ASSIGN_OR_RETURN(d.content_tokens,
                   IntField(m, source, names.content_tokens, 0,
                            limits::kMaxTokensPerExample - 1));
  ASSIGN_OR_RETURN(const Json* cls, Field(m, source, "cls_token"));
  if (!cls->is_boolean()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field 'cls_token' must be true or false, got ",
                     cls->dump()));
  }
  d.cls_token = cls->get<bool>();
  d.tokens_per_example = d.content_tokens + (d.cls_token ? 1 : 0);
  if (d.tokens_per_example < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": an example has no tokens ('",
                     names.content_tokens, "' = 0 and cls_token = false)"));
  }
  ASSIGN_OR_RETURN(d.d_model,
                   IntField(m, source, names.d_model, 1, limits::kMaxDModel));
  ASSIGN_OR_RETURN(d.n_examples, IntField(m, source, names.n_examples, 0,
                                          limits::kMaxExamples));
  ASSIGN_OR_RETURN(d.token_budget,
                   IntField(m, source, names.budget, 1,
                            std::numeric_limits<int64_t>::max()));

  // Bounded fields: T * L <= 2^36 and T * L * D * 4 <= 2^58 (limits.h).

  const int64_t per_example = d.tokens_per_example * d.num_layers();
  d.examples_per_shard = d.token_budget / per_example;
  if (d.examples_per_shard < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: examples_per_shard = %s // (tokens_per_example * len(layers)) = "
        "%d // (%d * %d) = %d; at least one example must fit in a shard "
        "(raise '%s')",
        source, names.budget, d.token_budget, d.tokens_per_example,
        d.num_layers(), d.examples_per_shard, names.budget));
  }
  // The bytes of the examples it claims, and of the shards those fill, must
  // fit the dataset bound: every offset computed later is below them.
  const std::optional<uint64_t> total = CheckedMul<uint64_t>(
      static_cast<uint64_t>(d.n_examples), d.example_bytes());
  const std::optional<uint64_t> shard = CheckedMul<uint64_t>(
      static_cast<uint64_t>(std::min(d.examples_per_shard, d.n_examples)),
      d.example_bytes());
  if (!total || !shard || *total > limits::kMaxDatasetBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": geometry is implausibly large (", d.n_examples,
                     " examples of ", per_example, " vectors of ", d.d_model,
                     " floats: more than the ", limits::kMaxDatasetBytes >> 50,
                     " PiB this build reads, common/base/limits.h)"));
  }
  return d;
}

absl::Status ParseShards(const Json& shards, absl::string_view source,
                         DatasetDesc* d) {
  if (!shards.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": must hold a JSON array of {name, n_examples} objects, got ",
        JsonTypeName(shards)));
  }
  const char* count_key = d->variant == Variant::kV1 ? "n_imgs" : "n_examples";
  const char* other_key = d->variant == Variant::kV1 ? "n_examples" : "n_imgs";
  d->shards.clear();
  int64_t sum = 0;
  if (shards.size() > static_cast<size_t>(limits::kMaxShards)) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": lists ", shards.size(), " shards; at most ",
                     limits::kMaxShards, " are read (common/base/limits.h)"));
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    const Json& e = shards[i];
    const std::string where = absl::StrCat(source, ": entry ", i);
    if (!e.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " must be an object, got ", e.dump()));
    }
    ShardEntry entry;
    ASSIGN_OR_RETURN(entry.name, StringField(e, where, "name"));
    const char* key =
        e.contains(count_key) || !e.contains(other_key) ? count_key : other_key;
    ASSIGN_OR_RETURN(entry.n_examples,
                     IntField(e, where, key, 0, limits::kMaxExamples));
    const std::string expected = ShardFileName(static_cast<int64_t>(i));
    if (entry.name != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": name is \"", entry.name, "\" but entry ", i, " must be \"",
          expected, "\" (readers locate shard i as acts{i:06d}.bin)"));
    }
    if (entry.n_examples > d->examples_per_shard) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " (", entry.name, ") claims ", entry.n_examples,
          " examples but a shard holds at most examples_per_shard = ",
          d->examples_per_shard));
    }
    sum += entry.n_examples;  // <= kMaxExamples before, so no overflow
    if (sum > limits::kMaxExamples) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": shard entries hold more than ", limits::kMaxExamples,
          " examples (common/base/limits.h)"));
    }
    d->shards.push_back(std::move(entry));
  }
  // All shards before the last non-empty one must be full; empty entries may
  // only trail (saev appends one when n_examples % examples_per_shard == 0).
  int64_t last_nonempty = -1;
  for (size_t i = 0; i < d->shards.size(); ++i) {
    if (d->shards[i].n_examples > 0) last_nonempty = static_cast<int64_t>(i);
  }
  for (int64_t i = 0; i < last_nonempty; ++i) {
    const ShardEntry& s = d->shards[static_cast<size_t>(i)];
    if (s.n_examples != d->examples_per_shard) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": entry ", i, " (", s.name, ") holds ", s.n_examples,
          " examples but every shard before the last must hold "
          "examples_per_shard = ",
          d->examples_per_shard));
    }
  }
  if (sum != d->n_examples) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": shard entries hold ", sum,
                     " examples in total but "
                     "metadata.json says n_examples = ",
                     d->n_examples));
  }
  return absl::OkStatus();
}

std::string SortedKeyHash(const Json& metadata) {
  PyJsonOptions options;
  options.sort_keys = true;
  options.ensure_ascii = true;
  return Sha256Hex(PyJsonDumps(metadata, options));
}

std::string FileOrderHash8(const Json& metadata) {
  PyJsonOptions options;
  options.sort_keys = false;
  options.ensure_ascii = false;
  return Sha256Hex(PyJsonDumps(metadata, options)).substr(0, 8);
}

std::string ShardFileName(int64_t shard_index) {
  return absl::StrFormat("acts%06d.bin", shard_index);
}

absl::StatusOr<VectorLocation> LocateExample(const DatasetDesc& d,
                                             int64_t example) {
  if (d.external != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a ", d.external->format,
        " dataset keeps each layer in its own files: no example block"));
  }
  if (example < 0 || example >= d.n_examples) {
    return absl::OutOfRangeError(
        absl::StrCat("example ", example, " is out of range: the dataset has ",
                     d.n_examples, " examples (0..", d.n_examples - 1, ")"));
  }
  VectorLocation loc;
  loc.shard = example / d.examples_per_shard;
  loc.offset =
      static_cast<uint64_t>(example % d.examples_per_shard) * d.example_bytes();
  return loc;
}

absl::StatusOr<VectorLocation> Locate(const DatasetDesc& d, int64_t example,
                                      int64_t layer, int64_t token) {
  ASSIGN_OR_RETURN(int64_t layer_index, d.LayerIndex(layer));
  return LocateIndex(d, example, layer_index, token);
}

absl::StatusOr<VectorLocation> LocateIndex(const DatasetDesc& d,
                                           int64_t example, int64_t layer_index,
                                           int64_t token) {
  if (d.external != nullptr) {
    const ExternalLayout& x = *d.external;
    if (example < 0 || example >= d.n_examples) {
      return absl::OutOfRangeError(absl::StrCat(
          "example ", example, " is out of range: the dataset has ",
          d.n_examples, " examples (0..", d.n_examples - 1, ")"));
    }
    if (token != 0) {
      return absl::OutOfRangeError(absl::StrCat(
          "token ", token, " is out of range: a ", x.format,
          " dataset has one vector per example and layer (token 0)"));
    }
    const auto it = std::upper_bound(x.first_example.begin(),
                                     x.first_example.end(), example);
    const int64_t s = (it - x.first_example.begin()) - 1;
    VectorLocation loc;
    loc.shard = layer_index * x.num_shards() + s;
    loc.offset = x.tensor_offset[static_cast<size_t>(loc.shard)] +
                 static_cast<uint64_t>(
                     example - x.first_example[static_cast<size_t>(s)]) *
                     d.vector_bytes();
    return loc;
  }
  ASSIGN_OR_RETURN(VectorLocation loc, LocateExample(d, example));
  if (token < 0 || token >= d.tokens_per_example) {
    return absl::OutOfRangeError(absl::StrCat(
        "token ", token, " is out of range: an example has ",
        d.tokens_per_example, " tokens (0..", d.tokens_per_example - 1,
        d.cls_token ? ", 0 is CLS)" : ")"));
  }
  loc.offset += (static_cast<uint64_t>(layer_index) * d.tokens_per_example +
                 static_cast<uint64_t>(token)) *
                d.vector_bytes();
  return loc;
}

}  // namespace shardcast
