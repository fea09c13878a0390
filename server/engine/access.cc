#include "server/engine/access.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/clock.h"
#include "common/base/file.h"
#include "common/base/status.h"

namespace shardcast {
namespace {

constexpr size_t kMaxVerdicts = 4096;

absl::Status Denied(const Credentials& who, const std::string& path,
                    const std::string& why) {
  return absl::PermissionDeniedError(absl::StrCat(
      "uid ", who.uid, " cannot open ", path, " (", why,
      "): the daemon serves a local client only what its own user may read"));
}

// Whether the mode bits of `st` give `who` every bit of `want` (4 read,
// 1 search).
bool Permits(const struct stat& st, const Credentials& who, unsigned want) {
  unsigned bits;
  if (st.st_uid == who.uid) {
    bits = (st.st_mode >> 6) & 7u;
  } else if (st.st_gid == who.gid ||
             std::find(who.groups.begin(), who.groups.end(), st.st_gid) !=
                 who.groups.end()) {
    bits = (st.st_mode >> 3) & 7u;
  } else {
    bits = st.st_mode & 7u;
  }
  return (bits & want) == want;
}

// Every directory from "/" down to `path`'s parent (stat follows links)
// searchable for `who`.
absl::Status CheckDirectories(const Credentials& who, const std::string& path,
                              const std::string& file) {
  for (size_t at = path.find('/', 1); at != std::string::npos;
       at = path.find('/', at + 1)) {
    const std::string dir = path.substr(0, at);
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0) {
      return Denied(who, file, absl::StrCat(dir, ": ", std::strerror(errno)));
    }
    if (!Permits(st, who, 1)) {
      return Denied(who, file, absl::StrCat(dir, " is not searchable for it"));
    }
  }
  return absl::OkStatus();
}

// The mode-bit emulation for one file: the directories of the path as
// named and as resolved searchable, the file readable.
absl::Status EmulateOpen(const Credentials& who, const std::string& path) {
  std::string absolute = path;
  if (absolute.empty() || absolute[0] != '/') {
    char* cwd = ::getcwd(nullptr, 0);
    if (cwd == nullptr) return ErrnoToStatus(errno, "getcwd");
    absolute = JoinPath(cwd, path);
    std::free(cwd);
  }
  RETURN_IF_ERROR(CheckDirectories(who, absolute, path));
  char* real = ::realpath(absolute.c_str(), nullptr);
  if (real == nullptr) return Denied(who, path, std::strerror(errno));
  const std::string resolved = real;
  std::free(real);
  RETURN_IF_ERROR(CheckDirectories(who, resolved, path));
  struct stat st;
  if (::stat(resolved.c_str(), &st) != 0) {
    return Denied(who, path, std::strerror(errno));
  }
  if (!Permits(st, who, 4)) return Denied(who, path, "not readable for it");
  return absl::OkStatus();
}

// Takes `who`'s filesystem ids on the calling thread only (the raw system
// calls: glibc's setgroups would change every thread). False when this
// process may not (no CAP_SETUID / CAP_SETGID); the thread's ids are then
// whatever they were, so the caller must not go on opening files as `who`.
bool BecomeOnThisThread(const Credentials& who) {
  if (::syscall(SYS_setgroups, who.groups.size(), who.groups.data()) != 0) {
    return false;
  }
  ::syscall(SYS_setfsgid, who.gid);
  if (static_cast<gid_t>(::syscall(SYS_setfsgid, -1)) != who.gid) return false;
  ::syscall(SYS_setfsuid, who.uid);
  return static_cast<uid_t>(::syscall(SYS_setfsuid, -1)) == who.uid;
}

}  // namespace

absl::StatusOr<RemoteRoot> ParseRemoteRoot(const std::string& text) {
  RemoteRoot r;
  const size_t eq = text.find('=');
  r.root = text.substr(0, eq);
  if (eq != std::string::npos) {
    r.names = absl::StrSplit(text.substr(eq + 1), ',');
  }
  if (r.root.empty() ||
      std::find(r.names.begin(), r.names.end(), "") != r.names.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--remote-root ", text,
                     ": expected DIR or DIR=NAME,NAME (certificate names)"));
  }
  return r;
}

bool AccessChecker::Exact() {
  // A thread that tries, and goes away with whatever it became.
  bool exact = false;
  std::thread([&exact] {
    Credentials probe;
    probe.uid = ::geteuid();
    probe.gid = ::getegid();
    exact = BecomeOnThisThread(probe);
  }).join();
  return exact;
}

absl::Status AccessChecker::CanOpen(const Credentials& who,
                                    const std::vector<std::string>& paths) {
  absl::Status result;
  bool exact = false;
  // The ids are switched on a thread of its own that ends with the check,
  // so no other work ever runs with them.
  std::thread([&] {
    exact = BecomeOnThisThread(who);
    if (!exact) return;
    for (const std::string& path : paths) {
      const int fd =
          ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
      if (fd < 0) {
        result = Denied(who, path, std::strerror(errno));
        return;
      }
      ::close(fd);
    }
  }).join();
  if (exact) return result;
  return CanOpenByModeBits(who, paths);
}

absl::Status AccessChecker::CanOpenByModeBits(
    const Credentials& who, const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    RETURN_IF_ERROR(EmulateOpen(who, path));
  }
  return absl::OkStatus();
}

AccessChecker::Key AccessChecker::KeyOf(const Credentials& who,
                                        const DatasetReader& reader) {
  std::vector<gid_t> groups = who.groups;
  std::sort(groups.begin(), groups.end());
  return {who.uid, who.gid, std::move(groups), reader.serial()};
}

std::optional<absl::Status> AccessChecker::Known(
    const Credentials& who, const DatasetReader& reader) const {
  if (who.uid == 0 || who.uid == ::geteuid()) return absl::OkStatus();
  const Key key = KeyOf(who, reader);
  MutexLock lock(&mu_);
  auto it = verdicts_.find(key);
  if (it == verdicts_.end() || it->second.until < MonotonicSeconds())
    return std::nullopt;
  return it->second.status;
}

absl::Status AccessChecker::Check(const Credentials& who,
                                  const DatasetReader& reader) {
  if (std::optional<absl::Status> known = Known(who, reader)) return *known;
  // Every file the dataset is read from, by the paths the daemon opened.
  const DatasetFiles& files = *reader.info().files;
  std::vector<std::string> paths;
  for (const char* name : {kMetadataFile, kShardsFile}) {
    if (files.Exists(name)) paths.push_back(files.Path(name));
  }
  const DatasetDesc& d = reader.desc();
  for (size_t s = 0; s < d.shards.size(); ++s) {
    if (d.shards[s].n_examples > 0) {
      paths.push_back(reader.shard_path(static_cast<int64_t>(s)));
    }
  }
  if (reader.info().has_labels) paths.push_back(reader.labels_path());
  absl::Status status = CanOpen(who, paths);
  MutexLock lock(&mu_);
  if (verdicts_.size() >= kMaxVerdicts) verdicts_.clear();
  verdicts_[KeyOf(who, reader)] = {status, MonotonicSeconds() + keep_};
  return status;
}

}  // namespace shardcast
