// Happens-before annotations for ThreadSanitizer at the boundary with
// libraries that are not TSan-instrumented (Debian's gRPC). gRPC orders a
// reactor's construction and its callbacks through its own completion
// queues, which TSan cannot see. A reactor states that ordering with
// TsanRelease(this) right before each call that hands the
// reactor to gRPC (StartRead/StartWrite/Finish), TsanAcquire(this) at the
// start of each callback and worker task. No-ops in builds without TSan.
#ifndef SHARDCAST_COMMON_TSAN_H_
#define SHARDCAST_COMMON_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace shardcast {

inline void TsanAcquire(void* addr) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(addr);
#else
  (void)addr;
#endif
}

inline void TsanRelease(void* addr) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(addr);
#else
  (void)addr;
#endif
}

/// For the whole of a reactor callback: acquires on entry, releases on exit,
/// so that whatever gRPC runs after this callback (OnDone after OnCancel,
/// say) is ordered after it for TSan too. Not for OnDone (it deletes).
class TsanReaction {
 public:
  explicit TsanReaction(void* addr) : addr_(addr) { TsanAcquire(addr_); }
  ~TsanReaction() { TsanRelease(addr_); }
  TsanReaction(const TsanReaction&) = delete;
  TsanReaction& operator=(const TsanReaction&) = delete;

 private:
  void* addr_;
};

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_TSAN_H_
