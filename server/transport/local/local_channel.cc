#include "server/transport/local/local_channel.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/clock.h"
#include "common/base/human_bytes.h"
#include "common/base/log.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"
#include "common/local/channel.h"
#include "common/local/memfd.h"
#include "server/io/ring_loop.h"
#include "server/transport/address.h"
#include "server/transport/local_peer.h"

namespace shardcast {
namespace {

using v1::LocalReply;
using v1::LocalRequest;

// Connections past max_connections waiting to be told so (at their first
// request).
constexpr int kRefusedSlack = 64;

// One client connection and the request it is being served.
struct Conn {
  uint32_t id = 0;
  UniqueFd fd;
  std::atomic<int>* open = nullptr;  // the service's count, once counted
  // Its user's count of connections, once counted.
  LocalChannel::UserConnections* per_user = nullptr;
  BatchRegions* regions = nullptr;
  LocalPeer peer;           // who it is (SO_PEERCRED, SO_PEERGROUPS)
  double accepted_at = 0;   // monotonic seconds
  bool asked = false;       // a request came (first_request_seconds)
  absl::Status refusal;     // not OK: the answer to its first request
  SharedMapping query;      // its query region, once asked for
  std::string batch_token;  // its batch region's, once asked for
  // An Attach sent in parts: the files so far.
  struct PendingAttach {
    std::string path, dir_name;
    std::map<std::string, HandedFile> files;
  };
  std::optional<PendingAttach> attaching;
  // The request in service (busy) and its reads.
  bool busy = false;
  LocalReply reply;
  absl::Status error;  // the first read failure
  // Its reads; the plan holds the files they name open until they are done.
  QueryEngine::VectorReads plan;
  std::vector<size_t> done;  // bytes in place, per op
  size_t remaining = 0;      // ops not done
  size_t in_flight = 0;      // ops handed to the ring loop, not completed

  Conn() = default;
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;
  ~Conn() {
    // Streams attached to its batch region keep it mapped.
    if (!batch_token.empty()) regions->Forget(batch_token);
    if (open != nullptr) open->fetch_sub(1, std::memory_order_relaxed);
    if (per_user != nullptr) {
      MutexLock lock(&per_user->mu);
      auto it = per_user->open.find(peer.uid);
      if (it != per_user->open.end() && --it->second <= 0) {
        per_user->open.erase(it);
      }
    }
  }
};

// `a + b <= limit` without overflow.
bool FitsIn(uint64_t a, uint64_t b, uint64_t limit) {
  return a <= limit && b <= limit - a;
}

void SetError(LocalReply* reply, const absl::Status& status) {
  reply->set_code(static_cast<int32_t>(status.code()));
  // A string field: invalid UTF-8 (a client's dataset name echoed in the
  // message) would make the reply unparsable, replaced here.
  reply->set_message(ValidUtf8(status.message()));
  reply->clear_result();
}

}  // namespace

class LocalChannel::Loop {
 public:
  // `listen_fd` is valid for the first loop only: it accepts, and hands
  // each connection to `loops` (this one among them) in turn. `open`
  // counts the connections of all loops.
  Loop(const LocalChannelOptions& options, const QueryEngine* queries,
       BatchRegions* regions, Metrics* metrics, UniqueFd listen_fd, int stop_fd,
       UniqueFd wake_fd, std::atomic<int>* open,
       LocalChannel::UserConnections* per_user,
       const std::vector<std::unique_ptr<Loop>>* loops)
      : options_(options),
        queries_(queries),
        regions_(regions),
        metrics_(metrics),
        ring_(RingLoop::Create(options.queue_depth)),
        listen_fd_(std::move(listen_fd)),
        stop_fd_(stop_fd),
        wake_fd_(std::move(wake_fd)),
        open_(open),
        per_user_(per_user),
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
  void ArmListen();
  void ArmWake();
  // The timer that closes connections silent since they were accepted.
  void ArmTick();
  void CloseSilent();
  // c's next request, when it comes.
  void ArmPoll(Conn& c);
  void Accept();
  // Serves c from now on: its id, its poll.
  void Insert(std::unique_ptr<Conn> c);
  void TakeInbox() ABSL_LOCKS_EXCLUDED(inbox_mu_);
  void OnPoll(Conn& c);
  // Sends `reply` (with `fds`) and waits for c's next request; closes c
  // when the socket cannot take it.
  void Answer(Conn& c, LocalReply& reply, absl::Span<const int> fds = {});
  void OnBatchRegion(Conn& c, const LocalRequest& request);
  void OnQueryRegion(Conn& c, const LocalRequest& request);
  void OnVectors(Conn& c, const LocalRequest& request);
  // Direct reads (Layout, OpenFiles): answered at once, no disk.
  void OnDirect(Conn& c, const LocalRequest& request);
  void OnAttach(Conn& c, const LocalRequest& request,
                std::vector<UniqueFd> fds);
  absl::Status WriteLayout(Conn& c, const LocalRequest::Layout& request,
                           LocalReply* reply);
  absl::Status Plan(Conn& c, const LocalRequest::Vectors& request);
  // Whether the client's user may read `dataset` (LocalChannelOptions::
  // check_access); OK when no check is configured.
  absl::Status Allowed(const Conn& c, const std::string& dataset) const {
    if (!options_.check_access) return absl::OkStatus();
    return options_.check_access(Caller{c.peer.credentials(), {}}, dataset);
  }
  void SubmitRead(Conn& c, size_t i);
  void OnRead(Conn& c, size_t i, int res);
  // Sends the reply of c's query and waits for its next request.
  void Finish(Conn& c);
  void Close(Conn& c);

  const LocalChannelOptions& options_;
  const QueryEngine* const queries_;
  BatchRegions* const regions_;
  Metrics* const metrics_;
  const std::unique_ptr<RingLoop> ring_;
  UniqueFd listen_fd_;
  const int stop_fd_;
  const UniqueFd wake_fd_;  // eventfd: the inbox has connections
  std::atomic<int>* const open_;
  LocalChannel::UserConnections* const per_user_;
  const std::vector<std::unique_ptr<Loop>>* const loops_;
  UniqueFd tick_fd_;      // timerfd, every second: first-request deadlines
  size_t next_loop_ = 0;  // the loop the next accepted connection goes to
  Mutex inbox_mu_;
  std::vector<std::unique_ptr<Conn>> inbox_ ABSL_GUARDED_BY(inbox_mu_);
  const int64_t spin_ns_ = int64_t{options_.spin_us} * 1000;
  bool stopping_ = false;
  int busy_ = 0;  // connections with a query in service
  uint32_t next_id_ = 1;
  std::map<uint32_t, std::unique_ptr<Conn>> conns_;
};

void LocalChannel::Loop::Run() {
  ring_->Poll(stop_fd_, POLLIN, [this](int) { stopping_ = true; });
  ArmWake();
  ArmTick();
  if (listen_fd_.valid()) ArmListen();
  // Once stopping, only the reads in flight are waited for: they write into
  // regions that are unmapped when their connections go.
  while (!stopping_ || ring_->reads_pending() > 0) {
    // With several calls in service, a short spin before sleeping: see
    // LocalChannelOptions::spin_us.
    const int64_t spin = busy_ >= 2 ? spin_ns_ : 0;
    if (!ring_->RunOnce(spin) && ring_->reads_pending() == 0) break;
  }
  // Every read has completed: the regions can go. Closing the connections
  // and the listener (also when the ring failed) sends clients to gRPC.
  conns_.clear();
  listen_fd_.Reset();
}

void LocalChannel::Loop::ArmListen() {
  ring_->Poll(listen_fd_.get(), POLLIN, [this](int) {
    if (stopping_) return;
    Accept();
    ArmListen();
  });
}

void LocalChannel::Loop::ArmTick() {
  if (options_.first_request_seconds <= 0) return;
  if (!tick_fd_.valid()) {
    tick_fd_.Reset(
        ::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
    struct itimerspec every = {};
    every.it_interval.tv_sec = 1;
    every.it_value.tv_sec = 1;
    if (!tick_fd_.valid() ||
        ::timerfd_settime(tick_fd_.get(), 0, &every, nullptr) != 0) {
      LogWarning("local channel: no timer for first-request deadlines: ",
                 std::strerror(errno));
      tick_fd_.Reset();
      return;
    }
  }
  ring_->Poll(tick_fd_.get(), POLLIN, [this](int) {
    if (stopping_) return;
    uint64_t ticks;
    ssize_t n = ::read(tick_fd_.get(), &ticks, sizeof(ticks));
    (void)n;
    CloseSilent();
    ArmTick();
  });
}

void LocalChannel::Loop::CloseSilent() {
  const double now = MonotonicSeconds();
  std::vector<Conn*> silent;
  for (auto& [id, c] : conns_) {
    if (!c->asked && !c->busy && c->in_flight == 0 &&
        now - c->accepted_at > options_.first_request_seconds) {
      silent.push_back(c.get());
    }
  }
  for (Conn* c : silent) {
    LogInfo("local channel: closed pid ", c->peer.pid, " (uid ", c->peer.uid,
            "): no request within ", options_.first_request_seconds, " s");
    // The poll armed on it holds the socket open in the ring: shut it down
    // so that the client sees the close now (the poll then completes).
    ::shutdown(c->fd.get(), SHUT_RDWR);
    Close(*c);
  }
}

void LocalChannel::Loop::ArmWake() {
  ring_->Poll(wake_fd_.get(), POLLIN, [this](int) {
    if (stopping_) return;
    TakeInbox();
    ArmWake();
  });
}

void LocalChannel::Loop::ArmPoll(Conn& c) {
  ring_->Poll(c.fd.get(), POLLIN, [this, id = c.id](int) {
    auto it = conns_.find(id);
    // A poll of a closed connection, or one during the stop.
    if (it == conns_.end() || stopping_) return;
    OnPoll(*it->second);
  });
}

void LocalChannel::Loop::Accept() {
  while (true) {
    const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: the listener stays readable; back off instead
        // of spinning (closing connections free some).
        LogWarning("local channel: accept: ", std::strerror(errno));
        ::poll(nullptr, 0, 100);
      }
      return;  // EAGAIN: no more waiting
    }
    auto c = std::make_unique<Conn>();
    c->fd.Reset(fd);
    c->regions = regions_;
    const std::optional<LocalPeer> peer = PeerOfSocket(fd);
    const bool known = peer.has_value();
    if (known) c->peer = *peer;
    // A refused connection is answered when its first request comes:
    // closed now, with its request unread, the client would get ECONNRESET
    // instead of the reason. Far past the limit (clients that never ask),
    // closed.
    const int open = open_->load(std::memory_order_relaxed);
    if (open >= options_.max_connections + kRefusedSlack) continue;
    c->accepted_at = MonotonicSeconds();
    int mine = 0;  // the user's connections open before this one
    {
      MutexLock lock(&per_user_->mu);
      mine = per_user_->open[c->peer.uid]++;
    }
    c->per_user = per_user_;
    if (options_.admits &&
        !(known && options_.admits(c->peer.uid, c->peer.gid))) {
      c->refusal = absl::PermissionDeniedError(
          "this user may not use shardcastd: not in --allow-user / "
          "--allow-group");
    } else if (options_.max_connections_per_user > 0 &&
               mine >= options_.max_connections_per_user) {
      c->refusal = absl::ResourceExhaustedError(absl::StrCat(
          "uid ", c->peer.uid, " has ", mine,
          " local channel connections open, the limit for one user "
          "(--max-connections-per-user ",
          options_.max_connections_per_user, ")"));
    } else if (open >= options_.max_connections) {
      c->refusal = absl::UnavailableError(absl::StrCat(
          "the daemon has ", open,
          " local channel connections open, its limit; try again later"));
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

void LocalChannel::Loop::Insert(std::unique_ptr<Conn> c) {
  do {  // ids wrap after 2^32 connections; skip those still open
    c->id = next_id_++;
  } while (c->id == 0 || conns_.count(c->id) != 0);
  ArmPoll(*c);
  conns_[c->id] = std::move(c);
}

void LocalChannel::Loop::TakeInbox() {
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

void LocalChannel::Loop::OnPoll(Conn& c) {
  LocalRequest request;
  std::vector<UniqueFd> fds;  // taken, so none is left open here
  absl::StatusOr<local::Received> got =
      local::ReceiveMessage(c.fd.get(), &request, &fds, MSG_DONTWAIT);
  if (got.ok() && *got == local::Received::kWouldBlock) {
    ArmPoll(c);
    return;
  }
  if (!got.ok() && absl::IsInvalidArgument(got.status())) {
    // Out of step with the protocol: told why, then disconnected.
    LocalReply reply;
    SetError(&reply, got.status());
    local::SendMessage(c.fd.get(), reply, {}, MSG_DONTWAIT).IgnoreError();
    Close(c);
    return;
  }
  if (!got.ok() || *got == local::Received::kClosed) {
    Close(c);  // the client went (EOF) or the socket failed
    return;
  }
  c.asked = true;
  LocalReply reply;
  reply.set_id(request.id());
  if (!c.refusal.ok()) {
    SetError(&reply, c.refusal);
    LogInfo("local channel: refused pid ", c.peer.pid, ": ",
            c.refusal.ToString());
    local::SendMessage(c.fd.get(), reply, {}, MSG_DONTWAIT).IgnoreError();
    Close(c);
    return;
  }
  if (request.op_case() != LocalRequest::kAttach && !fds.empty()) {
    SetError(&reply, absl::InvalidArgumentError(
                         "this request takes no descriptors, and it carried " +
                         std::to_string(fds.size())));
    Answer(c, reply);
    return;
  }
  switch (request.op_case()) {
    case LocalRequest::kBatchRegion:
      OnBatchRegion(c, request);
      return;
    case LocalRequest::kQueryRegion:
      OnQueryRegion(c, request);
      return;
    case LocalRequest::kVectors:
      OnVectors(c, request);
      return;
    case LocalRequest::kLayout:
    case LocalRequest::kOpenFiles:
      OnDirect(c, request);
      return;
    case LocalRequest::kAttach:
      OnAttach(c, request, std::move(fds));
      return;
    case LocalRequest::OP_NOT_SET:
      break;
  }
  SetError(&reply, absl::UnimplementedError(
                       "a local channel operation this daemon does not know "
                       "(a newer client?)"));
  Answer(c, reply);
}

void LocalChannel::Loop::Answer(Conn& c, LocalReply& reply,
                                absl::Span<const int> fds) {
  // A client that sent more requests without reading the replies fills its
  // socket: it is disconnected rather than waited for.
  if (!local::SendMessage(c.fd.get(), reply, fds, MSG_DONTWAIT).ok()) {
    Close(c);
    return;
  }
  if (!stopping_) ArmPoll(c);
}

void LocalChannel::Loop::OnBatchRegion(Conn& c, const LocalRequest& request) {
  LocalReply reply;
  reply.set_id(request.id());
  const LocalRequest::BatchRegion& asked = request.batch_region();
  absl::StatusOr<BatchRegions::Made> made;
  if (regions_ == nullptr) {
    made = absl::UnimplementedError(
        "shared memory is off on this daemon (--disable-shared-memory): "
        "batches come in gRPC messages");
  } else if (!c.batch_token.empty()) {
    made = absl::FailedPreconditionError(
        "this connection has a batch region already; open another "
        "connection for another stream");
  } else {
    made = regions_->Make(asked.slots(), asked.slot_bytes(), c.peer.pid,
                          c.peer.uid);
  }
  if (!made.ok()) {
    LogInfo("local channel: refused a batch region to pid ", c.peer.pid, ": ",
            made.status().ToString());
    SetError(&reply, made.status());
    Answer(c, reply);
    return;
  }
  const ShmRegion& region = *made->region;
  LocalReply::BatchRegion* out = reply.mutable_batch_region();
  out->set_slots(region.slots());
  out->set_slot_bytes(region.slot_bytes());
  out->set_region_bytes(region.bytes());
  out->set_token(made->token);
  c.batch_token = made->token;  // forgotten when the connection closes
  const int memfd = made->memfd.get();
  Answer(c, reply, {&memfd, 1});
  LogDebug("local channel: batch region of ", region.slots(), " x ",
           HumanBytes(region.slot_bytes()), " for pid ", c.peer.pid, " (uid ",
           c.peer.uid, ")");
  // The first touch of fresh memory is slow (docs/benchmarks.md), and
  // batches should not pay it.
  regions_->Populate(std::move(made->region));
}

void LocalChannel::Loop::OnQueryRegion(Conn& c, const LocalRequest& request) {
  LocalReply reply;
  reply.set_id(request.id());
  const uint64_t page = local::kOutAlign;
  const uint64_t asked = request.query_region().bytes();
  const uint64_t bytes =
      (std::min(asked, ~uint64_t{0} - page) + page - 1) / page * page;
  absl::StatusOr<UniqueFd> memfd;
  absl::StatusOr<SharedMapping> mapped;
  if (queries_ == nullptr) {
    memfd = absl::UnimplementedError(
        "local queries are off on this daemon (--disable-local-queries): "
        "ask over gRPC");
  } else if (bytes < page || bytes > options_.max_query_region_bytes) {
    memfd = absl::InvalidArgumentError(
        absl::StrCat("a query region of ", asked, " bytes is not in [", page,
                     ", ", options_.max_query_region_bytes, "]"));
  } else {
    memfd = SealedMemfd("shardcast-queries", bytes, "query region");
  }
  if (memfd.ok()) {
    mapped = SharedMapping::Map(memfd->get(), bytes, true, "query region");
  }
  if (!memfd.ok() || !mapped.ok()) {
    SetError(&reply, !memfd.ok() ? memfd.status() : mapped.status());
    Answer(c, reply);
    return;
  }
  c.query = *std::move(mapped);  // the old one goes: no reads are in flight
  LocalReply::QueryRegion* out = reply.mutable_query_region();
  out->set_bytes(bytes);
  out->set_max_region_bytes(options_.max_query_region_bytes);
  const int fd = memfd->get();
  Answer(c, reply, {&fd, 1});
  LogDebug("local channel: query region of ", HumanBytes(bytes), " for pid ",
           c.peer.pid, " (uid ", c.peer.uid, ")");
}

void LocalChannel::Loop::OnVectors(Conn& c, const LocalRequest& request) {
  metrics_->calls_total++;
  metrics_->calls_in_flight++;
  metrics_->queries_local++;
  c.busy = true;
  ++busy_;
  c.reply.Clear();
  c.reply.set_id(request.id());
  c.error = Plan(c, request.vectors());
  if (!c.error.ok() || c.remaining == 0) {
    Finish(c);
    return;
  }
  for (size_t i = 0; i < c.plan.ops.size(); ++i) {
    if (c.done[i] < c.plan.ops[i].length) SubmitRead(c, i);
  }
}

// At most this many files in one attached dataset (its shards, JSON,
// labels and sidecars): the shard count bound and a few more.
constexpr size_t kMaxAttachedFiles = 1 << 16;

void LocalChannel::Loop::OnAttach(Conn& c, const LocalRequest& request,
                                  std::vector<UniqueFd> fds) {
  LocalReply reply;
  reply.set_id(request.id());
  const LocalRequest::Attach& part = request.attach();
  absl::Status status = [&]() -> absl::Status {
    if (!options_.attach) {
      return absl::UnimplementedError(
          "this daemon attaches no datasets by path");
    }
    if (part.names_size() != part.errors_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("attach: ", part.names_size(), " names but ",
                       part.errors_size(), " errors"));
    }
    size_t carried = 0;
    for (int32_t e : part.errors()) carried += e == 0 ? 1 : 0;
    if (carried != fds.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("attach: ", carried, " files opened but ", fds.size(),
                       " descriptors carried"));
    }
    if (!c.attaching) {
      if (part.path().empty() || part.path().size() > 4096 ||
          part.dir_name().empty() || part.dir_name().size() > 255) {
        return absl::InvalidArgumentError(
            "attach: give the directory's path and name");
      }
      c.attaching.emplace();
      c.attaching->path = ValidUtf8(part.path());
      c.attaching->dir_name = part.dir_name();
    }
    auto& files = c.attaching->files;
    if (files.size() + static_cast<size_t>(part.names_size()) >
        kMaxAttachedFiles) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attach: more than ", kMaxAttachedFiles, " files in one dataset"));
    }
    size_t next_fd = 0;
    for (int i = 0; i < part.names_size(); ++i) {
      const std::string& name = part.names(i);
      if (name.empty() || name.size() > 255 || name == "." || name == ".." ||
          name.find('/') != std::string::npos ||
          name.find('\0') != std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat("attach: \"", Quoted(name), "\" is not a file name"));
      }
      HandedFile f;
      if (part.errors(i) == 0) {
        f.fd = std::move(fds[next_fd++]);
      } else {
        f.error = part.errors(i) > 0 ? part.errors(i) : EIO;
      }
      if (!files.emplace(name, std::move(f)).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("attach: \"", Quoted(name), "\" is given twice"));
      }
    }
    if (part.more()) {
      reply.mutable_attach();
      return absl::OkStatus();
    }
    Conn::PendingAttach done = std::move(*c.attaching);
    c.attaching.reset();
    ASSIGN_OR_RETURN(std::string id,
                     options_.attach(HandedFiles(std::move(done.path),
                                                 std::move(done.dir_name),
                                                 std::move(done.files))));
    reply.mutable_attach()->set_dataset(id);
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    c.attaching.reset();  // a failed part ends the attach
    SetError(&reply, status);
  }
  Answer(c, reply);
}

void LocalChannel::Loop::OnDirect(Conn& c, const LocalRequest& request) {
  LocalReply reply;
  reply.set_id(request.id());
  std::vector<UniqueFd> fds;
  absl::Status status;
  if (queries_ == nullptr) {
    status = absl::UnimplementedError(
        "local queries are off on this daemon (--disable-local-queries)");
  } else if (!options_.direct_reads) {
    status = absl::FailedPreconditionError(
        "this daemon hands out no files (--disable-direct-reads): ask it "
        "for the vectors");
  } else if (request.has_layout()) {
    status = Allowed(c, request.layout().dataset());
    if (status.ok()) status = WriteLayout(c, request.layout(), &reply);
  } else {
    const LocalRequest::OpenFiles& asked = request.open_files();
    status = Allowed(c, asked.dataset());
    if (!status.ok()) {
      // refused: the client's user could not open the files itself
    } else if (asked.files_size() == 0 ||
               static_cast<size_t>(asked.files_size()) >
                   local::kMaxFilesPerOpen) {
      status = absl::InvalidArgumentError(
          absl::StrCat("ask for 1 to ", local::kMaxFilesPerOpen,
                       " files at once, not ", asked.files_size()));
    } else {
      absl::StatusOr<std::vector<UniqueFd>> opened = queries_->OpenFiles(
          asked.dataset(), asked.serial(),
          std::vector<int64_t>(asked.files().begin(), asked.files().end()));
      if (opened.ok()) {
        fds = *std::move(opened);
        reply.mutable_open_files();
      } else {
        status = opened.status();
      }
    }
  }
  if (!status.ok()) {
    SetError(&reply, status);
    fds.clear();
  }
  std::vector<int> raw;
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  metrics_->direct_read_files += raw.size();
  if (request.has_layout() && status.ok()) metrics_->direct_read_layouts++;
  Answer(c, reply, raw);
}

absl::Status LocalChannel::Loop::WriteLayout(
    Conn& c, const LocalRequest::Layout& request, LocalReply* reply) {
  if (!c.query.valid()) {
    return absl::FailedPreconditionError(
        "ask for a query region before a layout");
  }
  ASSIGN_OR_RETURN(auto layout, queries_->Layout(request.dataset()));
  const std::string bytes = layout.second.Encode();
  if (!FitsIn(request.out_offset(), bytes.size(), c.query.size())) {
    reply->set_need_region_bytes(request.out_offset() + bytes.size());
    return absl::ResourceExhaustedError(absl::StrCat(
        "the layout needs a query region of ", reply->need_region_bytes(),
        " bytes; this one has ", c.query.size()));
  }
  std::memcpy(c.query.data() + request.out_offset(), bytes.data(),
              bytes.size());
  reply->mutable_layout()->set_bytes(bytes.size());
  reply->mutable_layout()->set_serial(layout.first);
  LogDebug("local channel: pid ", c.peer.pid, " reads ", request.dataset(),
           " directly");
  return absl::OkStatus();
}

absl::Status LocalChannel::Loop::Plan(Conn& c,
                                      const LocalRequest::Vectors& request) {
  c.plan = QueryEngine::VectorReads();
  c.done.clear();
  c.remaining = 0;
  if (!c.query.valid()) {
    return absl::FailedPreconditionError(
        "ask for a query region before vectors");
  }
  const uint64_t count = request.count();
  const uint64_t region = c.query.size();
  // Too many is refused before the coordinates are touched (they would be
  // copied, and the region's pages faulted in here, for nothing).
  RETURN_IF_ERROR(queries_->CheckCount(count));
  // The coordinates, copied out of the region before they are checked (the
  // client may change the region meanwhile).
  if (count > region / local::kCoordBytes ||
      !FitsIn(request.coords_offset(), count * local::kCoordBytes, region)) {
    return absl::InvalidArgumentError(
        absl::StrCat(count, " coordinates at offset ", request.coords_offset(),
                     " do not lie in the query region of ", region, " bytes"));
  }
  std::vector<Coord> coords(count);
  const char* p = c.query.data() + request.coords_offset();
  for (Coord& coord : coords) {
    int64_t v[3];
    std::memcpy(v, p, sizeof(v));
    p += sizeof(v);
    coord = Coord{v[0], v[1], v[2]};
  }
  const uint64_t out_offset = request.out_offset();
  if (out_offset % local::kOutAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the vectors' offset ", out_offset,
        " in the query region is not a multiple of ", local::kOutAlign));
  }
  RETURN_IF_ERROR(Allowed(c, request.dataset()));
  absl::StatusOr<QueryEngine::VectorReads> plan = queries_->PlanVectorReads(
      request.dataset(), coords, ColdReads::kDirect,
      [&](uint64_t bytes) -> absl::StatusOr<char*> {
        if (!FitsIn(out_offset, bytes, region)) {
          c.reply.set_need_region_bytes(out_offset + bytes);
          return absl::ResourceExhaustedError(absl::StrCat(
              "the vectors need a query region of ",
              c.reply.need_region_bytes(), " bytes; this one has ", region));
        }
        return c.query.data() + out_offset;
      });
  if (!plan.ok()) return plan.status();
  c.plan = std::move(*plan);
  c.reply.mutable_vectors()->set_rows(static_cast<uint64_t>(c.plan.shape[0]));
  c.reply.mutable_vectors()->set_d_model(
      static_cast<uint64_t>(c.plan.shape[1]));
  c.done.assign(c.plan.ops.size(), 0);
  for (const ReadOp& op : c.plan.ops) c.remaining += op.length > 0 ? 1 : 0;
  return absl::OkStatus();
}

void LocalChannel::Loop::SubmitRead(Conn& c, size_t i) {
  ++c.in_flight;
  ring_->Read(c.plan.ops[i], c.done[i], [this, id = c.id, i](int res) {
    auto it = conns_.find(id);
    if (it != conns_.end()) OnRead(*it->second, i, res);
  });
}

void LocalChannel::Loop::OnRead(Conn& c, size_t i, int res) {
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

void LocalChannel::Loop::Finish(Conn& c) {
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
    SetError(&c.reply, status);
  }
  c.plan = QueryEngine::VectorReads();  // the reads are done: let the files go
  c.done.clear();
  Answer(c, c.reply);
}

void LocalChannel::Loop::Close(Conn& c) {
  if (c.busy || c.in_flight > 0) {
    // Never with reads in flight: they write into its region.
    LogError("local channel: closing a connection with reads in flight");
    return;
  }
  conns_.erase(c.id);
}

LocalChannel::LocalChannel(LocalChannelOptions options)
    : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<LocalChannel>> LocalChannel::Start(
    LocalChannelOptions options, const QueryEngine* queries,
    BatchRegions* regions, Metrics* metrics) {
  std::unique_ptr<LocalChannel> s(new LocalChannel(std::move(options)));
  const int threads = std::max(1, s->options_.threads);
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
        s->options_, queries, regions, metrics,
        i == 0 ? std::move(listen_fd) : UniqueFd(), s->stop_fd_.get(),
        std::move(wake), &s->open_, &s->per_user_, &s->loops_));
  }
  for (const std::unique_ptr<Loop>& loop : s->loops_) {
    s->threads_.emplace_back([l = loop.get()] { l->Run(); });
  }
  LogInfo("local channel on ", s->options_.path, " (", threads, " thread",
          threads == 1 ? "" : "s", "; ",
          regions != nullptr ? "shared memory" : "no shared memory", ", ",
          queries != nullptr ? "queries" : "no queries", ")");
  return s;
}

LocalChannel::~LocalChannel() {
  const uint64_t one = 1;
  ssize_t n = ::write(stop_fd_.get(), &one, sizeof(one));
  (void)n;
  for (std::thread& t : threads_) t.join();
  loops_.clear();  // after every thread: a loop may hand another connections
  ::unlink(options_.path.c_str());
}

}  // namespace shardcast
