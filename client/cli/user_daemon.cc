// The daemon a daemon command talks to when given no --server and no
// $SHARDCAST_ADDRESS: the node's (kNodeSocket), else the user's own, started
// here when it is not running. The Python package does the same
// (client/python/shardcast/_daemon.py); docs/python.md, "No setup".
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli/commands.h"
#include "shardcast/client.h"
#include "common/base/file.h"
#include "common/base/status.h"

namespace shardcast {
namespace {

constexpr char kNodeSocket[] = "/run/shardcast/shardcastd.sock";
constexpr int kIdleSeconds = 300;
constexpr double kReadySeconds = 10;

// Whether a process accepts connections on the Unix socket `path`.
bool Answers(const std::string& path) {
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return false;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return false;
  return ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr),
                   sizeof(addr)) == 0;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

absl::StatusOr<std::string> PrivateDir() {
  const uid_t uid = ::getuid();
  std::string dir = absl::StrCat("/tmp/shardcast-", uid);
  if (const char* runtime = std::getenv("XDG_RUNTIME_DIR")) {
    struct stat st;
    if (runtime[0] == '/' && ::stat(runtime, &st) == 0 && S_ISDIR(st.st_mode) &&
        st.st_uid == uid) {
      dir = JoinPath(runtime, "shardcast");
    }
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return ErrnoToStatus(errno, absl::StrCat("mkdir ", dir));
  }
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) return ErrnoToStatus(errno, dir);
  if (!S_ISDIR(st.st_mode) || st.st_uid != uid || (st.st_mode & 077) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " is not a directory of yours closed to others (mode ",
        absl::Hex(st.st_mode & 07777), ", owner ", st.st_uid,
        "): remove it, or set ", Client::kAddressVariable));
  }
  return dir;
}

// shardcastd: $SHARDCASTD_BIN, beside this program, then on PATH.
absl::StatusOr<std::string> DaemonBinary() {
  std::vector<std::string> candidates;
  if (const char* v = std::getenv("SHARDCASTD_BIN")) candidates.push_back(v);
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    candidates.push_back(
        JoinPath(DirName(std::string(self, static_cast<size_t>(n))),
                 "shardcastd"));
  }
  if (const char* path = std::getenv("PATH")) {
    for (absl::string_view d : absl::StrSplit(path, ':')) {
      if (!d.empty()) candidates.push_back(JoinPath(d, "shardcastd"));
    }
  }
  for (const std::string& c : candidates) {
    struct stat st;
    if (::stat(c.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(c.c_str(), X_OK) == 0) {
      return c;
    }
  }
  return absl::NotFoundError(absl::StrCat(
      "no shardcast daemon is running for you and shardcastd was not found to "
      "start one: put it on PATH or beside shardcast, set SHARDCASTD_BIN, or "
      "give --server / set ",
      Client::kAddressVariable));
}

// An eighth of the memory available now, between 64 MiB and 2 GiB.
uint64_t ReservoirBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  while (meminfo >> key) {
    if (key == "MemAvailable:" && (meminfo >> kb)) {
      const uint64_t bytes = kb * 1024 / 8;
      return std::clamp<uint64_t>(bytes, 64ull << 20, 2ull << 30) >> 20 << 20;
    }
  }
  return 512ull << 20;
}

absl::Status Start(const std::string& dir, const std::string& sock) {
  ASSIGN_OR_RETURN(std::string binary, DaemonBinary());
  const std::string log = JoinPath(dir, "shardcastd.log");
  struct stat st;
  if (::stat(log.c_str(), &st) == 0 && st.st_size > (16 << 20)) {
    ::rename(log.c_str(), (log + ".1").c_str());  // one old log kept
  }
  const std::vector<std::string> argv = {
      binary,           "--listen",
      "unix:" + sock,   "--exit-when-idle",
      std::to_string(kIdleSeconds), "--prefault",
      "off",            "--reservoir-bytes",
      std::to_string(ReservoirBytes())};
  std::string command;
  for (const std::string& a : argv) absl::StrAppend(&command, " ", a);
  ASSIGN_OR_RETURN(UniqueFd out,
                   OpenFile(log, O_WRONLY | O_CREAT | O_APPEND, 0644));
  const std::string banner =
      absl::StrCat("--- started by `shardcast` pid ", ::getpid(), ":", command,
                   "\n");
  WriteFull(out.get(), banner.data(), banner.size(), log).IgnoreError();
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    ::setsid();
    const int null = ::open("/dev/null", O_RDONLY);
    ::dup2(null, 0);
    ::dup2(out.get(), 1);
    ::dup2(out.get(), 2);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(kReadySeconds);
  bool exited = false;
  int status = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    if (Answers(sock) && Exists(sock + ".local")) return absl::OkStatus();
    if (!exited && ::waitpid(pid, &status, WNOHANG) == pid) exited = true;
    // Exit 1 with the lock taken: another process of this user started
    // one at the same time; wait for that one.
    if (exited && !(WIFEXITED(status) && WEXITSTATUS(status) == 1 &&
                    Exists(sock + ".lock"))) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return absl::UnavailableError(absl::StrCat(
      "could not start shardcastd for you (", command.substr(1),
      "): see its log ", log));
}

}  // namespace

absl::StatusOr<std::string> UserDaemonAddress() {
  if (Exists(kNodeSocket) && Answers(kNodeSocket)) {
    return absl::StrCat("unix:", kNodeSocket);
  }
  ASSIGN_OR_RETURN(std::string dir, PrivateDir());
  const std::string sock = JoinPath(dir, "shardcastd.sock");
  if (!Answers(sock)) {
    // Sites that forbid per-user daemons, and the test suite, set it.
    const char* no_start = std::getenv("SHARDCAST_NO_AUTOSTART");
    if (no_start != nullptr && std::string(no_start) != "" &&
        std::string(no_start) != "0") {
      return absl::UnavailableError(absl::StrCat(
          "no shardcast daemon: give --server or set ",
          Client::kAddressVariable,
          ", or unset SHARDCAST_NO_AUTOSTART to start your own"));
    }
    RETURN_IF_ERROR(Start(dir, sock));
  }
  return absl::StrCat("unix:", sock);
}

}  // namespace shardcast
