#include "server/engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/human_bytes.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "server/engine/ordered_stream.h"
#include "server/engine/shuffled_stream.h"

namespace shardcast {

namespace {

// Seals the resume token of every batch a stream hands out: the streams
// know nothing of the key (resume_token.h, TokenSealer).
class SealedSource final : public BatchSource {
 public:
  // `counted`: the stream's place in its owner's count, given back when the
  // source goes.
  SealedSource(std::unique_ptr<BatchSource> inner, const TokenSealer* sealer,
               std::shared_ptr<void> counted)
      : inner_(std::move(inner)),
        sealer_(sealer),
        counted_(std::move(counted)) {
    shape_ = inner_->shape();
  }

  absl::StatusOr<Fill> Next(VectorDest dest, StreamBatch* out,
                            std::function<void()> waker) override {
    absl::StatusOr<Fill> fill = inner_->Next(dest, out, std::move(waker));
    if (fill.ok() && *fill == Fill::kBatch) {
      out->resume_token = sealer_->Seal(out->resume_token);
      out->dtype = static_cast<int>(shape_.dtype);
      out->transform = shape_.transform;
    }
    return fill;
  }
  bool CanView() const override { return inner_->CanView(); }

 private:
  std::unique_ptr<BatchSource> inner_;
  const TokenSealer* sealer_;
  std::shared_ptr<void> counted_;
};

}  // namespace

Engine::Engine(EngineOptions options)
    : options_(std::move(options)),
      catalog_(
          std::make_unique<Catalog>(options_.roots, options_.trusted_roots)),
      queries_(catalog_.get(), options_.limits, options_.query_direct),
      tokens_(options_.token_key.empty() ? TokenSealer::RandomKey()
                                         : options_.token_key) {}

Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Start(EngineOptions options) {
  std::unique_ptr<Engine> e(new Engine(std::move(options)));
  e->Rescan();
  ScanRegistry::Options scans;
  scans.reservoir = e->options_.reservoir;
  scans.reads = e->options_.reads;
  scans.scans = e->options_.scans;
  scans.gather_helpers = e->options_.gather_helpers;
  scans.on_sweep_scan = e->options_.on_sweep_scan;
  ASSIGN_OR_RETURN(e->scans_, ScanRegistry::Start(scans));
  e->leases_ =
      std::make_unique<LeasePool>(e->scans_.get(), e->scans_->reservoir());
  const Reservoir& r = *e->scans_->reservoir();
  const ReadEngine& reads = *e->scans_->engine();
  const ScanOptions& s = e->options_.scans;
  LogInfo(
      "reservoir ", r.bytes() >> 20, " MiB in ", r.num_slots(), " blocks of ",
      r.slot_bytes() >> 10, " KiB; each shuffled stream reserves ",
      s.window_blocks + s.lag_blocks, " (window ", s.window_blocks, " + lag ",
      s.lag_blocks,
      "); read engine: ", reads.uses_uring() ? "io_uring" : "pread fallback",
      ", ", reads.options().queue_depth,
      " reads of <= ", reads.options().read_bytes >> 10, " KiB in flight",
      s.read_mode == ScanReadMode::kAuto     ? ", read mode auto"
      : s.read_mode == ScanReadMode::kDirect ? ", read mode direct"
                                             : ", read mode buffered",
      reads.buffers_registered() ? ", registered buffers" : "", "; ",
      e->scans_->gather().helpers(),
      " gather helper thread(s) for large batches");
  return e;
}

std::pair<int64_t, int64_t> Engine::Rescan() {
  auto [ok, failed] = catalog_->Rescan();
  datasets_ok_ = ok;
  datasets_failed_ = failed;
  LogInfo("catalog: ", ok, " dataset(s) served, ", failed, " rejected");
  return {ok, failed};
}

absl::StatusOr<std::unique_ptr<BatchSource>> Engine::OpenStream(
    StreamOptions o) {
  if (o.spec.node_count == 0) {
    o.spec.node_rank = options_.node_rank;
    o.spec.node_count = options_.node_count;
    // A sweep: every node's trainers get every block (docs/sweeps.md). Not
    // for datasets attached by path: their ids are this daemon's own (a
    // random part), which no peer could resolve; they are read here whole.
    // (A catalog directory named "@..." is read whole too.)
    if (options_.sweep_shares > 1 && o.order == StreamOrder::kShuffled &&
        !absl::StartsWith(o.dataset, std::string(1, kAttachedPrefix))) {
      o.spec.node_rank = 0;
      o.spec.node_count = 1;
      o.spec.sweep_share = options_.sweep_share;
      o.spec.sweep_shares = options_.sweep_shares;
    }
  }
  ASSIGN_OR_RETURN(std::shared_ptr<void> counted, CountStream(o.owner));
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(o.dataset));
  const DatasetDesc& d = reader->desc();
  const uint64_t vb = static_cast<uint64_t>(d.d_model) *
                      OutputDTypeBytes(o.spec.transform.dtype);
  if (o.max_batch_bytes > 0 && o.spec.batch_size > 0 &&
      static_cast<uint64_t>(o.spec.batch_size) > o.max_batch_bytes / vb) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size ", o.spec.batch_size, " x d_model ", d.d_model,
                     " x ", OutputDTypeBytes(o.spec.transform.dtype),
                     " bytes exceeds the ", o.max_batch_bytes >> 20,
                     " MiB a batch may hold on this connection; use at most ",
                     o.max_batch_bytes / vb, " vectors per batch"));
  }
  std::string token;
  if (!o.resume_token.empty()) {
    ASSIGN_OR_RETURN(token, tokens_.Open(o.resume_token));
  }
  // The transform first: computing statistics is the slow part, and a
  // stream that cannot have them must not join a scan. A request that is
  // bad anyway is refused before that.
  RETURN_IF_ERROR(ValidateStreamSpec(reader->info(), &o.spec));
  RETURN_IF_ERROR(Selection::Create(d, o.spec).status());
  VectorTransform transform;
  if (o.spec.transform.needs_stats() ||
      o.spec.transform.dtype != OutputDType::kFloat32) {
    StatsEntry stats;
    if (o.spec.transform.needs_stats()) {
      ASSIGN_OR_RETURN(stats, Stats(*reader));
    }
    const StatsGroup group =
        o.spec.tokens == TokenSelection::kContent   ? StatsGroup::kContent
        : o.spec.tokens == TokenSelection::kSpecial ? StatsGroup::kSpecial
                                                    : StatsGroup::kAll;
    ASSIGN_OR_RETURN(transform, VectorTransform::Create(o.spec.transform, d,
                                                        stats.stats.get(),
                                                        group, stats.origin));
  }
  const std::string id = reader->info().dir_name;
  std::unique_ptr<BatchSource> source;
  if (o.order == StreamOrder::kShuffled) {
    ASSIGN_OR_RETURN(source, ShuffledStream::Create(
                                 scans_.get(), std::move(reader), id, o.spec,
                                 o.seed, token, o.peer, o.client));
  } else {
    ASSIGN_OR_RETURN(source,
                     OrderedStream::Create(std::move(reader), id, o.spec, token,
                                           &ordered_bytes_read_));
  }
  source->SetTransform(std::move(transform));
  return std::make_unique<SealedSource>(std::move(source), &tokens_,
                                        std::move(counted));
}

absl::StatusOr<std::unique_ptr<ShareFeed>> Engine::OpenShareFeed(
    const std::string& dataset, StreamSpec spec, uint64_t seed,
    const std::string& peer) {
  if (spec.sweep_shares < 2 || spec.sweep_share < 0 ||
      spec.sweep_share >= spec.sweep_shares) {
    return absl::InvalidArgumentError(
        absl::StrCat("a share feed names a share of a sweep (sweep share ",
                     spec.sweep_share, " of ", spec.sweep_shares, ")"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  spec.epochs = 1;      // a pass
  spec.batch_size = 1;  // (it has blocks, not batches)
  spec.rank = 0;
  spec.world_size = 1;
  RETURN_IF_ERROR(ValidateStreamSpec(reader->info(), &spec));
  SubscriberSpec sub;
  sub.peer = peer;
  sub.client = absl::StrCat("share ", spec.sweep_share);
  sub.node_rank = spec.sweep_share;
  sub.node_count = spec.sweep_shares;
  sub.epochs = 1;
  sub.borrow = false;
  const std::string id = reader->info().dir_name;
  ASSIGN_OR_RETURN(
      std::unique_ptr<ScanRegistry::Subscription> s,
      scans_->Subscribe(std::move(reader), id, spec, seed, std::move(sub)));
  return std::make_unique<ShareFeed>(std::move(s));
}

absl::StatusOr<std::shared_ptr<void>> Engine::CountStream(
    const std::string& owner) {
  if (owner.empty()) return nullptr;
  {
    MutexLock lock(&owners_->mu);
    int64_t& open = owners_->open[owner];
    const int64_t cap = options_.max_streams_per_owner;
    if (cap > 0 && open >= cap) {
      return absl::ResourceExhaustedError(absl::StrCat(
          owner, " has ", open,
          " streams open, the limit for one user (--max-streams-per-user ", cap,
          ")"));
    }
    ++open;
  }
  // Counted out when the last copy goes (the stream's source).
  std::shared_ptr<StreamOwners> owners = owners_;
  return std::shared_ptr<void>(
      nullptr, [owners = std::move(owners), owner](void*) {
        MutexLock lock(&owners->mu);
        auto it = owners->open.find(owner);
        if (it != owners->open.end() && --it->second <= 0) {
          owners->open.erase(it);
        }
      });
}

absl::StatusOr<Engine::StatsEntry> Engine::Stats(const DatasetReader& reader) {
  return stats_.Get(reader.info(),
                    [this, &reader] { return LoadOrComputeStats(reader); });
}

absl::StatusOr<Engine::StatsEntry> Engine::LoadOrComputeStats(
    const DatasetReader& reader) {
  const DatasetInfo& info = reader.info();
  StatsEntry entry;
  absl::StatusOr<DatasetStats> read = ReadStatsSidecar(info);
  if (read.ok()) {
    entry.origin = absl::StrCat("statistics from ", kStatsFile);
    entry.stats = std::make_shared<const DatasetStats>(std::move(*read));
    return entry;
  }
  if (read.status().code() != absl::StatusCode::kNotFound) return read.status();
  LogInfo("dataset ", info.dir_name, ": no ", kStatsFile,
          "; computing its statistics for scale_norm/center now (a full "
          "read of ",
          HumanBytes(info.desc.data_bytes()), "; `shardcast stats ", info.dir,
          "` stores them)");
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<DatasetStats> computed = ComputeDatasetStats(reader);
  if (!computed.ok()) {
    LogWarning(
        "dataset ", info.dir_name,
        ": statistics could not be computed: ", computed.status().message());
    return computed.status();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  LogInfo("dataset ", info.dir_name, ": statistics computed in ", seconds,
          " s");
  entry.origin = "statistics computed on first use";
  entry.stats = std::make_shared<const DatasetStats>(std::move(*computed));
  return entry;
}

LeasePool::~LeasePool() {
  MutexLock lock(&mu_);
  if (bytes_ != 0) {
    LogError("engine: ", bytes_, " bytes of memory leases outlive the engine");
  }
}

absl::StatusOr<uint64_t> LeasePool::Take(uint64_t bytes,
                                         const std::string& what) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  MutexLock lock(&mu_);
  if (bytes > reservoir_->bytes() - bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " needs ", bytes, " bytes; the reservoir has ",
                     reservoir_->bytes(), " (--reservoir-bytes), ", bytes_,
                     " of them lent to other clients' buffers"));
  }
  bytes = (bytes + page - 1) / page * page;  // what the kernel gives
  const int64_t need = Blocks(bytes_ + bytes) - Blocks(bytes_);
  if (need > 0) {
    RETURN_IF_ERROR(scans_->Reserve(need, what));
    reservoir_->Park(need);  // their pages go back to the kernel
  }
  bytes_ += bytes;
  return bytes;
}

void LeasePool::Give(uint64_t bytes) {
  MutexLock lock(&mu_);
  const int64_t held = Blocks(bytes_);
  bytes_ -= std::min(bytes, bytes_);
  const int64_t spare = held - Blocks(bytes_);
  if (spare > 0) {
    reservoir_->Unpark(spare);
    reservoir_->Unreserve(spare);
  }
}

absl::StatusOr<std::unique_ptr<MemoryLease>> Engine::LeaseMemory(
    uint64_t bytes, const std::string& what) {
  ASSIGN_OR_RETURN(bytes, leases_->Take(bytes, what));
  return std::unique_ptr<MemoryLease>(new MemoryLease(leases_.get(), bytes));
}

namespace {

// The remote side of the rule: which roots TCP clients may read, and who.
absl::Status CheckRemote(const std::vector<RemoteRoot>& roots,
                         const Caller& caller, const CatalogEntry& entry) {
  if (entry.root.empty()) {
    return absl::PermissionDeniedError(
        "a dataset attached by path is served on the daemon's node only");
  }
  if (roots.empty()) return absl::OkStatus();
  for (const RemoteRoot& r : roots) {
    if (r.root != entry.root) continue;
    if (r.names.empty()) return absl::OkStatus();
    for (const std::string& name : caller.certificate_names) {
      if (std::find(r.names.begin(), r.names.end(), name) != r.names.end()) {
        return absl::OkStatus();
      }
    }
    return absl::PermissionDeniedError(absl::StrCat(
        "dataset ", entry.id,
        " is open to remote clients whose certificate "
        "names one of: ",
        absl::StrJoin(r.names, ", "),
        caller.certificate_names.empty()
            ? "; this client presented none"
            : absl::StrCat("; this one names ",
                           absl::StrJoin(caller.certificate_names, ", "))));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "dataset ", entry.id,
      " is not open to remote clients (its root is not a --remote-root)"));
}

}  // namespace

std::optional<absl::Status> Engine::Access(const Caller& caller,
                                           absl::string_view dataset,
                                           bool decide) const {
  absl::StatusOr<std::shared_ptr<const CatalogEntry>> entry =
      catalog_->Find(dataset);
  if (!entry.ok() || (*entry)->reader == nullptr) {
    return absl::OkStatus();  // the call's own error
  }
  if (!caller.local) return CheckRemote(options_.remote_roots, caller, **entry);
  if (caller.local->uid == 0 || (*entry)->root.empty()) {
    return absl::OkStatus();
  }
  if (!decide) return access_.Known(*caller.local, *(*entry)->reader);
  return access_.Check(*caller.local, *(*entry)->reader);
}

absl::Status Engine::CheckAccess(const Caller& caller,
                                 absl::string_view dataset) const {
  return *Access(caller, dataset, /*decide=*/true);
}

std::optional<absl::Status> Engine::KnownAccess(
    const Caller& caller, absl::string_view dataset) const {
  return Access(caller, dataset, /*decide=*/false);
}

EngineFigures Engine::Figures() const {
  EngineFigures f;
  const Reservoir& r = *scans_->reservoir();
  f.reservoir_bytes = r.bytes();
  f.reservoir_bytes_in_use =
      static_cast<uint64_t>(r.slots_in_use()) * r.slot_bytes();
  f.reservoir_bytes_reserved =
      static_cast<uint64_t>(r.slots_reserved()) * r.slot_bytes();
  f.reservoir_bytes_touched =
      static_cast<uint64_t>(r.slots_touched()) * r.slot_bytes();
  f.blocks_read = scans_->engine()->blocks_read();
  f.bytes_read = scans_->engine()->bytes_read() + ordered_bytes_read_.load() +
                 queries_.bytes_read();
  f.query_direct_bytes_read = queries_.direct_bytes_read();
  f.datasets_ok = datasets_ok_.load();
  f.datasets_failed = datasets_failed_.load();
  f.scans = scans_->Status();
  return f;
}

}  // namespace shardcast
