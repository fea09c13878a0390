// `shardcast doctor`: checks a node the way a sysadmin would before a job.
// Each check prints a verdict (ok, warn, FAIL) and one line of why; the exit
// status is 1 when any check failed. Nothing here needs the daemon's code:
// the daemon is asked over its socket, the rest is read from the system.
#include <dirent.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli/commands.h"
#include "common/base/cli_args.h"
#include "common/base/file.h"
#include "common/base/human_bytes.h"
#include "common/base/proc_fields.h"
#include "common/base/status.h"
#include "common/format/dataset.h"
#include "common/format/pyjson.h"
#include "shardcast/client.h"

namespace shardcast {
namespace {

constexpr char kDefaultAddress[] = "unix:/run/shardcast/shardcastd.sock";
constexpr uint64_t kDefaultReservoirBytes = 2ull << 30;  // shardcastd's
constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kDefaultSocketSendBuffer = 4 * kMiB;  // shardcastd's

enum class Verdict { kOk, kWarn, kFail };

struct Check {
  std::string name;
  Verdict verdict;
  std::string detail;
};

// What the checks are about: from the flags, the daemon's config file and
// the daemon itself, in that order of precedence.
struct Subject {
  std::string address;
  std::vector<std::string> roots;
  std::optional<uint64_t> reservoir_bytes;
  bool daemon_expected = true;
  uint64_t read_bytes = 64 * kMiB;
  // The send buffer the daemon asks for each local connection (config key
  // socket_send_buffer; 0: the kernel's default).
  uint64_t socket_send_buffer = kDefaultSocketSendBuffer;
  // Filled in by the checks.
  std::optional<DaemonStatus> daemon;
  std::string sample_shard;  // the largest shard file of a sound dataset
  uint64_t sample_bytes = 0;
};

// The filesystem type of `path`, by name for those datasets live on.
std::string FsType(const std::string& path) {
  struct statfs st;
  if (::statfs(path.c_str(), &st) != 0) return "unknown";
  switch (static_cast<uint64_t>(st.f_type)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x6969:
      return "nfs";
    case 0x0BD00BD0:
      return "lustre";
    case 0x47504653:
      return "gpfs";
    case 0x00C36400:
      return "ceph";
    case 0x01021994:
      return "tmpfs";
    case 0x794C7630:
      return "overlayfs";
    case 0x65735546:
      return "fuse";
    case 0x2FC12FC1:
      return "zfs";
    default:
      return absl::StrCat("type 0x", absl::Hex(st.f_type));
  }
}

// ---- the daemon -------------------------------------------------------

Check CheckDaemon(Subject* s) {
  Check c{"daemon", Verdict::kOk, ""};
  const std::string& address = s->address;
  const Verdict missing = s->daemon_expected ? Verdict::kFail : Verdict::kWarn;
  if (absl::StartsWith(address, "unix:")) {
    const std::string path = address.substr(5);
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 && errno == EACCES) {
      c.verdict = Verdict::kFail;
      c.detail = absl::StrCat(
          "no permission to reach the socket ", path,
          ": a directory on its path is not searchable by this user (uid ",
          ::getuid(),
          "); the socket directory must be open to the trainers' "
          "group (mode 0750, group of the socket)");
      return c;
    }
    if (::stat(path.c_str(), &st) != 0) {
      c.verdict = missing;
      c.detail = absl::StrCat(
          "no socket at ", path, " (", std::strerror(errno),
          "): is shardcastd running? (systemctl status shardcastd; for a "
          "per-job daemon, is SHARDCAST_ADDRESS set?)");
      return c;
    }
    if (!S_ISSOCK(st.st_mode)) {
      c.verdict = Verdict::kFail;
      c.detail = absl::StrCat(path, " exists but is not a socket");
      return c;
    }
    if (::access(path.c_str(), R_OK | W_OK) != 0) {
      c.verdict = Verdict::kFail;
      c.detail = absl::StrCat(
          "no permission to connect to ", path, " (mode ",
          absl::StrFormat("%04o", st.st_mode & 07777), ", uid ", st.st_uid,
          ", gid ", st.st_gid, "); this user (uid ", ::getuid(),
          ") must own it or be in its group: ask for the socket's group or "
          "--allow-user/--allow-group");
      return c;
    }
  }
  ClientOptions options = RemoteOptions();
  options.connect_timeout_seconds = 3;
  auto client = Client::Connect(address, options);
  if (!client.ok()) {
    c.verdict = missing;
    c.detail = std::string(client.status().message());
    return c;
  }
  auto health = (*client)->CheckHealth(3);
  if (!health.ok()) {
    c.verdict = Verdict::kFail;
    c.detail = absl::StrCat("grpc.health.v1: ", health.status().message());
    return c;
  }
  if (*health != Client::Health::kServing) {
    c.verdict = Verdict::kFail;
    c.detail = absl::StrCat(address,
                            " answers but is not SERVING (draining for "
                            "shutdown, or starting)");
    return c;
  }
  auto status = (*client)->GetStatus();
  if (!status.ok()) {
    c.verdict = Verdict::kFail;
    c.detail = absl::StrCat("status: ", status.status().message());
    return c;
  }
  s->daemon = *status;
  c.detail = absl::StrCat(address, ": SERVING (shardcastd ", status->version,
                          ", ", status->datasets_ok, " datasets served, ",
                          status->datasets_failed, " rejected, ",
                          status->connected_clients, " calls in flight)");
  if (status->datasets_failed > 0) {
    c.verdict = Verdict::kWarn;
    auto list = (*client)->ListDatasets();
    if (list.ok()) {
      for (const DatasetDescription& d : *list) {
        if (!d.ok)
          absl::StrAppend(&c.detail, "\n    rejected ", d.id, ": ", d.error);
      }
    }
  }
  return c;
}

// ---- a sweep's peers ------------------------------------------------------

// A daemon in a sweep (docs/sweeps.md): every other node's daemon answers
// and agrees (node order, --block-bytes, the content hash of every dataset
// this user may read). Peers that are unreachable (not up yet) are asked
// again for up to `wait_seconds` (a job's daemons start together). Nothing
// when the daemon is not in a sweep, unless the check was `asked` for by
// name (--only sweep): then that is a FAIL saying why, as is a daemon that
// does not answer (`daemon`: its check).
std::optional<Check> CheckSweep(const Subject& s, double wait_seconds,
                                bool asked, const Check& daemon) {
  Check c{"sweep", Verdict::kFail, ""};
  const auto cannot = [&](std::string why) -> std::optional<Check> {
    if (!asked) return std::nullopt;
    c.detail = std::move(why);
    return c;
  };
  if (!s.daemon.has_value()) {
    return cannot(absl::StrCat("no daemon to ask: ", daemon.detail));
  }
  ClientOptions options = RemoteOptions();
  options.connect_timeout_seconds = 3;
  auto client = Client::Connect(s.address, options);
  if (!client.ok()) {
    return cannot(
        absl::StrCat("no daemon to ask: ", client.status().message()));
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(wait_seconds);
  absl::StatusOr<Client::SweepCheck> check;
  while (true) {
    check = (*client)->CheckSweep();
    if (!check.ok()) {
      const absl::StatusCode code = check.status().code();
      if (code == absl::StatusCode::kFailedPrecondition) {
        return cannot(absl::StrCat(s.address, ": ", check.status().message()));
      }
      if (code == absl::StatusCode::kUnimplemented) {
        return cannot(absl::StrCat(s.address,
                                   " is older than sweep checks (no "
                                   "Admin.CheckSweep)"));
      }
      c.detail = absl::StrCat("Admin.CheckSweep: ", check.status().message());
      return c;
    }
    const bool unreachable =
        std::any_of(check->peers.begin(), check->peers.end(),
                    [](const Client::SweepPeer& p) { return p.unreachable; });
    if (!unreachable || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  int64_t bad = 0;
  for (const Client::SweepPeer& p : check->peers) bad += !p.problems.empty();
  c.verdict = Verdict::kOk;
  const std::string nodes =
      absl::StrCat("node ", check->node, " of ", check->peers.size() + 1);
  if (bad == 0) {
    c.detail = absl::StrCat(nodes,
                            ": every peer answers and agrees (node "
                            "order, --block-bytes, the content hash of ",
                            check->datasets, " dataset",
                            check->datasets == 1 ? "" : "s", ")");
    return c;
  }
  c.verdict = Verdict::kFail;
  c.detail = absl::StrCat(nodes, ": ", bad, " of ", check->peers.size(),
                          " peers do not answer or disagree (this node "
                          "would read their shares itself)");
  for (const Client::SweepPeer& p : check->peers) {
    for (const std::string& problem : p.problems) {
      absl::StrAppend(&c.detail, "\n    node ", p.node, " at ", p.address, ": ",
                      problem);
    }
  }
  return c;
}

// ---- roots and datasets --------------------------------------------------

std::vector<Check> CheckRoots(Subject* s) {
  std::vector<Check> out;
  if (s->roots.empty()) {
    out.push_back({"roots", Verdict::kWarn,
                   "no roots to check: give --root DIR or --config FILE"});
    return out;
  }
  for (const std::string& root : s->roots) {
    Check c{absl::StrCat("root ", root), Verdict::kOk, ""};
    DIR* d = ::opendir(root.c_str());
    if (d == nullptr) {
      c.verdict = Verdict::kFail;
      c.detail = absl::StrCat("cannot list ", root, ": ", std::strerror(errno),
                              " (as uid ", ::getuid(), ")");
      out.push_back(c);
      continue;
    }
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') names.emplace_back(e->d_name);
    }
    ::closedir(d);
    std::sort(names.begin(), names.end());
    int64_t sound = 0;
    std::vector<std::string> rejected;
    for (const std::string& name : names) {
      const std::string dir = JoinPath(root, name);
      struct stat st;
      if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
      if (!LooksLikeDatasetDir(dir)) continue;
      absl::StatusOr<DatasetInfo> info = OpenDatasetInfo(dir);
      if (!info.ok()) {
        rejected.push_back(absl::StrCat(name, ": ", info.status().message()));
        continue;
      }
      ++sound;
      // The largest shard makes the most telling read.
      for (const ShardEntry& e : info->desc.shards) {
        const std::string shard = JoinPath(dir, e.name);
        struct stat shard_st;
        if (e.n_examples > 0 && ::stat(shard.c_str(), &shard_st) == 0 &&
            static_cast<uint64_t>(shard_st.st_size) > s->sample_bytes) {
          s->sample_shard = shard;
          s->sample_bytes = shard_st.st_size;
        }
      }
    }
    c.detail =
        absl::StrCat(sound, " dataset", sound == 1 ? "" : "s", " sound, ",
                     rejected.size(), " rejected (", FsType(root), ")");
    if (!rejected.empty()) {
      c.verdict = Verdict::kWarn;
      for (const std::string& r : rejected) {
        absl::StrAppend(&c.detail, "\n    rejected ", r);
      }
    } else if (sound == 0) {
      c.verdict = Verdict::kWarn;
      absl::StrAppend(&c.detail, ": nothing to serve under it");
    }
    out.push_back(c);
  }
  return out;
}

// ---- io_uring ---------------------------------------------------------

// A numeric /proc/sys value; nullopt when the file is missing (some are
// hidden inside network namespaces) or holds no number.
std::optional<uint64_t> SysctlValue(const std::string& path) {
  std::ifstream in(path);
  uint64_t value = 0;
  if (in >> value) return value;
  return std::nullopt;
}

Check CheckIoUring() {
  Check c{"io_uring", Verdict::kOk, ""};
  // A probe, not a user: set up a ring of 4 entries and close it.
  io_uring_params params;
  std::memset(&params, 0, sizeof(params));
  const long fd = ::syscall(__NR_io_uring_setup, 4, &params);
  if (fd >= 0) {
    ::close(static_cast<int>(fd));
    c.detail = "available: shared scans read with io_uring";
    return c;
  }
  const int err = errno;
  c.verdict = Verdict::kWarn;
  std::string why;
  const std::optional<uint64_t> disabled =
      SysctlValue("/proc/sys/kernel/io_uring_disabled");
  if (disabled.has_value() && *disabled != 0) {
    why = absl::StrCat(" (sysctl kernel.io_uring_disabled = ", *disabled, ")");
  } else if (err == EPERM) {
    why =
        " (a seccomp profile forbids it: container runtimes' default "
        "profiles do; see deploy/kubernetes/README.md)";
  } else if (err == ENOSYS) {
    why = " (the kernel was built without it)";
  }
  c.detail = absl::StrCat("unavailable: ", std::strerror(err), why,
                          "; shardcastd falls back to pread, which is slower");
  return c;
}

// ---- O_DIRECT and a read -------------------------------------------------

// An aligned buffer (O_DIRECT needs the memory aligned too).
struct AlignedBuffer {
  explicit AlignedBuffer(size_t n)
      : size(n),
        data(::mmap(nullptr, n, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)) {}
  ~AlignedBuffer() {
    if (data != MAP_FAILED) ::munmap(data, size);
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  bool ok() const { return data != MAP_FAILED; }
  const size_t size;
  void* const data;
};

Check CheckDirectIo(const Subject& s, bool* supported) {
  Check c{"o_direct", Verdict::kOk, ""};
  *supported = false;
  if (s.sample_shard.empty()) {
    c.verdict = Verdict::kWarn;
    c.detail = "no shard to try it on (no sound dataset under the roots)";
    return c;
  }
  const std::string fs = FsType(s.sample_shard);
  const int fd =
      ::open(s.sample_shard.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) {
    c.verdict = errno == EINVAL ? Verdict::kWarn : Verdict::kFail;
    c.detail = absl::StrCat(
        fs, " refuses O_DIRECT on ", s.sample_shard, " (", std::strerror(errno),
        "): reads go through the page cache, and read-ahead may read more "
        "than the selection");
    return c;
  }
  AlignedBuffer buffer(1 << 20);
  const ssize_t n = buffer.ok() ? ::pread(fd, buffer.data, 4096, 0) : -1;
  const int err = errno;
  ::close(fd);
  if (n < 0) {
    c.verdict = Verdict::kWarn;
    c.detail = absl::StrCat(fs, ": an aligned 4 KiB O_DIRECT read failed (",
                            std::strerror(err),
                            "): the device needs larger alignment, or the "
                            "filesystem only pretends to support O_DIRECT");
    return c;
  }
  *supported = true;
  c.detail = absl::StrCat("supported on ", fs, " (", s.sample_shard, ")");
  return c;
}

Check CheckRead(const Subject& s, bool direct) {
  Check c{"read", Verdict::kOk, ""};
  if (s.sample_shard.empty()) {
    c.verdict = Verdict::kWarn;
    c.detail = "no shard to read (no sound dataset under the roots)";
    return c;
  }
  const int fd = ::open(s.sample_shard.c_str(),
                        O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
  if (fd < 0) {
    c.verdict = Verdict::kFail;
    c.detail = absl::StrCat("cannot open ", s.sample_shard, ": ",
                            std::strerror(errno));
    return c;
  }
  struct stat st;
  const uint64_t size = ::fstat(fd, &st) == 0 ? st.st_size : 0;
  constexpr size_t kChunk = 4 << 20;
  const uint64_t want = std::min<uint64_t>(size, s.read_bytes);
  if (!direct) {
    // Measure the device, not the page cache: drop the file's clean pages.
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  }
  AlignedBuffer buffer(kChunk);
  uint64_t done = 0;
  const auto start = std::chrono::steady_clock::now();
  while (buffer.ok() && done < want) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, want - done));
    if (direct) n = (n + 4095) / 4096 * 4096;  // whole blocks; EOF cuts it
    const ssize_t got = ::pread(fd, buffer.data, n, static_cast<off_t>(done));
    if (got <= 0) {
      c.verdict = Verdict::kFail;
      c.detail = absl::StrCat(
          "reading ", s.sample_shard, " at offset ", done, ": ",
          got == 0 ? "unexpected end of file" : std::strerror(errno));
      ::close(fd);
      return c;
    }
    done += static_cast<uint64_t>(got);
  }
  ::close(fd);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const double mb_s = seconds > 0 ? done / 1e6 / seconds : 0;
  c.detail = absl::StrFormat(
      "%s in %.2f s = %.0f MB/s (%s, 4 MiB reads) from %s",
      HumanBytes(done).c_str(), seconds, mb_s,
      direct ? "O_DIRECT" : "buffered, cache dropped", s.sample_shard.c_str());
  if (done == 0) {
    c.verdict = Verdict::kWarn;
    c.detail = absl::StrCat(s.sample_shard, " is empty");
  }
  return c;
}

// ---- memory -----------------------------------------------------------

// The memory limit of this process's cgroup (v2), when one is set.
std::optional<uint64_t> CgroupLimit() {
  std::ifstream self("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(self, line)) {
    if (absl::StartsWith(line, "0::")) path = line.substr(3);
  }
  std::ifstream in("/sys/fs/cgroup" + path + "/memory.max");
  std::string v;
  uint64_t limit = 0;
  if (in >> v && v != "max" && absl::SimpleAtoi(v, &limit)) return limit;
  return std::nullopt;
}

Check CheckMemory(const Subject& s) {
  Check c{"memory", Verdict::kOk, ""};
  const uint64_t reservoir = s.reservoir_bytes.has_value() ? *s.reservoir_bytes
                             : s.daemon.has_value() ? s.daemon->reservoir_bytes
                                                    : kDefaultReservoirBytes;
  // The daemon's bound (docs/benchmarks.md, "Targets": reservoir + 10 % + 64
  // MiB).
  const uint64_t needed = reservoir + reservoir / 10 + 64 * kMiB;
  const absl::StatusOr<ProcFields> meminfo = ProcFields::Read("/proc/meminfo");
  const std::optional<uint64_t> total =
      meminfo.ok() ? meminfo->Get("MemTotal") : std::nullopt;
  const std::optional<uint64_t> available =
      meminfo.ok() ? meminfo->Get("MemAvailable") : std::nullopt;
  if (!total.has_value() || !available.has_value()) {
    c.verdict = Verdict::kWarn;
    c.detail = "cannot read /proc/meminfo";
    return c;
  }
  c.detail = absl::StrCat("reservoir ", HumanBytes(reservoir), " needs up to ",
                          HumanBytes(needed), "; ", HumanBytes(*available),
                          " available of ", HumanBytes(*total));
  if (std::optional<uint64_t> limit = CgroupLimit(); limit.has_value()) {
    absl::StrAppend(&c.detail, ", cgroup limit ", HumanBytes(*limit));
    if (*limit < needed && !s.daemon.has_value()) {
      c.verdict = Verdict::kFail;
      absl::StrAppend(&c.detail,
                      ": a daemon started in this cgroup would be killed");
      return c;
    }
  }
  if (s.daemon.has_value()) {
    // Its reservoir is already allocated: only the machine's size matters.
    absl::StrAppend(&c.detail, "; the daemon holds ",
                    HumanBytes(s.daemon->memory_rss_bytes), " resident");
    if (s.daemon->memory_rss_anon_bytes > 0) {  // 0 from an older daemon
      absl::StrAppend(&c.detail, " (",
                      HumanBytes(s.daemon->memory_rss_anon_bytes), " its own)");
    }
    if (*total < needed) c.verdict = Verdict::kFail;
    return c;
  }
  if (*available < needed) {
    c.verdict = *total < needed ? Verdict::kFail : Verdict::kWarn;
    absl::StrAppend(&c.detail,
                    c.verdict == Verdict::kFail
                        ? ": the machine is too small for this reservoir"
                        : ": other processes hold the memory it needs now");
  }
  return c;
}

// ---- socket buffers ---------------------------------------------------

// "4 MiB" when whole, else exact: "212992 bytes".
std::string ExactSize(uint64_t bytes) {
  return bytes % kMiB == 0 ? absl::StrCat(bytes / kMiB, " MiB")
                           : absl::StrCat(bytes, " bytes");
}

// The kernel caps SO_SNDBUF at net.core.wmem_max (socket(7)); below the
// daemon's socket_send_buffer, a 16 MiB gRPC batch crosses a local socket in
// more rounds of fill, wait and wake-up (tests/bench/results/HISTORY.md: warm
// gRPC streams).
Check CheckSocketBuffer(const Subject& s) {
  Check c{"sockets", Verdict::kOk, ""};
  const std::optional<uint64_t> cap =
      SysctlValue("/proc/sys/net/core/wmem_max");
  if (!cap.has_value()) {
    // Hidden inside some network namespaces (containers, kernels < 6.10).
    c.verdict = Verdict::kWarn;
    c.detail =
        "net.core.wmem_max is not visible here (a container's network "
        "namespace?): check it on the host; the daemon logs the send buffer "
        "it got when capped";
    return c;
  }
  if (s.socket_send_buffer == 0) {
    const std::optional<uint64_t> def =
        SysctlValue("/proc/sys/net/core/wmem_default");
    c.detail = absl::StrCat(
        "socket_send_buffer 0: local connections keep the kernel's default (",
        def.has_value()
            ? absl::StrCat("net.core.wmem_default ", ExactSize(*def))
            : std::string("net.core.wmem_default"),
        ")");
    return c;
  }
  c.detail = absl::StrCat("net.core.wmem_max ", ExactSize(*cap),
                          ", the daemon asks ", ExactSize(s.socket_send_buffer),
                          " per local connection (socket_send_buffer)");
  if (*cap < s.socket_send_buffer) {
    c.verdict = Verdict::kWarn;
    absl::StrAppend(&c.detail,
                    ": capped, so warm gRPC streams are slower; lift it with "
                    "sysctl -w net.core.wmem_max=",
                    s.socket_send_buffer, " (or a file in /etc/sysctl.d/)");
  }
  return c;
}

// ---- the command ------------------------------------------------------

// Reads what the checks need from the daemon's JSON config file.
absl::Status ReadConfig(const std::string& path, Subject* s) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ASSIGN_OR_RETURN(Json j, ParseJson(text, path));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": must hold a JSON object"));
  }
  if (j.contains("roots") && j["roots"].is_array()) {
    for (const Json& r : j["roots"]) {
      if (r.is_string()) s->roots.push_back(r.get<std::string>());
    }
  }
  if (j.contains("listen") && j["listen"].is_string()) {
    s->address = j["listen"].get<std::string>();
  }
  // A byte count written as a number or as "4M"; nullopt when absent (the
  // daemon itself refuses a malformed one).
  const auto bytes_key = [&j](const char* key) -> std::optional<uint64_t> {
    if (!j.contains(key)) return std::nullopt;
    const Json& v = j[key];
    uint64_t bytes = 0;
    if (v.is_number_unsigned()) return v.get<uint64_t>();
    if (v.is_string() && ParseByteCount(v.get<std::string>(), &bytes)) {
      return bytes;
    }
    return std::nullopt;
  };
  if (auto v = bytes_key("reservoir_bytes")) s->reservoir_bytes = *v;
  if (auto v = bytes_key("socket_send_buffer")) s->socket_send_buffer = *v;
  return absl::OkStatus();
}

const char* VerdictName(Verdict v) {
  switch (v) {
    case Verdict::kOk:
      return "ok";
    case Verdict::kWarn:
      return "warn";
    case Verdict::kFail:
      return "FAIL";
  }
  return "?";
}

int RunDoctor(const Args& args) {
  const char* cmd = "doctor";
  Subject s;
  if (args.Has("config")) {
    absl::Status st = ReadConfig(args.Get("config"), &s);
    if (!st.ok()) return Fail(cmd, std::string(st.message()));
  }
  if (args.Has("root")) s.roots = args.GetAll("root");
  if (!RemoteAddress().empty()) {
    s.address = RemoteAddress();
  } else if (!Client::DefaultAddress().empty()) {
    s.address = Client::DefaultAddress();
  } else if (s.address.empty()) {
    s.address = kDefaultAddress;
  }
  // A byte count flag > 0 into `out`; false (after saying why) otherwise.
  const auto bytes_flag = [&args](const char* flag, uint64_t* out) {
    if (!args.Has(flag)) return true;
    uint64_t bytes = 0;
    if (!ParseByteCount(args.Get(flag), &bytes) || bytes == 0) {
      std::fprintf(stderr,
                   "shardcast doctor: --%s must be a byte count > 0 like 4G "
                   "or 64M, got \"%s\"\n",
                   flag, args.Get(flag).c_str());
      return false;
    }
    *out = bytes;
    return true;
  };
  uint64_t reservoir = 0;
  if (!bytes_flag("reservoir-bytes", &reservoir) ||
      !bytes_flag("read-bytes", &s.read_bytes)) {
    return kExitUsage;
  }
  if (reservoir > 0) s.reservoir_bytes = reservoir;
  s.daemon_expected = !args.Has("no-daemon");
  double sweep_wait = 0;
  if (args.Has("sweep-wait") &&
      (!absl::SimpleAtod(args.Get("sweep-wait"), &sweep_wait) ||
       !(sweep_wait >= 0) || sweep_wait > 86400)) {
    std::fprintf(stderr,
                 "shardcast doctor: --sweep-wait must be a number of seconds "
                 "from 0 to 86400, got \"%s\"\n",
                 args.Get("sweep-wait").c_str());
    return kExitUsage;
  }

  // --only: the checks named (the daemon is asked anyway: others use it).
  static constexpr const char* kChecks[] = {"daemon",   "sweep",    "roots",
                                            "io_uring", "o_direct", "memory",
                                            "sockets",  "read"};
  std::vector<std::string> only;
  if (args.Has("only")) {
    only = absl::StrSplit(args.Get("only"), ',', absl::SkipEmpty());
    for (const std::string& name : only) {
      if (std::find(std::begin(kChecks), std::end(kChecks), name) ==
          std::end(kChecks)) {
        std::fprintf(stderr,
                     "shardcast doctor: --only: no check named \"%s\" (the "
                     "checks: %s)\n",
                     name.c_str(), absl::StrJoin(kChecks, ", ").c_str());
        return kExitUsage;
      }
    }
  }
  const auto want = [&only](const char* name) {
    return only.empty() ||
           std::find(only.begin(), only.end(), name) != only.end();
  };
  std::vector<Check> checks;
  const Check daemon = CheckDaemon(&s);
  if (want("daemon")) checks.push_back(daemon);
  if (want("sweep")) {
    if (std::optional<Check> c =
            CheckSweep(s, sweep_wait, /*asked=*/!only.empty(), daemon)) {
      checks.push_back(std::move(*c));
    }
  }
  // Roots the daemon would serve are the config's; a daemon found without
  // --config/--root still says how many datasets it has (above).
  if (want("roots") || want("o_direct") || want("read")) {
    std::vector<Check> roots = CheckRoots(&s);  // finds the sample shard
    if (want("roots")) {
      for (Check& c : roots) checks.push_back(std::move(c));
    }
  }
  if (want("io_uring")) checks.push_back(CheckIoUring());
  bool direct = false;
  Check o_direct = CheckDirectIo(s, &direct);
  if (want("o_direct")) checks.push_back(std::move(o_direct));
  if (want("memory")) checks.push_back(CheckMemory(s));
  if (want("sockets")) checks.push_back(CheckSocketBuffer(s));
  if (want("read")) checks.push_back(CheckRead(s, direct));

  int failures = 0, warnings = 0;
  for (const Check& c : checks) {
    failures += c.verdict == Verdict::kFail;
    warnings += c.verdict == Verdict::kWarn;
  }
  if (args.Has("json")) {
    Json j;
    j["ok"] = failures == 0;
    j["failures"] = failures;
    j["warnings"] = warnings;
    Json list = Json::array();
    for (const Check& c : checks) {
      Json cj;
      cj["check"] = c.name;
      cj["verdict"] = VerdictName(c.verdict);
      cj["detail"] = c.detail;
      list.push_back(cj);
    }
    j["checks"] = list;
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    for (const Check& c : checks) {
      std::printf("%-5s %-10s %s\n", VerdictName(c.verdict), c.name.c_str(),
                  c.detail.c_str());
    }
    std::printf("verdict: %s (%d failure%s, %d warning%s)\n",
                failures == 0 ? "ready" : "NOT READY", failures,
                failures == 1 ? "" : "s", warnings, warnings == 1 ? "" : "s");
  }
  return failures == 0 ? kExitOk : kExitFailure;
}

}  // namespace

Command DoctorCommand() {
  return {
      "doctor",
      "[--server A] doctor [--config FILE] [--root DIR ...] [options] [--json]",
      "check this node before a job: daemon, roots, io_uring, O_DIRECT, "
      "memory, a read",
      "Checks, each with a verdict (ok, warn, FAIL) and the reason:\n"
      "  daemon    the socket exists, this user may connect, grpc.health.v1 "
      "says SERVING, and which datasets the daemon rejected and why\n"
      "  root DIR  each root can be listed; every dataset under it is "
      "opened as the daemon would, and rejected ones are named with the "
      "error\n"
      "  io_uring  the kernel lets this process set up a ring (else the "
      "daemon reads with pread, slower)\n"
      "  o_direct  the roots' filesystem accepts an aligned O_DIRECT read\n"
      "  memory    available memory (and the cgroup limit) against the "
      "daemon's bound: reservoir + 10 % + 64 MiB\n"
      "  sockets   net.core.wmem_max against the send buffer the daemon "
      "asks for each local connection (socket_send_buffer, default 4M)\n"
      "  read      a sequential read of one shard (--read-bytes, default "
      "64M), O_DIRECT when supported, else with its cached pages dropped\n"
      "  sweep     (a sweep's daemon only, docs/sweeps.md) every other "
      "node's daemon answers over the sweep's TLS and agrees: node order, "
      "--block-bytes, and the same content hash for every dataset\n"
      "The daemon's address is --server, else $SHARDCAST_ADDRESS, else the "
      "config's \"listen\", else unix:/run/shardcast/shardcastd.sock. Roots "
      "and the reservoir size come from --root/--reservoir-bytes, else the "
      "daemon's config file (--config), else the running daemon (reservoir "
      "only). Exit status 1 when any check FAILs.",
      {{"config", "FILE",
        "the daemon's JSON config (roots, listen, "
        "reservoir_bytes)"},
       {"root", "DIR", "a dataset root to check; repeatable", true},
       {"reservoir-bytes", "N", "reservoir to check memory against (e.g. 4G)"},
       {"read-bytes", "N", "how much of one shard to read (default 64M)"},
       {"no-daemon", nullptr,
        "no daemon is expected yet (per-job setups): its absence is a "
        "warning, not a failure"},
       {"only", "NAMES",
        "run only these checks, comma-separated (daemon, sweep, roots, "
        "io_uring, o_direct, memory, sockets, read)"},
       {"sweep-wait", "S",
        "a sweep's peers that do not answer yet are asked again for up to S "
        "seconds (default 0: once); a job's daemons start together"},
       {"json", nullptr, "print machine-readable JSON"}},
      RunDoctor,
  };
}

}  // namespace shardcast
