// The rule for local clients on a node shared by many users: through the
// daemon, a client reads exactly what its own user could open. A dataset a
// client attaches by path holds to it by construction (the client opened the
// files). For a catalog dataset under a root the daemon checks it, against
// the client's credentials as the kernel reports them (SO_PEERCRED and
// SO_PEERGROUPS on its socket):
//  - exactly, where the daemon may switch a thread's filesystem ids (root,
//    or CAP_SETUID and CAP_SETGID): a short-lived thread takes the client's
//    fsuid, fsgid and groups (raw setfsuid/setfsgid/setgroups system calls,
//    which change the calling thread only) and opens each file the dataset
//    reads by the path the daemon opened it by, so the kernel applies its
//    own checks, ACLs and security modules included;
//  - otherwise (the systemd unit's `shardcast` user has no capabilities)
//    from the mode bits: every directory on the way searchable and the file
//    readable for the client's uid, gid and groups. ACL entries beyond the
//    mode are not seen (a named user an ACL admits is refused).
// Results are kept for a while per (credentials, dataset), so a trainer's
// calls after its first cost a map lookup.
#ifndef SHARDCAST_SERVER_ENGINE_ACCESS_H_
#define SHARDCAST_SERVER_ENGINE_ACCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/base/mutex.h"
#include "common/format/reader.h"

namespace shardcast {

/// Who a local client is: its process's uid, gid and supplementary groups.
struct Credentials {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;
};

/// Who makes a call: a local client (its credentials), or a remote one and
/// the names its TLS certificate carries (common name and subject; none
/// without mutual TLS).
struct Caller {
  std::optional<Credentials> local;
  std::vector<std::string> certificate_names;
};

/// A root remote clients may read (--remote-root DIR[=NAME,...]): every
/// client that may connect, or only those whose certificate carries one of
/// `names` (its common name or its whole subject).
struct RemoteRoot {
  std::string root;
  std::vector<std::string> names;
};

/// "DIR" or "DIR=NAME,NAME": INVALID_ARGUMENT naming the flag for an empty
/// directory or name.
absl::StatusOr<RemoteRoot> ParseRemoteRoot(const std::string& text);

/// Thread-safe.
class AccessChecker {
 public:
  /// `keep_seconds`: how long a verdict is reused (a chmod takes effect
  /// within it).
  explicit AccessChecker(double keep_seconds = 30) : keep_(keep_seconds) {}

  /// OK when `who` could open every file `reader` reads (metadata.json,
  /// shards.json, each shard, labels.bin). PERMISSION_DENIED naming the
  /// uid and the first file it could not open otherwise. Root, and the
  /// daemon's own user, may read what the daemon opened.
  absl::Status Check(const Credentials& who, const DatasetReader& reader)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// The kept verdict, without checking; nullopt when there is none (for
  /// callers that must not block: check on a worker then).
  std::optional<absl::Status> Known(const Credentials& who,
                                    const DatasetReader& reader) const
      ABSL_LOCKS_EXCLUDED(mu_);

  /// Whether this process checks exactly (it may switch a thread's
  /// filesystem ids) or from the mode bits.
  static bool Exact();
  /// The check itself, uncached: whether `who` could open each of `paths`.
  static absl::Status CanOpen(const Credentials& who,
                              const std::vector<std::string>& paths);
  /// The mode-bit emulation CanOpen falls back on (for tests, which hold it
  /// against the kernel's own verdict).
  static absl::Status CanOpenByModeBits(const Credentials& who,
                                        const std::vector<std::string>& paths);

 private:
  using Key = std::tuple<uid_t, gid_t, std::vector<gid_t>, uint64_t>;
  static Key KeyOf(const Credentials& who, const DatasetReader& reader);
  struct Verdict {
    absl::Status status;
    double until = 0;  // monotonic seconds
  };
  const double keep_;
  mutable Mutex mu_;
  std::map<Key, Verdict> verdicts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_ACCESS_H_
