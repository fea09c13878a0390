#include "server/engine/resume_token.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/format/sha256.h"

namespace shardcast {

absl::StatusOr<TokenReader> TokenReader::Open(absl::string_view token,
                                              const char (&magic)[4],
                                              absl::string_view kind) {
  if (token.size() < 4 || std::memcmp(token.data(), magic, 4) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("resume_token is not a shardcast ", kind, " token"));
  }
  return TokenReader(token);
}

bool TokenReader::GetBytes(size_t n, absl::string_view* out) {
  if (remaining() < n) return false;
  *out = token_.substr(at_, n);
  at_ += n;
  return true;
}

std::string TokenSealer::RandomKey() {
  std::string key(32, '\0');
  size_t got = 0;
  while (got < key.size()) {
    const ssize_t n = ::getrandom(key.data() + got, key.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) std::abort();  // no entropy source at all: cannot go on safely
    got += static_cast<size_t>(n);
  }
  return key;
}

std::string TokenSealer::Seal(absl::string_view token) const {
  std::string out(token);
  out.append(key_.Mac(token).substr(0, kMacBytes));
  return out;
}

absl::StatusOr<std::string> TokenSealer::Open(absl::string_view sealed) const {
  if (sealed.size() > kMacBytes) {
    const absl::string_view body = sealed.substr(0, sealed.size() - kMacBytes);
    const std::string mac = key_.Mac(body);
    unsigned char diff = 0;  // constant time: no early exit on a mismatch
    for (size_t i = 0; i < kMacBytes; ++i) {
      diff |= static_cast<unsigned char>(mac[i] ^ sealed[body.size() + i]);
    }
    if (diff == 0) return std::string(body);
  }
  return absl::InvalidArgumentError(
      "resume_token was not issued by this daemon: it is damaged, forged, or "
      "from a daemon with another key (tokens survive a restart only with "
      "the same --token-key-file)");
}

absl::Status MalformedToken(absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("resume_token is malformed: ", why));
}

uint64_t StreamFingerprint(absl::string_view kind, absl::string_view dataset,
                           const StreamSpec& spec, absl::string_view extra) {
  Sha256 h;
  h.Update(absl::StrCat(
      kind, "|", dataset, "|",
      spec.layer.has_value() ? absl::StrCat(*spec.layer) : "all", "|",
      static_cast<int>(spec.tokens), "|", spec.batch_size, "|", spec.rank, "/",
      spec.world_size,
      spec.node_count > 1
          ? absl::StrCat("|node ", spec.node_rank, "/", spec.node_count)
          : "",
      "|", spec.drop_last, extra.empty() ? "" : "|", extra, "|",
      absl::StrJoin(spec.exclude_labels, ",")));
  return std::stoull(h.HexDigest().substr(0, 16), nullptr, 16);
}

}  // namespace shardcast
