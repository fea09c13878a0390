// Where a dataset's files come from: a directory the process opens by path
// (a catalog root, the CLI), or descriptors a local client opened with its
// own credentials and handed to the daemon (docs/local-clients.md, "Datasets
// by path"). Everything that reads a dataset's files (validation, readers,
// sidecars) goes through this interface, so a handed dataset is read only
// through the handed descriptors.
#ifndef SHARDCAST_COMMON_FORMAT_DATASET_FILES_H_
#define SHARDCAST_COMMON_FORMAT_DATASET_FILES_H_

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/file.h"

namespace shardcast {

/// The files of one dataset directory, by name ("metadata.json",
/// "acts000000.bin"). Thread-safe: every method is const.
class DatasetFiles {
 public:
  virtual ~DatasetFiles() = default;
  /// The directory as its user named it, for messages.
  virtual const std::string& dir() const = 0;
  /// The name of the directory the path resolves to ("." or "x/.." name
  /// the real directory): what the content hash is compared with.
  virtual const std::string& dir_name() const = 0;
  /// The directory's path when this process may open files in it by path
  /// (lmprobe's tensors/, writing sidecars); nullopt for handed files.
  virtual std::optional<std::string> openable_dir() const = 0;
  /// "<dir>/<name>", for messages.
  std::string Path(absl::string_view name) const;
  /// Whether the entry exists (a dangling symlink included: a labels.bin
  /// that points nowhere is an error when opened, never "no labels").
  virtual bool Exists(absl::string_view name) const = 0;
  /// A new read-only descriptor of a regular file (OpenRegularFile's
  /// errors, naming Path(name)). Read it with pread only: a handed file's
  /// descriptors share one file offset.
  virtual absl::StatusOr<UniqueFd> Open(absl::string_view name) const = 0;
};

/// A file's whole contents, refused over `max_bytes` (RESOURCE_EXHAUSTED).
absl::StatusOr<std::string> ReadDatasetFile(const DatasetFiles& files,
                                            absl::string_view name,
                                            uint64_t max_bytes = 64 << 20);

/// Files opened by path under `dir`. With `beneath` (an absolute, resolved
/// directory: a catalog root), a file that resolves outside it (a symlink
/// leading out) is PERMISSION_DENIED naming where it leads, so that whoever
/// may write under a root cannot make the daemon read other files.
std::shared_ptr<const DatasetFiles> DirectoryFiles(std::string dir,
                                                   std::string beneath = "");

/// Files a client opened: name -> descriptor, or name -> the errno its
/// open failed with (so the daemon's message says why). Names are plain
/// file names (no '/'); `dir` is the client's path, for messages, and
/// `dir_name` the last component of the directory it resolves to.
struct HandedFile {
  UniqueFd fd;
  int error = 0;  // errno of the client's open; fd invalid when set
};
std::shared_ptr<const DatasetFiles> HandedFiles(
    std::string dir, std::string dir_name,
    std::map<std::string, HandedFile> files);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_DATASET_FILES_H_
