#include "server/transport/local/local_query_service.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/base/log.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/local/query_protocol.h"
#include "common/local/unix_socket.h"
#include "server/io/uring.h"
#include "server/transport/address.h"

namespace shardcast {
namespace {

namespace lq = local_query;

// Completion tags. A connection's are (id << 32) | sub, ids from 1: sub 0
// is its poll, sub i + 1 the read of its request's vector i.
constexpr uint64_t kStopTag = 0;
constexpr uint64_t kListenTag = 1;
constexpr uint64_t kWakeTag = 2;  // connections handed over by the first loop

// Connections past max_connections waiting to be told so (at their hello).
constexpr int kRefusedSlack = 64;
constexpr uint64_t Tag(uint32_t id, uint64_t sub) {
  return (static_cast<uint64_t>(id) << 32) | sub;
}

// One client connection and the request it is being served.
struct Conn {
  uint32_t id = 0;
  UniqueFd fd;
  std::atomic<int>* open = nullptr;  // the service's count, once counted
  pid_t pid = 0;
  uid_t uid = 0;
  absl::Status refusal;  // not OK: the answer to its hello
  char* base = nullptr;  // the client's region, once it said hello
  uint64_t bytes = 0;
  // The request in service (busy) and its reads.
  bool busy = false;
  lq::Reply reply;
  absl::Status error;  // the first read failure
  // Its reads; the plan holds the files they name open until they are done.
  QueryEngine::VectorReads plan;
  std::vector<size_t> done;  // bytes in place, per op
  size_t remaining = 0;      // ops not done
  size_t in_flight = 0;      // ops submitted, not completed

  Conn() = default;
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;
  ~Conn() {
    if (base != nullptr) ::munmap(base, bytes);
    if (open != nullptr) open->fetch_sub(1, std::memory_order_relaxed);
  }
};

// Sends one message without blocking; false when the socket cannot take it.
bool SendMessage(int fd, const std::string& bytes) {
  return SendWithDescriptor(fd, bytes, -1, MSG_DONTWAIT).ok();
}

// `a + b <= limit` without overflow.
bool FitsIn(uint64_t a, uint64_t b, uint64_t limit) {
  return a <= limit && b <= limit - a;
}

}  // namespace

class LocalQueryService::Loop {
 public:
  // `listen_fd` is valid for the first loop only: it accepts, and hands
  // each connection to `loops` (this one among them) in turn. `open`
  // counts the connections of all loops.
  Loop(const LocalQueryOptions& options, const QueryEngine* queries,
       Metrics* metrics, UringRing ring, UniqueFd listen_fd, int stop_fd,
       UniqueFd wake_fd, std::atomic<int>* open,
       const std::vector<std::unique_ptr<Loop>>* loops)
      : options_(options),
        queries_(queries),
        metrics_(metrics),
        ring_(std::move(ring)),
        listen_fd_(std::move(listen_fd)),
        stop_fd_(stop_fd),
        wake_fd_(std::move(wake_fd)),
        open_(open),
        loops_(loops) {}

  void Run();

  // Takes a connection the first loop accepted (from that loop's thread).
  void Adopt(std::unique_ptr<Conn> c) ABSL_LOCKS_EXCLUDED(inbox_mu_) {
    {
      MutexLock lock(&inbox_mu_);
      inbox_.push_back(std::move(c));
    }
    const uint64_t one = 1;
    ssize_t n = ::write(wake_fd_.get(), &one, sizeof(one));
    (void)n;  // a full counter is already readable
  }

 private:
  // Queues a submission, flushing the queue to the kernel when it is full.
  template <typename F>
  void Queue(F prepare) {
    while (!prepare()) ring_.SubmitAndWait(0);
  }
  // One completion (tagged `tag`) when `fd` is readable.
  void Poll(int fd, uint64_t tag) {
    Queue([&] { return ring_.PreparePoll(fd, POLLIN, tag); });
  }
  void ArmPoll(Conn& c) { Poll(c.fd.get(), Tag(c.id, 0)); }
  void Accept();
  // Serves c from now on: its id, its poll.
  void Insert(std::unique_ptr<Conn> c);
  void TakeInbox() ABSL_LOCKS_EXCLUDED(inbox_mu_);
  void OnPoll(Conn& c, int res);
  void OnHello(Conn& c, absl::string_view message, int region_fd);
  void OnRequest(Conn& c, absl::string_view message);
  // Direct reads (Op::kLayout, kOpenFiles): answered at once, no disk.
  void OnDirect(Conn& c, const lq::Request& request);
  absl::Status WriteLayout(Conn& c, const lq::Request& request,
                           lq::Reply* reply);
  absl::Status OpenFiles(Conn& c, const lq::Request& request, lq::Reply* reply,
                         std::vector<UniqueFd>* fds);
  absl::Status Plan(Conn& c, const lq::Request& request);
  void SubmitRead(Conn& c, size_t i);
  void OnRead(Conn& c, size_t i, int res);
  // Sends the reply of c's request and waits for its next one.
  void Finish(Conn& c);
  void Close(Conn& c);
  void StartWaitingReads();

  const LocalQueryOptions& options_;
  const QueryEngine* const queries_;
  Metrics* const metrics_;
  UringRing ring_;
  UniqueFd listen_fd_;
  const int stop_fd_;
  const UniqueFd wake_fd_;  // eventfd: the inbox has connections
  std::atomic<int>* const open_;
  const std::vector<std::unique_ptr<Loop>>* const loops_;
  size_t next_loop_ = 0;  // the loop the next accepted connection goes to
  Mutex inbox_mu_;
  std::vector<std::unique_ptr<Conn>> inbox_ ABSL_GUARDED_BY(inbox_mu_);
  const int64_t spin_ns_ = int64_t{options_.spin_us} * 1000;
  bool stopping_ = false;
  int busy_ = 0;  // connections with a request in service
  uint32_t next_id_ = 1;
  std::map<uint32_t, std::unique_ptr<Conn>> conns_;
  unsigned reads_in_flight_ = 0;
  // Reads that found queue_depth reads in flight: (connection id, op).
  std::deque<std::pair<uint32_t, size_t>> waiting_;
};

void LocalQueryService::Loop::Run() {
  Poll(stop_fd_, kStopTag);
  Poll(wake_fd_.get(), kWakeTag);
  if (listen_fd_.valid()) Poll(listen_fd_.get(), kListenTag);
  std::vector<std::pair<uint64_t, int>> events;
  // Once stopping, only the reads in flight are waited for: they write into
  // regions that are unmapped when their connections go.
  while (!stopping_ || reads_in_flight_ > 0) {
    // With several calls in service, a short spin before sleeping: see
    // LocalQueryOptions::spin_us.
    if (spin_ns_ > 0 && busy_ >= 2 && reads_in_flight_ > 0) {
      const int64_t until = absl::GetCurrentTimeNanos() + spin_ns_;
      while (ring_.SubmitAndPeek() == 0 &&
             absl::GetCurrentTimeNanos() < until) {
      }
    }
    const int rc = ring_.SubmitAndWait(1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      LogError("local queries: io_uring: ", std::strerror(-rc));
      if (reads_in_flight_ == 0) break;
      continue;
    }
    events.clear();
    ring_.ForEachCompletion(
        [&](uint64_t tag, int res) { events.emplace_back(tag, res); });
    for (const auto& [tag, res] : events) {
      if (tag == kStopTag) {
        stopping_ = true;
        waiting_.clear();
        continue;
      }
      if (tag == kListenTag) {
        if (stopping_) continue;
        Accept();
        Poll(listen_fd_.get(), kListenTag);
        continue;
      }
      if (tag == kWakeTag) {
        if (stopping_) continue;
        TakeInbox();
        Poll(wake_fd_.get(), kWakeTag);
        continue;
      }
      const uint64_t sub = tag & 0xffffffffu;
      if (sub != 0) --reads_in_flight_;
      auto it = conns_.find(static_cast<uint32_t>(tag >> 32));
      if (it == conns_.end()) continue;  // a poll of a closed connection
      Conn& c = *it->second;
      if (sub == 0) {
        if (!stopping_) OnPoll(c, res);
      } else {
        OnRead(c, static_cast<size_t>(sub - 1), res);
      }
    }
    if (!stopping_) StartWaitingReads();
  }
  // Every read has completed: the regions can go. Closing the connections
  // and the listener (also when the ring failed) sends clients to gRPC.
  conns_.clear();
  listen_fd_.Reset();
}

void LocalQueryService::Loop::Accept() {
  while (true) {
    const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: the listener stays readable; back off instead
        // of spinning (closing connections free some).
        LogWarning("local queries: accept: ", std::strerror(errno));
        ::poll(nullptr, 0, 100);
      }
      return;  // EAGAIN: no more waiting
    }
    auto c = std::make_unique<Conn>();
    c->fd.Reset(fd);
    struct ucred cred = {};
    socklen_t len = sizeof(cred);
    const bool known =
        ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
    c->pid = cred.pid;
    c->uid = cred.uid;
    // A refused connection is answered when its hello comes: closed now,
    // with its hello unread, the client would get ECONNRESET instead of the
    // reason. Far past the limit (clients that never say hello), closed.
    const int open = open_->load(std::memory_order_relaxed);
    if (open >= options_.max_connections + kRefusedSlack) continue;
    if (options_.admits && !(known && options_.admits(cred.uid, cred.gid))) {
      c->refusal = absl::PermissionDeniedError(
          "this user may not use shardcastd: not in --allow-user / "
          "--allow-group");
    } else if (open >= options_.max_connections) {
      c->refusal = absl::UnavailableError(absl::StrCat(
          "the daemon has ", open,
          " local query connections open, its limit; try again later"));
    }
    open_->fetch_add(1, std::memory_order_relaxed);
    c->open = open_;
    Loop* to = (*loops_)[next_loop_++ % loops_->size()].get();
    if (to == this) {
      Insert(std::move(c));
    } else {
      to->Adopt(std::move(c));
    }
  }
}

void LocalQueryService::Loop::Insert(std::unique_ptr<Conn> c) {
  do {  // ids wrap after 2^32 connections; skip those still open
    c->id = next_id_++;
  } while (c->id == 0 || conns_.count(c->id) != 0);
  ArmPoll(*c);
  conns_[c->id] = std::move(c);
}

void LocalQueryService::Loop::TakeInbox() {
  uint64_t count;
  ssize_t n = ::read(wake_fd_.get(), &count, sizeof(count));
  (void)n;  // EAGAIN: another wake-up took it; the inbox is checked anyway
  std::vector<std::unique_ptr<Conn>> taken;
  {
    MutexLock lock(&inbox_mu_);
    taken.swap(inbox_);
  }
  for (std::unique_ptr<Conn>& c : taken) Insert(std::move(c));
}

void LocalQueryService::Loop::OnPoll(Conn& c, int res) {
  if (res < 0) {
    Close(c);
    return;
  }
  // One message, and the descriptor a hello carries.
  char buf[lq::kRequestBytes + lq::kMaxDatasetBytes + 1];
  struct iovec iov = {buf, sizeof(buf)};
  struct msghdr msg = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(struct cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  do {
    n = ::recvmsg(c.fd.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    ArmPoll(c);
    return;
  }
  if (n <= 0) {  // the client went (EOF) or the socket failed
    Close(c);
    return;
  }
  // Take every descriptor it sent, so none is left open here.
  std::vector<UniqueFd> fds;
  TakeDescriptors(msg, &fds);
  const absl::string_view message(buf, static_cast<size_t>(n));
  const bool truncated = (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0;
  if (c.base == nullptr) {
    OnHello(c, truncated ? absl::string_view() : message,
            fds.size() == 1 ? fds[0].get() : -1);
    return;
  }
  if (truncated || !fds.empty()) {
    lq::Reply reply;
    reply.code = static_cast<uint32_t>(absl::StatusCode::kInvalidArgument);
    reply.message = truncated ? "a request longer than the protocol allows "
                                "(common/local/query_protocol.h)"
                              : "a request may not carry descriptors";
    SendMessage(c.fd.get(), reply.Encode());
    Close(c);
    return;
  }
  OnRequest(c, message);
}

void LocalQueryService::Loop::OnHello(Conn& c, absl::string_view message,
                                      int region_fd) {
  lq::Hello hello;
  absl::Status status = c.refusal;
  if (status.ok() && !hello.Decode(message)) {
    status = absl::InvalidArgumentError(
        "not a shardcast query hello (see common/local/query_protocol.h)");
  }
  if (status.ok() && hello.version != 1) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "query protocol version ", hello.version, "; this daemon speaks 1"));
  }
  if (status.ok() && region_fd < 0) {
    status = absl::InvalidArgumentError(
        "the hello must carry exactly one descriptor: the region's memfd");
  }
  if (status.ok() && (hello.region_bytes < lq::kOutAlign ||
                      hello.region_bytes > options_.max_region_bytes)) {
    status = absl::InvalidArgumentError(
        absl::StrCat("a region of ", hello.region_bytes, " bytes is not in [",
                     lq::kOutAlign, ", ", options_.max_region_bytes, "]"));
  }
  if (status.ok()) {
    // Sealed against shrinking, or the client could make our writes fault.
    const int seals = ::fcntl(region_fd, F_GET_SEALS);
    struct stat st;
    if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
      status = absl::InvalidArgumentError(
          "the region must be a memfd sealed with F_SEAL_SHRINK");
    } else if (::fstat(region_fd, &st) != 0 ||
               static_cast<uint64_t>(st.st_size) < hello.region_bytes) {
      status = absl::InvalidArgumentError(
          absl::StrCat("the region's memfd is smaller than the ",
                       hello.region_bytes, " bytes its hello says"));
    }
  }
  if (status.ok()) {
    void* p = ::mmap(nullptr, hello.region_bytes, PROT_READ | PROT_WRITE,
                     MAP_SHARED, region_fd, 0);
    if (p == MAP_FAILED) {
      status = ErrnoToStatus(errno, "map the client's region");
    } else {
      c.base = static_cast<char*>(p);
      c.bytes = hello.region_bytes;
    }
  }
  lq::HelloReply reply;
  reply.max_region_bytes = options_.max_region_bytes;
  if (!status.ok()) {
    reply.code = static_cast<uint32_t>(status.code());
    reply.message = std::string(status.message());
    LogInfo("local queries: refused pid ", c.pid, ": ", status.ToString());
    SendMessage(c.fd.get(), reply.Encode());
    Close(c);
    return;
  }
  if (!SendMessage(c.fd.get(), reply.Encode())) {
    Close(c);
    return;
  }
  LogDebug("local queries: pid ", c.pid, " (uid ", c.uid, ") with a region of ",
           c.bytes, " bytes");
  ArmPoll(c);
}

void LocalQueryService::Loop::OnRequest(Conn& c, absl::string_view message) {
  lq::Request request;
  if (!request.Decode(message)) {
    lq::Reply reply;
    reply.code = static_cast<uint32_t>(absl::StatusCode::kInvalidArgument);
    reply.message =
        "not a shardcast query request (see common/local/query_protocol.h)";
    SendMessage(c.fd.get(), reply.Encode());
    Close(c);
    return;
  }
  if (request.op == lq::Op::kLayout || request.op == lq::Op::kOpenFiles) {
    OnDirect(c, request);
    return;
  }
  metrics_->calls_total++;
  metrics_->calls_in_flight++;
  metrics_->queries_local++;
  c.busy = true;
  ++busy_;
  c.reply = lq::Reply();
  c.reply.id = request.id;
  c.error = Plan(c, request);
  if (!c.error.ok() || c.remaining == 0) {
    Finish(c);
    return;
  }
  for (size_t i = 0; i < c.plan.ops.size(); ++i) {
    if (c.done[i] < c.plan.ops[i].length) SubmitRead(c, i);
  }
}

void LocalQueryService::Loop::OnDirect(Conn& c, const lq::Request& request) {
  lq::Reply reply;
  reply.id = request.id;
  std::vector<UniqueFd> fds;
  absl::Status status;
  if (!options_.direct_reads) {
    status = absl::FailedPreconditionError(
        "this daemon hands out no files (--disable-direct-reads): ask it "
        "for the vectors");
  } else if (request.op == lq::Op::kLayout) {
    status = WriteLayout(c, request, &reply);
  } else {
    status = OpenFiles(c, request, &reply, &fds);
  }
  if (!status.ok()) {
    reply.code = static_cast<uint32_t>(status.code());
    reply.message = std::string(status.message());
    fds.clear();
  }
  std::vector<int> raw;
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  if (!SendWithDescriptors(c.fd.get(), reply.Encode(), raw, MSG_DONTWAIT)
           .ok()) {
    Close(c);
    return;
  }
  metrics_->direct_read_files += raw.size();
  if (request.op == lq::Op::kLayout && reply.code == 0) {
    metrics_->direct_read_layouts++;
  }
  if (!stopping_) ArmPoll(c);
}

absl::Status LocalQueryService::Loop::WriteLayout(Conn& c,
                                                  const lq::Request& request,
                                                  lq::Reply* reply) {
  ASSIGN_OR_RETURN(auto layout, queries_->Layout(request.dataset));
  const std::string bytes = layout.second.Encode();
  if (!FitsIn(request.out_offset, bytes.size(), c.bytes)) {
    reply->need_region_bytes = request.out_offset + bytes.size();
    return absl::ResourceExhaustedError(
        absl::StrCat("the layout needs a region of ", reply->need_region_bytes,
                     " bytes; this one has ", c.bytes));
  }
  std::memcpy(c.base + request.out_offset, bytes.data(), bytes.size());
  reply->rows = bytes.size();
  reply->serial = layout.first;
  LogDebug("local queries: pid ", c.pid, " reads ", request.dataset,
           " directly");
  return absl::OkStatus();
}

absl::Status LocalQueryService::Loop::OpenFiles(Conn& c,
                                                const lq::Request& request,
                                                lq::Reply* reply,
                                                std::vector<UniqueFd>* fds) {
  if (request.count == 0 || request.count > lq::kMaxFilesPerOpen ||
      !FitsIn(request.coords_offset, request.count * sizeof(int64_t),
              c.bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        request.count, " files at offset ", request.coords_offset, ": 1 to ",
        lq::kMaxFilesPerOpen, " in the region of ", c.bytes, " bytes"));
  }
  // Copied out first: the client may change the region meanwhile.
  std::vector<int64_t> files(request.count);
  std::memcpy(files.data(), c.base + request.coords_offset,
              files.size() * sizeof(int64_t));
  ASSIGN_OR_RETURN(*fds,
                   queries_->OpenFiles(request.dataset, request.serial, files));
  reply->rows = fds->size();
  return absl::OkStatus();
}

absl::Status LocalQueryService::Loop::Plan(Conn& c,
                                           const lq::Request& request) {
  c.plan = QueryEngine::VectorReads();
  c.done.clear();
  c.remaining = 0;
  if (request.op != lq::Op::kVectors) {
    return absl::UnimplementedError(absl::StrCat(
        "unknown query operation ", static_cast<uint32_t>(request.op)));
  }
  // Too many is refused before the coordinates are touched (they would be
  // copied, and the region's pages faulted in here, for nothing).
  RETURN_IF_ERROR(queries_->CheckCount(request.count));
  // The coordinates, copied out of the region before they are checked (the
  // client may change the region meanwhile).
  if (request.count > c.bytes / lq::kCoordBytes ||
      !FitsIn(request.coords_offset, request.count * lq::kCoordBytes,
              c.bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        request.count, " coordinates at offset ", request.coords_offset,
        " do not lie in the region of ", c.bytes, " bytes"));
  }
  std::vector<Coord> coords(request.count);
  const char* p = c.base + request.coords_offset;
  for (Coord& coord : coords) {
    int64_t v[3];
    std::memcpy(v, p, sizeof(v));
    p += sizeof(v);
    coord = Coord{v[0], v[1], v[2]};
  }
  if (request.out_offset % lq::kOutAlign != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the vectors' offset ", request.out_offset,
                     " in the region is not a multiple of ", lq::kOutAlign));
  }
  absl::StatusOr<QueryEngine::VectorReads> plan = queries_->PlanVectorReads(
      request.dataset, coords, ColdReads::kDirect,
      [&](uint64_t bytes) -> absl::StatusOr<char*> {
        if (!FitsIn(request.out_offset, bytes, c.bytes)) {
          c.reply.need_region_bytes = request.out_offset + bytes;
          return absl::ResourceExhaustedError(absl::StrCat(
              "the vectors need a region of ", c.reply.need_region_bytes,
              " bytes; this one has ", c.bytes));
        }
        return c.base + request.out_offset;
      });
  if (!plan.ok()) return plan.status();
  c.plan = std::move(*plan);
  c.reply.rows = static_cast<uint64_t>(c.plan.shape[0]);
  c.reply.d_model = static_cast<uint64_t>(c.plan.shape[1]);
  c.done.assign(c.plan.ops.size(), 0);
  for (const ReadOp& op : c.plan.ops) c.remaining += op.length > 0 ? 1 : 0;
  return absl::OkStatus();
}

void LocalQueryService::Loop::SubmitRead(Conn& c, size_t i) {
  if (reads_in_flight_ >= options_.queue_depth) {
    waiting_.emplace_back(c.id, i);
    ++c.in_flight;  // counted as in flight: the request waits for it
    return;
  }
  Queue([&] {
    return ring_.PrepareRead(c.plan.ops[i], c.done[i], Tag(c.id, i + 1));
  });
  ++reads_in_flight_;
  ++c.in_flight;
}

void LocalQueryService::Loop::StartWaitingReads() {
  while (!waiting_.empty() && reads_in_flight_ < options_.queue_depth) {
    const auto [id, i] = waiting_.front();
    waiting_.pop_front();
    auto it = conns_.find(id);
    if (it == conns_.end()) continue;
    Conn& c = *it->second;
    --c.in_flight;
    if (!c.error.ok()) {  // the request already failed: skip the rest
      if (c.in_flight == 0) Finish(c);
      continue;
    }
    SubmitRead(c, i);
  }
}

void LocalQueryService::Loop::OnRead(Conn& c, size_t i, int res) {
  --c.in_flight;
  if (i < c.plan.ops.size() && c.error.ok()) {
    absl::Status error;
    switch (ApplyReadResult(c.plan.ops[i], res, &c.done[i], &error)) {
      case ReadStep::kDone:
        --c.remaining;
        break;
      case ReadStep::kContinue:
        if (!stopping_) {
          SubmitRead(c, i);
        } else {
          c.error = absl::UnavailableError("the daemon is shutting down");
        }
        break;
      case ReadStep::kFailed:
        c.error = error;
        break;
    }
  }
  if (c.in_flight == 0 && (c.remaining == 0 || !c.error.ok())) Finish(c);
}

void LocalQueryService::Loop::Finish(Conn& c) {
  c.busy = false;
  --busy_;
  metrics_->calls_in_flight--;
  const absl::Status& status = c.error;
  metrics_->CallDone(status.code());
  if (status.ok()) {
    uint64_t bytes = 0;
    for (const ReadOp& op : c.plan.ops) bytes += op.length;
    queries_->CountReads(bytes, c.plan.direct_bytes);
    metrics_->bytes_served += bytes;
  } else {
    c.reply.code = static_cast<uint32_t>(status.code());
    c.reply.message = std::string(status.message());
    if (c.reply.need_region_bytes == 0) c.reply.rows = c.reply.d_model = 0;
  }
  c.plan = QueryEngine::VectorReads();  // the reads are done: let the files go
  c.done.clear();
  // A client that sent more requests without reading the replies fills its
  // socket: it is disconnected rather than waited for.
  if (!SendMessage(c.fd.get(), c.reply.Encode())) {
    Close(c);
    return;
  }
  if (!stopping_) ArmPoll(c);
}

void LocalQueryService::Loop::Close(Conn& c) {
  if (c.busy || c.in_flight > 0) {
    // Never with reads in flight: they write into its region.
    LogError("local queries: closing a connection with reads in flight");
    return;
  }
  conns_.erase(c.id);
}

LocalQueryService::LocalQueryService(LocalQueryOptions options)
    : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<LocalQueryService>> LocalQueryService::Start(
    LocalQueryOptions options, const QueryEngine* queries, Metrics* metrics) {
  std::unique_ptr<LocalQueryService> s(
      new LocalQueryService(std::move(options)));
  const int threads = std::max(1, s->options_.threads);
  std::vector<UringRing> rings;
  for (int i = 0; i < threads; ++i) {
    absl::StatusOr<UringRing> ring = UringRing::Create(s->options_.queue_depth);
    if (!ring.ok()) {
      return absl::UnimplementedError(
          absl::StrCat("no io_uring: ", ring.status().message()));
    }
    rings.push_back(std::move(*ring));
  }
  ASSIGN_OR_RETURN(UniqueFd listen_fd,
                   ListenUnix(s->options_.path, SOCK_SEQPACKET,
                              s->options_.mode, s->options_.group, 256));
  const int efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd < 0) return ErrnoToStatus(errno, "eventfd");
  s->stop_fd_.Reset(efd);
  for (int i = 0; i < threads; ++i) {
    UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake.valid()) return ErrnoToStatus(errno, "eventfd");
    s->loops_.push_back(std::make_unique<Loop>(
        s->options_, queries, metrics, std::move(rings[i]),
        i == 0 ? std::move(listen_fd) : UniqueFd(), s->stop_fd_.get(),
        std::move(wake), &s->open_, &s->loops_));
  }
  for (const std::unique_ptr<Loop>& loop : s->loops_) {
    s->threads_.emplace_back([l = loop.get()] { l->Run(); });
  }
  LogInfo("local queries on ", s->options_.path, " (", threads, " thread",
          threads == 1 ? "" : "s", ")");
  return s;
}

LocalQueryService::~LocalQueryService() {
  const uint64_t one = 1;
  ssize_t n = ::write(stop_fd_.get(), &one, sizeof(one));
  (void)n;
  for (std::thread& t : threads_) t.join();
  loops_.clear();  // after every thread: a loop may hand another connections
  ::unlink(options_.path.c_str());
}

}  // namespace shardcast
