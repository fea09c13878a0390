#include "common/convert/npy.h"

#include <fcntl.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/base/status.h"

namespace shardcast {
namespace {

// Finds the value text of 'key' in the header dict literal, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
absl::StatusOr<absl::string_view> DictValue(absl::string_view header,
                                            absl::string_view key,
                                            absl::string_view path) {
  const std::string quoted = absl::StrCat("'", key, "'");
  size_t pos = header.find(quoted);
  if (pos == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": .npy header has no '", key, "'"));
  }
  pos = header.find(':', pos + quoted.size());
  if (pos == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": bad .npy header"));
  }
  absl::string_view rest =
      absl::StripLeadingAsciiWhitespace(header.substr(pos + 1));
  size_t end;
  if (!rest.empty() && rest[0] == '(') {
    end = rest.find(')');
    if (end == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": bad .npy shape"));
    }
    return rest.substr(0, end + 1);
  }
  if (!rest.empty() && (rest[0] == '\'' || rest[0] == '"')) {
    end = rest.find(rest[0], 1);
    if (end == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": bad .npy header"));
    }
    return rest.substr(1, end - 1);
  }
  end = rest.find_first_of(",}");
  return absl::StripTrailingAsciiWhitespace(rest.substr(0, end));
}

}  // namespace

absl::StatusOr<NpyHeader> ParseNpyHeader(absl::string_view head,
                                         absl::string_view path) {
  NpyHeader npy;
  const uint64_t size = head.size();
  const auto* preamble = reinterpret_cast<const unsigned char*>(head.data());
  if (size < 10) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a .npy file (", size, " bytes)"));
  }
  if (std::memcmp(preamble, "\x93NUMPY", 6) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a .npy file (bad magic)"));
  }
  const int major = preamble[6];
  uint64_t header_len;
  uint64_t header_start;
  if (major == 1) {
    header_len = preamble[8] | (preamble[9] << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) {
      return absl::DataLossError(absl::StrCat(path, ": .npy file ends after ",
                                              size, " bytes, in its preamble"));
    }
    header_len = preamble[8] | (preamble[9] << 8) | (preamble[10] << 16) |
                 (static_cast<uint64_t>(preamble[11]) << 24);
    header_start = 12;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": unsupported .npy version ", major));
  }
  if (header_start + header_len > size || header_len > (1 << 20)) {
    return absl::DataLossError(
        absl::StrCat(path, ": .npy header runs past the end of the file"));
  }
  const absl::string_view header = head.substr(header_start, header_len);
  ASSIGN_OR_RETURN(absl::string_view descr, DictValue(header, "descr", path));
  npy.descr = std::string(descr);
  ASSIGN_OR_RETURN(absl::string_view fortran,
                   DictValue(header, "fortran_order", path));
  if (fortran != "False") {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": Fortran-order arrays are not supported; save with "
                     "np.ascontiguousarray"));
  }
  ASSIGN_OR_RETURN(absl::string_view shape, DictValue(header, "shape", path));
  // A tuple, "(2, 3)" or "()"; anything else (an empty value, a number) has
  // no parentheses to strip.
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')') {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": .npy shape '", shape, "' is not a tuple of dimensions"));
  }
  shape.remove_prefix(1);
  shape.remove_suffix(1);
  uint64_t elements = 1;
  for (absl::string_view part :
       absl::StrSplit(shape, ',', absl::SkipWhitespace())) {
    int64_t dim;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &dim) || dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": bad dimension '", part, "' in .npy shape"));
    }
    npy.shape.push_back(dim);
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(dim),
                               &elements)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": .npy shape (", shape, ") is too large"));
    }
  }
  uint64_t itemsize = 0;
  if (npy.descr == "<f4") itemsize = 4;
  if (npy.descr == "|u1" || npy.descr == "<u1") itemsize = 1;
  if (itemsize == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": dtype '", npy.descr,
        "' is not supported; use little-endian float32 ('<f4') for "
        "activations or uint8 for labels"));
  }
  npy.data_offset = header_start + header_len;
  if (__builtin_mul_overflow(elements, itemsize, &npy.data_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": .npy shape (", shape, ") is too large"));
  }
  return npy;
}

absl::StatusOr<NpyFile> OpenNpy(const std::string& path) {
  NpyFile npy;
  npy.path = path;
  ASSIGN_OR_RETURN(npy.fd, OpenRegularFile(path));
  ASSIGN_OR_RETURN(uint64_t size, FileSize(npy.fd.get(), path));
  // One read holds every header ParseNpyHeader accepts.
  std::string head(std::min(size, kNpyMaxHeadBytes), '\0');
  RETURN_IF_ERROR(PreadFull(npy.fd.get(), head.data(), head.size(), 0, path));
  ASSIGN_OR_RETURN(NpyHeader header, ParseNpyHeader(head, path));
  npy.descr = std::move(header.descr);
  npy.shape = std::move(header.shape);
  npy.data_offset = header.data_offset;
  npy.data_bytes = header.data_bytes;
  // data_offset <= size (the header is in the file); no sum to overflow.
  if (npy.data_bytes > size - npy.data_offset) {
    return absl::DataLossError(absl::StrCat(path, ": header says ",
                                            npy.data_bytes,
                                            " bytes of data but the file "
                                            "holds ",
                                            size - npy.data_offset));
  }
  return npy;
}

}  // namespace shardcast
