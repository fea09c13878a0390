// Fuzz target: the .npy header reader (common/convert/npy.h) behind `shardcast
// write
// --from X.npy [--labels-from Y.npy]`. The input is a whole .npy file. It is
// parsed twice: in memory with ParseNpyHeader, and as a file with OpenNpy (the
// bytes in a memfd, opened as /proc/self/fd/N), and the two must agree.
//
// Checks: no crash, leak, sanitizer report or hang; every refusal is a
// Status; both paths give the same answer; an accepted header describes a
// supported dtype whose shape's product times the item size is data_bytes,
// and OpenNpy accepts only files that hold all of that data.
//
// Run (tests/fuzz/run.sh builds and runs every target):
//   build-asan/npy_fuzz -max_total_time=60 -timeout=10 \
//       CORPUS_COPY tests/fuzz/corpus/npy
// Seeds: tests/fuzz/corpus/npy/ (make_corpus.sh): small arrays saved by
// numpy (format 1.0, 2.0 and 3.0, float32, uint8 and a few it refuses).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/convert/npy.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using namespace shardcast;  // NOLINT: test code
using fuzz::Fail;

// The input as a file: a memfd (a regular file to OpenRegularFile).
class MemFile {
 public:
  explicit MemFile(absl::string_view bytes) {
    fd_ = memfd_create("npy_fuzz", MFD_CLOEXEC);
    if (fd_ < 0) Fail("memfd_create");
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = write(fd_, bytes.data() + done, bytes.size() - done);
      if (n <= 0) Fail("write to the memfd");
      done += static_cast<size_t>(n);
    }
    path_ = absl::StrCat("/proc/self/fd/", fd_);
  }
  ~MemFile() { close(fd_); }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view input(reinterpret_cast<const char*>(data), size);
  const MemFile file(input);
  const absl::StatusOr<NpyHeader> header = ParseNpyHeader(
      input.substr(0, static_cast<size_t>(kNpyMaxHeadBytes)), file.path());
  const absl::StatusOr<NpyFile> opened = OpenNpy(file.path());
  if (!header.ok()) {
    if (opened.status() != header.status()) {
      Fail(absl::StrCat("ParseNpyHeader: ", header.status().ToString(),
                        "; OpenNpy: ", opened.status().ToString()));
    }
    return 0;
  }
  unsigned __int128 elements = 1;
  for (int64_t dim : header->shape) {
    if (dim < 0) Fail(absl::StrCat("negative dimension ", dim));
    elements *= static_cast<uint64_t>(dim);
    if (elements > ~uint64_t{0}) Fail("shape overflows and was accepted");
  }
  const uint64_t itemsize = header->descr == "<f4" ? 4
                            : header->descr == "|u1" || header->descr == "<u1"
                                ? 1
                                : 0;
  if (itemsize == 0) Fail("accepted dtype '" + header->descr + "'");
  if (elements * itemsize != header->data_bytes || header->data_offset > size) {
    Fail(absl::StrCat("data_bytes ", header->data_bytes, " data_offset ",
                      header->data_offset, " for a file of ", size));
  }
  const bool fits = static_cast<unsigned __int128>(header->data_offset) +
                        header->data_bytes <=
                    size;
  if (!opened.ok()) {
    if (fits || opened.status().code() != absl::StatusCode::kDataLoss) {
      Fail(absl::StrCat("ParseNpyHeader accepts, OpenNpy says ",
                        opened.status().ToString()));
    }
    return 0;
  }
  if (!fits) {
    Fail(absl::StrCat("OpenNpy accepts ", opened->data_bytes,
                      " bytes of data at ", opened->data_offset,
                      " in a file of ", size));
  }
  if (opened->descr != header->descr || opened->shape != header->shape ||
      opened->data_offset != header->data_offset ||
      opened->data_bytes != header->data_bytes) {
    Fail("OpenNpy and ParseNpyHeader disagree");
  }
  return 0;
}
