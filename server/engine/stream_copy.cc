#include "server/engine/stream_copy.h"

#include <cstdint>
#include <cstring>

#include "common/base/sanitizers.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// Sanitizers do not see the streaming stores (GCC's ASan and TSan, clang's
// TSan leave the intrinsics uninstrumented): sanitized builds copy with
// memcpy, so that an overrun or a race on a batch is still reported.
// stream_copy_test checks the streaming path's bounds in the plain build.
#if defined(SHARDCAST_ASAN) || defined(SHARDCAST_TSAN)
#define SHARDCAST_STREAM_STORES 0
#elif defined(__x86_64__)
#define SHARDCAST_STREAM_STORES 1
#else
#define SHARDCAST_STREAM_STORES 0
#endif

namespace shardcast {
namespace {

#if SHARDCAST_STREAM_STORES
bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") != 0;
  return has;
}

// `dst` 64-byte aligned (whole cache lines), `n` a multiple of 128.
__attribute__((target("avx2"))) void StreamBody(char* dst, const char* src,
                                                size_t n) {
  for (size_t o = 0; o < n; o += 128) {
    const __m256i a =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o));
    const __m256i b =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o + 32));
    const __m256i c =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o + 64));
    const __m256i d =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + o), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + o + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + o + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + o + 96), d);
  }
}
#endif

}  // namespace

bool StreamCopyStreams() {
#if SHARDCAST_STREAM_STORES
  return HasAvx2();
#else
  return false;
#endif
}

void StreamCopy(char* dst, const char* src, size_t n) {
#if SHARDCAST_STREAM_STORES
  if (n >= kStreamCopyMinBytes && HasAvx2()) {
    // Head up to the first cache-line boundary of dst, body in 128-byte
    // steps (whole lines: a line written partly by streaming stores and
    // partly by plain ones is the slow case), tail: plain copies.
    const size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    const size_t body = (n - head) & ~static_cast<size_t>(127);
    std::memcpy(dst, src, head);
    StreamBody(dst + head, src + head, body);
    std::memcpy(dst + head + body, src + head + body, n - head - body);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void StreamCopyFence() {
#if SHARDCAST_STREAM_STORES
  _mm_sfence();
#endif
}

}  // namespace shardcast
