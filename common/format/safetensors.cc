#include "common/format/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <numeric>
#include <random>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/checked.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"
#include "nlohmann/json.hpp"

namespace shardcast {
namespace {

struct DtypeInfo {
  SafetensorsDtype dtype;
  const char* name;
  int bits;
};

// In the safetensors library's order (increasing alignment).
constexpr DtypeInfo kDtypes[] = {
    {SafetensorsDtype::kBool, "BOOL", 8},
    {SafetensorsDtype::kF4, "F4", 4},
    {SafetensorsDtype::kF6E2M3, "F6_E2M3", 6},
    {SafetensorsDtype::kF6E3M2, "F6_E3M2", 6},
    {SafetensorsDtype::kU8, "U8", 8},
    {SafetensorsDtype::kI8, "I8", 8},
    {SafetensorsDtype::kF8E5M2, "F8_E5M2", 8},
    {SafetensorsDtype::kF8E4M3, "F8_E4M3", 8},
    {SafetensorsDtype::kF8E8M0, "F8_E8M0", 8},
    {SafetensorsDtype::kF8E4M3Fnuz, "F8_E4M3FNUZ", 8},
    {SafetensorsDtype::kF8E5M2Fnuz, "F8_E5M2FNUZ", 8},
    {SafetensorsDtype::kI16, "I16", 16},
    {SafetensorsDtype::kU16, "U16", 16},
    {SafetensorsDtype::kF16, "F16", 16},
    {SafetensorsDtype::kBF16, "BF16", 16},
    {SafetensorsDtype::kI32, "I32", 32},
    {SafetensorsDtype::kU32, "U32", 32},
    {SafetensorsDtype::kF32, "F32", 32},
    {SafetensorsDtype::kC64, "C64", 64},
    {SafetensorsDtype::kF64, "F64", 64},
    {SafetensorsDtype::kI64, "I64", 64},
    {SafetensorsDtype::kU64, "U64", 64},
};

const DtypeInfo& Info(SafetensorsDtype dtype) {
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == dtype) return d;
  }
  return kDtypes[0];  // unreachable: every enumerator is listed
}

constexpr char kMetadataKey[] = "__metadata__";

// A name from a file or a caller, quoted and bounded for a message.
std::string Q(absl::string_view name) {
  return absl::StrCat("\"", Quoted(name), "\"");
}

std::string ShapeText(const std::vector<uint64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string Range(uint64_t begin, uint64_t end) {
  return absl::StrCat("[", begin, ", ", end, ")");
}

// Builds SafetensorsHeader entries straight from the parser's events, so
// memory stays proportional to the tensors described, nesting deeper than
// the format allows is refused at its first token (the JSON parser is never
// asked to build a tree), and every duplicate key is seen.
class HeaderSax final : public nlohmann::json_sax<nlohmann::json> {
 public:
  using Base = nlohmann::json_sax<nlohmann::json>;

  bool null() override { return WrongValue("null"); }
  bool boolean(bool) override { return WrongValue("a boolean"); }
  bool number_integer(number_integer_t value) override {
    if (value >= 0) return Unsigned(static_cast<uint64_t>(value));
    return WrongValue(absl::StrCat("the negative number ", value));
  }
  bool number_unsigned(number_unsigned_t value) override {
    return Unsigned(value);
  }
  bool number_float(number_float_t, const string_t& raw) override {
    if (raw.find_first_of(".eE") == std::string::npos) {
      return WrongValue(
          absl::StrCat("the integer ", Quoted(raw), ", larger than 64 bits"));
    }
    return WrongValue(absl::StrCat("the non-integer number ", Quoted(raw)));
  }
  bool string(string_t& value) override;
  bool binary(binary_t&) override { return WrongValue("binary data"); }
  bool start_object(std::size_t) override;
  bool key(string_t& value) override;
  bool end_object() override;
  bool start_array(std::size_t) override;
  bool end_array() override;
  bool parse_error(std::size_t position, const std::string& last_token,
                   const nlohmann::detail::exception& ex) override {
    if (error_.empty()) {
      error_ = absl::StrCat("the header is not valid JSON (at byte ", position,
                            ", near ", Q(last_token), "): ", Quoted(ex.what()));
    }
    return false;
  }

  const std::string& error() const { return error_; }
  std::vector<SafetensorsTensor>& tensors() { return tensors_; }
  std::vector<std::pair<std::string, std::string>>& metadata() {
    return metadata_;
  }
  bool has_metadata() const { return has_metadata_; }
  std::unordered_map<std::string, size_t>& by_name() { return by_name_; }

 private:
  enum class State { kStart, kTop, kTensor, kShape, kOffsets, kMetadata, kEnd };
  enum class Field { kNone, kDtype, kShape, kOffsets };

  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }
  std::string TensorPrefix() const {
    return absl::StrCat("tensor ", Q(tensors_.back().name), ": ");
  }
  bool WrongValue(absl::string_view found);
  bool Unsigned(uint64_t value);

  State state_ = State::kStart;
  bool pending_metadata_ = false;  // kTop: the key just read is __metadata__
  Field field_ = Field::kNone;     // kTensor: the field just read
  unsigned fields_seen_ = 0;       // kTensor: bit per Field
  std::vector<uint64_t> offsets_;  // kTensor: data_offsets as read
  bool saw_metadata_key_ = false;
  std::unordered_map<std::string, size_t> by_name_;  // index in tensors_
  std::unordered_set<std::string> metadata_keys_;
  std::string metadata_key_;  // kMetadata: the key just read
  std::vector<SafetensorsTensor> tensors_;
  std::vector<std::pair<std::string, std::string>> metadata_;
  bool has_metadata_ = false;
  std::string error_;
};

bool HeaderSax::WrongValue(absl::string_view found) {
  switch (state_) {
    case State::kStart:
      return Fail(
          absl::StrCat("the header must be a JSON object, not ", found));
    case State::kTop:
      if (pending_metadata_) {
        return Fail(absl::StrCat(
            "__metadata__ must be an object of string values, not ", found));
      }
      return Fail(absl::StrCat(
          TensorPrefix(),
          "the entry must be an object {dtype, shape, data_offsets}, not ",
          found));
    case State::kTensor:
      switch (field_) {
        case Field::kDtype:
          return Fail(absl::StrCat(TensorPrefix(),
                                   "dtype must be a string such as \"F32\", "
                                   "not ",
                                   found));
        case Field::kShape:
          return Fail(absl::StrCat(
              TensorPrefix(),
              "shape must be an array of non-negative integers, not ", found));
        case Field::kOffsets:
        case Field::kNone:
          return Fail(absl::StrCat(TensorPrefix(),
                                   "data_offsets must be an array [begin, "
                                   "end] of non-negative integers, not ",
                                   found));
      }
      break;
    case State::kShape:
      return Fail(absl::StrCat(
          TensorPrefix(),
          "shape must be an array of non-negative integers, but element ",
          tensors_.back().shape.size(), " is ", found));
    case State::kOffsets:
      return Fail(absl::StrCat(TensorPrefix(),
                               "data_offsets must be an array [begin, end] of "
                               "non-negative integers, but element ",
                               offsets_.size(), " is ", found));
    case State::kMetadata:
      return Fail(absl::StrCat("__metadata__ ", Q(metadata_key_),
                               ": values must be strings, not ", found));
    case State::kEnd:
      break;
  }
  return Fail(absl::StrCat("unexpected ", found));
}

bool HeaderSax::Unsigned(uint64_t value) {
  if (state_ == State::kShape) {
    if (tensors_.back().shape.size() == kMaxSafetensorsRank) {
      return Fail(absl::StrCat(TensorPrefix(), "shape has more than ",
                               kMaxSafetensorsRank,
                               " dimensions, the most this reader accepts"));
    }
    tensors_.back().shape.push_back(value);
    return true;
  }
  if (state_ == State::kOffsets) {
    if (offsets_.size() == 2) {
      return Fail(absl::StrCat(TensorPrefix(),
                               "data_offsets must be [begin, end], two "
                               "numbers, but it has more"));
    }
    offsets_.push_back(value);
    return true;
  }
  return WrongValue(absl::StrCat("the number ", value));
}

bool HeaderSax::string(string_t& value) {
  if (state_ == State::kTensor && field_ == Field::kDtype) {
    std::optional<SafetensorsDtype> dtype = ParseSafetensorsDtype(value);
    if (!dtype) {
      return Fail(absl::StrCat(TensorPrefix(), "unknown dtype ", Q(value),
                               " (known: ", SafetensorsDtypeNames(), ")"));
    }
    tensors_.back().dtype = *dtype;
    return true;
  }
  if (state_ == State::kMetadata) {
    metadata_.emplace_back(std::move(metadata_key_), std::move(value));
    metadata_key_.clear();
    return true;
  }
  return WrongValue(absl::StrCat("the string ", Q(value)));
}

bool HeaderSax::start_object(std::size_t) {
  switch (state_) {
    case State::kStart:
      state_ = State::kTop;
      return true;
    case State::kTop:
      if (pending_metadata_) {
        state_ = State::kMetadata;
        has_metadata_ = true;
      } else {
        state_ = State::kTensor;
        field_ = Field::kNone;
        fields_seen_ = 0;
        offsets_.clear();
      }
      return true;
    default:
      return WrongValue("an object");
  }
}

bool HeaderSax::key(string_t& value) {
  switch (state_) {
    case State::kTop:
      pending_metadata_ = value == kMetadataKey;
      if (pending_metadata_) {
        if (saw_metadata_key_) return Fail("__metadata__ appears twice");
        saw_metadata_key_ = true;
        return true;
      }
      if (!by_name_.emplace(value, tensors_.size()).second) {
        return Fail(absl::StrCat("tensor ", Q(value),
                                 " appears twice (duplicate key)"));
      }
      tensors_.emplace_back();
      tensors_.back().name = std::move(value);
      return true;
    case State::kTensor: {
      Field field;
      if (value == "dtype") {
        field = Field::kDtype;
      } else if (value == "shape") {
        field = Field::kShape;
      } else if (value == "data_offsets") {
        field = Field::kOffsets;
      } else {
        return Fail(absl::StrCat(
            TensorPrefix(), "unknown field ", Q(value),
            " (an entry has exactly dtype, shape and data_offsets)"));
      }
      const unsigned bit = 1u << static_cast<unsigned>(field);
      if (fields_seen_ & bit) {
        return Fail(
            absl::StrCat(TensorPrefix(), "field ", Q(value), " appears twice"));
      }
      fields_seen_ |= bit;
      field_ = field;
      return true;
    }
    case State::kMetadata:
      if (!metadata_keys_.insert(value).second) {
        return Fail(
            absl::StrCat("__metadata__ key ", Q(value), " appears twice"));
      }
      metadata_key_ = std::move(value);
      return true;
    default:
      return Fail("unexpected object key");  // the parser never gets here
  }
}

bool HeaderSax::end_object() {
  switch (state_) {
    case State::kTop:
      state_ = State::kEnd;
      return true;
    case State::kMetadata:
      state_ = State::kTop;
      return true;
    case State::kTensor: {
      for (auto [field, name] : {std::pair{Field::kDtype, "dtype"},
                                 std::pair{Field::kShape, "shape"},
                                 std::pair{Field::kOffsets, "data_offsets"}}) {
        if (!(fields_seen_ & (1u << static_cast<unsigned>(field)))) {
          return Fail(absl::StrCat(TensorPrefix(), "missing field \"", name,
                                   "\" (an entry needs dtype, shape and "
                                   "data_offsets)"));
        }
      }
      SafetensorsTensor& t = tensors_.back();
      t.begin = offsets_[0];
      t.end = offsets_[1];
      state_ = State::kTop;
      return true;
    }
    default:
      return Fail("unexpected end of object");  // the parser never gets here
  }
}

bool HeaderSax::start_array(std::size_t) {
  if (state_ == State::kTensor && field_ == Field::kShape) {
    state_ = State::kShape;
    return true;
  }
  if (state_ == State::kTensor && field_ == Field::kOffsets) {
    state_ = State::kOffsets;
    return true;
  }
  return WrongValue("an array");
}

bool HeaderSax::end_array() {
  if (state_ == State::kShape) {
    state_ = State::kTensor;
    return true;
  }
  if (state_ == State::kOffsets) {
    if (offsets_.size() != 2) {
      return Fail(absl::StrCat(TensorPrefix(),
                               "data_offsets must be [begin, end], two "
                               "numbers, but it has ",
                               offsets_.size()));
    }
    state_ = State::kTensor;
    return true;
  }
  return Fail("unexpected end of array");  // the parser never gets here
}

absl::Status Invalid(absl::string_view source, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", message));
}

// Element count and byte size of one tensor, with every product checked.
absl::Status CheckSize(const SafetensorsTensor& t, absl::string_view source,
                       uint64_t* elements_out, uint64_t* bytes_out) {
  const std::string who = absl::StrCat("tensor ", Q(t.name), ": ");
  uint64_t elements = 1;
  for (uint64_t dim : t.shape) {
    std::optional<uint64_t> product = CheckedMul(elements, dim);
    if (!product) {
      return Invalid(source, absl::StrCat(who, "shape ", ShapeText(t.shape),
                                          " has more elements than fit in "
                                          "64 bits"));
    }
    elements = *product;
  }
  const int bits = SafetensorsDtypeBits(t.dtype);
  std::optional<uint64_t> total_bits =
      CheckedMul(elements, static_cast<uint64_t>(bits));
  if (!total_bits) {
    return Invalid(source, absl::StrCat(who, "shape ", ShapeText(t.shape),
                                        " of ", SafetensorsDtypeName(t.dtype),
                                        " is more bytes than fit in 64 bits"));
  }
  if (*total_bits % 8 != 0) {
    return Invalid(source,
                   absl::StrCat(who, elements, " elements of ",
                                SafetensorsDtypeName(t.dtype), " (", bits,
                                " bits each) are not a whole number of bytes"));
  }
  *elements_out = elements;
  *bytes_out = *total_bits / 8;
  return absl::OkStatus();
}

}  // namespace

absl::string_view SafetensorsDtypeName(SafetensorsDtype dtype) {
  return Info(dtype).name;
}

std::optional<SafetensorsDtype> ParseSafetensorsDtype(absl::string_view name) {
  for (const DtypeInfo& d : kDtypes) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

int SafetensorsDtypeBits(SafetensorsDtype dtype) { return Info(dtype).bits; }

std::string SafetensorsDtypeNames() {
  std::vector<absl::string_view> names;
  for (const DtypeInfo& d : kDtypes) names.push_back(d.name);
  return absl::StrJoin(names, ", ");
}

const SafetensorsTensor* SafetensorsHeader::Find(
    const std::string& name) const {
  auto it = by_name.find(name);
  return it == by_name.end() ? nullptr : &tensors[it->second];
}

const std::string* SafetensorsHeader::FindMetadata(
    absl::string_view key) const {
  for (const auto& [k, v] : metadata) {
    if (k == key) return &v;
  }
  return nullptr;
}

absl::StatusOr<uint64_t> ParseSafetensorsHeaderLength(
    absl::string_view prefix, uint64_t file_size, absl::string_view source) {
  if (file_size < 8 || prefix.size() < 8) {
    return absl::DataLossError(absl::StrCat(
        source, ": ", file_size,
        " bytes is too short for a safetensors file (it starts with an "
        "8-byte header length)"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) {
    n = (n << 8) | static_cast<unsigned char>(prefix[static_cast<size_t>(i)]);
  }
  if (n > kMaxSafetensorsHeaderBytes) {
    return Invalid(
        source,
        absl::StrCat("header length ", n, " exceeds the safetensors limit of ",
                     kMaxSafetensorsHeaderBytes,
                     " bytes (is this a safetensors file?)"));
  }
  if (n > file_size - 8) {
    return absl::DataLossError(absl::StrCat(
        source, ": header length ", n, " runs past the end of the file (",
        file_size, " bytes, so at most ", file_size - 8,
        " follow the length): truncated?"));
  }
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    absl::string_view header, uint64_t file_size, absl::string_view source) {
  if (file_size < 8 || header.size() > file_size - 8) {
    return absl::DataLossError(
        absl::StrCat(source, ": a header of ", header.size(),
                     " bytes does not fit in a file of ", file_size, " bytes"));
  }
  if (header.empty() || header.front() != '{') {
    return Invalid(
        source,
        header.empty()
            ? std::string("the header is empty (a safetensors header is a "
                          "JSON object)")
            : absl::StrFormat("the header starts with byte 0x%02x, not '{' "
                              "(a safetensors header is a JSON object)",
                              static_cast<unsigned char>(header.front())));
  }
  // JSON text never holds a raw NUL, but nlohmann's lexer takes one for the
  // end of the input and would ignore whatever follows it.
  if (const size_t nul = header.find('\0'); nul != absl::string_view::npos) {
    return Invalid(source,
                   absl::StrCat("the header is not valid JSON: NUL byte at "
                                "byte ",
                                nul, " (padding must be spaces)"));
  }
  HeaderSax sax;
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(header.begin(), header.end(), &sax);
  } catch (const std::exception& e) {
    return Invalid(source, absl::StrCat("the header is not valid JSON: ",
                                        Quoted(e.what())));
  }
  if (!ok) {
    return Invalid(source, sax.error().empty() ? std::string("invalid header")
                                               : sax.error());
  }

  SafetensorsHeader out;
  out.header_bytes = header.size();
  out.data_offset = 8 + out.header_bytes;
  out.file_size = file_size;
  out.has_metadata = sax.has_metadata();
  out.metadata = std::move(sax.metadata());
  out.tensors = std::move(sax.tensors());
  out.by_name = std::move(sax.by_name());
  const uint64_t data_size = file_size - out.data_offset;

  for (size_t i = 0; i < out.tensors.size(); ++i) {
    SafetensorsTensor& t = out.tensors[i];
    const std::string who = absl::StrCat("tensor ", Q(t.name), ": ");
    if (t.end < t.begin) {
      return Invalid(source, absl::StrCat(who, "data_offsets [", t.begin, ", ",
                                          t.end, "] end before they begin"));
    }
    uint64_t bytes = 0;
    RETURN_IF_ERROR(CheckSize(t, source, &t.num_elements, &bytes));
    if (bytes != t.size()) {
      return Invalid(source,
                     absl::StrCat(who, "shape ", ShapeText(t.shape), " of ",
                                  SafetensorsDtypeName(t.dtype), " is ", bytes,
                                  " bytes, but data_offsets ",
                                  Range(t.begin, t.end), " hold ", t.size()));
    }
    if (t.end > data_size) {
      return absl::DataLossError(absl::StrCat(
          source, ": ", who, "data_offsets ", Range(t.begin, t.end),
          " end past the data section, which holds ", data_size,
          " bytes (file of ", file_size, " bytes, data from byte ",
          out.data_offset, "): truncated?"));
    }
    t.offset = out.data_offset + t.begin;
  }

  // The tensors must tile the data section: sorted by offsets, each starts
  // where the previous one ended, and the last ends at the end of the file.
  std::vector<size_t> order(out.tensors.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const SafetensorsTensor& x = out.tensors[a];
    const SafetensorsTensor& y = out.tensors[b];
    return std::pair(x.begin, x.end) < std::pair(y.begin, y.end);
  });
  uint64_t cursor = 0;
  const SafetensorsTensor* previous = nullptr;
  for (size_t i : order) {
    const SafetensorsTensor& t = out.tensors[i];
    if (t.begin < cursor) {
      return Invalid(
          source, absl::StrCat("tensors ", Q(previous->name), " ",
                               Range(previous->begin, previous->end), " and ",
                               Q(t.name), " ", Range(t.begin, t.end),
                               " overlap in the data section"));
    }
    if (t.begin > cursor) {
      return Invalid(
          source,
          absl::StrCat("bytes ", Range(cursor, t.begin),
                       " of the data section belong to no tensor (a hole ",
                       previous == nullptr
                           ? std::string("at the start")
                           : absl::StrCat("after tensor ", Q(previous->name)),
                       ", before tensor ", Q(t.name), ")"));
    }
    cursor = t.end;
    previous = &t;
  }
  if (cursor != data_size) {
    return Invalid(
        source,
        absl::StrCat(
            "bytes ", Range(cursor, data_size),
            " at the end of the data section belong to no tensor ",
            previous == nullptr
                ? std::string("(the header lists none)")
                : absl::StrCat("(after tensor ", Q(previous->name), ")")));
  }
  return out;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensors(absl::string_view file,
                                                   absl::string_view source) {
  ASSIGN_OR_RETURN(uint64_t n,
                   ParseSafetensorsHeaderLength(file, file.size(), source));
  return ParseSafetensorsHeader(file.substr(8, n), file.size(), source);
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(
    int fd, absl::string_view path) {
  ASSIGN_OR_RETURN(uint64_t size, FileSize(fd, path));
  char prefix[8] = {};
  if (size >= 8) RETURN_IF_ERROR(PreadFull(fd, prefix, 8, 0, path));
  ASSIGN_OR_RETURN(uint64_t n, ParseSafetensorsHeaderLength(
                                   absl::string_view(prefix, 8), size, path));
  std::string header(n, '\0');
  RETURN_IF_ERROR(PreadFull(fd, header.data(), n, 8, path));
  return ParseSafetensorsHeader(header, size, path);
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(
    const std::string& path) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path));
  return ReadSafetensorsHeader(fd.get(), path);
}

absl::StatusOr<std::pair<std::string, SafetensorsHeader>>
BuildSafetensorsHeader(const SafetensorsWriterOptions& options) {
  const std::string source =
      absl::StrCat("safetensors writer for ", options.path);
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!options.metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [key, value] : options.metadata) {
      if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
        return Invalid(source, absl::StrCat("__metadata__ ", Q(key),
                                            ": key and value must be valid "
                                            "UTF-8"));
      }
      if (m.contains(key)) {
        return Invalid(source, absl::StrCat("__metadata__ key ", Q(key),
                                            " is given "
                                            "twice"));
      }
      m[key] = value;
    }
    j[kMetadataKey] = std::move(m);
  }
  uint64_t offset = 0;
  std::unordered_set<std::string> names;
  for (const SafetensorsTensorSpec& spec : options.tensors) {
    if (!IsValidUtf8(spec.name)) {
      return Invalid(source, absl::StrCat("tensor ", Q(spec.name),
                                          ": the name must be valid UTF-8"));
    }
    if (spec.name == kMetadataKey) {
      return Invalid(source, "a tensor cannot be called __metadata__");
    }
    if (!names.insert(spec.name).second) {
      return Invalid(source,
                     absl::StrCat("tensor ", Q(spec.name), " is given twice"));
    }
    SafetensorsTensor t;
    t.name = spec.name;
    t.dtype = spec.dtype;
    t.shape = spec.shape;
    uint64_t elements = 0;
    uint64_t bytes = 0;
    RETURN_IF_ERROR(CheckSize(t, source, &elements, &bytes));
    std::optional<uint64_t> end = CheckedAdd(offset, bytes);
    if (!end) {
      return Invalid(source,
                     "the tensors add up to more bytes than fit in "
                     "64 bits");
    }
    j[spec.name] = {{"dtype", std::string(SafetensorsDtypeName(spec.dtype))},
                    {"shape", spec.shape},
                    {"data_offsets", {offset, *end}}};
    offset = *end;
  }
  std::string json = j.dump();
  // Pad with spaces so that the data section starts 8-byte aligned, as the
  // safetensors library does.
  json.append((8 - json.size() % 8) % 8, ' ');
  if (json.size() > kMaxSafetensorsHeaderBytes) {
    return Invalid(source, absl::StrCat("the header would be ", json.size(),
                                        " bytes; readers accept at most ",
                                        kMaxSafetensorsHeaderBytes));
  }
  std::optional<uint64_t> file_size =
      CheckedAdd<uint64_t>(8 + json.size(), offset);
  if (!file_size) {
    return Invalid(source, "the file would be larger than 2^64 bytes");
  }
  // What we write goes through the reader's rules, so the writer cannot
  // produce a file a reader rejects.
  ASSIGN_OR_RETURN(SafetensorsHeader header,
                   ParseSafetensorsHeader(json, *file_size, source));
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) {
    bytes[static_cast<size_t>(i)] =
        static_cast<char>((json.size() >> (8 * i)) & 0xff);
  }
  bytes += json;
  return std::pair(std::move(bytes), std::move(header));
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    SafetensorsWriterOptions options) {
  if (options.path.empty()) {
    return absl::InvalidArgumentError("safetensors writer: empty path");
  }
  ASSIGN_OR_RETURN(auto built, BuildSafetensorsHeader(options));
  struct stat st;
  if (::stat(options.path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(options.path, " is a directory, not a file name"));
  }
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->header_ = std::move(built.second);
  std::random_device rd;
  w->temp_path_ = JoinPath(
      DirName(options.path),
      absl::StrFormat(".%s.shardcast-tmp-%d-%08x", BaseName(options.path),
                      static_cast<int>(::getpid()), rd()));
  w->options_ = std::move(options);
  absl::StatusOr<UniqueFd> fd =
      OpenFile(w->temp_path_, O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (!fd.ok()) {
    w->temp_path_.clear();  // nothing of ours to remove
    return fd.status();
  }
  w->fd_ = std::move(*fd);
  RETURN_IF_ERROR(WriteFull(w->fd_.get(), built.first.data(),
                            built.first.size(), w->temp_path_));
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!finished_ && !temp_path_.empty()) {
    fd_.Reset();
    ::unlink(temp_path_.c_str());  // abandoned: nothing to keep
  }
}

absl::Status SafetensorsWriter::Append(const void* data, size_t bytes) {
  if (finished_) {
    return absl::FailedPreconditionError(
        absl::StrCat(options_.path, ": append after Finish"));
  }
  if (bytes > data_bytes() - data_written_) {
    return absl::OutOfRangeError(absl::StrCat(
        options_.path, ": appending ", bytes, " bytes at data byte ",
        data_written_, " would pass the end of the data section (",
        data_bytes(), " bytes)"));
  }
  RETURN_IF_ERROR(WriteFull(fd_.get(), data, bytes, temp_path_));
  data_written_ += bytes;
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (finished_) {
    return absl::FailedPreconditionError(
        absl::StrCat(options_.path, ": Finish called twice"));
  }
  if (data_written_ != data_bytes()) {
    return absl::FailedPreconditionError(absl::StrCat(
        options_.path, ": only ", data_written_, " of the ", data_bytes(),
        " data bytes the header describes were written"));
  }
  RETURN_IF_ERROR(Fsync(fd_.get(), temp_path_));
  if (::close(fd_.Release()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("close ", temp_path_));
  }
  if (::rename(temp_path_.c_str(), options_.path.c_str()) != 0) {
    return ErrnoToStatus(
        errno, absl::StrCat("rename ", temp_path_, " to ", options_.path));
  }
  finished_ = true;
  return FsyncDirectory(DirName(options_.path));
}

absl::Status WriteSafetensors(SafetensorsWriterOptions options,
                              const SafetensorsFill& fill, size_t chunk_bytes) {
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsWriter> writer,
                   SafetensorsWriter::Create(std::move(options)));
  chunk_bytes = std::max<size_t>(chunk_bytes, 1);
  uint64_t largest = 0;
  for (const SafetensorsTensor& t : writer->header().tensors) {
    largest = std::max(largest, t.size());
  }
  std::vector<char> buffer(
      static_cast<size_t>(std::min<uint64_t>(largest, chunk_bytes)));
  const auto& tensors = writer->header().tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (uint64_t pos = 0; pos < tensors[i].size();) {
      const size_t n = static_cast<size_t>(
          std::min<uint64_t>(buffer.size(), tensors[i].size() - pos));
      RETURN_IF_ERROR(fill(i, pos, buffer.data(), n));
      RETURN_IF_ERROR(writer->Append(buffer.data(), n));
      pos += n;
    }
  }
  return writer->Finish();
}

}  // namespace shardcast
