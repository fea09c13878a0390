#include "common/format/dataset_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace shardcast {
namespace {

class Directory final : public DatasetFiles {
 public:
  Directory(std::string dir, std::string beneath)
      : dir_(std::move(dir)), beneath_(std::move(beneath)) {
    while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
    if (char* resolved = ::realpath(dir_.c_str(), nullptr)) {
      dir_name_ = BaseName(resolved);
      std::free(resolved);
    } else {
      dir_name_ = BaseName(dir_);
    }
  }
  const std::string& dir() const override { return dir_; }
  const std::string& dir_name() const override { return dir_name_; }
  std::optional<std::string> openable_dir() const override { return dir_; }
  bool Exists(absl::string_view name) const override {
    struct stat st;
    return ::lstat(Path(name).c_str(), &st) == 0;
  }
  absl::StatusOr<UniqueFd> Open(absl::string_view name) const override {
    const std::string path = Path(name);
    ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path));
    if (!beneath_.empty())
      RETURN_IF_ERROR(CheckBeneath(fd.get(), path, beneath_));
    return fd;
  }

 private:
  std::string dir_;
  std::string dir_name_;
  std::string beneath_;  // empty: anywhere
};

class Handed final : public DatasetFiles {
 public:
  Handed(std::string dir, std::string dir_name,
         std::map<std::string, HandedFile> files)
      : dir_(std::move(dir)),
        dir_name_(std::move(dir_name)),
        files_(std::move(files)) {}
  const std::string& dir() const override { return dir_; }
  const std::string& dir_name() const override { return dir_name_; }
  std::optional<std::string> openable_dir() const override {
    return std::nullopt;
  }
  bool Exists(absl::string_view name) const override {
    auto it = files_.find(std::string(name));
    return it != files_.end() && it->second.error != ENOENT;
  }
  absl::StatusOr<UniqueFd> Open(absl::string_view name) const override {
    const std::string path = Path(name);
    auto it = files_.find(std::string(name));
    if (it == files_.end()) return ErrnoToStatus(ENOENT, path);
    if (!it->second.fd.valid()) return ErrnoToStatus(it->second.error, path);
    UniqueFd fd(::fcntl(it->second.fd.get(), F_DUPFD_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoToStatus(errno, absl::StrCat("dup ", path));
    RETURN_IF_ERROR(CheckRegularFile(fd.get(), path));
    return fd;
  }

 private:
  const std::string dir_;
  const std::string dir_name_;
  const std::map<std::string, HandedFile> files_;
};

}  // namespace

std::string DatasetFiles::Path(absl::string_view name) const {
  return JoinPath(dir(), name);
}

absl::StatusOr<std::string> ReadDatasetFile(const DatasetFiles& files,
                                            absl::string_view name,
                                            uint64_t max_bytes) {
  ASSIGN_OR_RETURN(UniqueFd fd, files.Open(name));
  return ReadFdToString(fd.get(), files.Path(name), max_bytes);
}

std::shared_ptr<const DatasetFiles> DirectoryFiles(std::string dir,
                                                   std::string beneath) {
  return std::make_shared<Directory>(std::move(dir), std::move(beneath));
}

std::shared_ptr<const DatasetFiles> HandedFiles(
    std::string dir, std::string dir_name,
    std::map<std::string, HandedFile> files) {
  return std::make_shared<Handed>(std::move(dir), std::move(dir_name),
                                  std::move(files));
}

}  // namespace shardcast
