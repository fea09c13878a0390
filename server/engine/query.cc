#include "server/engine/query.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/format/layout_of.h"
#include "server/io/uring.h"

namespace shardcast {

absl::Status QueryEngine::CheckCount(uint64_t vectors) const {
  if (vectors > static_cast<uint64_t>(limits_.max_vectors_per_call)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the request asks for ", vectors, " vectors; the limit per call is ",
        limits_.max_vectors_per_call));
  }
  return absl::OkStatus();
}

absl::Status QueryEngine::CheckBytes(uint64_t bytes) const {
  if (bytes > limits_.max_bytes_per_call) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the reply would hold ", bytes, " bytes; the limit per call is ",
        limits_.max_bytes_per_call, " (split the request)"));
  }
  return absl::OkStatus();
}

bool QueryEngine::ShardFiles::Cached(int64_t s, uint64_t offset,
                                     uint64_t length) const {
  const size_t i = static_cast<size_t>(s);
  return s >= 0 && i < residency.size() && residency[i] != nullptr &&
         residency[i]->Cached(offset, length);
}

std::shared_ptr<const QueryEngine::ShardFiles> QueryEngine::Files(
    const std::shared_ptr<const DatasetReader>& reader) const {
  MutexLock lock(&files_mu_);
  // Drop what readers the catalog has let go of left behind (a few
  // datasets: cheaper than the call's first probe).
  for (auto e = files_.begin(); e != files_.end();) {
    e = e->second.reader.expired() ? files_.erase(e) : std::next(e);
  }
  auto it = files_.find(reader.get());
  if (it != files_.end()) return it->second.files;
  std::shared_ptr<const ShardFiles> made = MakeFiles(*reader);
  files_[reader.get()] = FilesEntry{reader, made};
  return made;
}

std::shared_ptr<const QueryEngine::ShardFiles> QueryEngine::MakeFiles(
    const DatasetReader& r) {
  const DatasetDesc& d = r.desc();
  auto files = std::make_shared<ShardFiles>();
  const size_t n = d.shards.size();
  files->residency.resize(n);
  // O_DIRECT reads land at row * vector bytes of a 4 KiB-aligned result.
  const bool aligned = d.vector_bytes() % Payload::kAlign == 0;
  if (aligned) files->direct.resize(n);
  absl::Status no_direct;
  // Without residency a cold vector cannot be told from a cached one
  // before it is read: every read goes through the page cache.
  const auto unknown = [&r](const absl::Status& why) {
    LogInfo("queries of ", r.info().dir_name,
            " read every vector through the page cache (", why.message(), ")");
    return nullptr;
  };
  for (size_t s = 0; s < n; ++s) {
    const int fd = r.shard_fd(static_cast<int64_t>(s));
    if (fd < 0) continue;
    const std::string& path = r.shard_path(static_cast<int64_t>(s));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      return unknown(ErrnoToStatus(errno, absl::StrCat("fstat of ", path)));
    }
    if (st.st_size == 0) continue;
    absl::StatusOr<std::unique_ptr<PageResidency>> residency =
        PageResidency::Open(fd, static_cast<uint64_t>(st.st_size), path);
    if (!residency.ok()) return unknown(residency.status());
    files->residency[s] = std::move(*residency);
    if (!aligned || !no_direct.ok()) continue;
    // The same inode as the catalog's descriptor (a file replaced on disk
    // since is not picked up).
    absl::StatusOr<UniqueFd> direct =
        OpenFile(absl::StrCat("/proc/self/fd/", fd), O_RDONLY | O_DIRECT);
    if (direct.ok()) {
      files->direct[s] = std::move(*direct);
    } else {
      no_direct = direct.status();
    }
  }
  if (!no_direct.ok()) {
    // EINVAL: a filesystem without O_DIRECT (tmpfs, some FUSE).
    LogInfo("queries of ", r.info().dir_name,
            " read vectors that are not cached through the page cache (",
            no_direct.message(), ")");
    files->direct.clear();
  }
  return files;
}

absl::StatusOr<VectorsResult> QueryEngine::PlanVectors(
    absl::string_view dataset, const std::vector<Coord>& coords, ColdReads cold,
    VectorReads* reads) const {
  VectorsResult r;
  ASSIGN_OR_RETURN(
      *reads, PlanVectorReads(dataset, coords, cold,
                              [&r](uint64_t bytes) -> absl::StatusOr<char*> {
                                r.data = Payload(static_cast<size_t>(bytes));
                                return r.data.data();
                              }));
  r.shape = reads->shape;
  return r;
}

absl::StatusOr<std::pair<uint64_t, VectorLayout>> QueryEngine::Layout(
    absl::string_view dataset) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  return std::make_pair(reader->serial(), LayoutOf(reader->desc()));
}

absl::StatusOr<std::vector<UniqueFd>> QueryEngine::OpenFiles(
    absl::string_view dataset, uint64_t serial,
    absl::Span<const int64_t> files) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  if (reader->serial() != serial) {
    return absl::AbortedError(absl::StrCat(
        "dataset ", dataset,
        " is not the one its layout described any more: ask for it again"));
  }
  const int64_t count = static_cast<int64_t>(reader->desc().shards.size());
  std::vector<UniqueFd> fds;
  for (int64_t f : files) {
    if (f < 0 || f >= count) {
      return absl::OutOfRangeError(absl::StrCat("file ", f, " of dataset ",
                                                dataset, ": it has ", count));
    }
    const int fd = reader->shard_fd(f);
    if (fd < 0) {
      return absl::NotFoundError(absl::StrCat("file ", f, " of dataset ",
                                              dataset, " holds no vectors"));
    }
    // Not the reader's own description: a client's reads then share no
    // read-ahead state (or fadvise hints) with the daemon's.
    ASSIGN_OR_RETURN(UniqueFd own, OpenFile(absl::StrCat("/proc/self/fd/", fd),
                                            O_RDONLY | O_CLOEXEC));
    fds.push_back(std::move(own));
  }
  return fds;
}

absl::StatusOr<QueryEngine::VectorReads> QueryEngine::PlanVectorReads(
    absl::string_view dataset, const std::vector<Coord>& coords, ColdReads cold,
    absl::FunctionRef<absl::StatusOr<char*>(uint64_t)> dest) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  const DatasetDesc& d = reader->desc();
  const int64_t n = static_cast<int64_t>(coords.size());
  RETURN_IF_ERROR(CheckCount(static_cast<uint64_t>(n)));
  RETURN_IF_ERROR(CheckBytes(static_cast<uint64_t>(n) * d.vector_bytes()));
  // Vectors the page cache does not hold: O_DIRECT into the result (which
  // is 4 KiB-aligned, as is every vector of a 4 KiB multiple in it).
  std::shared_ptr<const ShardFiles> files =
      direct_ && cold == ColdReads::kDirect && n > 0 ? Files(reader) : nullptr;
  if (files != nullptr && files->direct.empty()) files = nullptr;
  // Validate every coordinate before reading anything.
  VectorReads plan;
  plan.ops.reserve(static_cast<size_t>(n));
  // A probe costs ~0.5 us (a system call; 140 us for 256, before the first
  // read goes out). A call shows its kind early: after kTrust cached
  // vectors in a row it is taken for warm and the rest are read through
  // the cache unprobed; after kTrust missing in a row, for cold, and the
  // rest are read with O_DIRECT unprobed (a cached one then comes from the
  // disk: slower, not wrong).
  constexpr int kTrust = 8;
  int hits = 0, misses = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Coord& c = coords[static_cast<size_t>(i)];
    absl::StatusOr<FileRange> range =
        reader->VectorRange(c.example, c.layer, c.token);
    if (!range.ok()) {
      return Annotate(range.status(), absl::StrCat("coordinates[", i, "]"));
    }
    ReadOp op = ReadOp::Into(*range, nullptr);
    const size_t s = static_cast<size_t>(range->shard);
    if (files != nullptr && hits < kTrust && s < files->direct.size() &&
        files->direct[s].valid() && op.offset % Payload::kAlign == 0 &&
        op.length % Payload::kAlign == 0) {
      if (misses < kTrust &&
          files->Cached(range->shard, op.offset, op.length)) {
        ++hits;
        misses = 0;
      } else {
        hits = 0;
        ++misses;
        op.fd = files->direct[s].get();
        plan.direct_bytes += op.length;
      }
    }
    plan.ops.push_back(op);
  }
  ASSIGN_OR_RETURN(char* base,
                   dest(static_cast<uint64_t>(n) * d.vector_bytes()));
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    plan.ops[i].dest = base + i * d.vector_bytes();
  }
  plan.shape = {n, d.d_model};
  plan.files = std::make_shared<std::pair<std::shared_ptr<const DatasetReader>,
                                          std::shared_ptr<const ShardFiles>>>(
      std::move(reader), std::move(files));
  return plan;
}

absl::StatusOr<VectorsResult> QueryEngine::GetVectors(
    absl::string_view dataset, const std::vector<Coord>& coords,
    ColdReads cold) const {
  VectorReads reads;
  ASSIGN_OR_RETURN(VectorsResult r, PlanVectors(dataset, coords, cold, &reads));
  RETURN_IF_ERROR(UringReader::ThisThread().ReadAll(reads.ops));
  bytes_read_ += r.data.size();
  direct_bytes_read_ += reads.direct_bytes;
  return r;
}

absl::Status QueryEngine::StreamVectors(
    absl::string_view dataset, const std::vector<Coord>& coords,
    size_t part_vectors, VectorsResult* result,
    absl::FunctionRef<void(absl::Span<const int64_t>, bool)> part,
    ColdReads cold) const {
  VectorReads reads;
  ASSIGN_OR_RETURN(*result, PlanVectors(dataset, coords, cold, &reads));
  const std::vector<ReadOp>& ops = reads.ops;
  if (part_vectors < 1) part_vectors = 1;
  std::vector<int64_t> ready;  // in place, not yet in a part
  ready.reserve(std::min(ops.size(), 2 * part_vectors));
  size_t done = 0;
  RETURN_IF_ERROR(UringReader::ThisThread().ReadAll(
      ops, [&](absl::Span<const size_t> finished) {
        for (size_t i : finished) ready.push_back(static_cast<int64_t>(i));
        done += finished.size();
        // The rows that complete the request wait for the last part.
        if (ready.size() >= part_vectors && done < ops.size()) {
          part(ready, false);
          ready.clear();
        }
      }));
  part(ready, true);
  bytes_read_ += result->data.size();
  direct_bytes_read_ += reads.direct_bytes;
  return absl::OkStatus();
}

std::optional<absl::StatusOr<VectorsResult>> QueryEngine::GetVectorsIfCached(
    absl::string_view dataset, const std::vector<Coord>& coords,
    size_t max_vectors) const {
  if (coords.size() > max_vectors) return std::nullopt;
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  // Asked without I/O where the kernel tells: an RWF_NOWAIT read that
  // misses starts the read, which may complete before the check (a cold
  // call then answered here, the device read on the caller's thread). A
  // bad coordinate anywhere is refused below, by the planning, cached or
  // not.
  if (std::shared_ptr<const ShardFiles> files = Files(reader)) {
    std::optional<FileRange> missing;  // the first vector not cached
    for (const Coord& c : coords) {
      absl::StatusOr<FileRange> range =
          reader->VectorRange(c.example, c.layer, c.token);
      if (!range.ok()) {
        missing.reset();
        break;
      }
      if (!missing.has_value() &&
          !files->Cached(range->shard, range->offset, range->length)) {
        missing = *range;
      }
    }
    if (missing.has_value()) {
      // The worker that reads the call finds this vector's read under way
      // (the hop to it costs about as long as the read here): only the
      // vector's own pages, with no read-ahead around them.
      ::posix_fadvise(reader->shard_fd(missing->shard),
                      static_cast<off_t>(missing->offset),
                      static_cast<off_t>(missing->length), POSIX_FADV_WILLNEED);
      return std::nullopt;
    }
  }
  VectorReads reads;
  absl::StatusOr<VectorsResult> r =
      PlanVectors(dataset, coords, ColdReads::kPageCache, &reads);
  if (!r.ok()) return r;  // the request's errors need no disk
  for (const ReadOp& op : reads.ops) {
    struct iovec iov = {op.dest, op.length};
    // RWF_NOWAIT: EAGAIN instead of waiting for the device (a page evicted
    // since it was asked about, or no residency to ask); a short read (part
    // of the range cached) or any error is left to GetVectors, which reads
    // (and reports) it properly.
    const ssize_t got =
        ::preadv2(op.fd, &iov, 1, static_cast<off_t>(op.offset), RWF_NOWAIT);
    if (got < 0 || static_cast<size_t>(got) != op.length) return std::nullopt;
  }
  bytes_read_ += r->data.size();
  return r;
}

absl::StatusOr<VectorsResult> QueryEngine::GetExample(
    absl::string_view dataset, int64_t example,
    std::optional<int64_t> layer) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  const DatasetDesc& d = reader->desc();
  VectorsResult r;
  FileRange range;
  if (layer.has_value()) {
    RETURN_IF_ERROR(CheckBytes(d.layer_slice_bytes()));
    ASSIGN_OR_RETURN(range, reader->LayerSliceRange(example, *layer));
    r.shape = {d.tokens_per_example, d.d_model};
  } else if (d.external != nullptr) {
    // Each layer in its own file: one read per layer, in layer order.
    RETURN_IF_ERROR(CheckBytes(d.example_bytes()));
    r.shape = {d.num_layers(), d.tokens_per_example, d.d_model};
    r.data = Payload(static_cast<size_t>(d.example_bytes()));
    std::vector<ReadOp> ops;
    for (size_t l = 0; l < d.layers.size(); ++l) {
      ASSIGN_OR_RETURN(FileRange slice,
                       reader->LayerSliceRange(example, d.layers[l]));
      ops.push_back(ReadOp::Into(slice, r.data.data() + l * slice.length));
    }
    RETURN_IF_ERROR(UringReader::ThisThread().ReadAll(ops));
    bytes_read_ += r.data.size();
    return r;
  } else {
    RETURN_IF_ERROR(CheckBytes(d.example_bytes()));
    ASSIGN_OR_RETURN(range, reader->ExampleRange(example));
    r.shape = {d.num_layers(), d.tokens_per_example, d.d_model};
  }
  r.data = Payload(static_cast<size_t>(range.length));
  RETURN_IF_ERROR(
      UringReader::ThisThread().ReadAll({ReadOp::Into(range, r.data.data())}));
  bytes_read_ += r.data.size();
  return r;
}

absl::StatusOr<std::string> QueryEngine::GetExampleInfo(
    absl::string_view dataset, int64_t example) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  const DatasetInfo& info = reader->info();
  ASSIGN_OR_RETURN(
      std::shared_ptr<const SampleIndex> index,
      samples_.Get(
          info, [&]() -> absl::StatusOr<std::shared_ptr<const SampleIndex>> {
            absl::StatusOr<UniqueFd> fd = info.files->Open(kSamplesFile);
            absl::StatusOr<std::unique_ptr<SampleIndex>> built =
                fd.ok() ? SampleIndex::Build(std::move(*fd),
                                             info.files->Path(kSamplesFile),
                                             info.desc.n_examples)
                        : fd.status();
            if (!built.ok() &&
                built.status().code() == absl::StatusCode::kNotFound) {
              return absl::NotFoundError(absl::StrCat(
                  "dataset ", info.dir_name, " has no ", kSamplesFile,
                  " (only `shardcast import` writes one)"));
            }
            if (!built.ok()) return built.status();
            return std::shared_ptr<const SampleIndex>(std::move(*built));
          }));
  return index->Get(example);
}

absl::StatusOr<std::string> QueryEngine::GetLabels(absl::string_view dataset,
                                                   int64_t example) const {
  ASSIGN_OR_RETURN(std::shared_ptr<const DatasetReader> reader,
                   catalog_->Resolve(dataset));
  ASSIGN_OR_RETURN(FileRange range, reader->LabelsRange(example));
  std::string labels(static_cast<size_t>(range.length), '\0');
  RETURN_IF_ERROR(
      UringReader::ThisThread().ReadAll({ReadOp::Into(range, labels.data())}));
  bytes_read_ += labels.size();
  return labels;
}

}  // namespace shardcast
