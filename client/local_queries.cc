#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "client/local_queries_internal.h"
#include "common/base/file.h"
#include "common/base/status.h"
#include "common/local/query_protocol.h"
#include "common/local/unix_socket.h"
#include "common/local/vector_layout.h"

namespace shardcast {
namespace internal_client {
namespace {

namespace lq = local_query;

// The first region of a connection: 256 vectors of d_model 1024 and their
// coordinates. Its pages are only touched as calls use them.
constexpr uint64_t kFirstRegionBytes = (1 << 20) + 2 * lq::kOutAlign;

uint64_t RoundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

// The longest message the daemon sends: a reply and its error message.
constexpr size_t kMaxReplyBytes = 16 * 1024;

// Receives one message (blocking) into `buf`, and the descriptors it
// carries into `fds`; the error when the connection broke or the daemon
// closed it. (Not a std::string: zeroing its bytes first was a fifth of the
// client's time per call.)
absl::StatusOr<absl::string_view> Receive(int fd, char (&buf)[kMaxReplyBytes],
                                          std::vector<UniqueFd>* fds) {
  ASSIGN_OR_RETURN(const size_t n,
                   ReceiveWithDescriptors(fd, absl::MakeSpan(buf), fds));
  if (n == 0) {
    return absl::UnavailableError("the daemon closed the local query socket");
  }
  if (n > sizeof(buf)) {
    return absl::DataLossError(absl::StrCat("a local query reply of ", n,
                                            " bytes; at most ", sizeof(buf),
                                            " expected"));
  }
  return absl::string_view(buf, n);
}

}  // namespace

struct LocalQueries::Conn {
  UniqueFd fd;
  char* base = nullptr;
  uint64_t bytes = 0;
  uint64_t next_id = 1;
  // The region's pages below this were written here first, so the memory
  // is this process's (a page the daemon's read faults in first would be
  // charged to the daemon's memory cgroup).
  uint64_t touched = 0;
  uint64_t vector_bytes = 4096;  // of the last reply: the guess for the next
  void Touch(uint64_t end) {
    end = std::min(end, bytes);
    for (; touched < end; touched += lq::kOutAlign) base[touched] = 0;
  }
  ~Conn() {
    if (base != nullptr) ::munmap(base, bytes);
  }
};

struct LocalQueries::Pool {
  Mutex mu;
  bool open ABSL_GUARDED_BY(mu) = true;  // false once LocalQueries is gone
  std::vector<std::unique_ptr<Conn>> idle ABSL_GUARDED_BY(mu);
  uint64_t max_region_bytes ABSL_GUARDED_BY(mu) = 0;
  int64_t lent ABSL_GUARDED_BY(mu) = 0;  // connections held by blocks

  // Takes back a connection (closes it once the pool is gone).
  void Put(std::unique_ptr<Conn> c) ABSL_LOCKS_EXCLUDED(mu) {
    MutexLock lock(&mu);
    if (open) idle.push_back(std::move(c));
  }
};

// One dataset's direct reads: its layout as the daemon described it at
// `fetched`, and the descriptors of its files opened so far.
struct LocalQueries::Direct {
  std::chrono::steady_clock::time_point fetched;  // not the wall clock
  bool offered = false;  // false: the daemon reads this dataset's vectors
  uint64_t serial = 0;
  VectorLayout layout;
  Mutex mu;
  // Index = file; null until opened. Shared with the reads using them.
  std::vector<std::shared_ptr<const UniqueFd>> files ABSL_GUARDED_BY(mu);
};

LocalQueries::LocalQueries(std::string path, int timeout_seconds,
                           bool direct_reads)
    : path_(std::move(path)),
      timeout_seconds_(timeout_seconds),
      direct_reads_(direct_reads),
      pool_(std::make_shared<Pool>()) {}

std::unique_ptr<LocalQueries> LocalQueries::Open(const std::string& path,
                                                 int timeout_seconds,
                                                 bool direct_reads) {
  std::unique_ptr<LocalQueries> q(
      new LocalQueries(path, timeout_seconds, direct_reads));
  absl::StatusOr<std::unique_ptr<Conn>> c = q->Connect(kFirstRegionBytes);
  if (!c.ok()) return nullptr;
  q->Return(std::move(*c));
  return q;
}

LocalQueries::~LocalQueries() {
  // Blocks that still hold a connection close it when they go.
  std::vector<std::unique_ptr<Conn>> idle;
  MutexLock lock(&pool_->mu);
  pool_->open = false;
  idle.swap(pool_->idle);
}

void LocalQueries::Return(std::unique_ptr<Conn> c) { pool_->Put(std::move(c)); }

VectorBlock LocalQueries::MakeBlock(std::unique_ptr<Conn> c,
                                    std::vector<int64_t> shape,
                                    uint64_t out_offset) {
  const uint64_t floats =
      static_cast<uint64_t>(shape[0]) * static_cast<uint64_t>(shape[1]);
  VectorBlock block;
  block.shape = std::move(shape);
  bool lend = false;
  if (floats > 0) {
    MutexLock lock(&pool_->mu);
    lend = pool_->lent < kMaxLent;
    if (lend) ++pool_->lent;
  }
  if (!lend) {
    std::shared_ptr<float[]> values(new float[std::max<uint64_t>(floats, 1)]);
    std::memcpy(values.get(), c->base + out_offset, floats * sizeof(float));
    block.values = absl::Span<const float>(values.get(), floats);
    block.storage = std::move(values);
    Return(std::move(c));
    return block;
  }
  block.values = absl::Span<const float>(
      reinterpret_cast<const float*>(c->base + out_offset), floats);
  // The block's last copy gives the connection back (or closes it, when
  // this LocalQueries is gone).
  block.storage =
      std::shared_ptr<const void>(c.release(), [pool = pool_](const void* p) {
        std::unique_ptr<Conn> conn(static_cast<Conn*>(const_cast<void*>(p)));
        {
          MutexLock lock(&pool->mu);
          --pool->lent;
        }
        pool->Put(std::move(conn));
      });
  return block;
}

absl::StatusOr<std::unique_ptr<LocalQueries::Conn>> LocalQueries::Connect(
    uint64_t region_bytes) {
  auto c = std::make_unique<Conn>();
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path_.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path ", path_, " is too long"));
  }
  std::memcpy(addr.sun_path, path_.data(), path_.size());
  c->fd.Reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!c->fd.valid()) return ErrnoToStatus(errno, "socket");
  if (::connect(c->fd.get(), reinterpret_cast<sockaddr*>(&addr),
                sizeof(addr)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("connect to ", path_));
  }
  region_bytes = RoundUp(region_bytes, lq::kOutAlign);
  // The daemon maps only regions that cannot shrink under its writes.
  ASSIGN_OR_RETURN(UniqueFd memfd, SealedMemfd("shardcast-queries",
                                               region_bytes, "query region"));
  void* p = ::mmap(nullptr, region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   memfd.get(), 0);
  if (p == MAP_FAILED) return ErrnoToStatus(errno, "map the query region");
  c->base = static_cast<char*>(p);
  c->bytes = region_bytes;
  // The hello's reply is waited for at most timeout_seconds.
  struct timeval tv = {timeout_seconds_, 0};
  ::setsockopt(c->fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  lq::Hello hello;
  hello.region_bytes = region_bytes;
  RETURN_IF_ERROR(SendWithDescriptor(c->fd.get(), hello.Encode(), memfd.get()));
  char buf[kMaxReplyBytes];
  std::vector<UniqueFd> none;  // a hello's reply carries no descriptor
  ASSIGN_OR_RETURN(absl::string_view bytes, Receive(c->fd.get(), buf, &none));
  lq::HelloReply reply;
  if (!reply.Decode(bytes)) {
    return absl::DataLossError("not a local query hello reply");
  }
  if (reply.code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.code),
                        reply.message);
  }
  tv = {0, 0};  // calls may take as long as their reads
  ::setsockopt(c->fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  MutexLock lock(&pool_->mu);
  pool_->max_region_bytes = reply.max_region_bytes;
  return c;
}

absl::StatusOr<std::vector<int64_t>> LocalQueries::Call(
    Conn& c, const std::string& dataset, const std::vector<VectorCoord>& coords,
    uint64_t* out, uint64_t* need) {
  *need = 0;
  const uint64_t n = coords.size();
  const uint64_t coords_bytes = n * lq::kCoordBytes;
  const uint64_t out_offset = RoundUp(coords_bytes, lq::kOutAlign);
  *out = out_offset;
  if (out_offset >= c.bytes) {
    *need = out_offset + lq::kOutAlign;
    return absl::ResourceExhaustedError("the coordinates need a larger region");
  }
  c.Touch(out_offset + n * c.vector_bytes);
  char* p = c.base;
  for (const VectorCoord& v : coords) {
    const int64_t triple[3] = {v.example, v.layer, v.token};
    std::memcpy(p, triple, sizeof(triple));
    p += sizeof(triple);
  }
  lq::Request request;
  request.count = n;
  request.coords_offset = 0;
  request.out_offset = out_offset;
  request.dataset = dataset;
  std::vector<UniqueFd> none;  // a reply to vectors carries no descriptor
  ASSIGN_OR_RETURN(const lq::Reply reply, Ask(c, std::move(request), &none));
  if (reply.code != 0) {
    *need = reply.need_region_bytes;
    return absl::Status(static_cast<absl::StatusCode>(reply.code),
                        reply.message);
  }
  if (reply.rows != n || reply.d_model == 0 ||
      reply.d_model >
          (c.bytes - out_offset) / sizeof(float) / std::max<uint64_t>(n, 1)) {
    return absl::DataLossError(
        absl::StrCat("the daemon's local query reply has ", reply.rows, " x ",
                     reply.d_model, " vectors for ", n, " coordinates"));
  }
  c.vector_bytes = reply.d_model * sizeof(float);
  return std::vector<int64_t>{static_cast<int64_t>(n),
                              static_cast<int64_t>(reply.d_model)};
}

absl::StatusOr<std::unique_ptr<LocalQueries::Conn>> LocalQueries::Take() {
  {
    MutexLock lock(&pool_->mu);
    if (!pool_->idle.empty()) {
      std::unique_ptr<Conn> c = std::move(pool_->idle.back());
      pool_->idle.pop_back();
      return c;
    }
  }
  return Connect(kFirstRegionBytes);
}

absl::StatusOr<lq::Reply> LocalQueries::Ask(Conn& c, lq::Request request,
                                            std::vector<UniqueFd>* fds) {
  request.id = c.next_id++;
  absl::Status sent = SendWithDescriptor(c.fd.get(), request.Encode(), -1);
  if (!sent.ok()) return absl::UnavailableError(sent.message());
  char buf[kMaxReplyBytes];
  absl::StatusOr<absl::string_view> bytes = Receive(c.fd.get(), buf, fds);
  if (!bytes.ok()) {
    return absl::IsDataLoss(bytes.status())
               ? bytes.status()
               : absl::UnavailableError(bytes.status().message());
  }
  lq::Reply reply;
  if (!reply.Decode(*bytes) || reply.id != request.id) {
    return absl::DataLossError(
        "the daemon's local query reply does not answer the request");
  }
  return reply;
}

void LocalQueries::Forget(const std::string& dataset) {
  MutexLock lock(&direct_mu_);
  direct_.erase(dataset);
}

std::shared_ptr<LocalQueries::Direct> LocalQueries::DirectFor(
    const std::string& dataset) {
  // How long a layout is used before the daemon is asked again: a dataset
  // the daemon stops serving (a rescan) is read here at most this long.
  constexpr std::chrono::seconds kLayoutAge(1);
  // Datasets remembered at once; past it all are forgotten.
  constexpr size_t kMaxDatasets = 64;
  if (direct_unimplemented_.load(std::memory_order_relaxed)) return nullptr;
  const auto now = std::chrono::steady_clock::now();
  std::shared_ptr<Direct> old;
  {
    MutexLock lock(&direct_mu_);
    auto it = direct_.find(dataset);
    if (it != direct_.end() && now - it->second->fetched < kLayoutAge) {
      return it->second->offered ? it->second : nullptr;
    }
    // One thread asks; the others have the daemon read meanwhile (one
    // round trip), rather than each asking and each opening the files anew.
    if (!refreshing_.insert(dataset).second) return nullptr;
    if (it != direct_.end()) {
      old = it->second;
      // Not used past its age, whatever the refresh below gives: a failed
      // one (the daemon restarting) must not leave the old files in use.
      direct_.erase(it);
    }
  }
  absl::Cleanup done = [this, &dataset] {
    MutexLock lock(&direct_mu_);
    refreshing_.erase(dataset);
  };
  absl::StatusOr<std::unique_ptr<Conn>> c = Take();
  if (!c.ok()) return nullptr;
  auto d = std::make_shared<Direct>();
  d->fetched = now;
  lq::Request request;
  request.op = lq::Op::kLayout;
  request.dataset = dataset;
  std::vector<UniqueFd> fds;
  absl::StatusOr<lq::Reply> reply = Ask(**c, std::move(request), &fds);
  if (!reply.ok()) return nullptr;  // the connection goes with `c`
  if (reply->code == static_cast<uint32_t>(absl::StatusCode::kUnimplemented)) {
    direct_unimplemented_.store(true, std::memory_order_relaxed);
  }
  if (reply->code == 0 && reply->rows <= (*c)->bytes) {
    absl::StatusOr<VectorLayout> layout = VectorLayout::Decode(
        absl::string_view((*c)->base, static_cast<size_t>(reply->rows)));
    if (layout.ok()) {
      d->offered = true;
      d->serial = reply->serial;
      d->layout = *std::move(layout);
    }
  }
  Return(*std::move(c));
  // Anything else (no such dataset, a daemon that hands out no files or
  // does not know the operation, a layout larger than the region): the
  // daemon reads this dataset's vectors until the layout is asked again.
  if (d->offered) {
    const size_t files = static_cast<size_t>(d->layout.num_files());
    MutexLock lock(&d->mu);
    d->files.resize(files);
    if (old != nullptr && old->offered && old->serial == d->serial) {
      MutexLock old_lock(&old->mu);  // the same files: keep those open
      d->files = old->files;
    }
  }
  MutexLock lock(&direct_mu_);
  if (direct_.size() >= kMaxDatasets) direct_.clear();
  direct_[dataset] = d;
  return d->offered ? d : nullptr;
}

std::optional<VectorBlock> LocalQueries::ReadDirect(
    const std::string& dataset, const std::vector<VectorCoord>& coords) {
  // Descriptors of dataset files this process keeps open at most (a
  // quarter of its descriptor limit, at most 256): past it, vectors in
  // files not open yet are read by the daemon.
  static const int64_t kMaxOpenFiles = [] {
    struct rlimit r;
    if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) {
      return int64_t{256};
    }
    return std::min<int64_t>(256, static_cast<int64_t>(r.rlim_cur / 4));
  }();
  std::shared_ptr<Direct> d = DirectFor(dataset);
  if (d == nullptr) return std::nullopt;
  std::vector<VectorLayout::Place> places(coords.size());
  for (size_t i = 0; i < coords.size(); ++i) {
    const VectorCoord& v = coords[i];
    if (!d->layout.Find(v.example, v.layer, v.token, &places[i])) {
      return std::nullopt;
    }
  }
  // The descriptors, asked for those not open yet.
  std::vector<std::shared_ptr<const UniqueFd>> fds(places.size());
  std::vector<int64_t> missing;
  {
    MutexLock lock(&d->mu);
    for (size_t i = 0; i < places.size(); ++i) {
      fds[i] = d->files[static_cast<size_t>(places[i].file)];
      if (fds[i] == nullptr && std::find(missing.begin(), missing.end(),
                                         places[i].file) == missing.end()) {
        missing.push_back(places[i].file);
      }
    }
  }
  if (!missing.empty()) {
    if (missing.size() > lq::kMaxFilesPerOpen ||
        open_files_->load(std::memory_order_relaxed) +
                static_cast<int64_t>(missing.size()) >
            kMaxOpenFiles) {
      return std::nullopt;
    }
    absl::StatusOr<std::unique_ptr<Conn>> c = Take();
    if (!c.ok()) return std::nullopt;
    (*c)->Touch(missing.size() * sizeof(int64_t));
    std::memcpy((*c)->base, missing.data(), missing.size() * sizeof(int64_t));
    lq::Request request;
    request.op = lq::Op::kOpenFiles;
    request.count = missing.size();
    request.serial = d->serial;
    request.dataset = dataset;
    std::vector<UniqueFd> got;
    absl::StatusOr<lq::Reply> reply = Ask(**c, std::move(request), &got);
    if (!reply.ok()) return std::nullopt;
    Return(*std::move(c));
    if (reply->code != 0 || got.size() != missing.size()) {
      // ABORTED: the dataset changed since its layout; ask for it again.
      if (reply->code == static_cast<uint32_t>(absl::StatusCode::kAborted)) {
        Forget(dataset);
      }
      return std::nullopt;
    }
    MutexLock lock(&d->mu);
    for (size_t k = 0; k < missing.size(); ++k) {
      open_files_->fetch_add(1, std::memory_order_relaxed);
      std::shared_ptr<const UniqueFd> fd(
          new UniqueFd(std::move(got[k])),
          [count = open_files_](const UniqueFd* f) {
            delete f;
            count->fetch_sub(1, std::memory_order_relaxed);
          });
      d->files[static_cast<size_t>(missing[k])] = fd;
      for (size_t i = 0; i < places.size(); ++i) {
        if (places[i].file == missing[k]) fds[i] = fd;
      }
    }
  }
  // The reads. A short one (a file cut since) or an error: the daemon reads
  // the vectors, and says what is wrong.
  const uint64_t bytes = d->layout.vector_bytes();
  const uint64_t floats =
      places.size() * static_cast<uint64_t>(d->layout.d_model);
  std::shared_ptr<float[]> values(new float[std::max<uint64_t>(floats, 1)]);
  char* out = reinterpret_cast<char*>(values.get());
  for (size_t i = 0; i < places.size(); ++i) {
    ssize_t n;
    do {
      n = ::pread(fds[i]->get(), out + i * bytes, bytes,
                  static_cast<off_t>(places[i].offset));
    } while (n < 0 && errno == EINTR);
    if (n != static_cast<ssize_t>(bytes)) return std::nullopt;
  }
  VectorBlock block;
  block.shape = {static_cast<int64_t>(places.size()), d->layout.d_model};
  block.values = absl::Span<const float>(values.get(), floats);
  block.storage = std::move(values);
  return block;
}

std::optional<absl::StatusOr<VectorBlock>> LocalQueries::GetVectors(
    const std::string& dataset, const std::vector<VectorCoord>& coords) {
  // No dataset has a name this long, but the socket's requests cannot say
  // so: gRPC answers (NOT_FOUND), as for a client without the socket. (The
  // one check: ReadDirect, DirectFor and Call are only reached from here.)
  if (dataset.size() > lq::kMaxDatasetBytes) return std::nullopt;
  if (direct_reads_ && !coords.empty() && coords.size() <= kDirectMaxVectors) {
    std::optional<VectorBlock> block = ReadDirect(dataset, coords);
    if (block.has_value()) return *std::move(block);
  }
  std::unique_ptr<Conn> c;
  if (absl::StatusOr<std::unique_ptr<Conn>> idle = Take(); idle.ok()) {
    c = *std::move(idle);
  }
  // A new connection when none is free, a broken one is replaced once, and
  // a region too small is replaced by a larger one (for the coordinates,
  // then for the vectors, whose size only the daemon knows).
  bool replaced = false;
  int growths = 0;
  while (true) {
    if (c == nullptr) {
      absl::StatusOr<std::unique_ptr<Conn>> made = Connect(kFirstRegionBytes);
      if (!made.ok()) return std::nullopt;
      c = std::move(*made);
    }
    uint64_t need = 0, out_offset = 0;
    absl::StatusOr<std::vector<int64_t>> shape =
        Call(*c, dataset, coords, &out_offset, &need);
    if (shape.ok())
      return MakeBlock(std::move(c), *std::move(shape), out_offset);
    if (absl::IsDataLoss(shape.status())) return shape.status();  // drop c
    if (need == 0 && !absl::IsUnavailable(shape.status())) {
      Return(std::move(c));
      return shape.status();
    }
    if (need > 0) {
      uint64_t max_bytes;
      {
        MutexLock lock(&pool_->mu);
        max_bytes = pool_->max_region_bytes;
      }
      if (growths == 2 || need <= c->bytes || need > max_bytes) {
        Return(std::move(c));
        return shape.status();  // the daemon's RESOURCE_EXHAUSTED
      }
      ++growths;
      absl::StatusOr<std::unique_ptr<Conn>> made =
          Connect(std::min(max_bytes, std::max(need, 2 * c->bytes)));
      if (!made.ok()) return std::nullopt;
      c = std::move(*made);
      continue;
    }
    // The connection broke (the daemon restarted?): one new try.
    c.reset();
    if (replaced) return std::nullopt;
    replaced = true;
  }
}

}  // namespace internal_client
}  // namespace shardcast
