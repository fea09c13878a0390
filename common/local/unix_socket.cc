#include "common/local/unix_socket.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace shardcast {

absl::Status SendWithDescriptor(int sock, absl::string_view bytes, int fd,
                                int flags) {
  if (fd < 0) return SendWithDescriptors(sock, bytes, {}, flags);
  return SendWithDescriptors(sock, bytes, {fd}, flags);
}

absl::Status SendWithDescriptors(int sock, absl::string_view bytes,
                                 absl::Span<const int> fds, int flags) {
  if (fds.size() > kMaxDescriptors) {
    return absl::InvalidArgumentError(absl::StrCat(
        fds.size(), " descriptors in one message; at most ", kMaxDescriptors));
  }
  struct iovec iov = {const_cast<char*>(bytes.data()), bytes.size()};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char
      control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
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

void TakeDescriptors(const struct msghdr& msg, std::vector<UniqueFd>* fds) {
  for (struct cmsghdr* h = CMSG_FIRSTHDR(&msg); h != nullptr;
       h = CMSG_NXTHDR(const_cast<struct msghdr*>(&msg), h)) {
    if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
      fds->emplace_back(fd);
    }
  }
}

absl::StatusOr<size_t> ReceiveWithDescriptors(int sock, absl::Span<char> buf,
                                              std::vector<UniqueFd>* fds) {
  struct iovec iov = {buf.data(), buf.size()};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(
      struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(sock, &msg, MSG_TRUNC | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoToStatus(errno, "receive on a Unix socket");
  TakeDescriptors(msg, fds);
  return static_cast<size_t>(n);
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
