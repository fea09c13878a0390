// Happens-before annotations for ThreadSanitizer at the boundary with
// libraries that are not TSan-instrumented (Debian's gRPC). gRPC orders a
// reactor's construction and its callbacks through its own completion
// queues, which TSan cannot see. A reactor states that ordering by making
// each call that hands the reactor to gRPC (StartRead/StartWrite/Finish)
// through TsanHandOff(this, ...), and with TsanAcquire(this) at the start of
// each callback and worker task. No-ops in builds without TSan.
#ifndef SHARDCAST_COMMON_BASE_TSAN_H_
#define SHARDCAST_COMMON_BASE_TSAN_H_

#include "common/base/sanitizers.h"

#if defined(SHARDCAST_TSAN)
#include <sanitizer/tsan_interface.h>
// Exported by the TSan runtime (dynamic annotations).
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
#endif

#include <utility>

namespace shardcast {

inline void TsanAcquire(void* addr) {
#if defined(SHARDCAST_TSAN)
  __tsan_acquire(addr);
#else
  (void)addr;
#endif
}

inline void TsanRelease(void* addr) {
#if defined(SHARDCAST_TSAN)
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

/// Makes one call that hands the reactor to gRPC (StartRead, StartWrite,
/// StartWriteAndFinish, Finish): releases, then ignores this thread's memory
/// accesses until the call returns. The call reads the reactor's stream
/// pointer (grpcpp's inline code, so instrumented) after the release, and
/// gRPC may already run OnDone, which deletes the reactor, on another thread
/// before it returns; that read is ordered by gRPC, where TSan cannot see.
template <typename Call>
void TsanHandOff(void* addr, Call&& call) {
#if defined(SHARDCAST_TSAN)
  __tsan_release(addr);
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  std::forward<Call>(call)();
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#else
  (void)addr;
  std::forward<Call>(call)();
#endif
}

/// Deletes a reactor from its OnDone. The destructor runs as usual (TSan
/// checks its accesses), but freeing the memory is not recorded as a write:
/// gRPC binds a reactor after CreateReactor returns, on that thread, in
/// grpcpp's inline code (InternalBindStream reads the fields queued before
/// binding), after the constructor's last release; gRPC orders that before
/// OnDone where TSan cannot see, so the free would be reported against it.
template <typename Reactor>
void DeleteReactor(Reactor* reactor) {
  reactor->~Reactor();
#if defined(SHARDCAST_TSAN)
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  ::operator delete(static_cast<void*>(reactor));
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
#else
  ::operator delete(static_cast<void*>(reactor));
#endif
}

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_TSAN_H_
