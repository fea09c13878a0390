#include "common/local/memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace shardcast {

absl::StatusOr<UniqueFd> SealedMemfd(const char* name, uint64_t bytes,
                                     absl::string_view what) {
  UniqueFd fd(::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoToStatus(errno, "memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("size the ", what));
  }
  if (::fcntl(fd.get(), F_ADD_SEALS,
              F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("seal the ", what));
  }
  return fd;
}

absl::StatusOr<SharedMapping> SharedMapping::Map(int fd, uint64_t bytes,
                                                 bool writable,
                                                 absl::string_view what) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("stat the ", what));
  }
  if (bytes == 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", what, " has ", st.st_size, " bytes, not ", bytes));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | (writable ? PROT_WRITE : 0),
                   MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return ErrnoToStatus(errno, absl::StrCat("map the ", what));
  }
  SharedMapping m;
  m.base_ = static_cast<char*>(p);
  m.bytes_ = bytes;
  return m;
}

SharedMapping& SharedMapping::operator=(SharedMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void SharedMapping::Reset() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  base_ = nullptr;
  bytes_ = 0;
}

}  // namespace shardcast
