// Copies into memory that another process reads next (a batch in a
// shared-memory slot), with stores that bypass the caches.
//
// A batch is written once by the daemon and read once elsewhere (a trainer,
// a GPU's DMA): cache-allocating stores would first read every
// destination line from memory (read-for-ownership) and fill the caches with
// lines this thread never reads again. Non-temporal stores write the lines
// whole. Measured on the 2-core VM (random 4 KiB vectors of a 64 MiB window of
// a page-cache map into a 16 MiB memfd slot): 5.5-6.2 GB/s with memcpy and a
// whole-vector prefetch, 7.8-8.8 GB/s with AVX2 streaming stores and a prefetch
// of the first kilobyte of the vector four ahead
// (tests/bench/results/HISTORY.md).
#ifndef SHARDCAST_SERVER_ENGINE_STREAM_COPY_H_
#define SHARDCAST_SERVER_ENGINE_STREAM_COPY_H_

#include <cstddef>

namespace shardcast {

/// Copies `n` bytes from `src` to `dst` (not overlapping; any alignment).
/// With AVX2, the cache-line-aligned body of a copy of at least
/// kStreamCopyMinBytes is written with non-temporal stores, which are weakly
/// ordered: the thread that copied must call StreamCopyFence() before it
/// hands `dst` to anyone (a plain release store does not order them).
/// Smaller copies, CPUs without AVX2 and sanitized builds use memcpy.
/// Thread-safe.
void StreamCopy(char* dst, const char* src, size_t n);

/// Whether StreamCopy uses streaming stores in this build on this CPU.
bool StreamCopyStreams();

/// Orders this thread's earlier StreamCopy stores before its later stores
/// (sfence on x86; nothing elsewhere).
void StreamCopyFence();

/// Below this, StreamCopy is a memcpy (partial lines streamed are slow).
inline constexpr size_t kStreamCopyMinBytes = 512;

/// Hints the memory system to start loading the vector at `src` (its first
/// kilobyte: the hardware prefetcher follows the rest of its page), to be
/// copied soon.
inline void PrefetchVector(const char* src, size_t n) {
  const size_t lines = n < 1024 ? n : 1024;
  for (size_t o = 0; o < lines; o += 64) __builtin_prefetch(src + o);
}

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_STREAM_COPY_H_
