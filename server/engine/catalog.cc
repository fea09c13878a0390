#include "server/engine/catalog.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/clock.h"
#include "common/base/file.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace shardcast {

namespace {

// Which files `reader` reads: (device, inode, size, mtime) of each data
// file and of metadata.json/shards.json, and the content hash.
absl::StatusOr<std::string> FilesIdentity(const DatasetReader& reader) {
  std::string out = reader.info().hash;
  auto add = [&out](int fd, absl::string_view path) -> absl::Status {
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("stat ", path));
    }
    absl::StrAppend(&out, "|", st.st_dev, ":", st.st_ino, ":", st.st_size, ":",
                    st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
    return absl::OkStatus();
  };
  const DatasetFiles& files = *reader.info().files;
  for (const char* name : {kMetadataFile, kShardsFile}) {
    ASSIGN_OR_RETURN(UniqueFd fd, files.Open(name));
    RETURN_IF_ERROR(add(fd.get(), files.Path(name)));
  }
  for (size_t i = 0; i < reader.desc().shards.size(); ++i) {
    const int fd = reader.shard_fd(static_cast<int64_t>(i));
    if (fd >= 0) RETURN_IF_ERROR(add(fd, reader.shard_path(i)));
  }
  if (reader.labels_fd() >= 0) {
    RETURN_IF_ERROR(add(reader.labels_fd(), reader.labels_path()));
  }
  return out;
}

std::string RandomHex(int bytes) {
  static thread_local std::mt19937_64 rng{[] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }()};
  std::string out;
  for (int i = 0; i < bytes; i += 8) {
    absl::StrAppend(&out, absl::Hex(rng(), absl::kZeroPad16));
  }
  return out.substr(0, static_cast<size_t>(2 * bytes));
}

}  // namespace

std::pair<int64_t, int64_t> Catalog::Rescan() {
  std::shared_ptr<const Snapshot> previous;
  {
    MutexLock lock(&mu_);
    previous = snapshot_;
  }
  // Log only what changed since the last scan (a rescan of 1000 datasets
  // should not print 1000 lines).
  auto was = [&previous](const std::string& id) {
    auto it = previous->find(id);
    return it == previous->end() ? nullptr : it->second;
  };
  int64_t ok = 0, failed = 0;
  // Out of descriptors (or memory for one), every open below would fail and
  // every dataset would look broken: keep the catalog as it is.
  const int probe = ::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (probe < 0) {
    LogError("rescan postponed, the catalog is kept: cannot open files (",
             std::strerror(errno), ")");
    for (const auto& [id, entry] : *previous)
      ++(entry->status.ok() ? ok : failed);
    return {ok, failed};
  }
  ::close(probe);
  auto next = std::make_shared<Snapshot>();
  for (const std::string& root : roots_) {
    // Where the root resolves to: its datasets' files must stay beneath it
    // unless the root is trusted (empty `beneath`).
    std::string beneath;
    if (std::find(trusted_roots_.begin(), trusted_roots_.end(), root) ==
        trusted_roots_.end()) {
      if (char* real = ::realpath(root.c_str(), nullptr)) {
        beneath = real;
        std::free(real);
      }
    }
    DIR* d = ::opendir(root.c_str());
    if (d == nullptr) {
      // A root that cannot be listed now (a parallel filesystem hiccup)
      // keeps what it served: datasets vanish only when seen to be gone.
      LogError("root ", root, " cannot be read: ", std::strerror(errno),
               "; keeping its ", "datasets from the previous scan");
      for (const auto& [id, entry] : *previous) {
        if (entry->dir != JoinPath(root, id) || next->count(id) > 0) continue;
        ++(entry->status.ok() ? ok : failed);
        (*next)[id] = entry;
      }
      continue;
    }
    std::vector<std::string> names;
    while (struct dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;  // ., .., writers' temporaries
      names.emplace_back(e->d_name);
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    for (const std::string& name : names) {
      const std::string dir = JoinPath(root, name);
      struct stat st;
      if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
      if (!LooksLikeDatasetDir(dir)) {
        LogDebug("skipping ", dir,
                 ": no metadata.json, shards.json or acts*.bin");
        continue;
      }
      auto entry = std::make_shared<CatalogEntry>();
      entry->id = name;
      entry->dir = dir;
      entry->root = root;
      if (next->count(name) > 0) {
        entry->status = absl::AlreadyExistsError(absl::StrCat(
            "dataset id ", name, " exists under two roots; serving ",
            (*next)[name]->dir));
        LogWarning("dataset ", dir, " rejected: ", entry->status.message());
        ++failed;
        continue;  // the first one found keeps the id
      }
      std::shared_ptr<const DatasetFiles> files = DirectoryFiles(dir, beneath);
      // `beneath` empty: a trusted root, anywhere will do.
      const absl::Status within =
          beneath.empty() ? absl::OkStatus() : CheckPathBeneath(dir, beneath);
      absl::StatusOr<std::unique_ptr<DatasetReader>> reader =
          absl::UnknownError("not opened");
      if (within.ok()) {
        auto info = ReadDatasetInfo(files);
        if (info.ok()) entry->info = *info;
        reader = DatasetReader::Open(files);
      } else {
        reader = within;
      }
      if (reader.ok()) {
        // Which files these are: a client attaching the same files by path
        // gets this entry (Attach).
        if (absl::StatusOr<std::string> identity = FilesIdentity(**reader);
            identity.ok()) {
          (*reader)->set_identity(*identity);
          entry->info->identity = *identity;
        }
        ++ok;
        const std::shared_ptr<const CatalogEntry> before = was(name);
        // The same files as before: the entry stays, with its reader (the
        // scans reading it and the catalog share one set of descriptors,
        // and kept access verdicts stay valid); the new reader closes.
        if (before != nullptr && before->status.ok() && before->info &&
            entry->info && !entry->info->identity.empty() &&
            before->info->identity == entry->info->identity &&
            before->root == root) {
          (*next)[name] = before;
          continue;
        }
        entry->reader = std::move(*reader);
        const DatasetDesc& dd = entry->reader->desc();
        if (before != nullptr && before->status.ok()) {
          (*next)[name] = std::move(entry);
          continue;
        }
        for (const std::string& w : dd.warnings) LogWarning(w);
        if (!entry->info->hash_matches_dir) {
          LogWarning("dataset ", dir,
                     ": directory name does not match the "
                     "content hash ",
                     entry->info->hash, " (served anyway)");
        }
        LogInfo("dataset ", name, " loaded: protocol ", dd.protocol, ", ",
                dd.n_examples, " examples, layers ", dd.num_layers(), ", T ",
                dd.tokens_per_example, ", D ", dd.d_model);
      } else {
        entry->status = reader.status();
        const std::shared_ptr<const CatalogEntry> before = was(name);
        if (before == nullptr || before->status != entry->status) {
          LogWarning("dataset ", dir, " rejected: ", entry->status.message());
        }
        ++failed;
      }
      (*next)[name] = std::move(entry);
    }
  }
  for (const auto& [id, entry] : *previous) {
    if (next->count(id) == 0)
      LogInfo("dataset ", id, " is gone from ", entry->dir);
  }
  MutexLock lock(&mu_);
  snapshot_ = std::move(next);
  return {ok, failed};
}

std::vector<std::shared_ptr<const CatalogEntry>> Catalog::List() const {
  std::shared_ptr<const Snapshot> snap;
  {
    MutexLock lock(&mu_);
    snap = snapshot_;
  }
  std::vector<std::shared_ptr<const CatalogEntry>> out;
  for (const auto& [id, entry] : *snap) out.push_back(entry);
  return out;
}

std::string PublicDatasetId(absl::string_view id) {
  if (id.empty() || id[0] != kAttachedPrefix) return std::string(id);
  return std::string(id.substr(0, id.find('.')));
}

absl::StatusOr<std::shared_ptr<const CatalogEntry>> Catalog::Attach(
    std::shared_ptr<const DatasetFiles> files, double idle_seconds) {
  const std::string dir = files->dir();
  ASSIGN_OR_RETURN(std::unique_ptr<DatasetReader> reader,
                   DatasetReader::Open(std::move(files)));
  if (reader->desc().external != nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        dir, ": only datasets of the shard protocol are attached by path"));
  }
  ASSIGN_OR_RETURN(std::string identity, FilesIdentity(*reader));
  const double now = MonotonicSeconds();
  MutexLock lock(&mu_);
  // Files a root serves too: the catalog's entry (its scans are shared).
  for (const auto& [id, entry] : *snapshot_) {
    if (entry->status.ok() && entry->info &&
        entry->info->identity == identity) {
      return entry;
    }
  }
  auto known = attached_ids_.find(identity);
  if (known != attached_ids_.end()) {
    Attached& a = attached_[known->second];
    a.last_used = now;
    return a.entry;
  }
  // Drop what nobody used for a while (a reader held by a stream or a
  // query counts as used).
  for (auto it = attached_.begin(); it != attached_.end();) {
    if (now - it->second.last_used > idle_seconds &&
        it->second.entry->reader.use_count() == 1) {
      LogInfo("attached dataset ", PublicDatasetId(it->first), " (",
              it->second.entry->dir, ") dropped: unused");
      attached_ids_.erase(it->second.identity);
      it = attached_.erase(it);
    } else {
      ++it;
    }
  }
  auto entry = std::make_shared<CatalogEntry>();
  const DatasetInfo& info = reader->info();
  entry->id = absl::StrCat(std::string(1, kAttachedPrefix),
                           info.hash.substr(0, 16), ".", RandomHex(16));
  entry->dir = dir;
  entry->info = info;
  entry->info->identity = identity;
  reader->set_identity(identity);
  entry->reader = std::move(reader);
  LogInfo("dataset ", dir, " attached as ", PublicDatasetId(entry->id),
          ": protocol ", info.desc.protocol, ", ", info.desc.n_examples,
          " examples");
  attached_ids_[identity] = entry->id;
  attached_[entry->id] = {entry, identity, now};
  return std::shared_ptr<const CatalogEntry>(entry);
}

int64_t Catalog::attached() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(attached_.size());
}

absl::StatusOr<std::shared_ptr<const CatalogEntry>> Catalog::Find(
    absl::string_view id) const {
  std::shared_ptr<const Snapshot> snap;
  {
    MutexLock lock(&mu_);
    if (!id.empty() && id[0] == kAttachedPrefix) {
      auto it = attached_.find(std::string(id));
      if (it != attached_.end()) return it->second.entry;
    }
    snap = snapshot_;
  }
  auto exact = snap->find(std::string(id));
  if (exact != snap->end()) return exact->second;
  if (id.size() < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset \"", Quoted(id),
                     "\" not found; a prefix must have at least 8 characters"));
  }
  std::shared_ptr<const CatalogEntry> match;
  for (auto it = snap->lower_bound(std::string(id));
       it != snap->end() && absl::StartsWith(it->first, id); ++it) {
    if (match != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset prefix \"", Quoted(id), "\" is ambiguous: it matches ",
          match->id, " and ", it->first));
    }
    match = it->second;
  }
  if (match == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("dataset \"", Quoted(id), "\" not found"));
  }
  return match;
}

absl::StatusOr<std::shared_ptr<const DatasetReader>> Catalog::Resolve(
    absl::string_view id) const {
  absl::StatusOr<std::shared_ptr<const CatalogEntry>> entry = Find(id);
  if (!entry.ok()) return entry.status();
  if (!(*entry)->status.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("dataset ", (*entry)->id,
                     " is not served: ", (*entry)->status.message()));
  }
  return (*entry)->reader;
}

}  // namespace shardcast
