// Which sanitizer this translation unit is built with, the same way for GCC
// and clang: GCC defines __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__, clang
// (14, Debian's) only answers __has_feature. Code that must know tests
// SHARDCAST_ASAN / SHARDCAST_TSAN, defined (as 1) or not.
#ifndef SHARDCAST_COMMON_BASE_SANITIZERS_H_
#define SHARDCAST_COMMON_BASE_SANITIZERS_H_

#if defined(__SANITIZE_ADDRESS__)
#define SHARDCAST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SHARDCAST_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define SHARDCAST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SHARDCAST_TSAN 1
#endif
#endif

#endif  // SHARDCAST_COMMON_BASE_SANITIZERS_H_
