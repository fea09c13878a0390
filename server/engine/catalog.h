// The datasets a daemon serves: every directory under its roots, validated
// with the format library, and the datasets local clients attach by path
// (their files opened by the client and handed over as descriptors). Bad
// catalog datasets are listed with their error and not served. Clients
// address catalog datasets by id (directory name) or a unique prefix of at
// least 8 characters, attached ones by the id Attach returned.
#ifndef SHARDCAST_SERVER_ENGINE_CATALOG_H_
#define SHARDCAST_SERVER_ENGINE_CATALOG_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/base/mutex.h"
#include "common/format/dataset.h"
#include "common/format/dataset_files.h"
#include "common/format/reader.h"

namespace shardcast {

/// One dataset directory found under a root. Immutable once published.
struct CatalogEntry {
  std::string id;                   // directory name; kAttachedPrefix + ...
  std::string dir;                  // full path (never sent to clients)
  std::string root;                 // the --root it is under; "": attached
  absl::Status status;              // OK: being served
  std::optional<DatasetInfo> info;  // when the JSON parsed
  std::shared_ptr<const DatasetReader> reader;  // when status is OK
};

/// Attached datasets' ids start with this; Find looks such an id up among
/// attached datasets first (a catalog directory may be named "@...").
inline constexpr char kAttachedPrefix = '@';

/// What status and logs show of a dataset id: attached ids are
/// capabilities (whoever knows one can stream the dataset), so only their
/// content hash part is shown ("@<16 hex of the hash>").
std::string PublicDatasetId(absl::string_view id);

/// Thread-safe. Rescan() publishes a new snapshot; readers handed out
/// earlier stay valid (shared ownership) until their calls finish.
class Catalog {
 public:
  /// `trusted_roots` (each one of `roots`) may hold symlinks that lead out
  /// of them (roots of links into a parallel filesystem); under every other
  /// root, a dataset directory or file that resolves outside the root is
  /// rejected (PERMISSION_DENIED naming where it leads).
  explicit Catalog(std::vector<std::string> roots,
                   std::vector<std::string> trusted_roots = {})
      : roots_(std::move(roots)), trusted_roots_(std::move(trusted_roots)) {}

  /// Scans the roots and replaces the snapshot. Logs each dataset loaded or
  /// rejected. Returns (ok, failed) counts.
  std::pair<int64_t, int64_t> Rescan() ABSL_LOCKS_EXCLUDED(mu_);

  /// A dataset whose files a local client opened with its own credentials
  /// and handed over (HandedFiles): validated exactly as a catalog dataset
  /// (its first problem is the error). Handed files that are the same files
  /// (device, inode, size and modification time of every one) holding the
  /// same content hash are one dataset, whatever path they were reached
  /// by: one entry, one id, one shared scan; two copies are two datasets.
  /// Files a root serves too are that catalog entry.
  /// The id ("@<hash prefix>.<random>") is known only to clients that
  /// attached the files: attached datasets are not listed, and Find takes
  /// their whole id only. An entry unused for `idle_seconds` (no reader
  /// held outside the catalog) is dropped on a later Attach.
  absl::StatusOr<std::shared_ptr<const CatalogEntry>> Attach(
      std::shared_ptr<const DatasetFiles> files, double idle_seconds = 3600)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Attached datasets being served.
  int64_t attached() const ABSL_LOCKS_EXCLUDED(mu_);

  /// Entries sorted by id.
  std::vector<std::shared_ptr<const CatalogEntry>> List() const
      ABSL_LOCKS_EXCLUDED(mu_);

  /// Finds an entry by id or unique prefix. NOT_FOUND for no match,
  /// INVALID_ARGUMENT for a prefix under 8 characters or matching several.
  absl::StatusOr<std::shared_ptr<const CatalogEntry>> Find(
      absl::string_view id) const ABSL_LOCKS_EXCLUDED(mu_);

  /// Find() + the entry's reader; FAILED_PRECONDITION (with the load error)
  /// for a dataset that was rejected.
  absl::StatusOr<std::shared_ptr<const DatasetReader>> Resolve(
      absl::string_view id) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Snapshot = std::map<std::string, std::shared_ptr<const CatalogEntry>>;
  const std::vector<std::string> roots_;
  const std::vector<std::string> trusted_roots_;
  mutable Mutex mu_;
  std::shared_ptr<const Snapshot> snapshot_ ABSL_GUARDED_BY(mu_) =
      std::make_shared<Snapshot>();
  struct Attached {
    std::shared_ptr<const CatalogEntry> entry;
    std::string identity;
    double last_used = 0;  // seconds, monotonic
  };
  std::map<std::string, Attached> attached_ ABSL_GUARDED_BY(mu_);  // by id
  std::map<std::string, std::string> attached_ids_
      ABSL_GUARDED_BY(mu_);  // identity -> id
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_CATALOG_H_
