#include "server/engine/index_set.h"

#include <cstring>

#include "absl/base/config.h"
#include "absl/strings/str_cat.h"

namespace shardcast {

IndexSet::IndexSet(int64_t n, bool full)
    : n_(n), count_(0), words_(static_cast<size_t>((n + 63) / 64), 0) {
  if (full) {
    for (int64_t b = 0; b < n; ++b) Set(b);
  }
}

void IndexSet::Set(int64_t b) {
  uint64_t& w = words_[static_cast<size_t>(b >> 6)];
  const uint64_t bit = uint64_t{1} << (b & 63);
  if ((w & bit) == 0) {
    w |= bit;
    ++count_;
  }
}

void IndexSet::Clear(int64_t b) {
  uint64_t& w = words_[static_cast<size_t>(b >> 6)];
  const uint64_t bit = uint64_t{1} << (b & 63);
  if ((w & bit) != 0) {
    w &= ~bit;
    --count_;
  }
}

std::string IndexSet::ToBytes() const {
  // Byte i is bits 8i..8i+7: byte i % 8 of word i / 8, little-endian, so
  // on a little-endian machine the words' first bytes are the bitmap.
  std::string out(static_cast<size_t>((n_ + 7) / 8), '\0');
#if defined(ABSL_IS_LITTLE_ENDIAN)
  if (!out.empty()) std::memcpy(out.data(), words_.data(), out.size());
#else
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<char>(words_[i / 8] >> (8 * (i % 8)));
  }
#endif
  return out;
}

absl::StatusOr<IndexSet> IndexSet::FromBytes(int64_t n,
                                             absl::string_view bytes) {
  if (static_cast<int64_t>(bytes.size()) != (n + 7) / 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("bitmap of ", bytes.size(), " bytes for ", n, " entries"));
  }
  IndexSet s(n);
  for (int64_t i = 0; i < static_cast<int64_t>(bytes.size()) * 8; ++i) {
    if ((static_cast<uint8_t>(bytes[static_cast<size_t>(i / 8)]) >> (i % 8)) &
        1) {
      if (i >= n) {
        return absl::InvalidArgumentError("bitmap has bits past its end");
      }
      s.Set(i);
    }
  }
  return s;
}

}  // namespace shardcast
