// Reader for NumPy .npy files (format versions 1-3), enough to stream
// float32 / uint8 C-order arrays into the writer.
#ifndef SHARDCAST_COMMON_CONVERT_NPY_H_
#define SHARDCAST_COMMON_CONVERT_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/file.h"

namespace shardcast {

/// What a .npy header says. Plain data.
struct NpyHeader {
  std::string descr;  // e.g. "<f4", "|u1"
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;  // bytes before the array data
  uint64_t data_bytes = 0;   // product(shape) * itemsize
};

/// The most bytes of a file ParseNpyHeader needs: the 12-byte preamble of
/// format 2.0 and a header of at most 1 MiB (longer ones are refused).
inline constexpr uint64_t kNpyMaxHeadBytes = 12 + (uint64_t{1} << 20);

/// Parses the preamble and header dict of a .npy file, without I/O (OpenNpy
/// reads the bytes; the fuzzer calls it directly). `head` is the start of the
/// file: all of it, or at least its first kNpyMaxHeadBytes bytes. `path`
/// names the file in messages. INVALID_ARGUMENT for a bad magic, an
/// unsupported version or dtype, Fortran order or a malformed dict;
/// DATA_LOSS for a header that runs past the end of `head`. Does not check
/// the data against the file's size (OpenNpy does).
absl::StatusOr<NpyHeader> ParseNpyHeader(absl::string_view head,
                                         absl::string_view path);

/// An opened .npy file: its header and a descriptor positioned for reads.
struct NpyFile {
  std::string path;
  std::string descr;  // e.g. "<f4", "|u1"
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;  // bytes before the array data
  uint64_t data_bytes = 0;   // product(shape) * itemsize
  UniqueFd fd;
};

/// Opens and parses the header. INVALID_ARGUMENT (naming the path) for a bad
/// magic, an unsupported version, Fortran order, or a file shorter than its
/// header says (DATA_LOSS).
absl::StatusOr<NpyFile> OpenNpy(const std::string& path);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_CONVERT_NPY_H_
