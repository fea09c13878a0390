#include "common/base/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace shardcast {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) Reset(other.Release());
  return *this;
}

int UniqueFd::Release() { return std::exchange(fd_, -1); }

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::StatusOr<UniqueFd> OpenFile(const std::string& path, int flags,
                                  int mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("open ", path));
  return UniqueFd(fd);
}

namespace {

absl::string_view FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

absl::StatusOr<std::string> ResolvedPath(int fd, absl::string_view path) {
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  std::string target(4096, '\0');
  const ssize_t n = ::readlink(link.c_str(), target.data(), target.size());
  if (n < 0) {
    return ErrnoToStatus(errno,
                         absl::StrCat("where ", path, " leads (", link, ")"));
  }
  if (static_cast<size_t>(n) >= target.size() || target[0] != '/') {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot tell where ", path, " leads"));
  }
  target.resize(static_cast<size_t>(n));
  return target;
}

bool PathIsBeneath(absl::string_view path, absl::string_view root) {
  while (root.size() > 1 && root.back() == '/') root.remove_suffix(1);
  if (root == "/") return !path.empty() && path[0] == '/';
  return path == root ||
         (path.size() > root.size() && absl::StartsWith(path, root) &&
          path[root.size()] == '/');
}

absl::Status CheckBeneath(int fd, absl::string_view path,
                          absl::string_view root) {
  ASSIGN_OR_RETURN(const std::string at, ResolvedPath(fd, path));
  if (PathIsBeneath(at, root)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      path, " leads to ", at, ", outside its dataset root ", root,
      " (a root whose links may leave it is declared with --trust-symlinks)"));
}

absl::Status CheckPathBeneath(const std::string& path, absl::string_view root) {
  const UniqueFd fd(::open(path.c_str(), O_PATH | O_CLOEXEC));
  if (!fd.valid()) return ErrnoToStatus(errno, path);
  return CheckBeneath(fd.get(), path, root);
}

absl::StatusOr<UniqueFd> OpenRegularFile(const std::string& path) {
  // O_NONBLOCK: open() of a FIFO without a writer would wait for one; on a
  // regular file the flag changes nothing.
  ASSIGN_OR_RETURN(UniqueFd fd,
                   OpenFile(path, O_RDONLY | O_NONBLOCK | O_NOCTTY));
  RETURN_IF_ERROR(CheckRegularFile(fd.get(), path));
  return fd;
}

absl::Status CheckRegularFile(int fd, absl::string_view path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is ", FileKind(st.st_mode), ", not a regular file"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> FileSize(int fd, absl::string_view path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("stat ", path));
  }
  return static_cast<uint64_t>(st.st_size);
}

absl::StatusOr<uint64_t> FileSize(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not a regular file"));
  }
  return static_cast<uint64_t>(st.st_size);
}

absl::Status PreadFull(int fd, void* buffer, size_t length, uint64_t offset,
                       absl::string_view path) {
  char* out = static_cast<char*>(buffer);
  size_t done = 0;
  while (done < length) {
    ssize_t n = ::pread(fd, out + done, length - done,
                        static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(
          errno, absl::StrCat("read ", path, " at offset ", offset + done));
    }
    if (n == 0) return FileEndsEarly(path, offset, length, done);
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FileEndsEarly(absl::string_view path, uint64_t offset,
                           uint64_t length, uint64_t done) {
  return absl::DataLossError(absl::StrCat(
      path, ": file ends early: needed bytes [", offset, ", ", offset + length,
      ") but only ", done,
      " were readable (the file was truncated or is shorter than its metadata "
      "says)"));
}

absl::Status WriteFull(int fd, const void* data, size_t length,
                       absl::string_view path) {
  const char* in = static_cast<const char*>(data);
  size_t done = 0;
  while (done < length) {
    ssize_t n = ::write(fd, in + done, length - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat("write ", path));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status Fsync(int fd, absl::string_view path) {
  if (::fsync(fd) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("fsync ", path));
  }
  return absl::OkStatus();
}

absl::Status FsyncDirectory(const std::string& path) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY | O_DIRECTORY));
  return Fsync(fd.get(), path);
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             uint64_t max_bytes) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path));
  return ReadFdToString(fd.get(), path, max_bytes);
}

absl::StatusOr<std::string> ReadFdToString(int fd, absl::string_view path,
                                           uint64_t max_bytes) {
  ASSIGN_OR_RETURN(uint64_t size, FileSize(fd, path));
  if (size > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        path, " is ", size, " bytes; the limit for this file is ", max_bytes));
  }
  std::string contents(size, '\0');
  RETURN_IF_ERROR(PreadFull(fd, contents.data(), size, 0, path));
  return contents;
}

absl::Status WriteNewFile(const std::string& path, absl::string_view contents) {
  ASSIGN_OR_RETURN(UniqueFd fd,
                   OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0644));
  RETURN_IF_ERROR(WriteFull(fd.get(), contents.data(), contents.size(), path));
  RETURN_IF_ERROR(Fsync(fd.get(), path));
  if (::close(fd.Release()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("close ", path));
  }
  return absl::OkStatus();
}

std::string JoinPath(absl::string_view a, absl::string_view b) {
  if (a.empty()) return std::string(b);
  if (b.empty()) return std::string(a);
  const bool a_slash = a.back() == '/';
  const bool b_slash = b.front() == '/';
  if (a_slash && b_slash) return absl::StrCat(a, b.substr(1));
  if (a_slash || b_slash) return absl::StrCat(a, b);
  return absl::StrCat(a, "/", b);
}

std::string BaseName(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return std::string(path);
  if (path.size() == 1) return std::string(path);
  return std::string(path.substr(slash + 1));
}

std::string DirName(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoToStatus(errno, absl::StrCat("stat ", path));
  }
  if (S_ISDIR(st.st_mode)) {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) {
      return ErrnoToStatus(errno, absl::StrCat("opendir ", path));
    }
    absl::Status status;
    while (struct dirent* entry = ::readdir(dir)) {
      absl::string_view name = entry->d_name;
      if (name == "." || name == "..") continue;
      status.Update(RemoveTree(JoinPath(path, name)));
    }
    ::closedir(dir);
    RETURN_IF_ERROR(status);
    if (::rmdir(path.c_str()) != 0) {
      return ErrnoToStatus(errno, absl::StrCat("rmdir ", path));
    }
    return absl::OkStatus();
  }
  if (::unlink(path.c_str()) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("unlink ", path));
  }
  return absl::OkStatus();
}

int64_t CountOpenDescriptors() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int64_t n = -1;  // the directory's own descriptor is listed too
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n;
}

}  // namespace shardcast
