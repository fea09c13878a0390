#include "common/format/sha256.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/file.h"
#include "common/base/status.h"

namespace shardcast {

struct Sha256::Ctx {
  EVP_MD_CTX* md = nullptr;
  ~Ctx() { EVP_MD_CTX_free(md); }
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) {
  ctx_->md = EVP_MD_CTX_new();
  // Allocation failure of a few hundred bytes leaves nothing sensible to do.
  if (ctx_->md == nullptr ||
      EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr) != 1) {
    std::abort();
  }
}

Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;
Sha256::~Sha256() = default;

void Sha256::Update(const void* data, size_t length) {
  EVP_DigestUpdate(ctx_->md, data, length);
}

std::string Sha256::HexDigest() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx_->md, digest, &length);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(length * 2);
  for (unsigned int i = 0; i < length; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 0xF]);
  }
  return out;
}

struct HmacSha256Key::States {
  EVP_MD_CTX* inner = nullptr;  // has absorbed key ^ ipad
  EVP_MD_CTX* outer = nullptr;  // has absorbed key ^ opad
  ~States() {
    EVP_MD_CTX_free(inner);
    EVP_MD_CTX_free(outer);
  }
};

HmacSha256Key::HmacSha256Key(absl::string_view key) {
  constexpr size_t kBlock = 64;  // SHA-256's block size
  unsigned char k[kBlock] = {};
  if (key.size() > kBlock) {  // RFC 2104: a longer key is hashed first
    unsigned int n = 0;
    if (EVP_Digest(key.data(), key.size(), k, &n, EVP_sha256(), nullptr) != 1) {
      std::abort();
    }
  } else {
    std::memcpy(k, key.data(), key.size());
  }
  auto states = std::make_shared<States>();
  for (auto [ctx, pad] :
       {std::pair{&states->inner, 0x36}, std::pair{&states->outer, 0x5c}}) {
    unsigned char padded[kBlock];
    for (size_t i = 0; i < kBlock; ++i) {
      padded[i] = static_cast<unsigned char>(k[i] ^ pad);
    }
    *ctx = EVP_MD_CTX_new();
    // As in Sha256(): an allocation failure leaves nothing sensible to do.
    if (*ctx == nullptr ||
        EVP_DigestInit_ex(*ctx, EVP_sha256(), nullptr) != 1 ||
        EVP_DigestUpdate(*ctx, padded, kBlock) != 1) {
      std::abort();
    }
  }
  states_ = std::move(states);
}

std::string HmacSha256Key::Mac(absl::string_view data) const {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  unsigned char inner[EVP_MAX_MD_SIZE];
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int inner_length = 0, length = 0;
  if (ctx == nullptr || EVP_MD_CTX_copy_ex(ctx, states_->inner) != 1 ||
      EVP_DigestUpdate(ctx, data.data(), data.size()) != 1 ||
      EVP_DigestFinal_ex(ctx, inner, &inner_length) != 1 ||
      EVP_MD_CTX_copy_ex(ctx, states_->outer) != 1 ||
      EVP_DigestUpdate(ctx, inner, inner_length) != 1 ||
      EVP_DigestFinal_ex(ctx, mac, &length) != 1) {
    std::abort();
  }
  EVP_MD_CTX_free(ctx);
  return std::string(reinterpret_cast<const char*>(mac), length);
}

std::string Sha256Hex(absl::string_view data) {
  Sha256 h;
  h.Update(data);
  return h.HexDigest();
}

absl::StatusOr<std::string> Sha256File(
    const std::string& path, const std::function<void(uint64_t)>& on_bytes) {
  ASSIGN_OR_RETURN(UniqueFd fd, OpenRegularFile(path));
  return Sha256Fd(fd.get(), path, on_bytes);
}

absl::StatusOr<std::string> Sha256Fd(
    int fd, absl::string_view path,
    const std::function<void(uint64_t)>& on_bytes) {
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<char> buffer(8 << 20);
  Sha256 h;
  uint64_t offset = 0;
  while (true) {
    const ssize_t n = ::pread(fd, buffer.data(), buffer.size(),
                              static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, absl::StrCat("read ", path));
    }
    if (n == 0) break;
    h.Update(buffer.data(), static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
    if (on_bytes) on_bytes(static_cast<uint64_t>(n));
  }
  return h.HexDigest();
}

}  // namespace shardcast
