// JSON parsing and a byte-exact re-implementation of Python's json.dumps.
//
// The saev protocol names a dataset directory by the SHA-256 of
// json.dumps(metadata, ...) as Python prints it, so the bytes must match
// Python's encoder exactly: ASCII escaping of non-ASCII characters by default,
// floats printed with repr() (shortest round-trip, exponent outside
// [1e-4, 1e16)), and true/false/null.
#ifndef SHARDCAST_COMMON_FORMAT_PYJSON_H_
#define SHARDCAST_COMMON_FORMAT_PYJSON_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace shardcast {

/// JSON value that keeps object keys in file order (needed for the saev
/// "file order" hash variant and to write metadata in a readable order).
using Json = nlohmann::ordered_json;

/// Options mirroring the json.dumps keyword arguments that matter here.
struct PyJsonOptions {
  /// json.dumps(sort_keys=...): order object keys by code point.
  bool sort_keys = false;
  /// json.dumps(ensure_ascii=...): escape every non-ASCII character as \uXXXX.
  bool ensure_ascii = true;
  /// json.dumps(indent=...): negative means one line with the compact
  /// separators (',', ':'); n >= 0 means newline + n spaces per level with
  /// separators (',', ': ').
  int indent = -1;
};

/// Parses JSON text. INVALID_ARGUMENT naming `source` (a file name, for
/// messages) and the byte position on malformed text, and on integers beyond
/// 64 bits, which Python would keep exact but this parser cannot.
absl::StatusOr<Json> ParseJson(absl::string_view text,
                               absl::string_view source);

/// "null", "a boolean", "an integer", "a float", "a string", "an array",
/// "an object": what a value is, for error messages.
absl::string_view JsonTypeName(const Json& v);

/// Returns what Python's json.dumps(value, **options) returns, byte for byte.
std::string PyJsonDumps(const Json& value, const PyJsonOptions& options = {});

/// j.dump(indent) that never throws: bytes that are not valid UTF-8 (file
/// names can hold any bytes) are replaced by U+FFFD instead of aborting.
std::string JsonText(const Json& j, int indent = -1);

/// True when `text` is well-formed UTF-8 (as every Python str encodes to).
bool IsValidUtf8(absl::string_view text);

/// `text` with every invalid UTF-8 sequence replaced by U+FFFD, for
/// protobuf `string` fields, which must hold valid UTF-8.
std::string ValidUtf8(absl::string_view text);

/// Python's repr(float): "0.1", "1e-05", "1e+16", "100.0", "-0.0", "inf".
std::string PyFloatRepr(double value);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_PYJSON_H_
