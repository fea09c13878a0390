#include "server/transport/address.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace shardcast {

std::string HostOf(absl::string_view host_port) {
  if (absl::StartsWith(host_port, "[")) {
    const size_t end = host_port.find(']');
    return std::string(
        host_port.substr(1, end == absl::string_view::npos ? end : end - 1));
  }
  const size_t colon = host_port.rfind(':');
  return std::string(host_port.substr(0, colon));
}

bool IsLoopbackAddress(absl::string_view host_port) {
  const std::string host = HostOf(host_port);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, int type,
                                    mode_t mode, const std::string& group,
                                    int backlog) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unix socket path ", path, " is longer than ",
                     sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  UniqueFd fd(::socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket for " + path);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoToStatus(errno, "remove stale socket " + path);
  }
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoToStatus(errno, "bind " + path);
  }
  if (::chmod(path.c_str(), mode) != 0) {
    return ErrnoToStatus(errno, "chmod " + path);
  }
  if (!group.empty()) {
    // A name, or a numeric id (containers often have no group database
    // entry for the group the socket must have).
    uint32_t gid = 0;
    if (!absl::SimpleAtoi(group, &gid)) {
      struct group* g = ::getgrnam(group.c_str());
      if (g == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("socket group ", group, " does not exist"));
      }
      gid = g->gr_gid;
    }
    if (::chown(path.c_str(), static_cast<uid_t>(-1),
                static_cast<gid_t>(gid)) != 0) {
      return ErrnoToStatus(errno, "chgrp " + path);
    }
  }
  if (::listen(fd.get(), backlog) != 0) {
    return ErrnoToStatus(errno, "listen " + path);
  }
  return fd;
}

}  // namespace shardcast
