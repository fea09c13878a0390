// Status helpers shared by every shardcast module.
//
// Abseil 20220623 (Debian bookworm) has absl::Status and absl::StatusOr but no
// RETURN_IF_ERROR / ASSIGN_OR_RETURN, so they are defined once here, in the
// style of TensorStore's util/status.h.
#ifndef SHARDCAST_COMMON_BASE_STATUS_H_
#define SHARDCAST_COMMON_BASE_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardcast {

/// Converts an errno value from a failed system call into a Status whose code
/// follows the errno (ENOENT -> NOT_FOUND, EACCES -> PERMISSION_DENIED, ...)
/// and whose message is "<what>: <strerror>".
absl::Status ErrnoToStatus(int error_number, absl::string_view what);

/// Returns `status` with `prefix + ": "` prepended to its message, keeping the
/// code. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view prefix);

/// `text` (from a client or a file) for an error message or log line: at most
/// limits::kMaxQuotedChars characters of it, then "... (N bytes)" when cut,
/// control characters as '?', so a client's megabyte of input never reaches
/// an error or a log whole.
std::string Quoted(absl::string_view text);

}  // namespace shardcast

#define SHARDCAST_INTERNAL_CONCAT_IMPL(a, b) a##b
#define SHARDCAST_INTERNAL_CONCAT(a, b) SHARDCAST_INTERNAL_CONCAT_IMPL(a, b)

/// Evaluates `expr` (an absl::Status) and returns it from the enclosing
/// function if it is not OK.
#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    ::absl::Status shardcast_status_ = (expr);             \
    if (!shardcast_status_.ok()) return shardcast_status_; \
  } while (false)

/// `ASSIGN_OR_RETURN(auto x, Foo());` evaluates Foo() (an absl::StatusOr<T>),
/// returns its status from the enclosing function on error, and otherwise
/// move-assigns the value to the declaration on the left.
#define ASSIGN_OR_RETURN(lhs, expr)    \
  SHARDCAST_INTERNAL_ASSIGN_OR_RETURN( \
      SHARDCAST_INTERNAL_CONCAT(shardcast_statusor_, __LINE__), lhs, expr)

#define SHARDCAST_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, expr) \
  auto tmp = (expr);                                        \
  if (!tmp.ok()) return std::move(tmp).status();            \
  lhs = std::move(tmp).value()

#endif  // SHARDCAST_COMMON_BASE_STATUS_H_
