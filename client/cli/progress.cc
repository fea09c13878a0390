#include "client/cli/progress.h"

#include <unistd.h>

#include <cstdio>

namespace shardcast {

Progress::Progress(std::string what, uint64_t total, bool enabled)
    : what_(std::move(what)),
      total_(total),
      enabled_(enabled),
      tty_(::isatty(2) == 1),
      start_(std::chrono::steady_clock::now()),
      last_print_(start_) {}

void Progress::Update(uint64_t done) {
  last_done_ = done;
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  const auto since_start = now - start_;
  const auto since_print = now - last_print_;
  const auto interval =
      tty_ ? std::chrono::milliseconds(250) : std::chrono::milliseconds(5000);
  if (since_start < std::chrono::seconds(1) || since_print < interval) return;
  last_print_ = now;
  Print(done, false);
}

void Progress::Finish() {
  if (enabled_ && printed_) Print(last_done_, true);
}

void Progress::Print(uint64_t done, bool final) {
  printed_ = true;
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_)
          .count();
  const double mib = static_cast<double>(done) / (1 << 20);
  const double rate = secs > 0 ? mib / secs : 0;
  char line[256];
  if (total_ > 0) {
    std::snprintf(
        line, sizeof(line), "%s: %.0f / %.0f MiB (%.0f%%), %.0f MiB/s",
        what_.c_str(), mib, static_cast<double>(total_) / (1 << 20),
        100.0 * static_cast<double>(done) / static_cast<double>(total_), rate);
  } else {
    std::snprintf(line, sizeof(line), "%s: %.0f MiB, %.0f MiB/s", what_.c_str(),
                  mib, rate);
  }
  if (tty_) {
    std::fprintf(stderr, "\r%s\033[K%s", line, final ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s%s\n", line, final ? " (done)" : "");
  }
  std::fflush(stderr);
}

}  // namespace shardcast
