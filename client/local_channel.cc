#include "client/local_channel_internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/file.h"
#include "common/base/status.h"
#include "common/local/unix_socket.h"

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
                                  int timeout_seconds,
                                  absl::Span<const int> send_fds) {
  if (!fd_.valid()) return absl::UnavailableError("the connection is closed");
  if (timeout_seconds != timeout_seconds_) {
    struct timeval tv = {timeout_seconds, 0};
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    timeout_seconds_ = timeout_seconds;
  }
  request.set_id(next_id_++);
  const absl::Status sent = local::SendMessage(fd_.get(), request, send_fds);
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
                                    const char* what, int timeout_seconds,
                                    absl::Span<const int> send_fds) {
  RETURN_IF_ERROR(Ask(request, reply, fds, timeout_seconds, send_fds));
  if (reply->code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply->code()),
                        absl::StrCat(what, reply->message()));
  }
  return absl::OkStatus();
}

namespace {

// The files of a dataset directory the daemon reads (the shard protocol,
// common/format/dataset.h): what AttachDataset opens and hands over.
bool IsDatasetFile(absl::string_view name) {
  return name == "metadata.json" || name == "shards.json" ||
         name == "labels.bin" || name == "SHA256SUMS" ||
         name == "samples.json" || name == "shardcast_stats.json" ||
         (absl::StartsWith(name, "acts") && absl::EndsWith(name, ".bin"));
}

}  // namespace

absl::StatusOr<std::string> AttachDataset(const std::string& channel_path,
                                          const std::string& dir,
                                          int timeout_seconds) {
  UniqueFd dir_fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir_fd.valid()) {
    return ErrnoToStatus(errno, errno == ENOTDIR
                                    ? absl::StrCat(dir, " is not a directory")
                                    : dir);
  }
  std::vector<std::string> names;
  {
    DIR* d = ::fdopendir(::fcntl(dir_fd.get(), F_DUPFD_CLOEXEC, 0));
    if (d == nullptr) return ErrnoToStatus(errno, absl::StrCat("list ", dir));
    while (struct dirent* e = ::readdir(d)) {
      if (IsDatasetFile(e->d_name)) names.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  std::string dir_name;
  if (char* resolved = ::realpath(dir.c_str(), nullptr)) {
    dir_name = BaseName(resolved);
    std::free(resolved);
  } else {
    dir_name = BaseName(dir);
  }
  ASSIGN_OR_RETURN(LocalConnection conn, LocalConnection::Connect(channel_path));
  // A part at a time: never more than one message's descriptors open here.
  const size_t per_part = kMaxDescriptors;
  size_t at = 0;
  v1::LocalReply reply;
  do {
    v1::LocalRequest request;
    v1::LocalRequest::Attach* part = request.mutable_attach();
    if (at == 0) {
      part->set_path(dir);
      part->set_dir_name(dir_name);
    }
    const size_t end = std::min(names.size(), at + per_part);
    std::vector<UniqueFd> opened;
    std::vector<int> raw;
    for (; at < end; ++at) {
      UniqueFd fd(::openat(dir_fd.get(), names[at].c_str(),
                           O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
      part->add_names(names[at]);
      part->add_errors(fd.valid() ? 0 : errno);
      if (fd.valid()) {
        raw.push_back(fd.get());
        opened.push_back(std::move(fd));
      }
    }
    part->set_more(at < names.size());
    std::vector<UniqueFd> none;
    RETURN_IF_ERROR(conn.AskOk(request, &reply, &none, "", timeout_seconds,
                               raw));
  } while (at < names.size());
  return reply.attach().dataset();
}

}  // namespace internal_client
}  // namespace shardcast
