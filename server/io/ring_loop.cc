#include "server/io/ring_loop.h"

#include <linux/time_types.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/log.h"

namespace shardcast {

struct RingLoop::Op {
  // In the loop's list of operations not completed (io_uring: submitted or
  // waiting; poll(2): waiting reads, armed polls), so that none outlives it.
  Op* prev = nullptr;
  Op* next = nullptr;
  bool is_read = false;
  ReadOp read;
  size_t done_bytes = 0;
  int fixed_buffer = -1;  // a read's registered buffer
  int fd = -1;            // a poll's
  unsigned events = 0;
  bool is_timeout = false;
  struct __kernel_timespec ts = {};  // a timeout's, while in the ring
  absl::Time deadline;               // a timeout's, without io_uring
  Done done;
};

RingLoop::RingLoop(std::optional<UringRing> ring, unsigned depth)
    : ring_(std::move(ring)), depth_(depth < 1 ? 1 : depth) {}

RingLoop::~RingLoop() {
  // The ring goes first (the kernel cancels what it still holds); then the
  // operations never completed (the owner stopped with polls armed) go,
  // their callbacks dropped, not run.
  ring_.reset();
  while (open_ != nullptr) delete Unlink(open_);
}

RingLoop::Op* RingLoop::Link(Op* op) {
  op->next = open_;
  if (open_ != nullptr) open_->prev = op;
  open_ = op;
  return op;
}

RingLoop::Op* RingLoop::Unlink(Op* op) {
  if (op->prev != nullptr) op->prev->next = op->next;
  if (op->next != nullptr) op->next->prev = op->prev;
  if (open_ == op) open_ = op->next;
  op->prev = op->next = nullptr;
  return op;
}

std::unique_ptr<RingLoop> RingLoop::Create(unsigned queue_depth,
                                           const char* who) {
  // Room for the polls and timeouts beside the reads.
  absl::StatusOr<UringRing> ring = UringRing::Create(queue_depth + 8);
  if (!ring.ok()) {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) {
      LogWarning("io_uring unavailable (", ring.status().message(), "): ", who,
                 " are served with poll and pread");
    }
    return std::unique_ptr<RingLoop>(new RingLoop(std::nullopt, queue_depth));
  }
  return std::unique_ptr<RingLoop>(new RingLoop(std::move(*ring), queue_depth));
}

std::unique_ptr<RingLoop> RingLoop::CreateWithoutUring(unsigned queue_depth) {
  return std::unique_ptr<RingLoop>(new RingLoop(std::nullopt, queue_depth));
}

template <typename F>
void RingLoop::Queue(F prepare) {
  while (!prepare()) ring_->SubmitAndWait(0);
}

void RingLoop::Poll(int fd, unsigned events, Done done) {
  Op* op = Link(new Op);
  op->fd = fd;
  op->events = events;
  op->done = std::move(done);
  if (!ring_.has_value()) {
    polls_.push_back(op);
    return;
  }
  Queue([&] {
    return ring_->PreparePoll(fd, events, reinterpret_cast<uint64_t>(op));
  });
}

void RingLoop::Read(const ReadOp& read, size_t done_bytes, Done done,
                    int fixed_buffer) {
  Op* op = Link(new Op);
  op->is_read = true;
  op->read = read;
  op->done_bytes = done_bytes;
  op->fixed_buffer = ring_.has_value() ? fixed_buffer : -1;
  op->done = std::move(done);
  if (reads_in_flight_ >= depth_ || !ring_.has_value()) {
    waiting_.push_back(op);
    return;
  }
  SubmitRead(op);
}

void RingLoop::SubmitRead(Op* op) {
  Queue([&] {
    return ring_->PrepareRead(op->read, op->done_bytes,
                              reinterpret_cast<uint64_t>(op), op->fixed_buffer);
  });
  ++reads_in_flight_;
}

void RingLoop::Timeout(int64_t ns, Done done) {
  Op* op = Link(new Op);
  op->is_timeout = true;
  op->done = std::move(done);
  ns = std::max<int64_t>(ns, 0);
  if (!ring_.has_value()) {
    op->deadline = absl::Now() + absl::Nanoseconds(ns);
    timers_.push_back(op);
    return;
  }
  op->ts.tv_sec = ns / 1000000000;
  op->ts.tv_nsec = ns % 1000000000;
  Queue([&] {
    return ring_->PrepareTimeout(&op->ts, reinterpret_cast<uint64_t>(op));
  });
}

void RingLoop::CancelWaiting() {
  std::deque<Op*> cancelled;
  cancelled.swap(waiting_);
  for (Op* op : cancelled) {
    std::unique_ptr<Op> owned(Unlink(op));
    owned->done(-ECANCELED);
  }
}

absl::Status RingLoop::RegisterBuffers(
    const std::vector<struct iovec>& buffers) {
  if (!ring_.has_value()) {
    return absl::FailedPreconditionError(
        "no io_uring to register buffers with");
  }
  return ring_->RegisterBuffers(buffers);
}

bool RingLoop::RunOnce(int64_t spin_ns) {
  return ring_.has_value() ? RunOnceUring(spin_ns) : RunOncePoll();
}

bool RingLoop::RunOnceUring(int64_t spin_ns) {
  if (spin_ns > 0 && reads_in_flight_ > 0) {
    const int64_t until = absl::GetCurrentTimeNanos() + spin_ns;
    while (ring_->SubmitAndPeek() == 0 && absl::GetCurrentTimeNanos() < until) {
    }
  }
  const int rc = ring_->SubmitAndWait(1);
  bool ok = true;
  if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
    LogError("io_uring_submit_and_wait: ", std::strerror(-rc));
    ok = false;
  }
  done_.clear();
  ring_->ForEachCompletion([&](uint64_t tag, int res) {
    done_.emplace_back(reinterpret_cast<Op*>(tag), res);
  });
  for (const auto& [op, res] : done_) {
    if (op->is_read) --reads_in_flight_;
  }
  // Reads that waited for a slot take the slots just freed, before the
  // callbacks queue more of their own.
  while (!waiting_.empty() && reads_in_flight_ < depth_) {
    Op* op = waiting_.front();
    waiting_.pop_front();
    SubmitRead(op);
  }
  RunCallbacks();
  return ok;
}

void RingLoop::RunCallbacks() {
  for (const auto& [op, res] : done_) {
    std::unique_ptr<Op> owned(Unlink(op));
    owned->done(res);
  }
}

bool RingLoop::RunOncePoll() {
  done_.clear();
  // Reads first, one after another; then whatever polls are ready (without
  // waiting when reads were done, their callbacks may want more).
  std::deque<Op*> reads;
  reads.swap(waiting_);
  for (Op* op : reads) {
    ssize_t n;
    do {
      n = ::pread(op->read.fd,
                  static_cast<char*>(op->read.dest) + op->done_bytes,
                  op->read.length - op->done_bytes,
                  static_cast<off_t>(op->read.offset + op->done_bytes));
    } while (n < 0 && errno == EINTR);
    done_.emplace_back(op, n < 0 ? -errno : static_cast<int>(n));
  }
  // Timeouts due (now, and after the wait below); `next` is the earliest
  // of the others.
  absl::Time next;
  const auto take_due = [&](absl::Time now) {
    next = absl::InfiniteFuture();
    std::vector<Op*> kept;
    for (Op* op : timers_) {
      if (op->deadline <= now) {
        done_.emplace_back(op, -ETIME);
      } else {
        next = std::min(next, op->deadline);
        kept.push_back(op);
      }
    }
    timers_.swap(kept);
  };
  const absl::Time now = absl::Now();
  take_due(now);
  if (polls_.empty() && done_.empty() && timers_.empty()) {
    return true;  // nothing to wait for
  }
  std::vector<struct pollfd> fds;
  fds.reserve(polls_.size());
  for (const Op* op : polls_) {
    fds.push_back({op->fd, static_cast<short>(op->events), 0});
  }
  bool ok = true;
  {
    int timeout_ms = -1;  // until a poll fires, or the next timeout
    if (!done_.empty()) {
      timeout_ms = 0;
    } else if (next != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(
          absl::Ceil(next - now, absl::Milliseconds(1))));
    }
    const int rc = ::poll(fds.data(), fds.size(), timeout_ms);
    if (rc < 0 && errno != EINTR) {
      LogError("poll: ", std::strerror(errno));
      ok = false;
    }
    if (rc > 0) {
      std::vector<Op*> kept;
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents != 0) {
          done_.emplace_back(polls_[i], fds[i].revents);
        } else {
          kept.push_back(polls_[i]);
        }
      }
      polls_.swap(kept);
    }
    if (!timers_.empty()) take_due(absl::Now());
  }
  RunCallbacks();
  return ok;
}

}  // namespace shardcast
