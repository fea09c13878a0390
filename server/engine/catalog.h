// The datasets a daemon serves: every directory under its roots, validated
// with the format library. Bad datasets are listed with their error and not
// served. Clients address datasets by id (directory name) or a unique prefix
// of at least 8 characters, never by path.
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
#include "common/format/reader.h"

namespace shardcast {

/// One dataset directory found under a root. Immutable once published.
struct CatalogEntry {
  std::string id;                   // directory name
  std::string dir;                  // full path (never sent to clients)
  absl::Status status;              // OK: being served
  std::optional<DatasetInfo> info;  // when the JSON parsed
  std::shared_ptr<const DatasetReader> reader;  // when status is OK
};

/// Thread-safe. Rescan() publishes a new snapshot; readers handed out
/// earlier stay valid (shared ownership) until their calls finish.
class Catalog {
 public:
  explicit Catalog(std::vector<std::string> roots) : roots_(std::move(roots)) {}

  /// Scans the roots and replaces the snapshot. Logs each dataset loaded or
  /// rejected. Returns (ok, failed) counts.
  std::pair<int64_t, int64_t> Rescan() ABSL_LOCKS_EXCLUDED(mu_);

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
  mutable Mutex mu_;
  std::shared_ptr<const Snapshot> snapshot_ ABSL_GUARDED_BY(mu_) =
      std::make_shared<Snapshot>();
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_CATALOG_H_
