#include "common/unix_socket.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace shardcast {

absl::Status SendWithDescriptor(int sock, absl::string_view bytes, int fd,
                                int flags) {
  struct iovec iov = {const_cast<char*>(bytes.data()), bytes.size()};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | flags);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoToStatus(errno, "send on a Unix socket");
  if (static_cast<size_t>(n) != bytes.size()) {
    return absl::UnavailableError("a Unix socket took part of a message");
  }
  return absl::OkStatus();
}

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

}  // namespace shardcast
