// Progress line for long CLI work, on stderr: redrawn in place on a
// terminal, one line every few seconds otherwise (logs, CI).
#ifndef SHARDCAST_CLIENT_CLI_PROGRESS_H_
#define SHARDCAST_CLIENT_CLI_PROGRESS_H_

#include <chrono>
#include <cstdint>
#include <string>

namespace shardcast {

/// Not thread-safe; one per long operation.
class Progress {
 public:
  /// `what` names the work ("writing"); `total` is in bytes (0 = unknown).
  /// Nothing is printed for work that finishes within the first second.
  Progress(std::string what, uint64_t total, bool enabled = true);
  /// Reports `done` bytes; prints when due.
  void Update(uint64_t done);
  /// Prints the final line (if anything was printed before).
  void Finish();

 private:
  void Print(uint64_t done, bool final);

  std::string what_;
  uint64_t total_;
  bool enabled_;
  bool tty_;
  bool printed_ = false;
  uint64_t last_done_ = 0;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_print_;
};

}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_CLI_PROGRESS_H_
