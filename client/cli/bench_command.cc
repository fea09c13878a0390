// `shardcast --server A bench ID --clients N ...`: N concurrent streaming
// clients (this binary re-executed as `stream --json`), the daemon's
// counters around them and, with --dir, fio's sequential read bandwidth on
// the same shard files in the same run, so every figure can be read as a
// ratio (docs/benchmarks.md).
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/cli/commands.h"
#include "common/base/cpu_time.h"
#include "common/base/file.h"
#include "common/base/proc_fields.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"
#include "nlohmann/json.hpp"
#include "shardcast/client.h"

namespace shardcast {
namespace {

using OrderedJson = nlohmann::ordered_json;

constexpr int64_t kMaxClients = 256;
constexpr double kMiB = 1 << 20;

// ------------------------------------------------------------ processes

/// A child process with its stdout and stderr captured through pipes.
struct ChildProcess {
  pid_t pid = -1;
  UniqueFd out;  // read ends; invalid once at EOF
  UniqueFd err;
  std::string out_text;
  std::string err_text;
  int wait_status = 0;
  bool exited = false;
  double cpu_seconds = 0;  // user + system, from wait4 once exited
};

absl::Status MakePipe(UniqueFd* read_end, UniqueFd* write_end) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return ErrnoToStatus(errno, "pipe2");
  read_end->Reset(fds[0]);
  write_end->Reset(fds[1]);
  return absl::OkStatus();
}

/// Forks and executes `path` with `argv`, stdout and stderr into pipes.
/// The descriptors in `inherit` stay open across exec (all others the
/// parent opened with O_CLOEXEC are closed).
absl::StatusOr<ChildProcess> Spawn(const std::string& path,
                                   const std::vector<std::string>& argv,
                                   const std::vector<int>& inherit = {}) {
  // Everything the child needs is prepared before fork: between fork and
  // exec a child of a threaded process may only make async-signal-safe
  // calls.
  std::vector<char*> c_argv;
  for (const std::string& a : argv) {
    c_argv.push_back(const_cast<char*>(a.c_str()));
  }
  c_argv.push_back(nullptr);
  const std::string exec_failed = absl::StrCat("cannot execute ", path, "\n");
  ChildProcess child;
  UniqueFd out_write, err_write;
  RETURN_IF_ERROR(MakePipe(&child.out, &out_write));
  RETURN_IF_ERROR(MakePipe(&child.err, &err_write));
  const pid_t pid = ::fork();
  if (pid < 0) return ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    ::dup2(out_write.get(), 1);
    ::dup2(err_write.get(), 2);
    for (int fd : inherit) ::fcntl(fd, F_SETFD, 0);
    ::execv(path.c_str(), c_argv.data());
    ssize_t ignored = ::write(2, exec_failed.data(), exec_failed.size());
    (void)ignored;
    ::_exit(127);
  }
  child.pid = pid;
  return child;
}

/// Reads the children's output until every pipe is at EOF, calling `tick`
/// about once a second, then reaps them.
void DrainAndWait(std::vector<ChildProcess>& children,
                  const std::function<void()>& tick) {
  auto last_tick = std::chrono::steady_clock::now();
  while (true) {
    std::vector<pollfd> fds;
    std::vector<std::pair<UniqueFd*, std::string*>> targets;
    for (ChildProcess& c : children) {
      if (c.out.valid()) {
        fds.push_back({c.out.get(), POLLIN, 0});
        targets.push_back({&c.out, &c.out_text});
      }
      if (c.err.valid()) {
        fds.push_back({c.err.get(), POLLIN, 0});
        targets.push_back({&c.err, &c.err_text});
      }
    }
    if (fds.empty()) break;
    const int n = ::poll(fds.data(), fds.size(), 250);
    if (n < 0 && errno != EINTR) break;
    for (size_t i = 0; n > 0 && i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char buf[65536];
      const ssize_t got = ::read(fds[i].fd, buf, sizeof(buf));
      if (got > 0) {
        targets[i].second->append(buf, static_cast<size_t>(got));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        targets[i].first->Reset();
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (tick && now - last_tick >= std::chrono::seconds(1)) {
      last_tick = now;
      tick();
    }
  }
  for (ChildProcess& c : children) {
    struct rusage usage = {};
    while (::wait4(c.pid, &c.wait_status, 0, &usage) < 0 && errno == EINTR) {
    }
    c.exited = true;
    c.cpu_seconds = CpuSeconds(usage);
  }
}

std::string DescribeExit(int wait_status) {
  if (WIFEXITED(wait_status)) {
    return absl::StrCat("exit status ", WEXITSTATUS(wait_status));
  }
  if (WIFSIGNALED(wait_status)) {
    return absl::StrCat("killed by signal ", WTERMSIG(wait_status));
  }
  return "ended abnormally";
}

bool ExitedOk(int wait_status) {
  return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
}

// ------------------------------------------------------------ /proc

/// The value of `key` in a /proc file of "key: value" lines.
absl::StatusOr<uint64_t> ProcField(const std::string& path,
                                   absl::string_view key) {
  ASSIGN_OR_RETURN(ProcFields fields, ProcFields::Read(path));
  return fields.Require(key);
}

/// The CPU time a process has used so far (user + system: fields 14 and 15
/// of /proc/PID/stat, in clock ticks), over all its threads.
absl::StatusOr<double> ProcCpuSeconds(const std::string& proc) {
  ASSIGN_OR_RETURN(std::string text, ReadProcFile(proc + "/stat"));
  // The command name (field 2) is in parentheses and may hold spaces: the
  // fields to count start after its last ')'.
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) {
    return absl::DataLossError(absl::StrCat(proc, "/stat has no ')'"));
  }
  std::vector<absl::string_view> fields = absl::StrSplit(
      absl::string_view(text).substr(paren + 1), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state), so field N is fields[N - 3].
  uint64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return absl::DataLossError(
        absl::StrCat(proc, "/stat: no utime and stime fields"));
  }
  const long ticks = ::sysconf(_SC_CLK_TCK);
  if (ticks <= 0) return absl::InternalError("sysconf(_SC_CLK_TCK) failed");
  return static_cast<double>(utime + stime) / static_cast<double>(ticks);
}

// ------------------------------------------------------------ fio

/// Finds an executable `name` on $PATH.
std::optional<std::string> FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir :
       absl::StrSplit(path != nullptr ? path : "/usr/bin:/bin", ':')) {
    if (dir.empty()) continue;
    const std::string candidate = JoinPath(dir, name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return std::nullopt;
}

/// The dataset's shard files (acts*.bin) in `dir`, sorted, with sizes.
absl::StatusOr<std::vector<std::pair<std::string, uint64_t>>> ShardFiles(
    const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoToStatus(errno, absl::StrCat("--dir ", dir));
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (absl::StartsWith(name, "acts") && absl::EndsWith(name, ".bin")) {
      names.push_back(name);
    }
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  if (names.empty()) {
    return absl::NotFoundError(
        absl::StrCat("--dir ", dir, " holds no shard files (acts*.bin)"));
  }
  std::vector<std::pair<std::string, uint64_t>> files;
  for (const std::string& name : names) {
    const std::string path = JoinPath(dir, name);
    ASSIGN_OR_RETURN(uint64_t size, FileSize(path));
    files.push_back({path, size});
  }
  return files;
}

/// Drops the files' pages from the page cache, as `vmtouch -e` does.
absl::Status EvictFromPageCache(
    const std::vector<std::pair<std::string, uint64_t>>& files) {
  for (const auto& [path, size] : files) {
    ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
    const int rc = ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
    if (rc != 0) {
      return ErrnoToStatus(rc, absl::StrCat("posix_fadvise DONTNEED ", path));
    }
  }
  return absl::OkStatus();
}

struct FioRun {
  double bytes_per_second = 0;  // the reference: the faster of the two below
  double buffered = 0;          // psync, through the page cache
  double direct = 0;            // io_uring qd32, O_DIRECT; 0: not possible
  uint64_t io_bytes = 0;
  uint64_t block_bytes = 0;
};

/// fio's limit on one option's value (its filename list included).
constexpr size_t kFioMaxOptionLength = 4096;

/// One fio run over `names` (':'-joined, relative to `directory`); see RunFio.
absl::StatusOr<FioRun> RunFioOnce(const std::string& fio,
                                  const std::string& directory,
                                  const std::vector<std::string>& names,
                                  uint64_t block, bool direct) {
  const std::vector<std::string> argv = {
      "fio",
      "--name=seq",
      "--rw=read",
      absl::StrCat("--bs=", block),
      direct ? "--ioengine=io_uring" : "--ioengine=psync",
      direct ? "--direct=1" : "--direct=0",
      direct ? "--iodepth=32" : "--iodepth=1",
      "--readonly",
      absl::StrCat("--directory=", directory),
      absl::StrCat("--filename=", absl::StrJoin(names, ":")),
      "--output-format=json"};
  ASSIGN_OR_RETURN(ChildProcess child, Spawn(fio, argv));
  std::vector<ChildProcess> one;
  one.push_back(std::move(child));
  DrainAndWait(one, nullptr);
  const ChildProcess& c = one[0];
  if (!ExitedOk(c.wait_status)) {
    return absl::InternalError(absl::StrCat("fio failed (",
                                            DescribeExit(c.wait_status),
                                            "): ", c.err_text, c.out_text));
  }
  const size_t brace = c.out_text.find('{');
  OrderedJson j = OrderedJson::parse(
      brace == std::string::npos ? std::string() : c.out_text.substr(brace),
      nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("jobs") || !j["jobs"].is_array() ||
      j["jobs"].empty() || !j["jobs"][0].contains("read") ||
      !j["jobs"][0]["read"].contains("bw_bytes")) {
    return absl::InternalError(absl::StrCat(
        "cannot read jobs[0].read.bw_bytes from fio's JSON output: ",
        c.out_text.substr(0, 500)));
  }
  FioRun run;
  run.bytes_per_second = j["jobs"][0]["read"]["bw_bytes"].get<double>();
  run.io_bytes = j["jobs"][0]["read"].value("io_bytes", uint64_t{0});
  run.block_bytes = block;
  if (run.io_bytes == 0 || run.bytes_per_second <= 0) {
    return absl::InternalError(
        absl::StrCat("fio read ", run.io_bytes, " bytes at ",
                     run.bytes_per_second, " bytes/s from ", names.size(),
                     " files in ", directory, " (", block, "-byte reads)"));
  }
  return run;
}

/// One fio sequential read over all `files` (ShardFiles' list of
/// `directory`): psync through the page cache, or (`direct`) io_uring with 32
/// reads in flight and O_DIRECT, whichever the disk prefers is the reference.
/// fio takes the names relative to --directory, ':'-joined (and ':'
/// escaped); a list longer than fio's 4096-character limit on an option is
/// read in consecutive runs, one after the other, and the rate is all their
/// bytes over all their time.
/// --size is left out on purpose: fio then reads every file whole, while
/// --size splits the total evenly across the files and fio would extend (that
/// is, write to) a shard smaller than its share. --readonly makes sure fio
/// never writes to the dataset.
absl::StatusOr<FioRun> RunFio(
    const std::string& fio, const std::string& directory,
    const std::vector<std::pair<std::string, uint64_t>>& files, bool direct) {
  if (files.empty()) return absl::InvalidArgumentError("fio: no files to read");
  auto escape = [](absl::string_view s) {
    return absl::StrReplaceAll(s, {{":", "\\:"}});
  };
  std::vector<std::vector<std::string>> groups(1);
  size_t length = 0;
  for (const auto& [path, size] : files) {
    std::string name = escape(path.substr(path.rfind('/') + 1));
    if (name.size() + 1 >= kFioMaxOptionLength) {
      return absl::InvalidArgumentError(
          absl::StrCat("file name too long for fio: ", path));
    }
    if (!groups.back().empty() &&
        length + 1 + name.size() >= kFioMaxOptionLength) {
      groups.emplace_back();
      length = 0;
    }
    length += (groups.back().empty() ? 0 : 1) + name.size();
    groups.back().push_back(std::move(name));
  }
  // 1 MiB reads, or smaller ones for shards under 1 MiB (fio reads each file
  // in whole blocks, so it would skip such a file entirely).
  uint64_t smallest = UINT64_MAX;
  for (const auto& [path, size] : files) smallest = std::min(smallest, size);
  uint64_t block = 1 << 20;
  while (block > 4096 && block > smallest) block >>= 1;
  FioRun total;
  total.block_bytes = block;
  double seconds = 0;
  for (const std::vector<std::string>& names : groups) {
    ASSIGN_OR_RETURN(FioRun run,
                     RunFioOnce(fio, escape(directory), names, block, direct));
    total.io_bytes += run.io_bytes;
    seconds += static_cast<double>(run.io_bytes) / run.bytes_per_second;
  }
  total.bytes_per_second = static_cast<double>(total.io_bytes) / seconds;
  return total;
}

// ------------------------------------------------------------ the command

struct ClientResult {
  double bytes_per_second = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  int64_t vectors = 0;
  double cpu_seconds = 0;  // the client process's, user + system
};

std::string Mib(double bytes) { return absl::StrFormat("%.1f", bytes / kMiB); }

// Until the daemon's reservoir is touched (status reservoir_bytes_touched),
// while that figure grows: a daemon with --prefault off, or one whose
// untouched slots are parked for shared-memory regions, stops growing short
// of the total, and is waited for 2 s more. At most a minute (the thread is
// nice 19: a machine busy with other work starves it), then a warning.
absl::Status WaitForPrefault(Client& client) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Clock::time_point grew = start;
  uint64_t last = 0;
  uint64_t told_at = 0;
  bool told = false;
  while (true) {
    ASSIGN_OR_RETURN(DaemonStatus s, client.GetStatus());
    const uint64_t touched = s.reservoir_bytes_touched;
    if (touched >= s.reservoir_bytes) break;
    const Clock::time_point now = Clock::now();
    if (touched > last) {
      grew = now;
      last = touched;
    }
    if (now - grew > std::chrono::seconds(2) ||
        now - start > std::chrono::minutes(1)) {
      std::fprintf(stderr,
                   "bench: warning: measuring with %s of %s MiB of the "
                   "daemon's reservoir touched (--prefault off, or the "
                   "machine is busy)\n",
                   Mib(static_cast<double>(touched)).c_str(),
                   Mib(static_cast<double>(s.reservoir_bytes)).c_str());
      break;
    }
    if (!told || touched >= told_at + (uint64_t{256} << 20)) {
      std::fprintf(stderr,
                   "bench: the daemon is touching its reservoir in the "
                   "background (%s of %s MiB); waiting for it\n",
                   Mib(static_cast<double>(touched)).c_str(),
                   Mib(static_cast<double>(s.reservoir_bytes)).c_str());
      told = true;
      told_at = touched;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::OkStatus();
}

int RunBench(const Args& args) {
  const char* cmd = "bench";
  auto usage = [](const std::string& message) {
    std::fprintf(stderr, "shardcast bench: %s\n", message.c_str());
    return kExitUsage;
  };
  if (args.positional().size() != 1) return usage("expected one dataset ID");
  const std::string id = args.positional()[0];
  if (!args.Has("clients")) return usage("--clients N is required");
  auto clients = args.GetInt("clients", 1);
  auto epochs = args.GetInt("epochs", 1);
  auto layer = args.GetInt("layer", 0);
  auto pid = args.GetInt("daemon-pid", 0);
  for (const absl::Status& s :
       {clients.status(), epochs.status(), layer.status(), pid.status()}) {
    if (!s.ok()) return usage(std::string(s.message()));
  }
  if (*clients < 1 || *clients > kMaxClients) {
    return usage(absl::StrCat("--clients must be in [1, ", kMaxClients, "]"));
  }
  const bool partitioned = args.Has("partitioned");
  if (partitioned && (args.Has("rank") || args.Has("world-size"))) {
    return usage("--partitioned sets --rank and --world-size for each client");
  }
  if (*epochs < 0) return usage("--epochs must be >= 0");
  if (*epochs == 0 && !args.Has("max-batches")) {
    return usage("--epochs 0 (endless) needs --max-batches");
  }
  if (args.Has("cold") && !args.Has("dir")) {
    return usage("--cold evicts the shard files of --dir DATASET_DIR");
  }
  const std::string tokens = args.Get("tokens", "content");
  if (tokens != "content" && tokens != "special" && tokens != "all") {
    return usage("--tokens takes content, special or all");
  }
  if (args.Has("daemon-pid") && *pid <= 0) {
    return usage("--daemon-pid must be a process id");
  }

  auto client = Client::Connect(RemoteAddress(), RemoteOptions());
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  auto info = (*client)->DescribeDataset(id);
  if (!info.ok()) return Fail(cmd, std::string(info.status().message()));
  if (!info->ok) {
    return Fail(cmd, absl::StrCat("dataset ", info->id,
                                  " was rejected: ", info->error));
  }
  // Selected bytes per epoch, before any label filter.
  int64_t rows = info->n_examples * static_cast<int64_t>(info->layers.size());
  if (args.Has("layer")) {
    if (std::find(info->layers.begin(), info->layers.end(), *layer) ==
        info->layers.end()) {
      return Fail(cmd, absl::StrCat("layer ", *layer, " is not recorded in ",
                                    info->id, " (layers ",
                                    absl::StrJoin(info->layers, ","), ")"));
    }
    rows = info->n_examples;
  }
  const int64_t per_row = tokens == "all"       ? info->tokens_per_example
                          : tokens == "special" ? (info->cls_token ? 1 : 0)
                                                : info->content_tokens;
  const uint64_t selected_bytes =
      static_cast<uint64_t>(rows * per_row * info->d_model) * 4;

  // A daemon that just started touches its reservoir in the background
  // (shardcastd --prefault): wait for that, so that neither fio nor the
  // streams are measured against it (nor the streams against first touch).
  if (absl::Status st = WaitForPrefault(**client); !st.ok()) {
    return Fail(cmd, std::string(st.message()));
  }

  // fio and the page cache.
  std::vector<std::pair<std::string, uint64_t>> files;
  std::string fio;
  if (args.Has("dir")) {
    std::optional<std::string> found = FindOnPath("fio");
    if (!found) return Fail(cmd, "bench --dir needs fio: apt-get install fio");
    fio = *found;
    auto listed = ShardFiles(args.Get("dir"));
    if (!listed.ok()) return Fail(cmd, std::string(listed.status().message()));
    files = std::move(*listed);
  }
  const bool cold = args.Has("cold");
  std::vector<FioRun> fio_runs;
  auto run_fio = [&]() -> absl::Status {
    if (cold) RETURN_IF_ERROR(EvictFromPageCache(files));
    std::fprintf(stderr, "bench: fio sequential read of %zu shard files%s\n",
                 files.size(), cold ? " (evicted from the page cache)" : "");
    ASSIGN_OR_RETURN(FioRun run,
                     RunFio(fio, args.Get("dir"), files, /*direct=*/false));
    run.buffered = run.bytes_per_second;
    // The same with O_DIRECT and io_uring qd32; a filesystem or file sizes
    // that refuse O_DIRECT leave the buffered figure as the reference.
    if (cold) RETURN_IF_ERROR(EvictFromPageCache(files));
    absl::StatusOr<FioRun> direct =
        RunFio(fio, args.Get("dir"), files, /*direct=*/true);
    if (direct.ok()) {
      run.direct = direct->bytes_per_second;
      run.bytes_per_second = std::max(run.buffered, run.direct);
    } else {
      std::fprintf(
          stderr, "bench: fio with O_DIRECT failed (%s); using psync\n",
          std::string(direct.status().message()).substr(0, 200).c_str());
    }
    std::fprintf(stderr,
                 "bench: fio %.1f MiB/s buffered psync, %.1f MiB/s O_DIRECT "
                 "io_uring qd32\n",
                 run.buffered / kMiB, run.direct / kMiB);
    fio_runs.push_back(run);
    return absl::OkStatus();
  };
  if (!files.empty()) {
    if (absl::Status st = run_fio(); !st.ok()) {
      return Fail(cmd, std::string(st.message()));
    }
  }

  // The clients' command lines: this binary, `stream --json`.
  std::vector<std::string> base = {"shardcast", "--server", RemoteAddress()};
  const ClientOptions& tls = RemoteOptions();
  for (const auto& [flag, value] :
       std::vector<std::pair<const char*, std::string>>{
           {"--tls-ca", tls.tls_ca_file},
           {"--tls-cert", tls.tls_cert_file},
           {"--tls-key", tls.tls_key_file},
           {"--tls-server-name", tls.tls_server_name}}) {
    if (!value.empty()) absl::StrAppend(&base.emplace_back(), flag, "=", value);
  }
  if (!tls.shared_memory) base.push_back("--no-shared-memory");
  base.push_back("stream");
  base.push_back(id);
  for (const OptionSpec& spec : StreamRequestOptions()) {
    if (!args.Has(spec.name)) continue;
    base.push_back(
        spec.value_name == nullptr
            ? absl::StrCat("--", spec.name)
            : absl::StrCat("--", spec.name, "=", args.Get(spec.name)));
  }
  // Trainers stream shuffled unless told otherwise.
  if (!args.Has("order")) base.push_back("--order=shuffled");
  base.push_back("--json");

  auto status_before = (*client)->GetStatus();
  if (!status_before.ok()) {
    return Fail(cmd, std::string(status_before.status().message()));
  }
  const std::string proc = absl::StrCat("/proc/", *pid);
  std::optional<uint64_t> io_before;
  std::optional<double> cpu_before;
  if (args.Has("daemon-pid")) {
    auto v = ProcField(proc + "/io", "read_bytes");
    auto c = ProcCpuSeconds(proc);
    for (const absl::Status& s : {v.status(), c.status()}) {
      if (!s.ok()) {
        return Fail(cmd, absl::StrCat("--daemon-pid: ", s.message()));
      }
    }
    io_before = *v;
    cpu_before = *c;
  }
  if (cold) {
    if (absl::Status st = EvictFromPageCache(files); !st.ok()) {
      return Fail(cmd, std::string(st.message()));
    }
  }

  // Fork every client; each connects, says it is ready on `ready` and waits
  // for `go` to close before it opens its stream (stream --start-sync), so
  // the streams open within a few milliseconds of each other.
  UniqueFd ready_read, ready_write, go_read, go_write;
  for (const absl::Status& st :
       {MakePipe(&ready_read, &ready_write), MakePipe(&go_read, &go_write)}) {
    if (!st.ok()) return Fail(cmd, std::string(st.message()));
  }
  base.insert(base.end() - 1, absl::StrCat("--start-sync=", ready_write.get(),
                                           ",", go_read.get()));
  std::vector<ChildProcess> children;
  std::vector<std::string> labels;
  for (int64_t i = 0; i < *clients; ++i) {
    std::vector<std::string> argv = base;
    if (partitioned) {
      argv.insert(argv.end() - 1, {absl::StrCat("--rank=", i),
                                   absl::StrCat("--world-size=", *clients)});
    }
    auto child =
        Spawn("/proc/self/exe", argv, {ready_write.get(), go_read.get()});
    if (!child.ok()) {
      for (ChildProcess& c : children) ::kill(c.pid, SIGTERM);
      go_write.Reset();
      DrainAndWait(children, nullptr);
      return Fail(cmd, std::string(child.status().message()));
    }
    children.push_back(std::move(*child));
    labels.push_back(partitioned ? absl::StrCat("client ", i, " (rank ", i,
                                                " of ", *clients, ")")
                                 : absl::StrCat("client ", i));
  }
  ready_write.Reset();
  go_read.Reset();
  std::fprintf(stderr, "bench: %lld clients: %s\n",
               static_cast<long long>(*clients),
               absl::StrJoin(base, " ").c_str());
  // A byte from each client once it is connected; EOF when every client is
  // ready or gone.
  for (int64_t ready = 0; ready < *clients;) {
    char buf[256];
    const ssize_t got = ::read(ready_read.get(), buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    ready += got;
  }
  const auto start = std::chrono::steady_clock::now();
  go_write.Reset();  // go
  ready_read.Reset();
  auto progress = [&]() {
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    auto s = (*client)->GetStatus();
    if (!s.ok()) {
      std::fprintf(stderr, "bench: %.0f s\n", secs);
      return;
    }
    const double delivered = static_cast<double>(
        s->bytes_delivered - status_before->bytes_delivered);
    std::fprintf(
        stderr,
        "bench: %.0f s, daemon delivered %s MiB (%s MiB/s), read %s MiB "
        "from disk\n",
        secs, Mib(delivered).c_str(),
        Mib(secs > 0 ? delivered / secs : 0).c_str(),
        Mib(static_cast<double>(s->bytes_read_from_disk -
                                status_before->bytes_read_from_disk))
            .c_str());
  };
  DrainAndWait(children, progress);
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();

  // The clients' reports.
  std::vector<ClientResult> results;
  std::vector<std::string> failures;
  for (size_t i = 0; i < children.size(); ++i) {
    const ChildProcess& c = children[i];
    if (!ExitedOk(c.wait_status)) {
      failures.push_back(
          absl::StrCat(labels[i], " failed (", DescribeExit(c.wait_status),
                       "): ", absl::StripTrailingAsciiWhitespace(c.err_text)));
      continue;
    }
    OrderedJson j = OrderedJson::parse(c.out_text, nullptr, false);
    if (j.is_discarded() || !j.contains("bytes") || !j.contains("seconds")) {
      failures.push_back(absl::StrCat(
          labels[i], " printed no stream report: ", c.out_text.substr(0, 500),
          " ", c.err_text.substr(0, 500)));
      continue;
    }
    ClientResult r;
    r.bytes_per_second = j.value("bytes_per_second", 0.0);
    r.bytes = j.value("bytes", uint64_t{0});
    r.seconds = j.value("seconds", 0.0);
    r.vectors = j.value("vectors", int64_t{0});
    r.cpu_seconds = c.cpu_seconds;
    results.push_back(r);
  }
  if (!failures.empty()) {
    return Fail(cmd, absl::StrJoin(failures, "\n"));
  }

  auto status_after = (*client)->GetStatus();
  if (!status_after.ok()) {
    return Fail(cmd, std::string(status_after.status().message()));
  }
  std::optional<uint64_t> io_delta, hwm, proc_rss;
  std::optional<double> daemon_cpu;
  if (io_before.has_value()) {
    auto io_after = ProcField(proc + "/io", "read_bytes");
    auto status = ProcFields::Read(proc + "/status");
    auto h = status.ok() ? status->Require("VmHWM") : status.status();
    auto r = status.ok() ? status->Require("VmRSS") : status.status();
    auto c = ProcCpuSeconds(proc);
    for (const absl::Status& s :
         {io_after.status(), h.status(), r.status(), c.status()}) {
      if (!s.ok()) {
        return Fail(cmd, absl::StrCat("--daemon-pid: ", s.message()));
      }
    }
    io_delta = *io_after - *io_before;
    hwm = *h;
    proc_rss = *r;
    daemon_cpu = *c - *cpu_before;
  }
  if (!files.empty()) {
    if (absl::Status st = run_fio(); !st.ok()) {
      return Fail(cmd, std::string(st.message()));
    }
  }

  // Figures.
  uint64_t total_bytes = 0;
  double longest = 0;
  for (const ClientResult& r : results) {
    total_bytes += r.bytes;
    longest = std::max(longest, r.seconds);
  }
  const double total_rate =
      longest > 0 ? static_cast<double>(total_bytes) / longest : 0.0;
  const uint64_t disk =
      status_after->bytes_read_from_disk - status_before->bytes_read_from_disk;
  const double denominator =
      static_cast<double>(selected_bytes) * static_cast<double>(*epochs);
  // Disk bytes over the bytes the clients' selection covers (-1: nothing
  // selected).
  const double disk_ratio =
      denominator > 0 ? static_cast<double>(disk) / denominator : -1.0;
  const std::string disk_ratio_text =
      disk_ratio >= 0 ? absl::StrFormat("%.3f", disk_ratio) : "-";
  // What the storage devices read for the daemon (its /proc/self/io): the
  // read-ahead the kernel adds shows here, not in the bytes asked for.
  const uint64_t device =
      status_after->device_read_bytes - status_before->device_read_bytes;
  const double device_ratio =
      denominator > 0 ? static_cast<double>(device) / denominator : -1.0;
  const std::string device_ratio_text =
      device_ratio >= 0 ? absl::StrFormat("%.3f", device_ratio) : "-";
  std::optional<double> fio_mean;
  if (!fio_runs.empty()) {
    double sum = 0;
    for (const FioRun& f : fio_runs) sum += f.bytes_per_second;
    fio_mean = sum / static_cast<double>(fio_runs.size());
  }
  const uint64_t rss =
      proc_rss.has_value() ? *proc_rss : status_after->memory_rss_bytes;

  OrderedJson j;
  OrderedJson jc = OrderedJson::array();
  for (const ClientResult& r : results) {
    OrderedJson x;
    x["bytes_per_second"] = r.bytes_per_second;
    x["bytes"] = r.bytes;
    x["seconds"] = r.seconds;
    x["vectors"] = r.vectors;
    x["cpu_seconds"] = r.cpu_seconds;
    jc.push_back(std::move(x));
  }
  j["clients"] = std::move(jc);
  j["total_bytes_per_second"] = total_rate;
  j["wall_seconds"] = wall;
  j["selected_bytes_per_epoch"] = selected_bytes;
  j["epochs"] = *epochs;
  j["partitioned"] = partitioned;
  j["daemon_disk_read_bytes"] = disk;
  j["disk_read_ratio"] =
      disk_ratio >= 0 ? OrderedJson(disk_ratio) : OrderedJson(nullptr);
  j["daemon_device_read_bytes"] = device;
  j["device_read_ratio"] =
      device_ratio >= 0 ? OrderedJson(device_ratio) : OrderedJson(nullptr);
  j["proc_io_read_bytes"] =
      io_delta ? OrderedJson(*io_delta) : OrderedJson(nullptr);
  j["daemon_rss_bytes"] = rss;
  j["daemon_hwm_bytes"] = hwm ? OrderedJson(*hwm) : OrderedJson(nullptr);
  // The RSS by kind at the end (the daemon's own status).
  j["daemon_rss_anon_bytes"] = status_after->memory_rss_anon_bytes;
  j["daemon_rss_file_bytes"] = status_after->memory_rss_file_bytes;
  j["daemon_rss_shmem_bytes"] = status_after->memory_rss_shmem_bytes;
  // The daemon's CPU time over the run (all its threads; --daemon-pid), and
  // per byte the clients received: what the serving side costs, to set
  // beside grpc_stream_bench's server_cpu_seconds.
  std::optional<double> daemon_ns_per_byte;
  if (daemon_cpu && total_bytes > 0) {
    daemon_ns_per_byte = *daemon_cpu * 1e9 / static_cast<double>(total_bytes);
  }
  j["daemon_cpu_seconds"] =
      daemon_cpu ? OrderedJson(*daemon_cpu) : OrderedJson(nullptr);
  j["daemon_cpu_ns_per_byte"] = daemon_ns_per_byte
                                    ? OrderedJson(*daemon_ns_per_byte)
                                    : OrderedJson(nullptr);
  j["reservoir_bytes"] = status_after->reservoir_bytes;
  j["reservoir_bytes_touched_before"] = status_before->reservoir_bytes_touched;
  if (fio_mean.has_value()) {
    OrderedJson f;
    std::vector<double> rates, buffered;
    std::vector<uint64_t> io;
    OrderedJson direct = OrderedJson::array();
    for (const FioRun& r : fio_runs) {
      rates.push_back(r.bytes_per_second);
      buffered.push_back(r.buffered);
      direct.push_back(r.direct > 0 ? OrderedJson(r.direct)
                                    : OrderedJson(nullptr));
      io.push_back(r.io_bytes);
    }
    f["bytes_per_second"] = rates;
    f["buffered"] = buffered;
    f["direct"] = direct;
    f["mean"] = *fio_mean;
    f["io_bytes"] = io;
    f["block_bytes"] = fio_runs[0].block_bytes;
    j["fio"] = std::move(f);
    std::vector<double> ratios;
    for (const ClientResult& r : results) {
      ratios.push_back(*fio_mean > 0 ? r.bytes_per_second / *fio_mean : 0.0);
    }
    j["ratio_vs_fio"] = ratios;
  } else {
    j["fio"] = nullptr;
    j["ratio_vs_fio"] = nullptr;
  }
  if (args.Has("json")) {
    std::printf("%s\n", JsonText(j, 2).c_str());
    return kExitOk;
  }
  std::printf("%-8s %12s %12s %9s %10s %7s %8s\n", "client", "vectors", "MiB",
              "seconds", "MiB/s", "x fio", "CPU s");
  for (size_t i = 0; i < results.size(); ++i) {
    const ClientResult& r = results[i];
    const std::string ratio =
        fio_mean && *fio_mean > 0
            ? absl::StrFormat("%.2f", r.bytes_per_second / *fio_mean)
            : "-";
    std::printf("%-8zu %12lld %12s %9.3f %10s %7s %8.2f\n", i,
                static_cast<long long>(r.vectors),
                Mib(static_cast<double>(r.bytes)).c_str(), r.seconds,
                Mib(r.bytes_per_second).c_str(), ratio.c_str(), r.cpu_seconds);
  }
  std::printf("%-8s %12s %12s %9.3f %10s\n", "total", "",
              Mib(static_cast<double>(total_bytes)).c_str(), longest,
              Mib(total_rate).c_str());
  std::printf("selected per epoch: %s MiB x %lld epoch(s)%s\n",
              Mib(static_cast<double>(selected_bytes)).c_str(),
              static_cast<long long>(*epochs),
              partitioned ? " (split across the clients)"
                          : " (every client streams all of it)");
  std::printf(
      "daemon asked for %s MiB (%s x selected); devices read %s MiB (%s x "
      "selected)",
      Mib(static_cast<double>(disk)).c_str(), disk_ratio_text.c_str(),
      Mib(static_cast<double>(device)).c_str(), device_ratio_text.c_str());
  if (io_delta) {
    std::printf("; /proc io read_bytes %s MiB",
                Mib(static_cast<double>(*io_delta)).c_str());
  }
  std::printf("\ndaemon RSS %s MiB", Mib(static_cast<double>(rss)).c_str());
  if (hwm)
    std::printf(" (peak %s MiB)", Mib(static_cast<double>(*hwm)).c_str());
  std::printf(", reservoir %s MiB\n",
              Mib(static_cast<double>(status_after->reservoir_bytes)).c_str());
  if (status_after->memory_rss_anon_bytes > 0)  // 0 from an older daemon
    std::printf(
        "  of the RSS at the end: its own %s MiB, mapped files (shard pages, "
        "the program) %s MiB, "
        "clients' shared-memory regions %s MiB\n",
        Mib(static_cast<double>(status_after->memory_rss_anon_bytes)).c_str(),
        Mib(static_cast<double>(status_after->memory_rss_file_bytes)).c_str(),
        Mib(static_cast<double>(status_after->memory_rss_shmem_bytes)).c_str());
  if (daemon_ns_per_byte) {
    std::printf("daemon CPU %.2f s (%.3f ns per byte delivered)\n", *daemon_cpu,
                *daemon_ns_per_byte);
  }
  if (fio_mean) {
    std::vector<std::string> rates;
    for (const FioRun& r : fio_runs) {
      rates.push_back(absl::StrCat(Mib(r.bytes_per_second), " (psync ",
                                   Mib(r.buffered), ", O_DIRECT qd32 ",
                                   r.direct > 0 ? Mib(r.direct) : "-", ")"));
    }
    std::printf("fio sequential read: %s MiB/s (mean %s)%s\n",
                absl::StrJoin(rates, ", ").c_str(), Mib(*fio_mean).c_str(),
                cold ? ", cold" : "");
  }
  return kExitOk;
}

}  // namespace

Command BenchCommand() {
  std::vector<OptionSpec> options = {
      {"clients", "N", "concurrent streaming clients (processes)"},
      {"partitioned", nullptr,
       "client i streams --rank i --world-size N (else each streams all)"},
      {"dir", "DATASET_DIR",
       "the dataset's directory on this node: fio reads its acts*.bin before "
       "and after the streams"},
      {"cold", nullptr,
       "evict the shard files from the page cache before each fio run and "
       "before the streams (needs --dir)"},
      {"daemon-pid", "PID",
       "also read /proc/PID/io read_bytes, /proc/PID/status VmRSS/VmHWM and "
       "the daemon's CPU time (/proc/PID/stat) around the run"},
  };
  for (OptionSpec o : StreamRequestOptions()) {
    if (std::string(o.name) == "order") {
      o.help = "shuffled (default here) or ordered";
    }
    options.push_back(o);
  }
  options.push_back({"json", nullptr, "print machine-readable JSON"});
  return {
      "bench",
      "[--server A] bench ID --clients N [stream options] [--dir DATASET_DIR] "
      "[--cold] [--daemon-pid PID] [--partitioned] [--json]",
      "N concurrent streaming clients, daemon disk reads, fio on the same "
      "files",
      "Starts N `shardcast stream ID ... --json` processes together (this "
      "binary re-executed; each connects, then waits until all have, before "
      "it opens its stream) "
      "and reports each client's bytes/s, the total (all clients' bytes over "
      "the longest client's time), the selected bytes per epoch (vectors x "
      "d_model x 4, before any label filter), the bytes the daemon read from "
      "disk during the run (Admin.GetStatus) and their ratio to selected "
      "bytes x epochs, and the daemon's memory. Stream options are passed to "
      "every client; --order defaults to shuffled here (trainers sharing one "
      "disk pass). With --partitioned client i is rank i of N; otherwise "
      "every client streams the whole selection.\n\n"
      "With --dir, fio reads the same shard files sequentially before and "
      "after the streams, twice each time: --rw=read --bs=1M --readonly with "
      "--ioengine=psync --direct=0, and with --ioengine=io_uring --direct=1 "
      "--iodepth=32 (every file whole; smaller reads for shards under 1 "
      "MiB); the faster of the two is that time's reference, and each "
      "client's bytes/s is also given as a ratio to the mean of the two "
      "references. --cold evicts "
      "the files from the page cache (posix_fadvise DONTNEED, as vmtouch -e) "
      "before each fio run and before the streams. Progress goes to stderr; "
      "a client that fails makes bench exit 1 with its stderr.",
      options,
      RunBench};
}

}  // namespace shardcast
