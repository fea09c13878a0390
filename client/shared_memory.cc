#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/shared_memory_internal.h"
#include "common/base/status.h"
#include "common/local/shm_protocol.h"

namespace shardcast {
namespace internal_client {

std::string UnixSocketPath(const std::string& address) {
  if (!absl::StartsWith(address, "unix:")) return "";
  std::string path = address.substr(5);
  if (absl::StartsWith(path, "//")) path = path.substr(2);
  return path;
}

std::string SharedMemorySocket(const std::string& address) {
  const std::string path = UnixSocketPath(address);
  return path.empty() ? "" : path + shm::kSocketSuffix;
}

ClientRegion::~ClientRegion() {
  if (base_ != nullptr) ::munmap(const_cast<char*>(base_), bytes_);
}

absl::StatusOr<std::shared_ptr<const ClientRegion>> ClientRegion::Open(
    const std::string& socket_path, uint32_t slots, uint64_t slot_bytes) {
  std::shared_ptr<ClientRegion> r(new ClientRegion());
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path ", socket_path, " is too long"));
  }
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  r->connection_.Reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!r->connection_.valid()) return ErrnoToStatus(errno, "socket");
  if (::connect(r->connection_.get(), reinterpret_cast<sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("connect to ", socket_path));
  }
  shm::RegionRequest request;
  request.slots = slots;
  request.slot_bytes = slot_bytes;
  const std::string out = request.Encode();
  // EPIPE: refused at once (not allowed, busy); the reply below says why.
  if (::send(r->connection_.get(), out.data(), out.size(), MSG_NOSIGNAL) !=
          static_cast<ssize_t>(out.size()) &&
      errno != EPIPE && errno != ECONNRESET) {
    return ErrnoToStatus(errno, absl::StrCat("send to ", socket_path));
  }
  char buf[4096];
  struct iovec iov = {buf, sizeof(buf)};
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(r->connection_.get(), &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return ErrnoToStatus(errno, absl::StrCat("read ", socket_path));
  UniqueFd memfd;
  for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
       c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len >= CMSG_LEN(sizeof(int))) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
      memfd.Reset(fd);
    }
  }
  shm::RegionReply reply;
  if (!reply.Decode(absl::string_view(buf, static_cast<size_t>(n)))) {
    return absl::DataLossError(absl::StrCat(
        socket_path, " answered something that is not a region reply"));
  }
  if (reply.code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.code),
                        absl::StrCat("shared memory: ", reply.message));
  }
  struct stat st;
  if (!memfd.valid() || ::fstat(memfd.get(), &st) != 0 ||
      static_cast<uint64_t>(st.st_size) < reply.region_bytes ||
      reply.slot_bytes < slot_bytes || reply.slots != slots ||
      reply.region_bytes != uint64_t{reply.slots} * reply.slot_bytes) {
    return absl::DataLossError(absl::StrCat(
        socket_path, " handed over a region that does not match its reply"));
  }
  void* p = ::mmap(nullptr, reply.region_bytes, PROT_READ, MAP_SHARED,
                   memfd.get(), 0);
  if (p == MAP_FAILED) return ErrnoToStatus(errno, "map the region");
  r->base_ = static_cast<const char*>(p);
  r->bytes_ = reply.region_bytes;
  r->slots_ = reply.slots;
  r->slot_bytes_ = reply.slot_bytes;
  r->token_.assign(reply.token, sizeof(reply.token));
  return std::shared_ptr<const ClientRegion>(std::move(r));
}

}  // namespace internal_client
}  // namespace shardcast
