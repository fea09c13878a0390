// A restricted reader of Python pickles (protocols 2 to 5) and a streaming
// gzip decoder, for importing the pickle.gz activation shards of seed 002.
//
// The unpickler never executes anything: it interprets the opcodes Python's
// pickle module emits for plain data (dict, list, tuple, set, str, bytes,
// int, float, bool, None) and for numpy arrays as numpy pickles them, and it
// builds a small value tree. A GLOBAL / STACK_GLOBAL / INST naming anything
// outside a fixed allowlist (see kAllowedGlobals in pickle.cc) is refused
// with an error that names the module.name it asked for, and REDUCE is only
// carried out, by C++ code of our own, for allowlisted callables:
//
//   numpy.core.multiarray._reconstruct   numpy._core.multiarray._reconstruct
//   numpy.core.numeric._frombuffer       numpy._core.numeric._frombuffer
//   numpy.core.multiarray.scalar         numpy._core.multiarray.scalar
//   numpy.ndarray (only as _reconstruct's argument), numpy.memmap (likewise)
//   numpy.dtype                          _codecs.encode (protocol 2's bytes)
//   builtins/__builtin__ .bytes .bytearray .set .frozenset
//   collections.OrderedDict
//
// Every length, index and count read from the input is bounds-checked; a
// malformed, truncated or hostile pickle yields an absl::Status, never a
// crash, an unbounded allocation or a hang.
#ifndef SHARDCAST_COMMON_CONVERT_PICKLE_H_
#define SHARDCAST_COMMON_CONVERT_PICKLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace shardcast {

/// Element types of the numpy arrays the unpickler accepts.
enum class DType : uint8_t {
  kBool,
  kInt8,
  kUInt8,
  kInt16,
  kUInt16,
  kInt32,
  kUInt32,
  kInt64,
  kUInt64,
  kFloat16,
  kFloat32,
  kFloat64,
};

/// numpy's name of `dtype`: "float32", "int64", "bool", ...
absl::string_view DTypeName(DType dtype);
/// Bytes per element.
size_t DTypeSize(DType dtype);
/// The float32 equal to an IEEE 754 half-precision value (exact).
float Float16ToFloat32(uint16_t bits);

/// A numpy array as unpickled: little-endian elements in C order, whatever
/// byte order and memory order the pickle stored (big-endian data is
/// byte-swapped and Fortran-ordered data transposed while unpickling).
struct NdArray {
  DType dtype = DType::kInt8;
  std::vector<int64_t> shape;
  /// product(shape) * DTypeSize(dtype) bytes, owned by the Pickle the array
  /// came from. Not necessarily aligned: copy out with memcpy.
  absl::string_view data;

  int64_t num_elements() const;
};

/// One node of an unpickled value tree. A small handle: copying it copies
/// no data. Strings, bytes, containers and arrays point into the Pickle that
/// produced them and live as long as it does. Containers may be shared
/// (the pickle memo) and even cyclic, so code that walks a tree must bound
/// its depth and work (PickleToJson does).
class PickleValue {
 public:
  enum class Kind : uint8_t {
    kNone,
    kBool,
    kInt,     // fits int64
    kBigInt,  // LONG1/LONG4 beyond int64: AsString() is the two's-complement
              // little-endian bytes
    kFloat,
    kStr,    // UTF-8 bytes as Python encoded them (surrogates pass through)
    kBytes,  // bytes and bytearray
    kList,
    kTuple,
    kSet,  // set and frozenset
    kDict,
    kArray,   // numpy.ndarray
    kDType,   // a numpy.dtype object left in the tree
    kGlobal,  // an allowlisted class or function left in the tree
  };

  PickleValue() = default;

  Kind kind() const { return kind_; }
  /// Python's name of the kind, for messages: "int", "str", "numpy.ndarray".
  absl::string_view KindName() const;

  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_str() const { return kind_ == Kind::kStr; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_array() const { return kind_ == Kind::kArray; }
  /// list or tuple.
  bool is_sequence() const {
    return kind_ == Kind::kList || kind_ == Kind::kTuple;
  }

  /// The value of a kBool, kInt or kFloat; false / 0 for other kinds.
  bool AsBool() const { return kind_ == Kind::kBool && int_ != 0; }
  int64_t AsInt() const { return kind_ == Kind::kInt ? int_ : 0; }
  double AsFloat() const { return kind_ == Kind::kFloat ? float_ : 0.0; }
  /// The bytes of a kStr, kBytes or kBigInt; the global's "module.name" for
  /// kGlobal; empty for other kinds.
  absl::string_view AsString() const;
  /// Items of a kList, kTuple or kSet; empty for other kinds.
  const std::vector<PickleValue>& Items() const;
  /// Entries of a kDict (in insertion order; a key set twice appears twice,
  /// Get returns the later one); empty for other kinds.
  const std::vector<std::pair<PickleValue, PickleValue>>& Entries() const;
  /// The array of a kArray; an empty int8 array for other kinds.
  const NdArray& AsArray() const;

  /// For a kDict: the value of the last entry whose key is the str `key`,
  /// or nullptr. nullptr for other kinds.
  const PickleValue* Get(absl::string_view key) const;

 private:
  friend class Unpickler;
  Kind kind_ = Kind::kNone;
  union {
    int64_t int_ = 0;  // the int, the bool, or the size of a string
    double float_;
  };
  const void* ptr_ = nullptr;  // string bytes or the arena object
};

/// The result of Unpickle: the root value and everything it points into
/// (including the decompressed input). Move-only; not thread-safe to move
/// while values are read, safe to read from several threads.
class Pickle {
 public:
  Pickle();
  Pickle(Pickle&&) noexcept;
  Pickle& operator=(Pickle&&) noexcept;
  ~Pickle();

  const PickleValue& root() const { return root_; }

 private:
  friend class Unpickler;
  struct Arena;
  std::unique_ptr<Arena> arena_;
  PickleValue root_;
};

/// Limits on what one pickle may make the unpickler allocate beyond its
/// input. Defaults fit activation shards of many GiB.
struct UnpickleOptions {
  /// Objects created (containers, owned strings, arrays, memo entries) plus
  /// the largest stack depth. Each costs a few dozen bytes, so the default
  /// bounds bookkeeping memory at about 2 GiB whatever the input holds.
  uint64_t max_objects = uint64_t{1} << 25;
  /// Memo entries (BINPUT, LONG_BINPUT, MEMOIZE). Each copies a value into
  /// the memo, one opcode byte for ~60 bytes of memory, so a pickle that
  /// memoizes in a loop would grow 60 times its size: real activation
  /// pickles memoize a few objects per sample.
  uint64_t max_memo = uint64_t{1} << 20;
};

/// Unpickles `data` (one whole pickle; bytes after STOP are an error). The
/// returned Pickle owns `data`. Errors (each naming the byte offset and the
/// opcode):
///   PERMISSION_DENIED  a global outside the allowlist ("refusing to load
///                      global 'os.system'"), or REDUCE/BUILD/NEWOBJ on
///                      something that is not allowed;
///   DATA_LOSS          the input ends inside an opcode or before STOP;
///   INVALID_ARGUMENT   malformed input (stack underflow, memo miss, wrong
///                      argument types, sizes that do not add up);
///   UNIMPLEMENTED      valid pickle features this reader does not support
///                      (protocol 0/1 text opcodes, out-of-band buffers,
///                      object/structured/string dtypes, extensions);
///   RESOURCE_EXHAUSTED beyond UnpickleOptions::max_objects or max_memo.
absl::StatusOr<Pickle> Unpickle(std::string data,
                                const UnpickleOptions& options = {});

/// A JSON rendering of `value` for sidecar files and messages: None, bool,
/// int, float, str as themselves (invalid UTF-8 is replaced when dumped with
/// JsonText), list/tuple/set as arrays, dicts as objects (non-str keys are
/// rendered as their JSON text), big ints as decimal strings, bytes as
/// {"__bytes__": size}, arrays as {"__ndarray__": {"dtype", "shape"}}. At
/// most `max_depth` levels, `max_nodes` nodes and `max_string_bytes` bytes
/// of strings (keys included) are rendered; deeper or further parts become
/// the string "..." and a string cut short ends in "...", so the output is
/// bounded however the tree is shared or cyclic. Non-finite floats become
/// null, as JSON has no spelling for them.
nlohmann::json PickleToJson(const PickleValue& value, int max_depth = 16,
                            size_t max_nodes = 4096,
                            size_t max_string_bytes = 64 << 10);

/// Streaming gzip (RFC 1952) decoder over zlib. Accepts concatenated
/// members, as Python's gzip module does. Owns a z_stream; move-only; not
/// thread-safe.
class GzipDecoder {
 public:
  /// `max_output` bounds the total decompressed size (a gzip bomb is
  /// RESOURCE_EXHAUSTED, not an out-of-memory kill).
  explicit GzipDecoder(uint64_t max_output = uint64_t{1} << 40);
  GzipDecoder(GzipDecoder&&) noexcept;
  GzipDecoder& operator=(GzipDecoder&&) noexcept;
  ~GzipDecoder();

  /// Decompresses `input` (any split of the compressed stream) and appends
  /// the result to `*out`. DATA_LOSS with zlib's message on corrupt data
  /// (bad header, bad deflate data, CRC or length mismatch, bytes after the
  /// last member that are not another member); RESOURCE_EXHAUSTED past
  /// max_output. After an error the decoder stays failed.
  absl::Status Feed(absl::string_view input, std::string* out);
  /// Call after the last Feed: DATA_LOSS when the stream ended inside a
  /// member (a truncated file) or held no member at all.
  absl::Status Finish();
  /// Decompressed bytes produced so far.
  uint64_t total_out() const { return total_out_; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  uint64_t max_output_;
  uint64_t total_out_ = 0;
  absl::Status error_;
};

/// True when `data` starts with the gzip magic bytes 1f 8b.
bool LooksLikeGzip(absl::string_view data);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_CONVERT_PICKLE_H_
