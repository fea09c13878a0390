#include "server/engine/resume_token.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/sha256.h"

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
      spec.world_size, "|", spec.drop_last, extra.empty() ? "" : "|", extra,
      "|", absl::StrJoin(spec.exclude_labels, ",")));
  return std::stoull(h.HexDigest().substr(0, 16), nullptr, 16);
}

}  // namespace shardcast
