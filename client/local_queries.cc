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
#include "common/local/channel.h"
#include "common/local/memfd.h"
#include "common/local/vector_layout.h"

namespace shardcast {
namespace internal_client {
namespace {

// The first region of a connection: 256 vectors of d_model 1024 and their
// coordinates. Its pages are only touched as calls use them.
constexpr uint64_t kFirstRegionBytes = (1 << 20) + 2 * local::kOutAlign;

uint64_t RoundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

}  // namespace

struct LocalQueries::Conn {
  explicit Conn(LocalConnection c) : channel(std::move(c)) {}
  LocalConnection channel;
  SharedMapping region;  // the query region the daemon handed over
  // The region's pages below this were written here first, so the memory
  // is this process's (a page the daemon's read faults in first would be
  // charged to the daemon's memory cgroup).
  uint64_t touched = 0;
  uint64_t vector_bytes = 4096;  // of the last reply: the guess for the next
  char* base() const { return region.data(); }
  uint64_t bytes() const { return region.size(); }
  void Touch(uint64_t end) {
    end = std::min(end, bytes());
    for (; touched < end; touched += local::kOutAlign) base()[touched] = 0;
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
    std::memcpy(values.get(), c->base() + out_offset, floats * sizeof(float));
    block.values = absl::Span<const float>(values.get(), floats);
    block.storage = std::move(values);
    Return(std::move(c));
    return block;
  }
  block.values = absl::Span<const float>(
      reinterpret_cast<const float*>(c->base() + out_offset), floats);
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
  ASSIGN_OR_RETURN(LocalConnection channel, LocalConnection::Connect(path_));
  auto c = std::make_unique<Conn>(std::move(channel));
  RETURN_IF_ERROR(Grow(*c, region_bytes));
  return c;
}

absl::Status LocalQueries::Grow(Conn& c, uint64_t bytes) {
  v1::LocalRequest request;
  request.mutable_query_region()->set_bytes(RoundUp(bytes, local::kOutAlign));
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  // The reply is waited for at most timeout_seconds.
  RETURN_IF_ERROR(c.channel.AskOk(request, &reply, &fds,
                                  "local queries: ", timeout_seconds_));
  const uint64_t got = reply.query_region().bytes();
  if (!reply.has_query_region() || fds.size() != 1 || got < bytes) {
    return absl::DataLossError(
        "the daemon's query region does not match its reply");
  }
  ASSIGN_OR_RETURN(c.region,
                   SharedMapping::Map(fds[0].get(), got,
                                      /*writable=*/true, "query region"));
  c.touched = 0;
  MutexLock lock(&pool_->mu);
  pool_->max_region_bytes = reply.query_region().max_region_bytes();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> LocalQueries::Call(
    Conn& c, const std::string& dataset, const std::vector<VectorCoord>& coords,
    uint64_t* out, uint64_t* need) {
  *need = 0;
  const uint64_t n = coords.size();
  const uint64_t coords_bytes = n * local::kCoordBytes;
  const uint64_t out_offset = RoundUp(coords_bytes, local::kOutAlign);
  *out = out_offset;
  if (out_offset >= c.bytes()) {
    *need = out_offset + local::kOutAlign;
    return absl::ResourceExhaustedError("the coordinates need a larger region");
  }
  c.Touch(out_offset + n * c.vector_bytes);
  char* p = c.base();
  for (const VectorCoord& v : coords) {
    const int64_t triple[3] = {v.example, v.layer, v.token};
    std::memcpy(p, triple, sizeof(triple));
    p += sizeof(triple);
  }
  v1::LocalRequest request;
  v1::LocalRequest::Vectors* asked = request.mutable_vectors();
  asked->set_dataset(dataset);
  asked->set_count(n);
  asked->set_coords_offset(0);
  asked->set_out_offset(out_offset);
  v1::LocalReply reply;
  std::vector<UniqueFd> none;  // a reply to vectors carries no descriptor
  RETURN_IF_ERROR(c.channel.Ask(request, &reply, &none));
  if (reply.code() != 0) {
    *need = reply.need_region_bytes();
    return absl::Status(static_cast<absl::StatusCode>(reply.code()),
                        reply.message());
  }
  const uint64_t rows = reply.vectors().rows();
  const uint64_t d_model = reply.vectors().d_model();
  if (!none.empty() || rows != n || d_model == 0 ||
      d_model >
          (c.bytes() - out_offset) / sizeof(float) / std::max<uint64_t>(n, 1)) {
    return absl::DataLossError(
        absl::StrCat("the daemon's local query reply has ", rows, " x ",
                     d_model, " vectors for ", n, " coordinates"));
  }
  c.vector_bytes = d_model * sizeof(float);
  return std::vector<int64_t>{static_cast<int64_t>(n),
                              static_cast<int64_t>(d_model)};
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
  v1::LocalRequest request;
  request.mutable_layout()->set_dataset(dataset);
  request.mutable_layout()->set_out_offset(0);
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  if (!(*c)->channel.Ask(request, &reply, &fds).ok()) {
    return nullptr;  // the connection goes with `c`
  }
  if (reply.code() == static_cast<int32_t>(absl::StatusCode::kUnimplemented)) {
    direct_unimplemented_.store(true, std::memory_order_relaxed);
  }
  const uint64_t layout_bytes = reply.layout().bytes();
  if (reply.code() == 0 && layout_bytes <= (*c)->bytes()) {
    absl::StatusOr<VectorLayout> layout = VectorLayout::Decode(
        absl::string_view((*c)->base(), static_cast<size_t>(layout_bytes)));
    if (layout.ok()) {
      d->offered = true;
      d->serial = reply.layout().serial();
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
    if (missing.size() > local::kMaxFilesPerOpen ||
        open_files_->load(std::memory_order_relaxed) +
                static_cast<int64_t>(missing.size()) >
            kMaxOpenFiles) {
      return std::nullopt;
    }
    absl::StatusOr<std::unique_ptr<Conn>> c = Take();
    if (!c.ok()) return std::nullopt;
    v1::LocalRequest request;
    v1::LocalRequest::OpenFiles* asked = request.mutable_open_files();
    asked->set_dataset(dataset);
    asked->set_serial(d->serial);
    for (int64_t f : missing) asked->add_files(f);
    v1::LocalReply reply;
    std::vector<UniqueFd> got;
    if (!(*c)->channel.Ask(request, &reply, &got).ok()) return std::nullopt;
    Return(*std::move(c));
    if (reply.code() != 0 || got.size() != missing.size()) {
      // ABORTED: the dataset changed since its layout; ask for it again.
      if (reply.code() == static_cast<int32_t>(absl::StatusCode::kAborted)) {
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
  // No dataset has a name this long, but the channel's messages cannot say
  // so: gRPC answers (NOT_FOUND), as for a client without the channel. (The
  // one check: ReadDirect, DirectFor and Call are only reached from here.)
  if (dataset.size() > local::kMaxMessageBytes / 2) return std::nullopt;
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
      if (growths == 2 || need <= c->bytes() || need > max_bytes) {
        Return(std::move(c));
        return shape.status();  // the daemon's RESOURCE_EXHAUSTED
      }
      ++growths;
      // A larger region on the same connection.
      if (!Grow(*c, std::min(max_bytes, std::max(need, 2 * c->bytes()))).ok()) {
        return std::nullopt;
      }
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
