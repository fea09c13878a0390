// What both stream kinds share about resume tokens: the bytes a stream hands
// out with every batch so that a client can reopen it right after that
// batch. A token starts with a 4-byte magic naming the stream kind and the
// fingerprint of the request it belongs to, so it only continues that
// request; the rest (little-endian) is each kind's own (ordered_stream.h,
// shuffled_stream.h).
#ifndef SHARDCAST_SERVER_ENGINE_RESUME_TOKEN_H_
#define SHARDCAST_SERVER_ENGINE_RESUME_TOKEN_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/format/sha256.h"
#include "server/engine/selection.h"

namespace shardcast {

/// Appends little-endian fields to a token. Plain data.
class TokenWriter {
 public:
  explicit TokenWriter(const char (&magic)[4]) : bytes_(magic, 4) {}
  template <typename T>
  void Put(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof(v));
  }
  void Append(absl::string_view bytes) {
    bytes_.append(bytes.data(), bytes.size());
  }
  std::string Take() { return std::move(bytes_); }

 private:
  std::string bytes_;
};

/// Reads the fields of a token a client sent, never past its end.
class TokenReader {
 public:
  /// INVALID_ARGUMENT "resume_token is not a shardcast <kind> token" when
  /// `token` does not start with `magic`.
  static absl::StatusOr<TokenReader> Open(absl::string_view token,
                                          const char (&magic)[4],
                                          absl::string_view kind);
  /// Reads the next T; false (nothing read) when fewer bytes remain.
  template <typename T>
  bool Get(T* v) {
    if (token_.size() - at_ < sizeof(T)) return false;
    std::memcpy(v, token_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  /// The next `n` bytes; false (nothing read) when fewer remain.
  bool GetBytes(size_t n, absl::string_view* out);
  size_t remaining() const { return token_.size() - at_; }

 private:
  explicit TokenReader(absl::string_view token) : token_(token), at_(4) {}
  absl::string_view token_;
  size_t at_;
};

/// Authenticates resume tokens: every token a client receives ends in 16
/// bytes of HMAC-SHA256 of the rest under the daemon's key, so a client can
/// only hand back tokens this daemon (or one with the same key, see
/// --token-key-file) issued: a forged token with fields out of range never
/// reaches a stream's decoder. The streams make and read unsealed tokens;
/// the engine seals what they hand out and opens what clients send.
class TokenSealer {
 public:
  static constexpr size_t kMacBytes = 16;
  static constexpr size_t kMinKeyBytes = 16;

  /// `key`: at least kMinKeyBytes of secret.
  explicit TokenSealer(absl::string_view key) : key_(key) {}
  /// 32 bytes from getrandom(2): tokens then last as long as the process.
  static std::string RandomKey();

  std::string Seal(absl::string_view token) const;
  /// The token without its MAC; INVALID_ARGUMENT when it was not sealed
  /// with this key (forged, damaged, or from a daemon with another key).
  absl::StatusOr<std::string> Open(absl::string_view sealed) const;

 private:
  HmacSha256Key key_;
};

/// INVALID_ARGUMENT "resume_token is malformed: <why>".
absl::Status MalformedToken(absl::string_view why);

/// Binds a token to its request: the first 8 bytes of the SHA-256 of every
/// request field that shapes the stream (dataset, selection, batch size,
/// partition, drop_last, label filter), the stream `kind` and `extra`
/// (what else the kind depends on, e.g. the seed and block size).
uint64_t StreamFingerprint(absl::string_view kind, absl::string_view dataset,
                           const StreamSpec& spec, absl::string_view extra);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_RESUME_TOKEN_H_
