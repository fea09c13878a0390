#include "server/io/page_residency.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace shardcast {
namespace {

constexpr int kCapFowner = 3;  // linux/capability.h CAP_FOWNER

// Whether capability `cap` is in this process's effective set, from
// /proc/self/status (no libcap): "CapEff:\t<hex mask>".
bool HasEffectiveCapability(int cap) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    const uint64_t mask = std::stoull(line.substr(7), nullptr, 16);
    return (mask >> cap) & 1;
  }
  return false;
}

uint64_t PageBytes() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

bool ResidencyIsReported(int fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return false;
  if (st.st_uid == ::geteuid()) return true;
  // The kernel's test is "could open it for writing": the file's mode and
  // a read-only mount both count, so ask about the inode behind `fd`.
  const std::string self = absl::StrCat("/proc/self/fd/", fd);
  if (::faccessat(AT_FDCWD, self.c_str(), W_OK, AT_EACCESS) == 0) return true;
  return HasEffectiveCapability(kCapFowner);
}

absl::StatusOr<std::unique_ptr<PageResidency>> PageResidency::Open(
    int fd, uint64_t size, const std::string& path) {
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot probe the page cache of empty file ", path));
  }
  if (!ResidencyIsReported(fd)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the kernel reports page-cache residency of ", path,
        " only to its owner, a process that may write it, or one with "
        "CAP_FOWNER"));
  }
  const uint64_t page = PageBytes();
  const uint64_t mapped = (size + page - 1) / page * page;
  void* base = ::mmap(nullptr, mapped, PROT_READ, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    return ErrnoToStatus(errno, absl::StrCat("mmap of ", path));
  }
  return std::unique_ptr<PageResidency>(
      new PageResidency(static_cast<char*>(base), mapped));
}

PageResidency::~PageResidency() { ::munmap(base_, mapped_); }

bool PageResidency::Cached(uint64_t offset, uint64_t length) const {
  if (length == 0) return true;
  if (offset >= mapped_ || length > mapped_ - offset) return false;
  const uint64_t page = PageBytes();
  const uint64_t first = offset / page * page;
  const uint64_t pages = (offset + length - first + page - 1) / page;
  // One byte per page; most queries ask about one or two pages.
  unsigned char small[16];
  std::vector<unsigned char> large;
  unsigned char* vec = small;
  if (pages > sizeof(small)) {
    large.resize(pages);
    vec = large.data();
  }
  if (::mincore(base_ + first, pages * page, vec) != 0) return false;
  for (uint64_t i = 0; i < pages; ++i) {
    if ((vec[i] & 1) == 0) return false;
  }
  return true;
}

}  // namespace shardcast
