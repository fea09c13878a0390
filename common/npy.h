// Reader for NumPy .npy files (format versions 1-3), enough to stream
// float32 / uint8 C-order arrays into the writer.
#ifndef SHARDCAST_COMMON_NPY_H_
#define SHARDCAST_COMMON_NPY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/file.h"

namespace shardcast {

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

#endif  // SHARDCAST_COMMON_NPY_H_
