#include "server/transport/grpc/local_acceptor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/server_posix.h"
#include "server/transport/address.h"
#include "server/transport/grpc/payload_router.h"

namespace shardcast {
namespace {

// Finishes every call on its connections with one status.
class RefusingService final : public grpc::CallbackGenericService {
 public:
  explicit RefusingService(grpc::Status status) : status_(std::move(status)) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* /*context*/) override {
    return NewRefusingReactor(status_);
  }

 private:
  const grpc::Status status_;
};

// A server without ports that refuses every call: connections are handed
// to it by descriptor.
std::unique_ptr<grpc::Server> StartRefuser(
    grpc::StatusCode code, const std::string& message,
    std::vector<std::unique_ptr<RefusingService>>* services) {
  services->push_back(
      std::make_unique<RefusingService>(grpc::Status(code, message)));
  grpc::ServerBuilder builder;
  builder.RegisterCallbackGenericService(services->back().get());
  return builder.BuildAndStart();
}

std::vector<std::unique_ptr<RefusingService>>& RefuserServices() {
  // They must outlive their servers, which live as long as the acceptor;
  // a handful per process (one pair per daemon start), never freed.
  static auto* services = new std::vector<std::unique_ptr<RefusingService>>();
  return *services;
}

// Descriptors kept free for gRPC and the engine when accepting.
constexpr int kDescriptorReserve = 16;

// How many more descriptors this process may open (RLIMIT_NOFILE minus the
// open ones, counted in /proc/self/fd; a connection is accepted rarely
// enough for that).
int64_t DescriptorsLeft() {
  struct rlimit limit;
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 ||
      limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur > (1u << 30)) {
    return 1 << 30;
  }
  const int64_t open = CountOpenDescriptors();
  if (open < 0) return errno == EMFILE || errno == ENFILE ? 0 : 1 << 30;
  return static_cast<int64_t>(limit.rlim_cur) - open;
}

}  // namespace

bool LocalAllowList::Admits(uid_t uid, gid_t gid) const {
  if (uids.empty() && gids.empty()) return true;
  if (uid == 0 || uid == ::geteuid()) return true;
  return std::find(uids.begin(), uids.end(), uid) != uids.end() ||
         std::find(gids.begin(), gids.end(), gid) != gids.end();
}

LocalAcceptor::LocalAcceptor(LocalAcceptorOptions options)
    : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<LocalAcceptor>> LocalAcceptor::Create(
    LocalAcceptorOptions options) {
  std::unique_ptr<LocalAcceptor> a(new LocalAcceptor(std::move(options)));
  ASSIGN_OR_RETURN(a->listener_,
                   ListenUnix(a->options_.path, SOCK_STREAM, a->options_.mode,
                              a->options_.group, SOMAXCONN));
  a->wake_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!a->wake_.valid()) return ErrnoToStatus(errno, "eventfd");
  return a;
}

void LocalAcceptor::Serve(grpc::Server* server) {
  server_ = server;
  // Built after the daemon's server, not in Create: gRPC starts its shared
  // threads with the first server, and what ThreadSanitizer can see of the
  // ordering (gRPC is not built with it) needs the services to exist first.
  busy_ = StartRefuser(grpc::StatusCode::RESOURCE_EXHAUSTED,
                       absl::StrCat("shardcastd has ", options_.max_connections,
                                    " local connections open, its limit "
                                    "(--max-connections); try again later"),
                       &RefuserServices());
  denied_ = StartRefuser(
      grpc::StatusCode::PERMISSION_DENIED,
      "this user may not use shardcastd: its uid and group are not in "
      "--allow-user / --allow-group",
      &RefuserServices());
  if (busy_ == nullptr || denied_ == nullptr) {
    LogError(
        "local acceptor: cannot start the refusing gRPC servers; "
        "refused connections are closed without an answer");
  }
  thread_ = std::thread([this] { Loop(); });
}

void LocalAcceptor::Stop() {
  if (wake_.valid()) {
    const uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  listener_.Reset();
}

LocalAcceptor::~LocalAcceptor() {
  Stop();
  // Refused connections still open are cancelled with their server.
  if (busy_ != nullptr) busy_->Shutdown(std::chrono::system_clock::now());
  if (denied_ != nullptr) denied_->Shutdown(std::chrono::system_clock::now());
}

void LocalAcceptor::Loop() {
  auto backoff = std::chrono::milliseconds(10);
  while (true) {
    struct pollfd fds[2] = {{listener_.get(), POLLIN, 0},
                            {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      LogError("local acceptor: poll: ", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;  // stop
    // Accepting the last free descriptors would make gRPC's own (epoll,
    // wakeup fds, new files) fail with EMFILE, which it may not recover
    // from: leave a reserve and wait as if accept() had failed.
    const bool reserve_left = DescriptorsLeft() > kDescriptorReserve;
    const int fd = reserve_left ? ::accept4(listener_.get(), nullptr, nullptr,
                                            SOCK_CLOEXEC | SOCK_NONBLOCK)
                                : -1;
    if (!reserve_left) errno = EMFILE;
    if (fd >= 0) {
      if (starved_.exchange(false)) {
        LogInfo("local acceptor: accepting again");
      }
      backoff = std::chrono::milliseconds(10);
      Admit(fd);
      continue;
    }
    if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
    // EMFILE, ENFILE, ENOBUFS, ENOMEM: the pending connection stays queued
    // and the listener readable; wait, then try again. Never give up.
    accept_failures_.fetch_add(1, std::memory_order_relaxed);
    if (!starved_.exchange(true)) {
      LogError("local acceptor: accept: ",
               reserve_left ? std::strerror(errno)
                            : absl::StrCat("only ", kDescriptorReserve,
                                           " descriptors left (RLIMIT_NOFILE)"),
               "; retrying with backoff (/healthz reports 503 meanwhile)");
    }
    struct pollfd stop = {wake_.get(), POLLIN, 0};
    if (::poll(&stop, 1, static_cast<int>(backoff.count())) > 0) return;
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

void LocalAcceptor::Admit(int fd) {
  Connection c;
  if (std::optional<LocalPeer> peer = PeerOfSocket(fd)) c.peer = *peer;
  struct stat st;
  if (::fstat(fd, &st) == 0) c.inode = st.st_ino;
  grpc::Server* to = server_;
  {
    MutexLock lock(&mu_);
    Prune();
    int64_t admitted = 0;
    for (const auto& [n, other] : connections_) admitted += other.admitted;
    const int64_t open = static_cast<int64_t>(connections_.size());
    if (!options_.allow.Admits(c.peer.uid, c.peer.gid)) {
      refused_denied_.fetch_add(1, std::memory_order_relaxed);
      LogWarning("local connection from pid ", c.peer.pid, " uid ", c.peer.uid,
                 " gid ", c.peer.gid, " refused: not an allowed uid/gid");
      to = denied_.get();
    } else if (admitted >= options_.max_connections) {
      refused_busy_.fetch_add(1, std::memory_order_relaxed);
      to = busy_.get();
    } else {
      c.admitted = true;
    }
    if (to == nullptr || open >= 2 * int64_t{options_.max_connections}) {
      ::close(fd);  // far past the cap: not even an answer
      return;
    }
    connections_[fd] = c;
  }
  SetSendBuffer(fd);
  grpc::AddInsecureChannelFromFd(to, fd);
}

void LocalAcceptor::SetSendBuffer(int fd) {
  const int asked = options_.send_buffer_bytes;
  if (asked > 0 &&
      ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &asked, sizeof(asked)) != 0 &&
      !send_buffer_noted_.exchange(true)) {
    LogWarning("local connections: SO_SNDBUF ", asked, " failed (",
               std::strerror(errno), "); the kernel's default stays");
  }
  int got = 0;
  socklen_t len = sizeof(got);
  if (::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &got, &len) != 0) return;
  send_buffer_.store(got, std::memory_order_relaxed);
  // Linux keeps twice the size asked (socket(7)); less means
  // net.core.wmem_max capped it.
  if (asked > 0 && got / 2 < asked && !send_buffer_noted_.exchange(true)) {
    LogInfo("local connections get a send buffer of ", got / 2 / 1024,
            " KiB, not the ", asked / 1024,
            " KiB asked (--socket-send-buffer): net.core.wmem_max caps it. "
            "Warm streams over gRPC messages are faster with `sysctl -w "
            "net.core.wmem_max=",
            asked, "`");
  }
}

void LocalAcceptor::Prune() const {
  for (auto it = connections_.begin(); it != connections_.end();) {
    struct stat st;
    const bool same = ::fstat(it->first, &st) == 0 && S_ISSOCK(st.st_mode) &&
                      st.st_ino == it->second.inode;
    it = same ? std::next(it) : connections_.erase(it);
  }
}

std::optional<LocalPeer> LocalAcceptor::PeerOf(
    const std::string& grpc_peer) const {
  int fd = -1;
  if (grpc_peer.rfind("fd:", 0) != 0 ||
      !absl::SimpleAtoi(absl::string_view(grpc_peer).substr(3), &fd)) {
    return std::nullopt;
  }
  MutexLock lock(&mu_);
  auto it = connections_.find(fd);
  if (it == connections_.end()) return std::nullopt;
  return it->second.peer;
}

std::string LocalAcceptor::Describe(const std::string& grpc_peer) const {
  std::optional<LocalPeer> p = PeerOf(grpc_peer);
  if (!p) return grpc_peer;
  return absl::StrCat("pid ", p->pid, " uid ", p->uid);
}

LocalAcceptorFigures LocalAcceptor::Figures() const {
  LocalAcceptorFigures f;
  {
    MutexLock lock(&mu_);
    Prune();
    for (const auto& [fd, c] : connections_) {
      if (!c.admitted) continue;
      ++f.connections;
      f.peers.push_back(c.peer);
    }
  }
  f.refused_busy = refused_busy_.load(std::memory_order_relaxed);
  f.refused_denied = refused_denied_.load(std::memory_order_relaxed);
  f.accept_failures = accept_failures_.load(std::memory_order_relaxed);
  f.starved = starved_.load(std::memory_order_relaxed);
  f.send_buffer_bytes = send_buffer_.load(std::memory_order_relaxed);
  return f;
}

}  // namespace shardcast
