#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/local_channel_internal.h"
#include "common/base/status.h"

namespace shardcast {
namespace internal_client {

std::string UnixSocketPath(const std::string& address) {
  if (!absl::StartsWith(address, "unix:")) return "";
  std::string path = address.substr(5);
  if (absl::StartsWith(path, "//")) path = path.substr(2);
  return path;
}

std::string LocalChannelPath(const std::string& address) {
  const std::string path = UnixSocketPath(address);
  return path.empty() ? "" : path + local::kSocketSuffix;
}

absl::StatusOr<LocalConnection> LocalConnection::Connect(
    const std::string& path) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path ", path, " is too long"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  LocalConnection c;
  c.fd_.Reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!c.fd_.valid()) return ErrnoToStatus(errno, "socket");
  if (::connect(c.fd_.get(), reinterpret_cast<sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("connect to ", path));
  }
  return c;
}

absl::Status LocalConnection::Ask(v1::LocalRequest& request,
                                  v1::LocalReply* reply,
                                  std::vector<UniqueFd>* fds,
                                  int timeout_seconds) {
  if (!fd_.valid()) return absl::UnavailableError("the connection is closed");
  if (timeout_seconds != timeout_seconds_) {
    struct timeval tv = {timeout_seconds, 0};
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    timeout_seconds_ = timeout_seconds;
  }
  request.set_id(next_id_++);
  const absl::Status sent = local::SendMessage(fd_.get(), request);
  if (absl::IsInvalidArgument(sent)) return sent;  // nothing went out
  // A failed send (EPIPE) may still have a reply waiting: a refused
  // connection is closed as its reply goes, and the reply says why.
  absl::StatusOr<local::Received> got =
      local::ReceiveMessage(fd_.get(), reply, fds);
  if (!got.ok()) {
    if (absl::IsInvalidArgument(got.status())) {
      return absl::DataLossError(absl::StrCat(
          "the daemon's local channel reply: ", got.status().message()));
    }
    return absl::UnavailableError(!sent.ok() ? sent.message()
                                             : got.status().message());
  }
  if (*got == local::Received::kWouldBlock) {
    return absl::UnavailableError(absl::StrCat(
        "no reply on the local channel within ", timeout_seconds, " s"));
  }
  if (*got != local::Received::kMessage) {
    return absl::UnavailableError(!sent.ok() ? std::string(sent.message())
                                             : "the daemon closed the local "
                                               "channel");
  }
  if (reply->id() != request.id()) {
    return absl::DataLossError(
        absl::StrCat("the daemon's local channel reply answers request ",
                     reply->id(), ", not ", request.id()));
  }
  return absl::OkStatus();
}

absl::Status LocalConnection::AskOk(v1::LocalRequest& request,
                                    v1::LocalReply* reply,
                                    std::vector<UniqueFd>* fds,
                                    const char* what, int timeout_seconds) {
  RETURN_IF_ERROR(Ask(request, reply, fds, timeout_seconds));
  if (reply->code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply->code()),
                        absl::StrCat(what, reply->message()));
  }
  return absl::OkStatus();
}

}  // namespace internal_client
}  // namespace shardcast
