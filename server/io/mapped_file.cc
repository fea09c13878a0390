#include "server/io/mapped_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace shardcast {
namespace {

// The SIGBUS guard: which address ranges are maps of ours, readable from a
// signal handler (lock-free atomics only). Entries are taken and freed
// under g_table_mu; the handler scans [0, g_high).
struct GuardEntry {
  std::atomic<uintptr_t> begin{0};  // 0: free
  std::atomic<uintptr_t> end{0};
  std::atomic<uint64_t> faults{0};
};
GuardEntry g_entries[MappedFile::kMaxMaps];
std::atomic<int> g_high{0};
std::mutex g_table_mu;
struct sigaction g_previous;
uintptr_t g_page = 4096;
std::atomic<bool> g_no_populate{false};

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info->si_addr);
  const int high = g_high.load(std::memory_order_acquire);
  for (int i = 0; i < high; ++i) {
    GuardEntry& e = g_entries[i];
    const uintptr_t begin = e.begin.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin ||
        addr >= e.end.load(std::memory_order_acquire)) {
      continue;
    }
    // Ours: a page of zeros in place of the lost one, so the copy that
    // touched it completes; the fault count tells the copier to discard it.
    void* page = reinterpret_cast<void*>(addr & ~(g_page - 1));
    if (::mmap(page, g_page, PROT_READ, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS,
               -1, 0) != MAP_FAILED) {
      e.faults.fetch_add(1, std::memory_order_acq_rel);
      return;
    }
    break;
  }
  // Not a map of ours (or it could not be repaired): what would have
  // happened without us.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 &&
      g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  ::signal(SIGBUS, SIG_DFL);  // the fault repeats on return and kills
}

// Installs the handler once; returns a free entry for [begin, end), or -1.
int TakeGuardEntry(uintptr_t begin, uintptr_t end) {
  std::lock_guard<std::mutex> lock(g_table_mu);
  static const bool installed = [] {
    g_page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGBUS, &sa, &g_previous) != 0) {
      LogWarning("cannot install the SIGBUS handler for mapped shards: ",
                 std::strerror(errno));
    }
    return true;
  }();
  (void)installed;
  for (int i = 0; i < MappedFile::kMaxMaps; ++i) {
    GuardEntry& e = g_entries[i];
    if (e.begin.load(std::memory_order_relaxed) != 0) continue;
    e.faults.store(0, std::memory_order_relaxed);
    e.end.store(end, std::memory_order_relaxed);
    e.begin.store(begin, std::memory_order_release);
    if (i >= g_high.load(std::memory_order_relaxed)) {
      g_high.store(i + 1, std::memory_order_release);
    }
    return i;
  }
  return -1;
}

void FreeGuardEntry(int i) {
  std::lock_guard<std::mutex> lock(g_table_mu);
  g_entries[i].begin.store(0, std::memory_order_release);
}

// The signal a lease break is reported with (F_SETSIG), sent to the
// watcher thread alone (F_SETOWN_EX F_OWNER_TID), which blocks it and takes
// it with sigwaitinfo(); si_fd names the map's descriptor.
int LeaseSignal() { return SIGRTMIN + 5; }

}  // namespace

/// Takes read leases on the files of maps and, when one is broken, has the
/// map copy its cached pages before letting the lease go. Thread-safe.
class LeaseWatcher {
 public:
  static LeaseWatcher& Get() {
    // Never destroyed: its thread waits for signals for the process's life.
    static LeaseWatcher* const watcher = new LeaseWatcher();
    return *watcher;
  }
  /// Takes a read lease on `m`'s descriptor (and says so in m->leased());
  /// false where the kernel refuses one (the first refusal is logged).
  bool Watch(MappedFile* m) {
    std::lock_guard<std::mutex> lock(mu_);
    if (tid_ <= 0) return false;
    const int fd = m->fd_.get();
    struct f_owner_ex owner = {F_OWNER_TID, tid_};
    if (::fcntl(fd, F_SETSIG, LeaseSignal()) != 0 ||
        ::fcntl(fd, F_SETOWN_EX, &owner) != 0 ||
        ::fcntl(fd, F_SETLEASE, F_RDLCK) != 0) {
      if (!refusal_logged_) {
        refusal_logged_ = true;
        LogInfo("maps of shard files hold no read lease (", m->path_, ": ",
                std::strerror(errno),
                "): a file truncated while a gRPC stream sends from its map "
                "ends that connection");
      }
      return false;
    }
    files_[fd] = m;
    m->leased_.store(true, std::memory_order_release);  // before any break
    return true;
  }
  /// No break of `m`'s lease is handled after this returns (one being
  /// handled is finished first).
  void Forget(const MappedFile* m) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(m->fd_.get());
    if (it != files_.end() && it->second == m) files_.erase(it);
  }

 private:
  LeaseWatcher() {
    std::thread([this] { Run(); }).detach();
    std::unique_lock<std::mutex> lock(mu_);
    started_.wait(lock, [this] { return tid_ != 0; });
  }

  void Run() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, LeaseSignal());
    const bool blocked = ::pthread_sigmask(SIG_BLOCK, &set, nullptr) == 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tid_ = blocked ? ::gettid() : -1;
    }
    started_.notify_all();
    if (!blocked) return;
    while (true) {
      siginfo_t info;
      if (::sigwaitinfo(&set, &info) < 0) continue;  // EINTR
      std::lock_guard<std::mutex> lock(mu_);
      auto it = files_.find(info.si_fd);
      if (it == files_.end()) continue;  // its map is gone
      MappedFile* m = it->second;
      files_.erase(it);
      m->CopyCachedPages();
      m->leased_.store(false, std::memory_order_release);
      ::fcntl(m->fd_.get(), F_SETLEASE, F_UNLCK);  // the truncation goes on
    }
  }

  std::mutex mu_;
  std::condition_variable started_;
  pid_t tid_ = 0;  // the thread's, once it blocked the signal; -1: none
  bool refusal_logged_ = false;
  std::map<int, MappedFile*> files_;  // by lease descriptor
};

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Map(int fd,
                                                            uint64_t size,
                                                            std::string path) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t mapped =
      std::max<uint64_t>(page, (size + page - 1) / page * page);
  void* p = ::mmap(nullptr, mapped, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return ErrnoToStatus(errno, absl::StrCat("mmap ", path));
  }
  char* base = static_cast<char*>(p);
  // A description of its own (the same inode), for the lease: a lease
  // belongs to a description, and other maps of the file take theirs.
  UniqueFd own(
      ::open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDONLY | O_CLOEXEC));
  if (!own.valid()) own.Reset(::fcntl(fd, F_DUPFD_CLOEXEC, 0));  // no /proc
  if (!own.valid()) {
    const int e = errno;
    ::munmap(p, mapped);
    return ErrnoToStatus(e, absl::StrCat("dup ", path));
  }
  const int guard = TakeGuardEntry(reinterpret_cast<uintptr_t>(base),
                                   reinterpret_cast<uintptr_t>(base) + mapped);
  if (guard < 0) {
    ::munmap(p, mapped);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", path, ": ", kMaxMaps,
                     " shard files are mapped already"));
  }
  std::unique_ptr<MappedFile> m(new MappedFile(
      base, size, mapped, std::move(path), guard, std::move(own)));
  LeaseWatcher::Get().Watch(m.get());
  return m;
}

MappedFile::MappedFile(char* base, uint64_t size, uint64_t mapped,
                       std::string path, int guard, UniqueFd fd)
    : base_(base),
      size_(size),
      mapped_(mapped),
      path_(std::move(path)),
      guard_(guard),
      fd_(std::move(fd)) {}

MappedFile::~MappedFile() {
  LeaseWatcher::Get().Forget(this);
  FreeGuardEntry(guard_);
  ::munmap(base_, mapped_);
}

absl::Status MappedFile::Populate(uint64_t offset, uint64_t length) const {
  if (offset > size_ || length > size_ - offset) {
    return absl::DataLossError(
        absl::StrCat(path_, ": bytes [", offset, ", ", offset + length,
                     ") are beyond its end (", size_, " bytes when mapped)"));
  }
  if (length == 0 || g_no_populate.load(std::memory_order_relaxed)) {
    return absl::OkStatus();
  }
  const uint64_t begin = offset / g_page * g_page;
  const uint64_t end = offset + length;
  while (true) {
    if (::madvise(base_ + begin, end - begin, MADV_POPULATE_READ) == 0) {
      return absl::OkStatus();
    }
    const int e = errno;
    if (e == EINTR || e == EAGAIN) continue;
    if (e == EINVAL) {  // a kernel before 5.14: touches fault pages in
      g_no_populate.store(true, std::memory_order_relaxed);
      return absl::OkStatus();
    }
    const std::string range = absl::StrCat("bytes [", offset, ", ", end, ")");
    if (e == EFAULT) {
      return absl::DataLossError(
          absl::StrCat(path_, ": ", range,
                       " are gone (the file shrank after it was opened)"));
    }
    return absl::DataLossError(
        absl::StrCat(path_, ": cannot read ", range, ": ", std::strerror(e)));
  }
}

void MappedFile::CopyCachedPages() {
  std::lock_guard<std::mutex> lock(copy_mu_);
  if (copied_) return;
  copied_ = true;
  const size_t pages = static_cast<size_t>(mapped_ / g_page);
  std::vector<unsigned char> cached(pages, 1);
  // Pages not in the page cache are in no send under way (a send populates
  // first): they stay maps of the file, and fault once it shrank.
  if (::mincore(base_, mapped_, cached.data()) != 0) {
    std::fill(cached.begin(), cached.end(), 1);
  }
  uint64_t copied = 0;
  for (size_t i = 0; i < pages;) {
    if ((cached[i] & 1) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < pages && (cached[j] & 1) != 0) ++j;
    char* at = base_ + i * g_page;
    const size_t length = (j - i) * g_page;
    i = j;
    void* copy = ::mmap(nullptr, length, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy == MAP_FAILED) {
      LogWarning(path_, ": cannot keep ", length,
                 " bytes of its map before it changes: ", std::strerror(errno));
      break;
    }
    // The file still holds them: the truncation waits for the lease.
    std::memcpy(copy, at, length);
    ::mprotect(copy, length, PROT_READ);
    if (::mremap(copy, length, length, MREMAP_MAYMOVE | MREMAP_FIXED, at) ==
        MAP_FAILED) {
      LogWarning(path_,
                 ": cannot put a copy in its map: ", std::strerror(errno));
      ::munmap(copy, length);
      break;
    }
    copied += length;
  }
  copied_bytes_.store(copied, std::memory_order_release);
  LogWarning(path_,
             " is being truncated or opened for writing while it is served; "
             "the ",
             copied, " bytes of it that were cached are kept in memory");
}

void MappedFile::Unmap(uint64_t offset, uint64_t length) const {
  std::lock_guard<std::mutex> lock(copy_mu_);
  if (copied_) return;  // private copies would read zeros after it
  // Whole pages inside the range only: a page shared with a neighbouring
  // range stays (it is dropped with that one, or with the map).
  const uint64_t begin = (offset + g_page - 1) / g_page * g_page;
  const uint64_t end = std::min(offset + length, mapped_) / g_page * g_page;
  if (end > begin) ::madvise(base_ + begin, end - begin, MADV_DONTNEED);
}

void MappedFile::AdviseRandom() const {
  ::madvise(base_, mapped_, MADV_RANDOM);
}

absl::StatusOr<uint64_t> MappedFile::CurrentSize() const {
  struct stat st;
  if (::fstat(fd_.get(), &st) != 0) return ErrnoToStatus(errno, path_);
  return static_cast<uint64_t>(st.st_size);
}

uint64_t MappedFile::faults() const {
  return g_entries[guard_].faults.load(std::memory_order_acquire);
}

}  // namespace shardcast
