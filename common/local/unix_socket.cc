#include "common/local/unix_socket.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace shardcast {

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

}  // namespace shardcast
