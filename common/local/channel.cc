#include "common/local/channel.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/local/unix_socket.h"

namespace shardcast {
namespace local {

template <typename M>
absl::Status SendMessage(int sock, M& message, absl::Span<const int> fds,
                         int flags) {
  message.set_descriptors(static_cast<uint32_t>(fds.size()));
  const size_t size = message.ByteSizeLong();
  if (size > kMaxMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a local channel message of ", size, " bytes; at most ",
                     kMaxMessageBytes));
  }
  char buf[kMaxMessageBytes];
  message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(buf));
  return SendWithDescriptors(sock, absl::string_view(buf, size), fds, flags);
}

template <typename M>
absl::StatusOr<Received> ReceiveMessage(int sock, M* message,
                                        std::vector<UniqueFd>* fds, int flags) {
  // Not a std::string: zeroing it first was a fifth of a client's time per
  // call. One byte more than allowed, to see a longer packet.
  char buf[kMaxMessageBytes + 1];
  fds->clear();
  struct iovec iov = {buf, sizeof(buf)};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(
      struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxDescriptors)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got;
  do {
    got = ::recvmsg(sock, &msg, MSG_TRUNC | MSG_CMSG_CLOEXEC | flags);
  } while (got < 0 && errno == EINTR);
  if (got < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Received::kWouldBlock;
    return ErrnoToStatus(errno, "receive on the local channel");
  }
  TakeDescriptors(msg, fds);
  const size_t n = static_cast<size_t>(got);
  if (n == 0 && fds->empty()) return Received::kClosed;
  absl::Status bad;
  if (n > kMaxMessageBytes) {
    bad = absl::InvalidArgumentError(
        absl::StrCat("a local channel message of ", n, " bytes; at most ",
                     kMaxMessageBytes, " (proto/shardcast/v1/local.proto)"));
  } else if ((msg.msg_flags & MSG_CTRUNC) != 0) {
    bad = absl::InvalidArgumentError(
        absl::StrCat("a local channel message with more than ", kMaxDescriptors,
                     " descriptors"));
  } else if (!message->ParseFromArray(buf, static_cast<int>(n))) {
    bad = absl::InvalidArgumentError(
        "not a local channel message (proto/shardcast/v1/local.proto)");
  } else if (message->descriptors() != fds->size()) {
    bad = absl::InvalidArgumentError(absl::StrCat(
        "a local channel message says it carries ", message->descriptors(),
        " descriptors and carries ", fds->size()));
  }
  if (!bad.ok()) {
    fds->clear();
    return bad;
  }
  return Received::kMessage;
}

template absl::Status SendMessage(int, v1::LocalRequest&, absl::Span<const int>,
                                  int);
template absl::Status SendMessage(int, v1::LocalReply&, absl::Span<const int>,
                                  int);
template absl::StatusOr<Received> ReceiveMessage(int, v1::LocalRequest*,
                                                 std::vector<UniqueFd>*, int);
template absl::StatusOr<Received> ReceiveMessage(int, v1::LocalReply*,
                                                 std::vector<UniqueFd>*, int);

}  // namespace local
}  // namespace shardcast
