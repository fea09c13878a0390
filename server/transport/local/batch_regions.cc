#include "server/transport/local/shm_service.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/local/shm_protocol.h"
#include "common/local/unix_socket.h"
#include "server/transport/address.h"

namespace shardcast {
namespace {

// Connections past max_connections waiting to be told so (at their request).
constexpr int kRefusedSlack = 64;

// Counters shared by the service and its regions (which may outlive it).
struct ShmCounters {
  std::atomic<int64_t> regions{0};
  std::atomic<uint64_t> bytes{0};
  std::atomic<int64_t> attached{0};
};

ShmCounters& Counters() {
  static ShmCounters* const counters = new ShmCounters;
  return *counters;
}

std::string HumanSize(uint64_t bytes) {
  return bytes >= (1 << 20) ? absl::StrCat(bytes >> 20, " MiB")
                            : absl::StrCat(bytes, " bytes");
}

// Sends `reply`, with `fd` as SCM_RIGHTS when >= 0.
absl::Status SendReply(int sock, const shm::RegionReply& reply, int fd) {
  return SendWithDescriptor(sock, reply.Encode(), fd);
}

}  // namespace

struct ShmService::Connection {
  UniqueFd fd;
  pid_t pid = 0;
  uid_t uid = 0;
  bool answered = false;
  absl::Status refusal;  // not OK: the answer to its request, whatever it is
  std::string token;     // of its region, once made
};

ShmRegion::~ShmRegion() {
  if (base_ == nullptr) return;  // refused before it was mapped and counted
  ::munmap(base_, bytes());
  Counters().regions--;
  Counters().bytes -= bytes();
}

absl::StatusOr<std::unique_ptr<ShmService>> ShmService::Start(
    ShmServiceOptions options, Engine* engine) {
  std::unique_ptr<ShmService> s(new ShmService(std::move(options), engine));
  const std::string& path = s->options_.path;
  ASSIGN_OR_RETURN(s->listen_fd_,
                   ListenUnix(path, SOCK_SEQPACKET, s->options_.mode,
                              s->options_.group, 64));
  const int efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd < 0) return ErrnoToStatus(errno, "eventfd");
  s->stop_fd_.Reset(efd);
  ShmService* raw = s.get();
  s->populate_thread_ = std::thread([raw] { raw->PopulateLoop(); });
  s->thread_ = std::thread([raw] { raw->Loop(); });
  LogInfo("shared memory for local clients on ", path);
  return s;
}

ShmService::~ShmService() {
  const uint64_t one = 1;
  ssize_t n = ::write(stop_fd_.get(), &one, sizeof(one));
  (void)n;
  if (thread_.joinable()) thread_.join();
  {
    MutexLock lock(&populate_mu_);
    populate_stop_ = true;
    to_populate_.clear();
  }
  populate_ready_.SignalAll();
  if (populate_thread_.joinable()) populate_thread_.join();
  ::unlink(options_.path.c_str());
}

void ShmService::PopulateLoop() {
  while (true) {
    std::shared_ptr<ShmRegion> region;  // mapped while it is populated
    {
      MutexLock lock(&populate_mu_);
      populate_ready_.Wait(
          &populate_mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(populate_mu_) {
            return populate_stop_ || !to_populate_.empty();
          });
      if (populate_stop_) return;
      region = std::move(to_populate_.front());
      to_populate_.pop_front();
    }
    if (options_.populate) {
      options_.populate(region->base_, region->bytes());
    } else if (::madvise(region->base_, region->bytes(), MADV_POPULATE_WRITE) !=
               0) {
      // Kernels before 5.14: the stream's first writes fault the pages in.
      LogDebug("shared memory: populate the region: ", std::strerror(errno));
    }
  }
}

absl::StatusOr<std::shared_ptr<ShmRegion>> ShmService::Attach(
    absl::string_view token) {
  std::shared_ptr<ShmRegion> region;
  {
    MutexLock lock(&mu_);
    auto it = regions_.find(std::string(token));
    if (it == regions_.end()) {
      return absl::NotFoundError(
          "no shared-memory region has this token (its connection to the "
          "shared-memory socket closed, or it was never handed out)");
    }
    region = it->second;
  }
  if (region->attached_.exchange(true)) {
    return absl::FailedPreconditionError(
        "the shared-memory region is in use by another stream");
  }
  Counters().attached++;
  // The handle's last copy detaches the region (and keeps it mapped).
  struct Attachment {
    std::shared_ptr<ShmRegion> region;
    ~Attachment() {
      region->attached_ = false;
      Counters().attached--;
    }
  };
  auto attachment = std::make_shared<Attachment>();
  attachment->region = region;
  return std::shared_ptr<ShmRegion>(attachment, region.get());
}

ShmFigures ShmService::Figures() const {
  ShmFigures f;
  f.regions = Counters().regions.load();
  f.bytes = Counters().bytes.load();
  f.attached = Counters().attached.load();
  return f;
}

absl::StatusOr<std::shared_ptr<ShmRegion>> ShmService::MakeRegion(
    uint32_t slots, uint64_t slot_bytes, int* memfd) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  if (slots < 1 || slots > options_.max_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a region has 1 to ", options_.max_slots, " slots, not ", slots));
  }
  if (slot_bytes < 1 || slot_bytes > options_.max_region_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a slot of ", slot_bytes, " bytes is not in [1, ",
                     options_.max_region_bytes, "]"));
  }
  slot_bytes = (slot_bytes + page - 1) / page * page;
  if (slot_bytes > options_.max_region_bytes / slots) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a region of ", slots, " slots of ", HumanSize(slot_bytes),
                     " exceeds the ", HumanSize(options_.max_region_bytes),
                     " a region may have; use fewer slots or smaller batches"));
  }
  const uint64_t bytes = slot_bytes * slots;
  std::shared_ptr<ShmRegion> region(new ShmRegion());
  ASSIGN_OR_RETURN(
      region->lease_,
      engine_->LeaseMemory(
          bytes, absl::StrCat("shared-memory region of ", slots, " slots of ",
                              HumanSize(slot_bytes))));
  // Sealed: the client can neither shrink the region under the daemon's
  // writes (SIGBUS) nor change the seals.
  ASSIGN_OR_RETURN(UniqueFd fd, SealedMemfd("shardcast-region", bytes,
                                            "shared-memory region"));
  // Not populated here: the populate thread does it once the reply is out
  // (the header says why).
  void* p =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoToStatus(errno, "map the region");
  region->base_ = static_cast<char*>(p);
  region->slots_ = slots;
  region->slot_bytes_ = slot_bytes;
  Counters().regions++;
  Counters().bytes += bytes;
  *memfd = fd.Release();
  return region;
}

void ShmService::Serve(Connection& c) {
  c.answered = true;
  char buf[256];
  ssize_t n;
  do {
    n = ::recv(c.fd.get(), buf, sizeof(buf), 0);
  } while (n < 0 && errno == EINTR);
  shm::RegionRequest request;
  shm::RegionReply reply;
  absl::StatusOr<std::shared_ptr<ShmRegion>> region;
  int memfd = -1;
  if (n < 0 ||
      !request.Decode(absl::string_view(buf, static_cast<size_t>(n)))) {
    region = absl::InvalidArgumentError(
        "not a shardcast region request (see common/local/shm_protocol.h)");
  } else if (!c.refusal.ok()) {
    region = c.refusal;
  } else {
    region = MakeRegion(request.slots, request.slot_bytes, &memfd);
  }
  if (region.ok()) {
    (*region)->pid_ = c.pid;
    (*region)->uid_ = c.uid;
    if (::getrandom(reply.token, sizeof(reply.token), 0) !=
        static_cast<ssize_t>(sizeof(reply.token))) {
      region = ErrnoToStatus(errno, "getrandom for the region's token");
    }
  }
  if (!region.ok()) {
    reply.code = static_cast<uint32_t>(region.status().code());
    reply.message = std::string(region.status().message());
    LogInfo("shared memory: refused a region to pid ", c.pid, ": ",
            region.status().ToString());
    SendReply(c.fd.get(), reply, -1).IgnoreError();
    return;
  }
  reply.slots = (*region)->slots();
  reply.slot_bytes = (*region)->slot_bytes();
  reply.region_bytes = (*region)->bytes();
  // Attachable before the client can know the token.
  c.token.assign(reply.token, sizeof(reply.token));
  {
    MutexLock lock(&mu_);
    regions_[c.token] = *region;
  }
  absl::Status sent = SendReply(c.fd.get(), reply, memfd);
  ::close(memfd);  // the mapping keeps the memory; the client has its fd
  if (!sent.ok()) {
    LogInfo("shared memory: ", sent.ToString());
    return;  // the connection's close unregisters it
  }
  LogDebug("shared memory: region of ", reply.slots, " x ",
           HumanSize(reply.slot_bytes), " for pid ", c.pid, " (uid ", c.uid,
           ")");
  // The first touch of fresh memory is slow (docs/benchmarks.md), and
  // batches should not pay it.
  {
    MutexLock lock(&populate_mu_);
    to_populate_.push_back(*region);
  }
  populate_ready_.Signal();
}

// Connections counted against max_connections: those not being refused.
int ShmService::Admitted(
    const std::vector<std::unique_ptr<Connection>>& conns) {
  int n = 0;
  for (const auto& c : conns) n += c->refusal.ok() ? 1 : 0;
  return n;
}

void ShmService::Loop() {
  std::vector<std::unique_ptr<Connection>> conns;
  std::vector<struct pollfd> fds;
  while (true) {
    fds.clear();
    fds.push_back({stop_fd_.get(), POLLIN, 0});
    fds.push_back({listen_fd_.get(), POLLIN, 0});
    for (const auto& c : conns) fds.push_back({c->fd.get(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      LogError("shared memory: poll: ", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) break;
    // Connections first (the vector changes below).
    std::vector<std::unique_ptr<Connection>> kept;
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = *conns[i];
      const short ev = fds[i + 2].revents;
      bool close = (ev & (POLLHUP | POLLERR | POLLNVAL)) != 0;
      if (!close && (ev & POLLIN) != 0) {
        if (!c.answered) {
          Serve(c);
        } else {
          close = true;  // one request per connection; EOF or more: done
        }
      }
      if (close) {
        if (!c.token.empty()) {
          MutexLock lock(&mu_);
          regions_.erase(c.token);  // streams using it keep it mapped
        }
        continue;
      }
      kept.push_back(std::move(conns[i]));
    }
    conns.swap(kept);
    if ((fds[1].revents & POLLIN) != 0) {
      const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr,
                               SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        auto c = std::make_unique<Connection>();
        c->fd.Reset(fd);
        struct ucred cred = {};
        socklen_t len = sizeof(cred);
        const bool known =
            ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
        if (known) {
          c->pid = cred.pid;
          c->uid = cred.uid;
        }
        if (options_.admits &&
            !(known && options_.admits(cred.uid, cred.gid))) {
          // Answered when its request comes: closing now would reset the
          // connection and lose the reason.
          c->refusal = absl::PermissionDeniedError(
              "this user may not use shardcastd: not in --allow-user / "
              "--allow-group");
          conns.push_back(std::move(c));
        } else if (Admitted(conns) >= options_.max_connections) {
          // Also answered at its request (a reply sent now, the request
          // unread, then a close would reach the client as ECONNRESET).
          // Far past the limit (clients that never ask), closed unanswered.
          if (static_cast<int>(conns.size()) <
              options_.max_connections + kRefusedSlack) {
            c->refusal = absl::UnavailableError(
                absl::StrCat("the daemon has ", options_.max_connections,
                             " shared-memory connections open, its limit; "
                             "try again later"));
            conns.push_back(std::move(c));
          }
        } else {
          conns.push_back(std::move(c));
        }
      } else if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: the listener stays readable, so back off
        // instead of spinning; connections closing will free some.
        LogWarning("shared memory: accept: ", std::strerror(errno));
        ::poll(nullptr, 0, 100);
      }
    }
  }
  MutexLock lock(&mu_);
  regions_.clear();
}

}  // namespace shardcast
