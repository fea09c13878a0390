#include "server/engine/reservoir.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/base/human_bytes.h"
#include "common/base/log.h"

namespace shardcast {
namespace {

// Faults in the pages of [begin, begin + n) for writing without changing
// their bytes (MADV_POPULATE_WRITE, Linux 5.14, on the whole pages inside);
// older kernels get a zero written in every page the range touches, which
// the caller allows (the bytes are its own).
void TouchPages(char* begin, uint64_t n) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t b = reinterpret_cast<uintptr_t>(begin);
  const uintptr_t first = (b + page - 1) / page * page;
  const uintptr_t last = (b + n) / page * page;
  if (last > first && ::madvise(reinterpret_cast<void*>(first), last - first,
                                MADV_POPULATE_WRITE) == 0) {
    return;
  }
  for (uintptr_t p = b; p < b + n; p = (p / page + 1) * page) {
    *reinterpret_cast<volatile char*>(p) = 0;
  }
}

}  // namespace

absl::StatusOr<Prefault> ParsePrefault(absl::string_view name) {
  if (name == "background") return Prefault::kBackground;
  if (name == "start") return Prefault::kStart;
  if (name == "off") return Prefault::kOff;
  return absl::InvalidArgumentError(absl::StrCat(
      "prefault '", name, "' is not one of background, start, off"));
}

Reservoir::Reservoir(char* base, uint64_t mapped, uint64_t slot_bytes,
                     int64_t slots)
    : base_(base),
      mapped_(mapped),
      slot_bytes_(slot_bytes),
      num_slots_(slots),
      elastic_margin_(std::max<int64_t>(4, slots / 32)) {
  MutexLock lock(&mu_);
  state_.assign(static_cast<size_t>(slots), SlotState::kFree);
  touched_.assign(static_cast<size_t>(slots), false);
  for (int64_t i = 0; i < slots; ++i) {
    free_.insert(free_.end(), static_cast<int32_t>(i));
  }
}

Reservoir::~Reservoir() {
  StopPrefault();
  const int64_t in_use = slots_in_use();
  if (in_use > 0) {
    LogError("reservoir destroyed with ", in_use, " block(s) still in use");
  }
  ::munmap(base_, mapped_);
}

absl::StatusOr<std::unique_ptr<Reservoir>> Reservoir::Create(
    ReservoirOptions options) {
  // Slots are cache-line multiples; a page multiple (as --block-bytes
  // normally is) keeps every slot page-aligned for O_DIRECT.
  const uint64_t slot =
      std::max<uint64_t>(64, (options.slot_bytes + 63) / 64 * 64);
  const uint64_t slots = options.bytes / slot;
  if (slots < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--reservoir-bytes ", options.bytes, " holds fewer than 2 blocks of ",
        slot, " bytes (--block-bytes); give at least ", 2 * slot));
  }
  if (slots > (1u << 30)) {
    return absl::InvalidArgumentError(
        "--reservoir-bytes / --block-bytes is too many slots");
  }
  const uint64_t mapped = slots * slot;
  void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map the reservoir (", HumanBytes(mapped),
                     "): ", std::strerror(errno)));
  }
  // Huge pages make the first touch of the reservoir far cheaper; a kernel
  // without transparent huge pages just ignores the advice.
  ::madvise(p, mapped, MADV_HUGEPAGE);
  if (options.prefault == Prefault::kStart) {
    TouchPages(static_cast<char*>(p), mapped);
  }
  std::unique_ptr<Reservoir> r(new Reservoir(
      static_cast<char*>(p), mapped, slot, static_cast<int64_t>(slots)));
  if (options.prefault == Prefault::kStart) {
    MutexLock lock(&r->mu_);
    r->touched_.assign(slots, true);
    r->touched_count_ = static_cast<int64_t>(slots);
  }
  r->background_ = options.prefault == Prefault::kBackground;
  return r;
}

void Reservoir::StartPrefault() {
  if (!background_ || prefault_thread_.joinable()) return;
  prefault_thread_ = std::thread([this] { PrefaultLoop(); });
}

void Reservoir::PrefaultLoop() {
  // The lowest priority short of SCHED_IDLE, for this thread alone (Linux
  // nices threads one by one): it competes little with other processes.
  // Not SCHED_IDLE: this thread takes mu_, and one preempted while holding
  // it on a busy machine would wait for an idle CPU while every stream
  // waits for it (seen: 8 cold trainers at 0.03 x fio).
  if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19) != 0) {
    LogDebug("reservoir prefault: setpriority: ", std::strerror(errno));
  }
  while (true) {
    int32_t slot;
    {
      MutexLock lock(&mu_);
      prefault_wake_.Wait(&mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        while (prefault_next_ < num_slots_) {
          const size_t i = static_cast<size_t>(prefault_next_);
          if (!touched_[i] && state_[i] == SlotState::kFree) break;
          ++prefault_next_;  // touched, in use (so touched) or parked
        }
        // Not while streams or leases hold reservations: they touch the
        // slots they use, and this thread would compete with them.
        return prefault_stop_ ||
               (reserved_ == 0 && prefault_next_ < num_slots_);
      });
      if (prefault_stop_) return;
      slot = static_cast<int32_t>(prefault_next_);
      if (free_.erase(slot) != 1) {  // kFree means in free_
        LogError("reservoir: free slot ", slot, " not in the pool (bug)");
        return;
      }
      state_[static_cast<size_t>(slot)] = SlotState::kPrefaulting;
      ++prefaulting_;
    }
    // Out of the pool: no reader writes the slot meanwhile. In steps of
    // 2 MiB, so that a stream that starts meanwhile (a reservation) stops
    // it within one step: the populate holds the process's memory-map lock,
    // which a reader's mmap would wait for behind a nice-19 thread.
    constexpr uint64_t kStep = 2 << 20;
    uint64_t done = 0;
    while (done < slot_bytes_ &&
           !prefault_yield_.load(std::memory_order_relaxed)) {
      const uint64_t n = std::min(kStep, slot_bytes_ - done);
      TouchPages(slot_data(slot) + done, n);
      done += n;
    }
    {
      MutexLock lock(&mu_);
      if (done == slot_bytes_ && !touched_[static_cast<size_t>(slot)]) {
        touched_[static_cast<size_t>(slot)] = true;
        ++touched_count_;
      }  // else taken up again after the reservations
      --prefaulting_;
      ReturnLocked(slot);  // parks it (untouched again) if parking is owed
    }
    if (listener_) listener_();  // a reader may have waited for this slot
  }
}

void Reservoir::StopPrefault() {
  {
    MutexLock lock(&mu_);
    prefault_stop_ = true;
    prefault_yield_ = true;
  }
  prefault_wake_.SignalAll();
  if (prefault_thread_.joinable()) prefault_thread_.join();
}

absl::Status Reservoir::Reserve(int64_t slots, const std::string& what) {
  if (slots < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot reserve a negative number of blocks (", slots, ")"));
  }
  MutexLock lock(&mu_);
  // Overflow lent out does not count: it is taken back (ScanRegistry
  // reclaims it) when a new reservation needs the room.
  if (reserved_ + slots > num_slots_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the reservoir cannot take this stream: it needs ", slots,
        " blocks of ", HumanBytes(slot_bytes_), " (", what, ") but only ",
        num_slots_ - reserved_, " of the reservoir's ", num_slots_, " (",
        HumanBytes(bytes()),
        ", --reservoir-bytes) are not reserved by other "
        "streams; raise --reservoir-bytes or lower --shuffle-window, "
        "--lag-blocks or --block-bytes"));
  }
  reserved_ += slots;
  if (reserved_ > 0) prefault_yield_ = true;
  return absl::OkStatus();
}

void Reservoir::Unreserve(int64_t slots) {
  MutexLock lock(&mu_);
  if (slots < 0 || slots > reserved_) {
    LogError("reservoir: unreserving ", slots, " blocks of ", reserved_,
             " reserved (bug); ignored");
    return;
  }
  reserved_ -= slots;
  if (reserved_ == 0 && !prefault_stop_) {
    prefault_yield_ = false;
    prefault_wake_.SignalAll();  // it may go on
  }
}

bool Reservoir::TryTakeOverflow() {
  MutexLock lock(&mu_);
  // Called for a block that holds its slot already (a scan checks
  // overflow_available() >= 1 before it reads one), hence `margin` free
  // slots suffice here.
  if (SpareLocked() < 1 && FreeLocked() < elastic_margin_) return false;
  ++overflow_;
  return true;
}

int64_t Reservoir::OverflowAvailableLocked() const {
  // The spare, or elastically the free slots beyond the margin.
  return std::max<int64_t>({0, SpareLocked(), FreeLocked() - elastic_margin_});
}

void Reservoir::ReturnOverflow(int64_t n) {
  MutexLock lock(&mu_);
  if (n < 0 || n > overflow_) {
    LogError("reservoir: returning ", n, " overflow blocks of ", overflow_,
             " taken (bug); ignored");
    return;
  }
  overflow_ -= n;
}

int64_t Reservoir::overflow_available() const {
  MutexLock lock(&mu_);
  return OverflowAvailableLocked();
}

int64_t Reservoir::overflow_excess() const {
  MutexLock lock(&mu_);
  return std::max<int64_t>(0, -SpareLocked());
}

int64_t Reservoir::elastic_shortfall() const {
  MutexLock lock(&mu_);
  return std::min(std::max<int64_t>(0, -SpareLocked()),
                  std::max<int64_t>(0, elastic_margin_ - FreeLocked()));
}

int64_t Reservoir::overflow_taken() const {
  MutexLock lock(&mu_);
  return overflow_;
}

std::optional<int32_t> Reservoir::TryAcquire() {
  MutexLock lock(&mu_);
  if (free_.empty()) return std::nullopt;
  const int32_t slot = *free_.begin();
  free_.erase(free_.begin());
  state_[static_cast<size_t>(slot)] = SlotState::kInUse;
  if (!touched_[static_cast<size_t>(slot)]) {
    touched_[static_cast<size_t>(slot)] = true;  // by its user, from now
    ++touched_count_;
  }
  return slot;
}

void Reservoir::Release(int32_t slot) {
  {
    MutexLock lock(&mu_);
    if (slot < 0 || slot >= num_slots_ ||
        state_[static_cast<size_t>(slot)] != SlotState::kInUse) {
      LogError("reservoir: release of slot ", slot,
               " that is not in use (bug); ignored");
      return;
    }
    ReturnLocked(slot);
  }
  if (listener_) listener_();
}

void Reservoir::ReturnLocked(int32_t slot) {
  if (park_owed_ > 0) {
    --park_owed_;
    ParkLocked(slot);
  } else {
    state_[static_cast<size_t>(slot)] = SlotState::kFree;
    free_.insert(slot);
  }
}

void Reservoir::ParkLocked(int32_t slot) {
  state_[static_cast<size_t>(slot)] = SlotState::kParked;
  if (!pinned_) {
    if (touched_[static_cast<size_t>(slot)]) {
      touched_[static_cast<size_t>(slot)] = false;
      --touched_count_;
    }
    // Only the pages wholly inside the slot: madvise rounds its length up
    // to a page, and slots smaller than a page (or not page-aligned) share
    // pages with their neighbours, whose data must stay.
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(slot_data(slot));
    const uintptr_t first = (begin + page - 1) / page * page;
    const uintptr_t last = (begin + slot_bytes_) / page * page;
    if (last > first) {
      ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
    }
  }
  parked_.push_back(slot);
}

void Reservoir::Park(int64_t slots) {
  MutexLock lock(&mu_);
  park_owed_ += slots;
  while (park_owed_ > 0 && !free_.empty()) {
    // The highest free index: low slots stay warm for reuse.
    auto top = std::prev(free_.end());
    const int32_t slot = *top;
    free_.erase(top);
    --park_owed_;
    ParkLocked(slot);
  }
}

void Reservoir::Unpark(int64_t slots) {
  {
    MutexLock lock(&mu_);
    const int64_t cancelled = std::min(slots, park_owed_);
    park_owed_ -= cancelled;
    for (int64_t i = cancelled; i < slots && !parked_.empty(); ++i) {
      const int32_t slot = parked_.back();
      parked_.pop_back();
      state_[static_cast<size_t>(slot)] = SlotState::kFree;
      free_.insert(slot);
      prefault_next_ = std::min<int64_t>(prefault_next_, slot);
    }
  }
  prefault_wake_.SignalAll();  // their pages were given back
  if (listener_) listener_();  // a reader may wait for these slots
}

int64_t Reservoir::slots_parked() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(parked_.size());
}

void Reservoir::SetPinned() {
  MutexLock lock(&mu_);
  pinned_ = true;
  // Registration faulted every page in, and pinned pages are never given
  // back: all of it stays touched.
  touched_.assign(static_cast<size_t>(num_slots_), true);
  touched_count_ = num_slots_;
}

int64_t Reservoir::slots_in_use() const {
  MutexLock lock(&mu_);
  return num_slots_ - static_cast<int64_t>(free_.size()) -
         static_cast<int64_t>(parked_.size()) - prefaulting_;
}

int64_t Reservoir::slots_touched() const {
  MutexLock lock(&mu_);
  return touched_count_;
}

int64_t Reservoir::slots_reserved() const {
  MutexLock lock(&mu_);
  return reserved_;
}

}  // namespace shardcast
