// safetensors files (seed 004; the huggingface/safetensors format): reading
// and validating the header, and a one-pass, crash-safe writer.
//
// A file is an 8-byte little-endian header length N, N bytes of JSON, then
// the data section. The JSON object maps each tensor name to {"dtype",
// "shape", "data_offsets": [begin, end]} (offsets relative to the data
// section), plus an optional "__metadata__" object of string values. The
// reader enforces the format's rules (those of the safetensors library, and
// stricter where the library is silent: duplicate keys and unknown fields are
// refused) and hands back absolute file offsets, so that readers that issue
// their own reads (pread, io_uring) never redo the header arithmetic.
#ifndef SHARDCAST_COMMON_FORMAT_SAFETENSORS_H_
#define SHARDCAST_COMMON_FORMAT_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/file.h"

namespace shardcast {

/// The largest header (N) a reader accepts: the safetensors library's
/// MAX_HEADER_SIZE.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;
/// The most dimensions a tensor may have here (numpy's limit is 64; the
/// format sets none, so that a header's shapes cannot take 8x its size).
inline constexpr size_t kMaxSafetensorsRank = 64;

/// Element types, as the safetensors library (0.6) names them in "dtype".
enum class SafetensorsDtype {
  kBool,
  kF4,      // 4 bits (float4 e2m1)
  kF6E2M3,  // 6 bits
  kF6E3M2,  // 6 bits
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kF8E8M0,
  kF8E4M3Fnuz,
  kF8E5M2Fnuz,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kC64,
  kF64,
  kI64,
  kU64,
};

/// "F32", "BF16", "F8_E4M3", ...
absl::string_view SafetensorsDtypeName(SafetensorsDtype dtype);
/// Inverse of SafetensorsDtypeName; nullopt for anything else.
std::optional<SafetensorsDtype> ParseSafetensorsDtype(absl::string_view name);
/// Bits of one element (4 for F4, 6 for the F6 types, 8 for BOOL, ...).
int SafetensorsDtypeBits(SafetensorsDtype dtype);
/// "BOOL, F4, ..., U64": every name, for messages.
std::string SafetensorsDtypeNames();

/// One tensor of a validated header. Plain data.
struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<uint64_t> shape;
  uint64_t num_elements = 0;  // product of shape (1 for a scalar)
  uint64_t begin = 0;         // data_offsets[0], relative to the data section
  uint64_t end = 0;           // data_offsets[1], relative to the data section
  uint64_t offset = 0;        // absolute file offset of the first byte

  /// Bytes of the tensor's data: [offset, offset + size()) of the file.
  uint64_t size() const { return end - begin; }
};

/// A safetensors header that passed every rule. Plain data; copyable.
struct SafetensorsHeader {
  uint64_t header_bytes = 0;  // N, the JSON with its padding
  uint64_t data_offset = 0;   // 8 + N: where the data section starts
  uint64_t file_size = 0;     // data_offset + the data section
  std::vector<SafetensorsTensor> tensors;  // in header (JSON) order
  bool has_metadata = false;               // "__metadata__" was present
  /// "__metadata__" entries, in header order.
  std::vector<std::pair<std::string, std::string>> metadata;
  /// Tensor name -> index in `tensors`.
  std::unordered_map<std::string, size_t> by_name;

  /// The tensor called `name`, or nullptr.
  const SafetensorsTensor* Find(const std::string& name) const;
  /// The "__metadata__" value of `key`, or nullptr.
  const std::string* FindMetadata(absl::string_view key) const;
};

/// Parses the 8-byte little-endian header length at the start of a file of
/// `file_size` bytes (`prefix` holds at least those 8 bytes, or the whole
/// file when it is shorter). DATA_LOSS when the file is shorter than 8 bytes
/// or than 8 + N; INVALID_ARGUMENT when N exceeds
/// kMaxSafetensorsHeaderBytes. Messages name `source`.
absl::StatusOr<uint64_t> ParseSafetensorsHeaderLength(absl::string_view prefix,
                                                      uint64_t file_size,
                                                      absl::string_view source);

/// Parses and validates the N bytes of header JSON of a file of `file_size`
/// bytes: a JSON object (starting with '{', trailing spaces allowed), no
/// duplicate keys at any level, "__metadata__" an object of strings, every
/// other key a tensor with exactly dtype (a known name), shape (non-negative
/// integers) and data_offsets ([begin, end], begin <= end), where
/// product(shape) x dtype bits is a whole number of bytes equal to
/// end - begin (checked for overflow), and the tensors tile the data section
/// (8 + N to the end of the file) exactly: no overlap, no hole, nothing past
/// the end, nothing left over. INVALID_ARGUMENT naming `source`, the tensor
/// and the rule; DATA_LOSS when a tensor ends past the end of the file
/// (a truncated file).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    absl::string_view header, uint64_t file_size, absl::string_view source);

/// ParseSafetensorsHeaderLength + ParseSafetensorsHeader on a whole file
/// held in memory (tests, fuzzing, small files).
absl::StatusOr<SafetensorsHeader> ParseSafetensors(absl::string_view file,
                                                   absl::string_view source);

/// Reads and validates the header of the open regular file `fd` with pread
/// (no mapping), against the file's size now. `path` names it in messages.
/// Errors as ParseSafetensorsHeader, and those of PreadFull / FileSize.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(int fd,
                                                        absl::string_view path);

/// Opens `path` with OpenRegularFile (so a FIFO or a device is refused, not
/// waited on) and reads its header as above.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(
    const std::string& path);

/// One tensor a SafetensorsWriter writes.
struct SafetensorsTensorSpec {
  std::string name;  // valid UTF-8, unique, not "__metadata__"
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<uint64_t> shape;  // [] is a scalar
};

/// What a SafetensorsWriter writes.
struct SafetensorsWriterOptions {
  std::string path;  // final file name; replaced atomically if it exists
  /// In data-section order. The safetensors library puts the widest dtypes
  /// first so that every tensor starts aligned to its element size; callers
  /// that care should do the same (offsets are not padded).
  std::vector<SafetensorsTensorSpec> tensors;
  /// "__metadata__" entries (valid UTF-8, unique keys); omitted when empty.
  std::vector<std::pair<std::string, std::string>> metadata;
};

/// The header bytes (8-byte length + JSON padded with spaces to a multiple
/// of 8 bytes, as the safetensors library pads it) for `options`, and the
/// layout it describes. INVALID_ARGUMENT for a bad name, a duplicate, or a
/// shape whose size overflows.
absl::StatusOr<std::pair<std::string, SafetensorsHeader>>
BuildSafetensorsHeader(const SafetensorsWriterOptions& options);

/// Writes one safetensors file in one pass: the header (computed from the
/// shapes up front) then the data, streamed by Append. The bytes go to a
/// temporary file beside the target (".<name>.shardcast-tmp-..."), which
/// Finish fsyncs and renames over the target, then fsyncs the directory, so
/// a crash never leaves a partial file under the final name. Not
/// thread-safe. Destroying an unfinished writer removes its temporary file.
class SafetensorsWriter {
 public:
  /// Validates the options (as BuildSafetensorsHeader), creates the
  /// temporary file and writes the header. Errors from the filesystem keep
  /// their errno code (NOT_FOUND for a missing directory, ...).
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      SafetensorsWriterOptions options);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  /// The layout being written, with absolute offsets.
  const SafetensorsHeader& header() const { return header_; }
  const std::string& temp_path() const { return temp_path_; }
  /// Bytes of the data section written so far, and in all.
  uint64_t data_written() const { return data_written_; }
  uint64_t data_bytes() const {
    return header_.file_size - header_.data_offset;
  }

  /// Appends the next `bytes` of the data section: the tensors' raw
  /// little-endian C-order bytes, one after the other in options order; any
  /// split of the stream is allowed. OUT_OF_RANGE past the end of the data
  /// section (nothing is written then).
  absl::Status Append(const void* data, size_t bytes);

  /// FAILED_PRECONDITION unless the whole data section arrived; then fsyncs,
  /// closes, renames into place and fsyncs the directory.
  absl::Status Finish();

 private:
  SafetensorsWriter() = default;

  SafetensorsWriterOptions options_;
  SafetensorsHeader header_;
  std::string temp_path_;
  UniqueFd fd_;
  uint64_t data_written_ = 0;
  bool finished_ = false;
};

/// Supplies bytes for WriteSafetensors: `length` bytes of tensor `tensor`
/// (index in options.tensors) starting at byte `offset` of that tensor, into
/// `out`. A non-OK status aborts the write (the target is left untouched).
using SafetensorsFill = std::function<absl::Status(
    size_t tensor, uint64_t offset, char* out, size_t length)>;

/// Writes a whole file with a SafetensorsWriter, asking `fill` for the data
/// in order, in pieces of at most `chunk_bytes`, never spanning two tensors.
absl::Status WriteSafetensors(SafetensorsWriterOptions options,
                              const SafetensorsFill& fill,
                              size_t chunk_bytes = size_t{16} << 20);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_SAFETENSORS_H_
