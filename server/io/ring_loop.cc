#include "server/io/ring_loop.h"

#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/time/clock.h"
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
  int fd = -1;  // a poll's
  unsigned events = 0;
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

std::unique_ptr<RingLoop> RingLoop::Create(unsigned queue_depth) {
  absl::StatusOr<UringRing> ring = UringRing::Create(queue_depth);
  if (!ring.ok()) {
    static std::atomic<bool> logged{false};
    if (!logged.exchange(true)) {
      LogWarning("no io_uring (", ring.status().message(),
                 "): local clients are served with poll and pread");
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

void RingLoop::Read(const ReadOp& read, size_t done_bytes, Done done) {
  Op* op = Link(new Op);
  op->is_read = true;
  op->read = read;
  op->done_bytes = done_bytes;
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
                              reinterpret_cast<uint64_t>(op));
  });
  ++reads_in_flight_;
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
  if (polls_.empty() && done_.empty()) return true;  // nothing to wait for
  std::vector<struct pollfd> fds;
  fds.reserve(polls_.size());
  for (const Op* op : polls_) {
    fds.push_back({op->fd, static_cast<short>(op->events), 0});
  }
  bool ok = true;
  if (!fds.empty() || done_.empty()) {
    const int rc = ::poll(fds.data(), fds.size(), done_.empty() ? -1 : 0);
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
  }
  RunCallbacks();
  return ok;
}

}  // namespace shardcast
