// The reservoir: the daemon's one bounded pool of block memory
// (--reservoir-bytes), cut into fixed slots that hold one block each. Shared
// scans read blocks into slots; a slot returns to the pool when the last
// client holding its block lets go.
//
// Memory is one anonymous mapping made at start. First touch of fresh memory
// is slow (on the 2-core VMs the kernel's zeroing of a new huge page was 16 %
// of a fresh daemon's CPU in a cold 8-trainer run:
// tests/bench/results/HISTORY.md), so with Prefault::kBackground a thread of
// the lowest priority (nice 19) touches the free slots, lowest index first,
// while nothing is reserved (no stream running); a slot in use is never written
// by it. Free slots are handed out lowest index first, so a daemon that needs
// little memory keeps reusing the same warm pages.
//
// Admission: each shuffled stream reserves the slots it may pin (its shuffle
// window plus its lag bound, see SharedScan). Reserve() refuses a stream the
// pool cannot guarantee, so a reader that needs a slot always finds one,
// at worst once the scans have given back what laggards borrowed beyond the
// reservations (overflow, below).
#ifndef SHARDCAST_SERVER_ENGINE_RESERVOIR_H_
#define SHARDCAST_SERVER_ENGINE_RESERVOIR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/mutex.h"

namespace shardcast {

/// When the reservoir's pages are first touched.
enum class Prefault {
  kOff,         // when a slot is first used
  kStart,       // all of them in Create
  kBackground,  // by a nice-19 thread, free slots, while nothing is reserved
};

/// "background", "start" or "off"; INVALID_ARGUMENT naming the choices.
absl::StatusOr<Prefault> ParsePrefault(absl::string_view name);

struct ReservoirOptions {
  uint64_t bytes = 2ull << 30;         // total; rounded down to whole slots
  uint64_t slot_bytes = 4ull << 20;    // one block; rounded up to 64 bytes
  Prefault prefault = Prefault::kOff;  // the daemon's default: kBackground
};

/// Thread-safe. Owns its mapping (unmapped on destruction; every slot must
/// have been released by then, which is logged otherwise) and, with
/// Prefault::kBackground, the prefault thread (joined on destruction).
class Reservoir {
 public:
  /// INVALID_ARGUMENT when fewer than 2 slots fit; RESOURCE_EXHAUSTED when
  /// the mapping cannot be made.
  static absl::StatusOr<std::unique_ptr<Reservoir>> Create(
      ReservoirOptions options);
  ~Reservoir();
  Reservoir(const Reservoir&) = delete;
  Reservoir& operator=(const Reservoir&) = delete;

  /// Reserves `slots` for a new stream; RESOURCE_EXHAUSTED with the numbers
  /// (and `what` the stream needs them for) when they are not available.
  /// Overflow lent out does not count against it (see overflow_excess).
  absl::Status Reserve(int64_t slots, const std::string& what)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Returns a reservation made by Reserve().
  void Unreserve(int64_t slots) ABSL_LOCKS_EXCLUDED(mu_);

  /// Overflow: slots that scans may use to let a stream fall behind further
  /// than its lag bound. First the spare beyond every stream's reservation
  /// (num_slots minus the reserved ones); then, elastically, slots that are
  /// physically free while more than a margin (1/32 of the pool, >= 4) stay
  /// free: reservations count every stream's worst case, but streams of one
  /// scan share their blocks, so most reserved slots are usually free.
  /// Elastic units are overflow_excess(): scans give them back when a
  /// reservation needs the room or a read finds no free slot
  /// (ScanRegistry), so reservations always remain honourable.
  bool TryTakeOverflow() ABSL_LOCKS_EXCLUDED(mu_);
  void ReturnOverflow(int64_t n) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t overflow_taken() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t overflow_available() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Overflow lent beyond what the reservations leave (elastically, or
  /// after a new Reserve): what may be reclaimed.
  int64_t overflow_excess() const ABSL_LOCKS_EXCLUDED(mu_);
  /// How much of that excess to reclaim now: slots missing to keep the
  /// elastic margin free (parking owed counts as taken); 0 without excess.
  int64_t elastic_shortfall() const ABSL_LOCKS_EXCLUDED(mu_);

  /// A free slot (lowest index first), or nothing when all are in use.
  std::optional<int32_t> TryAcquire() ABSL_LOCKS_EXCLUDED(mu_);
  /// Gives a slot back, then calls the release listener. A slot that is not
  /// in use (a bug) is logged and ignored.
  void Release(int32_t slot) ABSL_LOCKS_EXCLUDED(mu_);
  /// Called (without locks held) after every Release, e.g. to wake the read
  /// engine that may be waiting for a slot. Set once, before use (and
  /// before StartPrefault).
  void SetReleaseListener(std::function<void()> listener) {
    listener_ = std::move(listener);
  }

  char* slot_data(int32_t slot) const {
    return base_ + static_cast<uint64_t>(slot) * slot_bytes_;
  }
  uint64_t slot_bytes() const { return slot_bytes_; }
  int64_t num_slots() const { return num_slots_; }
  /// The whole mapping (for io_uring buffer registration).
  char* base() const { return base_; }
  uint64_t bytes() const {
    return static_cast<uint64_t>(num_slots_) * slot_bytes_;
  }

  int64_t slots_in_use() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t slots_reserved() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Slots whose pages are in memory: touched by a prefault or handed out
  /// since the start (a parked slot's pages were given back: not counted).
  int64_t slots_touched() const ABSL_LOCKS_EXCLUDED(mu_);

  /// Memory lent elsewhere (a client's shared-memory region) comes out of
  /// the reservoir physically, not only in the accounts: Park takes `slots`
  /// slots out of use, free ones now (highest index first) and the rest as
  /// they are released, and gives their pages back to the kernel
  /// (MADV_DONTNEED), so the process stays within the reservoir's size.
  /// Call after Reserve(slots), which guarantees they come free. Unpark
  /// returns them (their pages are touched again when next used, or by the
  /// background prefault).
  void Park(int64_t slots) ABSL_LOCKS_EXCLUDED(mu_);
  void Unpark(int64_t slots) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t slots_parked() const ABSL_LOCKS_EXCLUDED(mu_);
  /// With Prefault::kBackground, starts the prefault thread (once; nothing
  /// otherwise). Call after SetReleaseListener: the thread calls the
  /// listener when it returns a slot. Owner's thread only, like
  /// StopPrefault.
  void StartPrefault() ABSL_LOCKS_EXCLUDED(mu_);
  /// Stops and joins the background prefault thread (the destructor does
  /// too): call before whatever the release listener reaches goes away.
  void StopPrefault() ABSL_LOCKS_EXCLUDED(mu_);
  /// The slots are registered with io_uring (pinned, so every page is in
  /// memory): their pages must not be given back, or the kernel would keep
  /// writing the old ones. Parking then only keeps them out of use.
  void SetPinned() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class SlotState : uint8_t { kFree, kInUse, kParked, kPrefaulting };

  Reservoir(char* base, uint64_t mapped, uint64_t slot_bytes, int64_t slots);
  // The background prefault: takes the lowest free untouched slot out of
  // the pool, touches it without the lock, returns it; sleeps when every
  // free slot is touched or a reservation is held.
  void PrefaultLoop() ABSL_LOCKS_EXCLUDED(mu_);
  // Puts a slot that is in no state's list back: free, or parked if
  // parking is owed.
  void ReturnLocked(int32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  char* const base_;
  const uint64_t mapped_;
  const uint64_t slot_bytes_;
  const int64_t num_slots_;
  std::function<void()> listener_;

  mutable Mutex mu_;
  // Free slots, ordered: handed out lowest first, parked highest first,
  // and the prefault takes a given one, each in O(log n).
  absl::btree_set<int32_t> free_ ABSL_GUARDED_BY(mu_);
  std::vector<SlotState> state_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> touched_ ABSL_GUARDED_BY(mu_);  // see slots_touched()
  int64_t touched_count_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t prefaulting_ ABSL_GUARDED_BY(mu_) = 0;  // slots the thread holds
  // Where the prefault thread looks next (every lower free slot is touched,
  // unless an unpark lowered it since).
  int64_t prefault_next_ ABSL_GUARDED_BY(mu_) = 0;
  bool prefault_stop_ ABSL_GUARDED_BY(mu_) = false;
  // Written under mu_ (reservations held, or stopping); read by the
  // prefault thread between steps, without it.
  std::atomic<bool> prefault_yield_{false};
  CondVar prefault_wake_;
  bool background_ = false;  // Prefault::kBackground: StartPrefault starts
  std::thread prefault_thread_;
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  const int64_t elastic_margin_;  // free slots elastic overflow leaves
  int64_t overflow_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int32_t> parked_ ABSL_GUARDED_BY(mu_);
  int64_t park_owed_ ABSL_GUARDED_BY(mu_) = 0;  // to park when released
  bool pinned_ ABSL_GUARDED_BY(mu_) = false;

  void ParkLocked(int32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Units TryTakeOverflow could still lend.
  int64_t OverflowAvailableLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Slots beyond the reservations and the overflow lent (negative: lent
  // elastically, see overflow_excess).
  int64_t SpareLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return num_slots_ - reserved_ - overflow_;
  }
  // Slots free now, less those owed to parking.
  int64_t FreeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return static_cast<int64_t>(free_.size()) - park_owed_;
  }
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_RESERVOIR_H_
