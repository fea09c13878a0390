#include "common/convert/pickle.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"

namespace shardcast {
namespace {

// What an allowlisted global does when REDUCE calls it. Every one of them
// is implemented here in C++; nothing from the pickle is ever executed.
enum class Callable : uint8_t {
  kReconstruct,   // numpy's _reconstruct(ndarray, shape, typecode) + BUILD
  kNdarrayType,   // numpy.ndarray: only an argument of _reconstruct
  kDtype,         // numpy.dtype(spec, align, copy) + BUILD
  kFromBuffer,    // numpy's _frombuffer(buf, dtype, shape, order)
  kScalar,        // numpy's scalar(dtype, bytes): numpy.int64(5) and co.
  kCodecsEncode,  // _codecs.encode(str, 'latin1'): protocol 2's bytes
  kBytes,
  kByteArray,
  kSet,
  kFrozenSet,
  kOrderedDict,
};

struct GlobalEntry {
  const char* module;
  const char* name;
  const char* full;  // "module.name", what AsString() returns
  Callable callable;
};

// The allowlist. Anything else a pickle names is refused.
constexpr GlobalEntry kAllowedGlobals[] = {
    {"numpy.core.multiarray", "_reconstruct",
     "numpy.core.multiarray._reconstruct", Callable::kReconstruct},
    {"numpy._core.multiarray", "_reconstruct",
     "numpy._core.multiarray._reconstruct", Callable::kReconstruct},
    {"numpy.core.numeric", "_frombuffer", "numpy.core.numeric._frombuffer",
     Callable::kFromBuffer},
    {"numpy._core.numeric", "_frombuffer", "numpy._core.numeric._frombuffer",
     Callable::kFromBuffer},
    {"numpy.core.multiarray", "scalar", "numpy.core.multiarray.scalar",
     Callable::kScalar},
    {"numpy._core.multiarray", "scalar", "numpy._core.multiarray.scalar",
     Callable::kScalar},
    {"numpy", "ndarray", "numpy.ndarray", Callable::kNdarrayType},
    {"numpy", "memmap", "numpy.memmap", Callable::kNdarrayType},
    {"numpy", "dtype", "numpy.dtype", Callable::kDtype},
    {"_codecs", "encode", "_codecs.encode", Callable::kCodecsEncode},
    {"builtins", "bytes", "builtins.bytes", Callable::kBytes},
    {"__builtin__", "bytes", "__builtin__.bytes", Callable::kBytes},
    {"builtins", "bytearray", "builtins.bytearray", Callable::kByteArray},
    {"__builtin__", "bytearray", "__builtin__.bytearray", Callable::kByteArray},
    {"builtins", "set", "builtins.set", Callable::kSet},
    {"__builtin__", "set", "__builtin__.set", Callable::kSet},
    {"builtins", "frozenset", "builtins.frozenset", Callable::kFrozenSet},
    {"__builtin__", "frozenset", "__builtin__.frozenset", Callable::kFrozenSet},
    {"collections", "OrderedDict", "collections.OrderedDict",
     Callable::kOrderedDict},
};

const GlobalEntry* FindGlobal(absl::string_view module,
                              absl::string_view name) {
  for (const GlobalEntry& g : kAllowedGlobals) {
    if (module == g.module && name == g.name) return &g;
  }
  return nullptr;
}

// A numpy.dtype object while it is being built: the element type from the
// constructor and the byte order from BUILD's state.
struct DTypeObj {
  DType dtype = DType::kFloat64;
  bool big_endian = false;
};

constexpr int kMaxArrayDims = 64;  // numpy's NPY_MAXDIMS (numpy 2)

const char* OpName(uint8_t op) {
  switch (op) {
    case '(':
      return "MARK";
    case '.':
      return "STOP";
    case '0':
      return "POP";
    case '1':
      return "POP_MARK";
    case '2':
      return "DUP";
    case 'F':
      return "FLOAT";
    case 'I':
      return "INT";
    case 'J':
      return "BININT";
    case 'K':
      return "BININT1";
    case 'L':
      return "LONG";
    case 'M':
      return "BININT2";
    case 'N':
      return "NONE";
    case 'P':
      return "PERSID";
    case 'Q':
      return "BINPERSID";
    case 'R':
      return "REDUCE";
    case 'S':
      return "STRING";
    case 'T':
      return "BINSTRING";
    case 'U':
      return "SHORT_BINSTRING";
    case 'V':
      return "UNICODE";
    case 'X':
      return "BINUNICODE";
    case 'a':
      return "APPEND";
    case 'b':
      return "BUILD";
    case 'c':
      return "GLOBAL";
    case 'd':
      return "DICT";
    case '}':
      return "EMPTY_DICT";
    case 'e':
      return "APPENDS";
    case 'g':
      return "GET";
    case 'h':
      return "BINGET";
    case 'i':
      return "INST";
    case 'j':
      return "LONG_BINGET";
    case 'l':
      return "LIST";
    case ']':
      return "EMPTY_LIST";
    case 'o':
      return "OBJ";
    case 'p':
      return "PUT";
    case 'q':
      return "BINPUT";
    case 'r':
      return "LONG_BINPUT";
    case 's':
      return "SETITEM";
    case 't':
      return "TUPLE";
    case ')':
      return "EMPTY_TUPLE";
    case 'u':
      return "SETITEMS";
    case 'G':
      return "BINFLOAT";
    case 0x80:
      return "PROTO";
    case 0x81:
      return "NEWOBJ";
    case 0x82:
      return "EXT1";
    case 0x83:
      return "EXT2";
    case 0x84:
      return "EXT4";
    case 0x85:
      return "TUPLE1";
    case 0x86:
      return "TUPLE2";
    case 0x87:
      return "TUPLE3";
    case 0x88:
      return "NEWTRUE";
    case 0x89:
      return "NEWFALSE";
    case 0x8a:
      return "LONG1";
    case 0x8b:
      return "LONG4";
    case 'B':
      return "BINBYTES";
    case 'C':
      return "SHORT_BINBYTES";
    case 0x8c:
      return "SHORT_BINUNICODE";
    case 0x8d:
      return "BINUNICODE8";
    case 0x8e:
      return "BINBYTES8";
    case 0x8f:
      return "EMPTY_SET";
    case 0x90:
      return "ADDITEMS";
    case 0x91:
      return "FROZENSET";
    case 0x92:
      return "NEWOBJ_EX";
    case 0x93:
      return "STACK_GLOBAL";
    case 0x94:
      return "MEMOIZE";
    case 0x95:
      return "FRAME";
    case 0x96:
      return "BYTEARRAY8";
    case 0x97:
      return "NEXT_BUFFER";
    case 0x98:
      return "READONLY_BUFFER";
    default:
      return "unknown";
  }
}

uint64_t LoadLe(const char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) {
    v = (v << 8) | static_cast<unsigned char>(p[i]);
  }
  return v;
}

// numpy's dtype constructor string as pickles spell it ("f4", "<i8", "b1").
bool ParseDTypeSpec(absl::string_view spec, DTypeObj* out) {
  if (!spec.empty() &&
      (spec[0] == '<' || spec[0] == '>' || spec[0] == '|' || spec[0] == '=')) {
    out->big_endian = spec[0] == '>';
    spec.remove_prefix(1);
  }
  struct Name {
    const char* spec;
    DType dtype;
  };
  static constexpr Name kNames[] = {
      {"b1", DType::kBool},    {"?", DType::kBool},     {"i1", DType::kInt8},
      {"u1", DType::kUInt8},   {"i2", DType::kInt16},   {"u2", DType::kUInt16},
      {"i4", DType::kInt32},   {"u4", DType::kUInt32},  {"i8", DType::kInt64},
      {"u8", DType::kUInt64},  {"f2", DType::kFloat16}, {"f4", DType::kFloat32},
      {"f8", DType::kFloat64},
  };
  for (const Name& n : kNames) {
    if (spec == n.spec) {
      out->dtype = n.dtype;
      return true;
    }
  }
  return false;
}

bool IsLatin1Name(absl::string_view e) {
  return e == "latin1" || e == "latin-1" || e == "latin_1" ||
         e == "iso-8859-1" || e == "iso8859-1" || e == "l1";
}

// The code points of UTF-8 `text` as bytes, each < 256 (what Python's
// str.encode('latin1') does). False on invalid UTF-8 or a code point >= 256.
bool Utf8ToLatin1(absl::string_view text, std::string* out) {
  out->clear();
  out->reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      out->push_back(static_cast<char>(c));
      ++i;
    } else if ((c == 0xc2 || c == 0xc3) && i + 1 < text.size() &&
               (static_cast<unsigned char>(text[i + 1]) & 0xc0) == 0x80) {
      out->push_back(
          static_cast<char>(((c & 0x1f) << 6) | (text[i + 1] & 0x3f)));
      i += 2;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

// ------------------------------------------------------------------ DType

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return "bool";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt16:
      return "int16";
    case DType::kUInt16:
      return "uint16";
    case DType::kInt32:
      return "int32";
    case DType::kUInt32:
      return "uint32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt64:
      return "uint64";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
  }
  return "unknown";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBool:
    case DType::kInt8:
    case DType::kUInt8:
      return 1;
    case DType::kInt16:
    case DType::kUInt16:
    case DType::kFloat16:
      return 2;
    case DType::kInt32:
    case DType::kUInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
    case DType::kUInt64:
    case DType::kFloat64:
      return 8;
  }
  return 1;
}

float Float16ToFloat32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {  // inf / nan: keep the payload
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400) == 0);
    bits =
        sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

int64_t NdArray::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // checked when the array was built
  return n;
}

// ------------------------------------------------------------ PickleValue

namespace {

const std::vector<PickleValue>& EmptyItems() {
  static const auto* const kEmpty = new std::vector<PickleValue>();
  return *kEmpty;
}

const std::vector<std::pair<PickleValue, PickleValue>>& EmptyEntries() {
  static const auto* const kEmpty =
      new std::vector<std::pair<PickleValue, PickleValue>>();
  return *kEmpty;
}

}  // namespace

absl::string_view PickleValue::KindName() const {
  switch (kind_) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kBigInt:
      return "int (beyond 64 bits)";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kSet:
      return "set";
    case Kind::kDict:
      return "dict";
    case Kind::kArray:
      return "numpy.ndarray";
    case Kind::kDType:
      return "numpy.dtype";
    case Kind::kGlobal:
      return "class or function";
  }
  return "unknown";
}

absl::string_view PickleValue::AsString() const {
  switch (kind_) {
    case Kind::kStr:
    case Kind::kBytes:
    case Kind::kBigInt:
      return absl::string_view(static_cast<const char*>(ptr_),
                               static_cast<size_t>(int_));
    case Kind::kGlobal:
      return static_cast<const GlobalEntry*>(ptr_)->full;
    default:
      return {};
  }
}

const std::vector<PickleValue>& PickleValue::Items() const {
  if (kind_ == Kind::kList || kind_ == Kind::kTuple || kind_ == Kind::kSet) {
    return *static_cast<const std::vector<PickleValue>*>(ptr_);
  }
  return EmptyItems();
}

const std::vector<std::pair<PickleValue, PickleValue>>& PickleValue::Entries()
    const {
  if (kind_ != Kind::kDict) return EmptyEntries();
  return *static_cast<const std::vector<std::pair<PickleValue, PickleValue>>*>(
      ptr_);
}

const NdArray& PickleValue::AsArray() const {
  static const auto* const kEmpty = new NdArray{DType::kInt8, {0}, {}};
  if (kind_ != Kind::kArray) return *kEmpty;
  return *static_cast<const NdArray*>(ptr_);
}

const PickleValue* PickleValue::Get(absl::string_view key) const {
  const auto& entries = Entries();
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->first.kind() == Kind::kStr && it->first.AsString() == key) {
      return &it->second;
    }
  }
  return nullptr;
}

// ----------------------------------------------------------------- Pickle

// Owns every object of one unpickled tree. Values hold plain pointers into
// it; deques keep those pointers stable while objects are added. Nothing
// here owns another object, so destruction is flat, however deep or cyclic
// the tree.
struct Pickle::Arena {
  std::string input;
  std::deque<std::string> strings;
  std::deque<std::vector<PickleValue>> lists;
  std::deque<std::vector<std::pair<PickleValue, PickleValue>>> dicts;
  std::deque<NdArray> arrays;
  std::deque<DTypeObj> dtypes;
};

Pickle::Pickle() = default;
Pickle::Pickle(Pickle&&) noexcept = default;
Pickle& Pickle::operator=(Pickle&&) noexcept = default;
Pickle::~Pickle() = default;

// ------------------------------------------------------------- Unpickler

class Unpickler {
 public:
  using Kind = PickleValue::Kind;

  Unpickler(Pickle::Arena* arena, const UnpickleOptions& options)
      : arena_(arena),
        options_(options),
        begin_(arena->input.data()),
        p_(begin_),
        end_(begin_ + arena->input.size()) {}

  /// Unpickle() itself.
  static absl::StatusOr<Pickle> Parse(std::string data,
                                      const UnpickleOptions& options) {
    Pickle pickle;
    pickle.arena_ = std::make_unique<Pickle::Arena>();
    pickle.arena_->input = std::move(data);
    Unpickler unpickler(pickle.arena_.get(), options);
    ASSIGN_OR_RETURN(pickle.root_, unpickler.Run());
    return pickle;
  }

 private:
  absl::StatusOr<PickleValue> Run();

  // --- errors, all naming the opcode and its byte offset
  absl::Status Error(absl::StatusCode code, absl::string_view message) const {
    return absl::Status(
        code, absl::StrFormat("pickle: byte %d, opcode %s (0x%02x): %s",
                              op_pos_, OpName(op_), op_, message));
  }
  absl::Status Invalid(absl::string_view message) const {
    return Error(absl::StatusCode::kInvalidArgument, message);
  }
  absl::Status Refused(absl::string_view message) const {
    return Error(absl::StatusCode::kPermissionDenied, message);
  }
  absl::Status Unsupported(absl::string_view message) const {
    return Error(absl::StatusCode::kUnimplemented, message);
  }

  // --- input
  absl::Status Take(uint64_t n, const char** out) {
    const uint64_t left = static_cast<uint64_t>(end_ - p_);
    if (n > left) {
      return Error(absl::StatusCode::kDataLoss,
                   absl::StrFormat("the input ends after %d bytes, %d bytes "
                                   "short of what the opcode needs (a "
                                   "truncated pickle?)",
                                   end_ - begin_, n - left));
    }
    *out = p_;
    p_ += n;
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> TakeLe(int n) {
    const char* p = nullptr;
    RETURN_IF_ERROR(Take(static_cast<uint64_t>(n), &p));
    return LoadLe(p, n);
  }
  absl::StatusOr<absl::string_view> TakeLine() {
    const void* nl = std::memchr(p_, '\n', static_cast<size_t>(end_ - p_));
    if (nl == nullptr) {
      return Error(absl::StatusCode::kDataLoss,
                   "the input ends inside a newline-terminated argument");
    }
    absl::string_view line(
        p_, static_cast<size_t>(static_cast<const char*>(nl) - p_));
    p_ = static_cast<const char*>(nl) + 1;
    return line;
  }

  // --- accounting
  absl::Status Count(uint64_t n = 1) {
    objects_ += n;
    if (objects_ + stack_.size() > options_.max_objects) {
      return Error(absl::StatusCode::kResourceExhausted,
                   absl::StrCat("more than ", options_.max_objects,
                                " objects (UnpickleOptions::max_objects)"));
    }
    return absl::OkStatus();
  }

  // --- stack; values below the innermost MARK are out of reach, as in
  // Python, where MARK starts a fresh stack.
  size_t Floor() const { return marks_.empty() ? 0 : marks_.back(); }
  absl::Status Push(PickleValue v) {
    stack_.push_back(v);
    if (stack_.size() + objects_ > options_.max_objects) return Count(0);
    return absl::OkStatus();
  }
  absl::StatusOr<PickleValue> Pop() {
    if (stack_.size() <= Floor()) {
      return Invalid("stack underflow (nothing above the last MARK)");
    }
    PickleValue v = stack_.back();
    stack_.pop_back();
    return v;
  }
  absl::StatusOr<PickleValue*> Top() {
    if (stack_.size() <= Floor()) {
      return Invalid("stack underflow (nothing above the last MARK)");
    }
    return &stack_.back();
  }
  // Removes the values above the innermost MARK and the MARK itself.
  absl::StatusOr<std::vector<PickleValue>> PopMark() {
    if (marks_.empty()) return Invalid("no MARK on the stack");
    const size_t at = marks_.back();
    marks_.pop_back();
    std::vector<PickleValue> items(stack_.begin() + static_cast<ptrdiff_t>(at),
                                   stack_.end());
    stack_.resize(at);
    return items;
  }

  // --- value constructors
  static PickleValue Scalar(Kind kind, int64_t i) {
    PickleValue v;
    v.kind_ = kind;
    v.int_ = i;
    return v;
  }
  static PickleValue Float(double f) {
    PickleValue v;
    v.kind_ = Kind::kFloat;
    v.float_ = f;
    return v;
  }
  static PickleValue View(Kind kind, const char* data, uint64_t size) {
    PickleValue v;
    v.kind_ = kind;
    v.ptr_ = data;
    v.int_ = static_cast<int64_t>(size);
    return v;
  }
  absl::StatusOr<PickleValue> Owned(Kind kind, std::string bytes) {
    RETURN_IF_ERROR(Count());
    arena_->strings.push_back(std::move(bytes));
    const std::string& s = arena_->strings.back();
    return View(kind, s.data(), s.size());
  }
  absl::StatusOr<PickleValue> NewList(Kind kind,
                                      std::vector<PickleValue> items) {
    RETURN_IF_ERROR(Count());
    arena_->lists.push_back(std::move(items));
    PickleValue v;
    v.kind_ = kind;
    v.ptr_ = &arena_->lists.back();
    return v;
  }
  absl::StatusOr<PickleValue> NewDict() {
    RETURN_IF_ERROR(Count());
    arena_->dicts.emplace_back();
    PickleValue v;
    v.kind_ = Kind::kDict;
    v.ptr_ = &arena_->dicts.back();
    return v;
  }
  absl::StatusOr<PickleValue> NewArray(NdArray array) {
    RETURN_IF_ERROR(Count());
    arena_->arrays.push_back(std::move(array));
    PickleValue v;
    v.kind_ = Kind::kArray;
    v.ptr_ = &arena_->arrays.back();
    return v;
  }
  static PickleValue GlobalValue(const GlobalEntry* g) {
    PickleValue v;
    v.kind_ = Kind::kGlobal;
    v.ptr_ = g;
    return v;
  }

  // Mutable access to the arena objects behind a value (the memo shares
  // them, so SETITEM and BUILD act on the one object, as in Python).
  static std::vector<PickleValue>* MutableItems(const PickleValue& v) {
    return const_cast<std::vector<PickleValue>*>(
        static_cast<const std::vector<PickleValue>*>(v.ptr_));
  }
  static std::vector<std::pair<PickleValue, PickleValue>>* MutableEntries(
      const PickleValue& v) {
    return const_cast<std::vector<std::pair<PickleValue, PickleValue>>*>(
        static_cast<const std::vector<std::pair<PickleValue, PickleValue>>*>(
            v.ptr_));
  }
  static NdArray* MutableArray(const PickleValue& v) {
    return const_cast<NdArray*>(static_cast<const NdArray*>(v.ptr_));
  }
  static DTypeObj* MutableDType(const PickleValue& v) {
    return const_cast<DTypeObj*>(static_cast<const DTypeObj*>(v.ptr_));
  }
  static const GlobalEntry* Global(const PickleValue& v) {
    return static_cast<const GlobalEntry*>(v.ptr_);
  }

  // --- opcodes
  absl::Status Step(bool* stop);
  absl::Status LoadInt(uint64_t length);
  absl::Status LoadGlobal(absl::string_view module, absl::string_view name);
  absl::Status Reduce();
  absl::Status Build();
  absl::StatusOr<PickleValue> CallReduce(const GlobalEntry& g,
                                         const std::vector<PickleValue>& args);
  absl::StatusOr<PickleValue> MakeArray(const DTypeObj& dtype,
                                        const PickleValue& shape, bool fortran,
                                        absl::string_view data);
  absl::StatusOr<PickleValue> MakeScalar(const DTypeObj& dtype,
                                         absl::string_view data);

  Pickle::Arena* arena_;
  UnpickleOptions options_;
  const char* begin_;
  const char* p_;
  const char* end_;
  size_t op_pos_ = 0;
  uint8_t op_ = 0;
  std::vector<PickleValue> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PickleValue> memo_;
  uint64_t objects_ = 0;
  PickleValue result_;
};

absl::StatusOr<PickleValue> Unpickler::Run() {
  bool stop = false;
  while (!stop) {
    if (p_ == end_) {
      op_pos_ = static_cast<size_t>(p_ - begin_);
      op_ = 0;
      return absl::DataLossError(absl::StrFormat(
          "pickle: the input ends after %d bytes without a STOP opcode (a "
          "truncated pickle?)",
          end_ - begin_));
    }
    RETURN_IF_ERROR(Step(&stop));
  }
  if (p_ != end_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "pickle: %d bytes follow the STOP opcode at byte %d; expected exactly "
        "one pickle",
        end_ - p_, op_pos_));
  }
  return result_;
}

absl::Status Unpickler::LoadInt(uint64_t length) {
  const char* p = nullptr;
  RETURN_IF_ERROR(Take(length, &p));
  if (length == 0) return Push(Scalar(Kind::kInt, 0));
  // Two's complement, little-endian: it fits int64 when every byte beyond
  // the eighth repeats the sign.
  const bool negative = (static_cast<unsigned char>(p[length - 1]) & 0x80);
  bool fits = true;
  for (uint64_t i = 8; i < length && fits; ++i) {
    fits = static_cast<unsigned char>(p[i]) == (negative ? 0xff : 0x00);
  }
  if (fits && length > 8) {
    fits = ((static_cast<unsigned char>(p[7]) & 0x80) != 0) == negative;
  }
  if (!fits) return Push(View(Kind::kBigInt, p, length));
  const int n = static_cast<int>(std::min<uint64_t>(length, 8));
  uint64_t v = LoadLe(p, n);
  if (negative && n < 8) v |= ~uint64_t{0} << (8 * n);
  return Push(Scalar(Kind::kInt, static_cast<int64_t>(v)));
}

absl::Status Unpickler::LoadGlobal(absl::string_view module,
                                   absl::string_view name) {
  const GlobalEntry* g = FindGlobal(module, name);
  if (g == nullptr) {
    return Refused(absl::StrCat(
        "refusing to load global '", Quoted(absl::StrCat(module, ".", name)),
        "': only numpy arrays and plain Python data are allowed (a pickle "
        "that loads other globals can run arbitrary code)"));
  }
  return Push(GlobalValue(g));
}

absl::Status Unpickler::Step(bool* stop) {
  op_pos_ = static_cast<size_t>(p_ - begin_);
  op_ = static_cast<uint8_t>(*p_++);
  switch (op_) {
    case 0x80: {  // PROTO
      ASSIGN_OR_RETURN(uint64_t proto, TakeLe(1));
      if (proto > 5) {
        return Unsupported(absl::StrCat("pickle protocol ", proto,
                                        " is newer than 5, the newest known"));
      }
      return absl::OkStatus();
    }
    case 0x95: {  // FRAME: a length hint; the opcodes follow inline
      ASSIGN_OR_RETURN(uint64_t n, TakeLe(8));
      if (n > static_cast<uint64_t>(end_ - p_)) {
        return Error(absl::StatusCode::kDataLoss,
                     absl::StrFormat("frame of %d bytes but only %d bytes "
                                     "follow (a truncated pickle?)",
                                     n, end_ - p_));
      }
      return absl::OkStatus();
    }
    case '.': {  // STOP
      ASSIGN_OR_RETURN(result_, Pop());
      *stop = true;
      return absl::OkStatus();
    }
    case '(':  // MARK
      marks_.push_back(stack_.size());
      return Count(0);
    case '0':  // POP: a value, or the MARK when nothing is above it
      if (!marks_.empty() && stack_.size() == marks_.back()) {
        marks_.pop_back();
        return absl::OkStatus();
      }
      return Pop().status();
    case '1':  // POP_MARK
      return PopMark().status();
    case '2': {  // DUP
      ASSIGN_OR_RETURN(PickleValue * top, Top());
      return Push(*top);
    }
    case 'N':
      return Push(PickleValue());
    case 0x88:  // NEWTRUE
      return Push(Scalar(Kind::kBool, 1));
    case 0x89:  // NEWFALSE
      return Push(Scalar(Kind::kBool, 0));
    case 'J': {  // BININT
      ASSIGN_OR_RETURN(uint64_t v, TakeLe(4));
      return Push(Scalar(Kind::kInt, static_cast<int32_t>(v)));
    }
    case 'K': {  // BININT1
      ASSIGN_OR_RETURN(uint64_t v, TakeLe(1));
      return Push(Scalar(Kind::kInt, static_cast<int64_t>(v)));
    }
    case 'M': {  // BININT2
      ASSIGN_OR_RETURN(uint64_t v, TakeLe(2));
      return Push(Scalar(Kind::kInt, static_cast<int64_t>(v)));
    }
    case 0x8a: {  // LONG1
      ASSIGN_OR_RETURN(uint64_t n, TakeLe(1));
      return LoadInt(n);
    }
    case 0x8b: {  // LONG4
      ASSIGN_OR_RETURN(uint64_t n, TakeLe(4));
      if (static_cast<int32_t>(n) < 0) {
        return Invalid(
            absl::StrCat("negative length ", static_cast<int32_t>(n)));
      }
      return LoadInt(n);
    }
    case 'G': {  // BINFLOAT: big-endian IEEE 754 double
      const char* p = nullptr;
      RETURN_IF_ERROR(Take(8, &p));
      uint64_t bits = 0;
      for (int i = 0; i < 8; ++i) {
        bits = (bits << 8) | static_cast<unsigned char>(p[i]);
      }
      double d;
      std::memcpy(&d, &bits, 8);
      return Push(Float(d));
    }
    case 'X':     // BINUNICODE
    case 0x8c:    // SHORT_BINUNICODE
    case 0x8d:    // BINUNICODE8
    case 'B':     // BINBYTES
    case 'C':     // SHORT_BINBYTES
    case 0x8e:    // BINBYTES8
    case 0x96: {  // BYTEARRAY8
      const int width = (op_ == 0x8c || op_ == 'C')  ? 1
                        : (op_ == 'X' || op_ == 'B') ? 4
                                                     : 8;
      ASSIGN_OR_RETURN(uint64_t n, TakeLe(width));
      const char* p = nullptr;
      RETURN_IF_ERROR(Take(n, &p));
      const bool is_str = op_ == 'X' || op_ == 0x8c || op_ == 0x8d;
      return Push(View(is_str ? Kind::kStr : Kind::kBytes, p, n));
    }
    case 'T':    // BINSTRING (Python 2 str)
    case 'U': {  // SHORT_BINSTRING
      ASSIGN_OR_RETURN(uint64_t n, TakeLe(op_ == 'U' ? 1 : 4));
      if (op_ == 'T' && static_cast<int32_t>(n) < 0) {
        return Invalid(
            absl::StrCat("negative length ", static_cast<int32_t>(n)));
      }
      const char* p = nullptr;
      RETURN_IF_ERROR(Take(n, &p));
      // Python 3 reads these as ASCII str by default; other bytes (numpy
      // array data from Python 2) stay bytes.
      bool ascii = true;
      for (uint64_t i = 0; i < n && ascii; ++i) {
        ascii = static_cast<unsigned char>(p[i]) < 0x80;
      }
      return Push(View(ascii ? Kind::kStr : Kind::kBytes, p, n));
    }
    case ')':     // EMPTY_TUPLE
    case ']':     // EMPTY_LIST
    case 0x8f: {  // EMPTY_SET
      const Kind kind = op_ == ')'   ? Kind::kTuple
                        : op_ == ']' ? Kind::kList
                                     : Kind::kSet;
      ASSIGN_OR_RETURN(PickleValue v, NewList(kind, {}));
      return Push(v);
    }
    case 't':     // TUPLE
    case 'l':     // LIST
    case 0x91: {  // FROZENSET
      ASSIGN_OR_RETURN(std::vector<PickleValue> items, PopMark());
      const Kind kind = op_ == 't'   ? Kind::kTuple
                        : op_ == 'l' ? Kind::kList
                                     : Kind::kSet;
      ASSIGN_OR_RETURN(PickleValue v, NewList(kind, std::move(items)));
      return Push(v);
    }
    case 0x85:    // TUPLE1
    case 0x86:    // TUPLE2
    case 0x87: {  // TUPLE3
      const size_t n = op_ - 0x84u;
      if (stack_.size() < Floor() + n) {
        return Invalid(absl::StrCat("stack underflow: needs ", n,
                                    " values above the last MARK"));
      }
      std::vector<PickleValue> items(stack_.end() - static_cast<ptrdiff_t>(n),
                                     stack_.end());
      stack_.resize(stack_.size() - n);
      ASSIGN_OR_RETURN(PickleValue v, NewList(Kind::kTuple, std::move(items)));
      return Push(v);
    }
    case 'a': {  // APPEND
      ASSIGN_OR_RETURN(PickleValue item, Pop());
      ASSIGN_OR_RETURN(PickleValue * list, Top());
      if (list->kind() != Kind::kList) {
        return Invalid(absl::StrCat("APPEND to a ", list->KindName(),
                                    "; only lists are supported"));
      }
      MutableItems(*list)->push_back(item);
      return absl::OkStatus();
    }
    case 'e':     // APPENDS
    case 0x90: {  // ADDITEMS
      ASSIGN_OR_RETURN(std::vector<PickleValue> items, PopMark());
      ASSIGN_OR_RETURN(PickleValue * target, Top());
      const Kind want = op_ == 'e' ? Kind::kList : Kind::kSet;
      if (target->kind() != want) {
        return Invalid(absl::StrCat(OpName(op_), " to a ", target->KindName(),
                                    "; expected a ",
                                    want == Kind::kList ? "list" : "set"));
      }
      auto* dst = MutableItems(*target);
      dst->insert(dst->end(), items.begin(), items.end());
      return absl::OkStatus();
    }
    case '}': {  // EMPTY_DICT
      ASSIGN_OR_RETURN(PickleValue v, NewDict());
      return Push(v);
    }
    case 'd':    // DICT
    case 'u': {  // SETITEMS
      ASSIGN_OR_RETURN(std::vector<PickleValue> items, PopMark());
      if (items.size() % 2 != 0) {
        return Invalid(absl::StrCat(items.size(),
                                    " values after MARK; keys and values "
                                    "come in pairs"));
      }
      PickleValue dict;
      if (op_ == 'd') {
        ASSIGN_OR_RETURN(dict, NewDict());
        RETURN_IF_ERROR(Push(dict));
      } else {
        ASSIGN_OR_RETURN(PickleValue * top, Top());
        dict = *top;
        if (dict.kind() != Kind::kDict) {
          return Invalid(absl::StrCat("SETITEMS on a ", dict.KindName(),
                                      "; expected a dict"));
        }
      }
      auto* entries = MutableEntries(dict);
      for (size_t i = 0; i < items.size(); i += 2) {
        entries->emplace_back(items[i], items[i + 1]);
      }
      return absl::OkStatus();
    }
    case 's': {  // SETITEM
      ASSIGN_OR_RETURN(PickleValue value, Pop());
      ASSIGN_OR_RETURN(PickleValue key, Pop());
      ASSIGN_OR_RETURN(PickleValue * dict, Top());
      if (dict->kind() != Kind::kDict) {
        return Invalid(absl::StrCat("SETITEM on a ", dict->KindName(),
                                    "; expected a dict"));
      }
      MutableEntries(*dict)->emplace_back(key, value);
      return absl::OkStatus();
    }
    case 'h':    // BINGET
    case 'j': {  // LONG_BINGET
      ASSIGN_OR_RETURN(uint64_t key, TakeLe(op_ == 'h' ? 1 : 4));
      auto it = memo_.find(key);
      if (it == memo_.end()) {
        return Invalid(absl::StrCat("memo key ", key, " was never stored"));
      }
      return Push(it->second);
    }
    case 'q':     // BINPUT
    case 'r':     // LONG_BINPUT
    case 0x94: {  // MEMOIZE
      uint64_t key = memo_.size();
      if (op_ != 0x94) {
        ASSIGN_OR_RETURN(key, TakeLe(op_ == 'q' ? 1 : 4));
      }
      ASSIGN_OR_RETURN(PickleValue * top, Top());
      if (memo_.size() >= options_.max_memo && memo_.count(key) == 0) {
        return Error(absl::StatusCode::kResourceExhausted,
                     absl::StrCat("more than ", options_.max_memo,
                                  " memo entries (UnpickleOptions::max_memo): "
                                  "not an activation pickle"));
      }
      auto [it, inserted] = memo_.insert_or_assign(key, *top);
      (void)it;
      return inserted ? Count() : absl::OkStatus();
    }
    case 'c': {  // GLOBAL
      ASSIGN_OR_RETURN(absl::string_view module, TakeLine());
      ASSIGN_OR_RETURN(absl::string_view name, TakeLine());
      return LoadGlobal(module, name);
    }
    case 0x93: {  // STACK_GLOBAL
      ASSIGN_OR_RETURN(PickleValue name, Pop());
      ASSIGN_OR_RETURN(PickleValue module, Pop());
      if (name.kind() != Kind::kStr || module.kind() != Kind::kStr) {
        return Invalid(absl::StrCat("module and name must be str, got ",
                                    module.KindName(), " and ",
                                    name.KindName()));
      }
      return LoadGlobal(module.AsString(), name.AsString());
    }
    case 'i': {  // INST: constructs an object of a class named inline
      ASSIGN_OR_RETURN(absl::string_view module, TakeLine());
      ASSIGN_OR_RETURN(absl::string_view name, TakeLine());
      RETURN_IF_ERROR(LoadGlobal(module, name));
      return Refused(absl::StrCat("INST of '",
                                  Quoted(absl::StrCat(module, ".", name)),
                                  "' is not supported"));
    }
    case 'o':     // OBJ
    case 0x81:    // NEWOBJ
    case 0x92: {  // NEWOBJ_EX
      // The class was loaded by an earlier (allowlisted) GLOBAL; none of
      // the allowlisted classes is ever built this way by numpy or Python.
      return Refused(
          "creating objects with OBJ/NEWOBJ/NEWOBJ_EX is not supported (only "
          "REDUCE on allowlisted numpy/builtin functions is)");
    }
    case 'R':
      return Reduce();
    case 'b':
      return Build();
    case 0x82:  // EXT1..4 load globals through copyreg's extension registry
    case 0x83:
    case 0x84:
      return Refused(
          "extension codes (copyreg's extension registry) load arbitrary "
          "globals and are not supported");
    case 'P':
    case 'Q':
      return Unsupported("persistent IDs are not supported");
    case 0x97:
    case 0x98:
      return Unsupported(
          "out-of-band buffers (pickle protocol 5 with buffer_callback) are "
          "not supported; pickle the data in-band");
    case 'I':
    case 'L':
    case 'F':
    case 'S':
    case 'V':
    case 'g':
    case 'p':
      return Unsupported(
          "text opcodes of pickle protocols 0 and 1 are not supported; write "
          "the pickle with protocol 2 or later");
    default:
      return Invalid("unknown opcode (not a pickle, or a corrupt one)");
  }
}

absl::Status Unpickler::Reduce() {
  ASSIGN_OR_RETURN(PickleValue args, Pop());
  ASSIGN_OR_RETURN(PickleValue callable, Pop());
  if (callable.kind() != Kind::kGlobal) {
    return Refused(absl::StrCat("REDUCE on a ", callable.KindName(),
                                "; only allowlisted functions may be called"));
  }
  if (args.kind() != Kind::kTuple) {
    return Invalid(absl::StrCat("REDUCE arguments must be a tuple, got ",
                                args.KindName()));
  }
  ASSIGN_OR_RETURN(PickleValue v, CallReduce(*Global(callable), args.Items()));
  return Push(v);
}

absl::StatusOr<PickleValue> Unpickler::CallReduce(
    const GlobalEntry& g, const std::vector<PickleValue>& args) {
  const auto bad_args = [&](absl::string_view expected) {
    std::vector<std::string> kinds;
    for (const PickleValue& a : args) kinds.emplace_back(a.KindName());
    return Invalid(absl::StrCat(g.full, " expects ", expected, ", got (",
                                absl::StrJoin(kinds, ", "), ")"));
  };
  switch (g.callable) {
    case Callable::kReconstruct: {
      // _reconstruct(ndarray, (0,), b'b'): an empty array that BUILD fills.
      if (args.size() != 3 || args[0].kind() != Kind::kGlobal ||
          Global(args[0])->callable != Callable::kNdarrayType) {
        return bad_args("(numpy.ndarray, shape, typecode)");
      }
      NdArray empty;
      empty.shape = {0};
      return NewArray(std::move(empty));
    }
    case Callable::kNdarrayType:
      return Refused(
          absl::StrCat("calling ", g.full, " directly is not supported"));
    case Callable::kDtype: {
      if (args.empty() || args.size() > 3 ||
          (args[0].kind() != Kind::kStr && args[0].kind() != Kind::kBytes)) {
        return bad_args("(str, align, copy)");
      }
      DTypeObj d;
      if (!ParseDTypeSpec(args[0].AsString(), &d)) {
        return Unsupported(absl::StrCat(
            "numpy dtype '", Quoted(args[0].AsString()),
            "' is not supported (bool, int8-int64, uint8-uint64 and "
            "float16/32/64 are; object, string, structured, complex and "
            "datetime arrays are not)"));
      }
      RETURN_IF_ERROR(Count());
      arena_->dtypes.push_back(d);
      PickleValue v;
      v.kind_ = Kind::kDType;
      v.ptr_ = &arena_->dtypes.back();
      return v;
    }
    case Callable::kCodecsEncode: {
      if (args.size() != 2 || args[0].kind() != Kind::kStr ||
          args[1].kind() != Kind::kStr || !IsLatin1Name(args[1].AsString())) {
        return bad_args("(str, 'latin1')");
      }
      std::string bytes;
      if (!Utf8ToLatin1(args[0].AsString(), &bytes)) {
        return Invalid(
            "_codecs.encode: the str holds a character beyond latin-1 or is "
            "not valid UTF-8");
      }
      return Owned(Kind::kBytes, std::move(bytes));
    }
    case Callable::kBytes:
    case Callable::kByteArray: {
      if (args.empty()) return View(Kind::kBytes, begin_, 0);
      if (args.size() == 1 && args[0].kind() == Kind::kBytes) return args[0];
      if (args.size() == 2 && args[0].kind() == Kind::kStr &&
          args[1].kind() == Kind::kStr && IsLatin1Name(args[1].AsString())) {
        std::string bytes;
        if (!Utf8ToLatin1(args[0].AsString(), &bytes)) {
          return Invalid(absl::StrCat(g.full,
                                      ": the str holds a character beyond "
                                      "latin-1 or is not valid UTF-8"));
        }
        return Owned(Kind::kBytes, std::move(bytes));
      }
      return bad_args("(), (bytes,) or (str, 'latin-1')");
    }
    case Callable::kSet:
    case Callable::kFrozenSet: {
      if (args.empty()) return NewList(Kind::kSet, {});
      if (args.size() == 1 &&
          (args[0].is_sequence() || args[0].kind() == Kind::kSet)) {
        return NewList(Kind::kSet, args[0].Items());
      }
      return bad_args("() or (list,)");
    }
    case Callable::kOrderedDict: {
      if (args.size() > 1 || (args.size() == 1 && !args[0].is_sequence())) {
        return bad_args("() or (list of pairs,)");
      }
      ASSIGN_OR_RETURN(PickleValue dict, NewDict());
      if (!args.empty()) {
        for (const PickleValue& pair : args[0].Items()) {
          if (!pair.is_sequence() || pair.Items().size() != 2) {
            return bad_args("() or (list of pairs,)");
          }
          MutableEntries(dict)->emplace_back(pair.Items()[0], pair.Items()[1]);
        }
      }
      return dict;
    }
    case Callable::kFromBuffer: {
      // _frombuffer(buffer, dtype, shape, order): protocol 5, in-band.
      if (args.size() != 4 || args[0].kind() != Kind::kBytes ||
          args[1].kind() != Kind::kDType || args[2].kind() != Kind::kTuple ||
          args[3].kind() != Kind::kStr) {
        return bad_args("(bytes, numpy.dtype, shape tuple, 'C' or 'F')");
      }
      const absl::string_view order = args[3].AsString();
      if (order != "C" && order != "F") {
        return Invalid(absl::StrCat("_frombuffer: order '", Quoted(order),
                                    "'; expected 'C' or 'F'"));
      }
      return MakeArray(*MutableDType(args[1]), args[2], order == "F",
                       args[0].AsString());
    }
    case Callable::kScalar: {
      // scalar(dtype, bytes): numpy.int64(5), numpy.float32(1.5), ...
      if (args.size() != 2 || args[0].kind() != Kind::kDType ||
          (args[1].kind() != Kind::kBytes && args[1].kind() != Kind::kStr)) {
        return bad_args("(numpy.dtype, bytes)");
      }
      return MakeScalar(*MutableDType(args[0]), args[1].AsString());
    }
  }
  return Invalid("unknown callable");
}

absl::StatusOr<PickleValue> Unpickler::MakeScalar(const DTypeObj& d,
                                                  absl::string_view data) {
  const size_t size = DTypeSize(d.dtype);
  if (data.size() != size) {
    return Invalid(absl::StrCat("numpy scalar of dtype ", DTypeName(d.dtype),
                                " with ", data.size(),
                                " bytes of data; expected ", size));
  }
  char le[8];
  for (size_t i = 0; i < size; ++i) {
    le[i] = d.big_endian ? data[size - 1 - i] : data[i];
  }
  const uint64_t u = LoadLe(le, static_cast<int>(size));
  const auto sext = [&](int bits) {
    const uint64_t m = uint64_t{1} << (bits - 1);
    return static_cast<int64_t>((u ^ m) - m);
  };
  switch (d.dtype) {
    case DType::kBool:
      return Scalar(Kind::kBool, u != 0);
    case DType::kInt8:
      return Scalar(Kind::kInt, sext(8));
    case DType::kInt16:
      return Scalar(Kind::kInt, sext(16));
    case DType::kInt32:
      return Scalar(Kind::kInt, sext(32));
    case DType::kInt64:
      return Scalar(Kind::kInt, static_cast<int64_t>(u));
    case DType::kUInt8:
    case DType::kUInt16:
    case DType::kUInt32:
      return Scalar(Kind::kInt, static_cast<int64_t>(u));
    case DType::kUInt64: {
      if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Scalar(Kind::kInt, static_cast<int64_t>(u));
      }
      std::string big(le, 8);
      big.push_back('\0');  // a positive two's-complement number
      return Owned(Kind::kBigInt, std::move(big));
    }
    case DType::kFloat16:
      return Float(Float16ToFloat32(static_cast<uint16_t>(u)));
    case DType::kFloat32: {
      const auto bits = static_cast<uint32_t>(u);
      float f;
      std::memcpy(&f, &bits, 4);
      return Float(f);
    }
    case DType::kFloat64: {
      double f;
      std::memcpy(&f, &u, 8);
      return Float(f);
    }
  }
  return Invalid("unknown dtype");
}

absl::StatusOr<PickleValue> Unpickler::MakeArray(const DTypeObj& d,
                                                 const PickleValue& shape_value,
                                                 bool fortran,
                                                 absl::string_view data) {
  NdArray array;
  array.dtype = d.dtype;
  const size_t item = DTypeSize(d.dtype);
  if (shape_value.Items().size() > static_cast<size_t>(kMaxArrayDims)) {
    return Invalid(absl::StrCat("array with ", shape_value.Items().size(),
                                " dimensions; numpy allows at most ",
                                kMaxArrayDims));
  }
  uint64_t elements = 1;
  bool overflow = false;
  for (const PickleValue& dim : shape_value.Items()) {
    if (dim.kind() != Kind::kInt || dim.AsInt() < 0) {
      return Invalid(absl::StrCat("array shape entries must be ints >= 0, got ",
                                  dim.kind() == Kind::kInt
                                      ? std::to_string(dim.AsInt())
                                      : std::string(dim.KindName())));
    }
    const auto n = static_cast<uint64_t>(dim.AsInt());
    if (n != 0 && elements > std::numeric_limits<uint64_t>::max() / 8 / n) {
      overflow = true;
    } else {
      elements *= n;
    }
    array.shape.push_back(dim.AsInt());
  }
  for (int64_t n : array.shape) {
    if (n == 0) {
      overflow = false;  // an empty array, whatever the other dimensions
      elements = 0;
    }
  }
  if (overflow || elements * item != data.size()) {
    return Invalid(absl::StrCat(
        "array data has ", data.size(), " bytes but shape [",
        absl::StrJoin(array.shape, ", "), "] of ", DTypeName(d.dtype),
        overflow ? " overflows 64 bits"
                 : absl::StrCat(" needs ", elements * item)));
  }
  const bool swap = d.big_endian && item > 1;
  const bool transpose = fortran && array.shape.size() > 1 && elements > 1;
  if (!swap && !transpose) {
    array.data = data;
    return NewArray(std::move(array));
  }
  std::string out(data.size(), '\0');
  if (transpose) {
    // Element (i0, .., ik) of a Fortran-order array is at sum(i_j * s_j)
    // with s_0 = 1, s_j = s_(j-1) * n_(j-1). Walk the C order of the output
    // with an odometer, moving the input offset by the strides.
    const size_t dims = array.shape.size();
    std::vector<uint64_t> stride(dims), index(dims, 0);
    stride[0] = 1;
    for (size_t j = 1; j < dims; ++j) {
      stride[j] = stride[j - 1] * static_cast<uint64_t>(array.shape[j - 1]);
    }
    uint64_t in = 0;
    for (uint64_t o = 0; o < elements; ++o) {
      std::memcpy(&out[o * item], &data[in * item], item);
      for (size_t j = dims; j-- > 0;) {
        in += stride[j];
        if (++index[j] < static_cast<uint64_t>(array.shape[j])) break;
        in -= stride[j] * index[j];
        index[j] = 0;
      }
    }
  } else {
    std::memcpy(out.data(), data.data(), data.size());
  }
  if (swap) {
    for (size_t o = 0; o < out.size(); o += item) {
      std::reverse(out.begin() + static_cast<ptrdiff_t>(o),
                   out.begin() + static_cast<ptrdiff_t>(o + item));
    }
  }
  ASSIGN_OR_RETURN(PickleValue owned, Owned(Kind::kBytes, std::move(out)));
  array.data = owned.AsString();
  return NewArray(std::move(array));
}

absl::Status Unpickler::Build() {
  ASSIGN_OR_RETURN(PickleValue state, Pop());
  ASSIGN_OR_RETURN(PickleValue * target, Top());
  const auto& s = state.Items();
  if (target->kind() == Kind::kDType) {
    // (version, byteorder, subarray, names, fields, elsize, alignment,
    //  flags[, metadata]); only plain types: no subarray, no fields.
    if (state.kind() != Kind::kTuple || s.size() < 5 || s.size() > 9 ||
        s[1].kind() != Kind::kStr) {
      return Invalid(
          "numpy.dtype state must be a tuple (version, byteorder, "
          "...)");
    }
    const absl::string_view order = s[1].AsString();
    if (order != "<" && order != ">" && order != "|" && order != "=") {
      return Invalid(absl::StrCat("numpy.dtype byte order '", Quoted(order),
                                  "'; expected <, >, | or ="));
    }
    if (s.size() >= 8 &&
        (!s[2].is_none() || !s[3].is_none() || !s[4].is_none())) {
      return Unsupported(
          "structured or sub-array numpy dtypes are not supported");
    }
    DTypeObj* d = MutableDType(*target);
    d->big_endian = order == ">";
    return absl::OkStatus();
  }
  if (target->kind() == Kind::kArray) {
    // ndarray.__setstate__((version, shape, dtype, is_fortran, data)), or
    // the same without the version.
    if (state.kind() != Kind::kTuple || (s.size() != 5 && s.size() != 4)) {
      return Invalid(
          "numpy.ndarray state must be a tuple (version, shape, "
          "dtype, is_fortran, data)");
    }
    const size_t o = s.size() == 5 ? 1 : 0;
    const PickleValue& shape = s[o];
    const PickleValue& dtype = s[o + 1];
    const PickleValue& fortran = s[o + 2];
    const PickleValue& data = s[o + 3];
    if (!shape.is_sequence() || dtype.kind() != Kind::kDType ||
        (fortran.kind() != Kind::kBool && fortran.kind() != Kind::kInt)) {
      return Invalid(absl::StrCat(
          "numpy.ndarray state holds (", shape.KindName(), ", ",
          dtype.KindName(), ", ", fortran.KindName(),
          ", ...); expected (shape tuple, numpy.dtype, bool, data)"));
    }
    if (data.kind() == Kind::kList) {
      return Unsupported("numpy object arrays are not supported");
    }
    if (data.kind() != Kind::kBytes && data.kind() != Kind::kStr) {
      return Invalid(absl::StrCat("numpy.ndarray data must be bytes, got ",
                                  data.KindName()));
    }
    const bool is_fortran =
        fortran.kind() == Kind::kBool ? fortran.AsBool() : fortran.AsInt() != 0;
    ASSIGN_OR_RETURN(PickleValue built, MakeArray(*MutableDType(dtype), shape,
                                                  is_fortran, data.AsString()));
    // The array object may already be in the memo: fill it in place.
    *MutableArray(*target) = built.AsArray();
    return absl::OkStatus();
  }
  return Refused(absl::StrCat("BUILD on a ", target->KindName(),
                              "; only numpy arrays and dtypes are built"));
}

absl::StatusOr<Pickle> Unpickle(std::string data,
                                const UnpickleOptions& options) {
  return Unpickler::Parse(std::move(data), options);
}

// ------------------------------------------------------------ PickleToJson

namespace {

// Decimal digits of a two's-complement little-endian integer (<= 64 bytes).
std::string BigIntDecimal(absl::string_view le) {
  const bool negative =
      !le.empty() && (static_cast<unsigned char>(le.back()) & 0x80);
  std::vector<uint32_t> words((le.size() + 3) / 4, 0);  // little-endian
  for (size_t i = 0; i < le.size(); ++i) {
    uint32_t b = static_cast<unsigned char>(le[i]);
    words[i / 4] |= b << (8 * (i % 4));
  }
  if (le.size() % 4 != 0 && negative) {
    words.back() |= ~uint32_t{0} << (8 * (le.size() % 4));
  }
  if (negative) {  // magnitude = ~x + 1
    uint64_t carry = 1;
    for (uint32_t& w : words) {
      const uint64_t v = static_cast<uint64_t>(~w) + carry;
      w = static_cast<uint32_t>(v);
      carry = v >> 32;
    }
  }
  std::string digits;
  while (std::any_of(words.begin(), words.end(),
                     [](uint32_t w) { return w != 0; })) {
    uint64_t rem = 0;
    for (size_t i = words.size(); i-- > 0;) {
      const uint64_t cur = (rem << 32) | words[i];
      words[i] = static_cast<uint32_t>(cur / 10);
      rem = cur % 10;
    }
    digits.push_back(static_cast<char>('0' + rem));
  }
  if (digits.empty()) digits = "0";
  if (negative) digits.push_back('-');
  std::reverse(digits.begin(), digits.end());
  return digits;
}

// What is left to render: nodes, and bytes of string content.
struct Budget {
  size_t nodes;
  size_t bytes;
};

// `text` cut to what the budget has left (at a UTF-8 character boundary),
// with "..." appended when cut.
std::string TakeString(absl::string_view text, Budget* budget) {
  if (text.size() <= budget->bytes) {
    budget->bytes -= text.size();
    return std::string(text);
  }
  size_t n = budget->bytes;
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xc0) == 0x80) --n;
  budget->bytes = 0;
  return absl::StrCat(text.substr(0, n), "...");
}

nlohmann::json ToJson(const PickleValue& v, int depth, Budget* budget) {
  using Kind = PickleValue::Kind;
  if (budget->nodes == 0 || depth <= 0) return "...";
  --budget->nodes;
  switch (v.kind()) {
    case Kind::kNone:
      return nullptr;
    case Kind::kBool:
      return v.AsBool();
    case Kind::kInt:
      return v.AsInt();
    case Kind::kBigInt:
      if (v.AsString().size() > 64) {
        return absl::StrCat("<int of ", v.AsString().size(), " bytes>");
      }
      return BigIntDecimal(v.AsString());
    case Kind::kFloat:
      if (!std::isfinite(v.AsFloat())) return nullptr;
      return v.AsFloat();
    case Kind::kStr:
      return TakeString(v.AsString(), budget);
    case Kind::kBytes:
      return nlohmann::json{{"__bytes__", v.AsString().size()}};
    case Kind::kList:
    case Kind::kTuple:
    case Kind::kSet: {
      nlohmann::json a = nlohmann::json::array();
      for (const PickleValue& item : v.Items()) {
        if (budget->nodes == 0) {
          a.push_back("...");
          break;
        }
        a.push_back(ToJson(item, depth - 1, budget));
      }
      return a;
    }
    case Kind::kDict: {
      nlohmann::json o = nlohmann::json::object();
      for (const auto& [key, value] : v.Entries()) {
        if (budget->nodes == 0) {
          o["..."] = "...";
          break;
        }
        std::string k = key.kind() == Kind::kStr
                            ? TakeString(key.AsString(), budget)
                            : JsonText(ToJson(key, depth - 1, budget));
        o[k] = ToJson(value, depth - 1, budget);
      }
      return o;
    }
    case Kind::kArray: {
      const NdArray& a = v.AsArray();
      return nlohmann::json{
          {"__ndarray__",
           {{"dtype", std::string(DTypeName(a.dtype))}, {"shape", a.shape}}}};
    }
    case Kind::kDType:
      return "<numpy.dtype>";
    case Kind::kGlobal:
      return absl::StrCat("<", v.AsString(), ">");
  }
  return nullptr;
}

}  // namespace

nlohmann::json PickleToJson(const PickleValue& value, int max_depth,
                            size_t max_nodes, size_t max_string_bytes) {
  Budget budget{max_nodes, max_string_bytes};
  return ToJson(value, max_depth, &budget);
}

// ------------------------------------------------------------------- gzip

struct GzipDecoder::State {
  z_stream zs{};
  bool initialized = false;
  bool in_member = false;
  bool any_member = false;
};

GzipDecoder::GzipDecoder(uint64_t max_output)
    : state_(std::make_unique<State>()), max_output_(max_output) {
  // 16 + MAX_WBITS: gzip wrapper only (header, CRC-32 and length checked).
  if (inflateInit2(&state_->zs, 16 + MAX_WBITS) != Z_OK) {
    error_ = absl::ResourceExhaustedError("gzip: inflateInit2 failed");
  } else {
    state_->initialized = true;
  }
}

GzipDecoder::GzipDecoder(GzipDecoder&&) noexcept = default;
GzipDecoder& GzipDecoder::operator=(GzipDecoder&&) noexcept = default;

GzipDecoder::~GzipDecoder() {
  if (state_ != nullptr && state_->initialized) inflateEnd(&state_->zs);
}

absl::Status GzipDecoder::Feed(absl::string_view input, std::string* out) {
  if (!error_.ok()) return error_;
  z_stream& zs = state_->zs;
  const auto* next = reinterpret_cast<const Bytef*>(input.data());
  size_t left = input.size();
  while (left > 0) {
    if (!state_->in_member) {
      // Zero bytes between and after members are padding (Python's gzip
      // skips them too); anything else starts a new member.
      if (*next == 0) {
        ++next;
        --left;
        continue;
      }
      if (state_->any_member && inflateReset(&zs) != Z_OK) {
        error_ = absl::DataLossError("gzip: cannot restart the decoder");
        return error_;
      }
      state_->in_member = true;
      state_->any_member = true;
    }
    const auto chunk_in = static_cast<uInt>(
        std::min<size_t>(left, std::numeric_limits<uInt>::max()));
    zs.next_in = const_cast<Bytef*>(next);
    zs.avail_in = chunk_in;
    while (true) {
      const size_t old = out->size();
      const uint64_t room = max_output_ - total_out_;  // total_out_ <= max
      // At most one byte past the limit, so that exceeding it shows.
      const size_t grow = static_cast<size_t>(
          std::min<uint64_t>(std::max<size_t>(size_t{1} << 20, old / 4),
                             std::min<uint64_t>(room, uint64_t{64} << 20)) +
          1);
      out->resize(old + grow);
      zs.next_out = reinterpret_cast<Bytef*>(&(*out)[old]);
      zs.avail_out = static_cast<uInt>(grow);
      const int rc = inflate(&zs, Z_NO_FLUSH);
      const size_t produced = grow - zs.avail_out;
      out->resize(old + produced);
      total_out_ += produced;
      if (total_out_ > max_output_) {
        // The byte past the limit only showed that there is more: the
        // output never holds more than max_output.
        out->resize(out->size() - (total_out_ - max_output_));
        total_out_ = max_output_;
        error_ = absl::ResourceExhaustedError(absl::StrCat(
            "gzip: decompresses to more than ", max_output_, " bytes"));
        return error_;
      }
      if (rc == Z_STREAM_END) {
        state_->in_member = false;
        break;
      }
      if (rc == Z_BUF_ERROR ||
          (rc == Z_OK && zs.avail_in == 0 && zs.avail_out > 0)) {
        break;  // all input consumed; more is needed
      }
      if (rc != Z_OK) {
        error_ = absl::DataLossError(
            absl::StrCat("gzip: corrupt data (zlib: ",
                         zs.msg != nullptr ? zs.msg : zError(rc), ")"));
        return error_;
      }
    }
    const size_t used = chunk_in - zs.avail_in;
    if (used == 0 && state_->in_member) {
      error_ = absl::DataLossError("gzip: the decoder made no progress");
      return error_;
    }
    next += used;
    left -= used;
  }
  return absl::OkStatus();
}

absl::Status GzipDecoder::Finish() {
  if (!error_.ok()) return error_;
  if (state_->in_member) {
    return absl::DataLossError(absl::StrFormat(
        "gzip: the data ends inside a compressed member after %d "
        "decompressed bytes (a truncated file?)",
        total_out_));
  }
  if (!state_->any_member) {
    return absl::DataLossError("gzip: no compressed data");
  }
  return absl::OkStatus();
}

bool LooksLikeGzip(absl::string_view data) {
  return data.size() >= 2 && static_cast<unsigned char>(data[0]) == 0x1f &&
         static_cast<unsigned char>(data[1]) == 0x8b;
}

}  // namespace shardcast
