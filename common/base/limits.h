// Every bound shardcast puts on what it reads from outside: dataset files,
// requests, resume tokens. One place, so that a reviewer can check that the
// products the code forms from bounded values fit in 64 bits, and a user can
// see why an input was refused (errors name the limit).
//
// The arithmetic: a vector is at most kMaxDModel * 4 = 2^22 bytes, an
// example's [L, T, D] block at most 2^12 * 2^24 * 2^22 = 2^58 bytes, and the
// bytes of a dataset (examples * example bytes) are checked against
// kMaxDatasetBytes with common/base/checked.h, never computed unchecked.
#ifndef SHARDCAST_COMMON_BASE_LIMITS_H_
#define SHARDCAST_COMMON_BASE_LIMITS_H_

#include <cstddef>
#include <cstdint>

namespace shardcast::limits {

// --- dataset geometry (metadata.json, shards.json) ---
inline constexpr int64_t kMaxDModel = int64_t{1} << 20;  // floats per vector
inline constexpr int64_t kMaxTokensPerExample = int64_t{1} << 24;
inline constexpr int64_t kMaxLayers = int64_t{1} << 12;
inline constexpr int64_t kMaxExamples = int64_t{1} << 40;
inline constexpr int64_t kMaxShards = int64_t{1} << 24;
// Bytes of all shards of a dataset together (and so of any one shard).
inline constexpr uint64_t kMaxDatasetBytes = uint64_t{1} << 56;  // 64 PiB

// --- JSON read from files ---
inline constexpr size_t kMaxJsonBytes = size_t{64} << 20;  // per file
inline constexpr int kMaxJsonDepth = 64;                   // nested [ and {

// --- requests ---
inline constexpr int64_t kMaxBatchVectors = int64_t{1} << 24;
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 20;
inline constexpr int64_t kMaxEpochs = int64_t{1} << 40;
inline constexpr size_t kMaxResumeTokenBytes = size_t{1} << 16;
// Exclude lists and other repeated request fields.
inline constexpr size_t kMaxRequestListItems = 256;
// Random-access queries: vectors in one GetVectors call, bytes of a reply
// (under the 80 MiB gRPC message limit).
inline constexpr int64_t kMaxVectorsPerCall = int64_t{1} << 20;
inline constexpr uint64_t kMaxReplyBytes = uint64_t{64} << 20;
// A request message larger than what `max_vectors_per_call` coordinates
// need is refused by gRPC before it is parsed (one Coordinate is at most
// 3 x (tag + 10-byte varint) + 2 bytes of framing = 35 bytes).
inline constexpr int RequestMessageLimit(int64_t max_vectors_per_call) {
  return static_cast<int>((int64_t{64} << 10) + max_vectors_per_call * 35);
}

// --- text from clients in errors and logs ---
inline constexpr size_t kMaxQuotedChars = 160;

}  // namespace shardcast::limits

#endif  // SHARDCAST_COMMON_BASE_LIMITS_H_
