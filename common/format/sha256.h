// Incremental SHA-256 (OpenSSL EVP) for content hashes and shard checksums.
#ifndef SHARDCAST_COMMON_FORMAT_SHA256_H_
#define SHARDCAST_COMMON_FORMAT_SHA256_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardcast {

/// Incremental SHA-256. Owns an EVP_MD_CTX; move-only; not thread-safe.
class Sha256 {
 public:
  Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  ~Sha256();

  void Update(const void* data, size_t length);
  void Update(absl::string_view data) { Update(data.data(), data.size()); }
  /// Returns the lowercase hex digest (64 characters). The object may not be
  /// updated afterwards.
  std::string HexDigest();

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

/// Lowercase hex SHA-256 of `data`.
std::string Sha256Hex(absl::string_view data);

/// HMAC-SHA256 (RFC 2104) under one key: the padded key is hashed into the
/// inner and outer states once, and each MAC continues copies of them.
/// OpenSSL's one-shot HMAC() looks the MAC and the digest up by name on
/// every call, which cost the daemon 6 % of its CPU when it sealed a resume
/// token for every 32-vector batch. Copyable (the
/// states are shared); Mac is thread-safe (it only reads them).
class HmacSha256Key {
 public:
  explicit HmacSha256Key(absl::string_view key);
  /// The 32 raw bytes of HMAC-SHA256(key, data).
  std::string Mac(absl::string_view data) const;

 private:
  struct States;
  std::shared_ptr<const States> states_;
};

/// Lowercase hex SHA-256 of a file's contents, read sequentially in 8 MiB
/// chunks. `on_bytes` (may be empty) is called with each chunk's size, for
/// progress. Errors from open/read, naming the path.
absl::StatusOr<std::string> Sha256File(
    const std::string& path,
    const std::function<void(uint64_t)>& on_bytes = {});
/// The same of an open descriptor (read with pread from offset 0); `path`
/// is for messages.
absl::StatusOr<std::string> Sha256Fd(
    int fd, absl::string_view path,
    const std::function<void(uint64_t)>& on_bytes = {});

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_SHA256_H_
