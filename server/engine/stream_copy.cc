#include "server/engine/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace shardcast {
namespace {

#if defined(__x86_64__)
bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") != 0;
  return has;
}

// `dst` 32-byte aligned, `n` a multiple of 128.
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

void StreamCopy(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  if (n >= kStreamCopyMinBytes && HasAvx2()) {
    // Head up to the first 32-byte boundary of dst, body in 128-byte steps,
    // tail: plain copies.
    const size_t head =
        (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
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
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace shardcast
