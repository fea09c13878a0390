// The local query socket's messages (docs/local-clients.md, "Local queries"). A
// client on the daemon's node connects to `<unix socket path>.query`
// (SOCK_SEQPACKET) and sends one Hello carrying, as SCM_RIGHTS ancillary
// data, a memfd of its own: the region. The memfd must be sealed against
// shrinking (F_SEAL_SHRINK), so that the daemon's writes into it can never
// fault. The daemon answers with a HelloReply; with code 0 the connection
// then carries requests and replies, one at a time: a client sends its next
// request after the reply to the previous one.
//
// A request names a dataset and where in the region its coordinates lie
// (`count` little-endian int64 triples example, layer, token) and where the
// vectors go (`out_offset`, 4 KiB-aligned, so the daemon can read from disk
// straight into it). The daemon copies the coordinates out before it reads
// them, and only ever writes into [out_offset, out_offset + rows * d_model *
// 4). Its reply says how it went: code 0 and the shape, or an
// absl::StatusCode and its message, or `need_region_bytes` > 0 when the
// vectors do not fit in the region (the client then reconnects with a larger
// one). Per call this costs each side one message and, in the daemon, no
// thread hop: a few threads serve the connections, each from its own
// io_uring.
//
// Direct reads: a client may instead ask for a dataset's layout
// (Op::kLayout) and read-only descriptors of its files (Op::kOpenFiles),
// and read vectors itself with pread (docs/local-clients.md, "Local queries").
//
// All messages are little-endian fixed layouts followed by UTF-8 text (an
// error's message, a request's dataset), so any language can speak them.
#ifndef SHARDCAST_COMMON_LOCAL_QUERY_PROTOCOL_H_
#define SHARDCAST_COMMON_LOCAL_QUERY_PROTOCOL_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"

namespace shardcast {
namespace local_query {

inline constexpr char kMagic[4] = {'S', 'C', 'Q', '1'};
/// Appended to the gRPC Unix socket's path.
inline constexpr char kSocketSuffix[] = ".query";
/// Where the vectors may start in the region.
inline constexpr uint64_t kOutAlign = 4096;
/// Bytes of one coordinate in the region: example, layer, token (int64).
inline constexpr uint64_t kCoordBytes = 24;
/// A request's dataset name is at most this long.
inline constexpr size_t kMaxDatasetBytes = 1024;

inline constexpr size_t kHelloBytes = 16;
inline constexpr size_t kHelloReplyBytes = 16;
inline constexpr size_t kRequestBytes = 48;
inline constexpr size_t kReplyBytes = 48;

/// The operations a request may ask for.
enum class Op : uint32_t {
  kVectors = 1,  // GetVectors: [count, d_model] float32 at out_offset
  /// Direct reads, step 1: where the dataset's vectors lie. Code 0: `rows`
  /// bytes of a VectorLayout (common/local/vector_layout.h) at out_offset, and
  /// `serial` names the files it describes (need_region_bytes as for
  /// vectors). FAILED_PRECONDITION when the daemon hands out no files
  /// (--disable-direct-reads); a daemon without direct reads answers
  /// UNIMPLEMENTED (an unknown operation).
  kLayout = 2,
  /// Direct reads, step 2: read-only descriptors of `count` (at most
  /// kMaxFilesPerOpen) of the layout's files, whose int64 indices lie at
  /// coords_offset; the request's `serial` is the layout's. Code 0: the
  /// reply carries `rows` = count descriptors as SCM_RIGHTS, in the order
  /// asked. ABORTED when the dataset's files are not those of `serial`
  /// any more (ask for the layout again).
  kOpenFiles = 3,
};
/// Descriptors one kOpenFiles request may ask for.
inline constexpr uint64_t kMaxFilesPerOpen = 16;

namespace internal {
template <typename T>
void Put(std::string* out, size_t at, T v) {
  std::memcpy(&(*out)[at], &v, sizeof(v));
}
template <typename T>
T Get(absl::string_view in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(v));
  return v;
}
inline bool HasMagic(absl::string_view in, size_t size) {
  return in.size() >= size && std::memcmp(in.data(), kMagic, 4) == 0;
}
}  // namespace internal

/// Client -> daemon, first message, with the region's memfd.
struct Hello {
  uint32_t version = 1;
  uint64_t region_bytes = 0;  // the memfd's size, as the client made it

  std::string Encode() const {
    std::string out(kHelloBytes, '\0');
    std::memcpy(&out[0], kMagic, 4);
    internal::Put(&out, 4, version);
    internal::Put(&out, 8, region_bytes);
    return out;
  }
  /// False when `in` is not a Hello.
  bool Decode(absl::string_view in) {
    if (in.size() != kHelloBytes || !internal::HasMagic(in, kHelloBytes))
      return false;
    version = internal::Get<uint32_t>(in, 4);
    region_bytes = internal::Get<uint64_t>(in, 8);
    return true;
  }
};

/// Daemon -> client. `code` 0: requests may follow; else an absl::StatusCode
/// and `message` says why (the daemon then closes the connection).
struct HelloReply {
  uint32_t code = 0;
  uint64_t max_region_bytes = 0;  // the largest region the daemon maps

  std::string message;

  std::string Encode() const {
    std::string out(kHelloReplyBytes, '\0');
    std::memcpy(&out[0], kMagic, 4);
    internal::Put(&out, 4, code);
    internal::Put(&out, 8, max_region_bytes);
    return out + message;
  }
  bool Decode(absl::string_view in) {
    if (!internal::HasMagic(in, kHelloReplyBytes)) return false;
    code = internal::Get<uint32_t>(in, 4);
    max_region_bytes = internal::Get<uint64_t>(in, 8);
    message = std::string(in.substr(kHelloReplyBytes));
    return true;
  }
};

/// Client -> daemon: one call.
struct Request {
  Op op = Op::kVectors;
  uint64_t id = 0;  // echoed in the reply
  uint64_t count = 0;
  uint64_t coords_offset = 0;
  uint64_t out_offset = 0;
  uint64_t serial = 0;  // kOpenFiles: the layout's
  std::string dataset;  // id or unique prefix

  std::string Encode() const {
    std::string out(kRequestBytes, '\0');
    std::memcpy(&out[0], kMagic, 4);
    internal::Put(&out, 4, static_cast<uint32_t>(op));
    internal::Put(&out, 8, id);
    internal::Put(&out, 16, count);
    internal::Put(&out, 24, coords_offset);
    internal::Put(&out, 32, out_offset);
    internal::Put(&out, 40, serial);
    return out + dataset;
  }
  bool Decode(absl::string_view in) {
    if (!internal::HasMagic(in, kRequestBytes) ||
        in.size() > kRequestBytes + kMaxDatasetBytes)
      return false;
    op = static_cast<Op>(internal::Get<uint32_t>(in, 4));
    id = internal::Get<uint64_t>(in, 8);
    count = internal::Get<uint64_t>(in, 16);
    coords_offset = internal::Get<uint64_t>(in, 24);
    out_offset = internal::Get<uint64_t>(in, 32);
    serial = internal::Get<uint64_t>(in, 40);
    dataset = std::string(in.substr(kRequestBytes));
    return true;
  }
};

/// Daemon -> client: the answer to request `id`. `code` 0: `rows` x
/// `d_model` float32 are at the request's out_offset. Else an
/// absl::StatusCode and `message`; with `need_region_bytes` > 0 the call was
/// not run because its vectors need a region of that many bytes (with the
/// request's own out_offset).
struct Reply {
  uint32_t code = 0;
  uint64_t id = 0;
  uint64_t rows = 0;
  uint64_t d_model = 0;
  uint64_t need_region_bytes = 0;
  uint64_t serial = 0;  // kLayout: names the files the layout describes
  std::string message;

  std::string Encode() const {
    std::string out(kReplyBytes, '\0');
    std::memcpy(&out[0], kMagic, 4);
    internal::Put(&out, 4, code);
    internal::Put(&out, 8, id);
    internal::Put(&out, 16, rows);
    internal::Put(&out, 24, d_model);
    internal::Put(&out, 32, need_region_bytes);
    internal::Put(&out, 40, serial);
    return out + message;
  }
  bool Decode(absl::string_view in) {
    if (!internal::HasMagic(in, kReplyBytes)) return false;
    code = internal::Get<uint32_t>(in, 4);
    id = internal::Get<uint64_t>(in, 8);
    rows = internal::Get<uint64_t>(in, 16);
    d_model = internal::Get<uint64_t>(in, 24);
    need_region_bytes = internal::Get<uint64_t>(in, 32);
    serial = internal::Get<uint64_t>(in, 40);
    message = std::string(in.substr(kReplyBytes));
    return true;
  }
};

}  // namespace local_query
}  // namespace shardcast

#endif  // SHARDCAST_COMMON_LOCAL_QUERY_PROTOCOL_H_
