#include "server/read_engine.h"

#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/log.h"

namespace shardcast {

struct ReadEngine::Ring {
  struct io_uring ring;
  bool initialized = false;
  ~Ring() {
    if (initialized) io_uring_queue_exit(&ring);
  }
};

// One read of at most read_bytes: a range, or a piece of one.
struct ReadEngine::Op {
  BlockRead* read;
  int fd;
  uint64_t offset;
  size_t length;
  size_t done = 0;
  char* dest;
  const std::string* path;
  bool fixed;  // dest lies in the registered slot: READ_FIXED
};

namespace {

constexpr uint64_t kWakeTag = 0;   // user_data of the eventfd read
constexpr uint64_t kTimerTag = 1;  // user_data of the retry timeout

}  // namespace

ReadEngine::ReadEngine(ReadEngineOptions options, Reservoir* reservoir)
    : options_(options), reservoir_(reservoir) {}

absl::StatusOr<std::unique_ptr<ReadEngine>> ReadEngine::Start(
    ReadEngineOptions options, Reservoir* reservoir) {
  if (options.queue_depth < 1) options.queue_depth = 1;
  options.read_bytes = std::clamp<uint64_t>(options.read_bytes / 4096 * 4096,
                                            4096, uint64_t{1} << 30);
  std::unique_ptr<ReadEngine> e(new ReadEngine(options, reservoir));
  // Blocking: io_uring then waits for the counter (a non-blocking eventfd
  // would complete the read at once with EAGAIN and the loop would spin).
  // The pread fallback polls it before reading.
  const int efd = ::eventfd(0, EFD_CLOEXEC);
  if (efd < 0) return ErrnoToStatus(errno, "eventfd for the read engine");
  e->event_fd_.Reset(efd);
  auto ring = std::make_unique<Ring>();
  const int rc = io_uring_queue_init(options.queue_depth + 1, &ring->ring, 0);
  if (rc < 0) {
    LogWarning("read engine: io_uring unavailable (", std::strerror(-rc),
               "); falling back to pread on the engine thread");
  } else {
    ring->initialized = true;
    e->ring_ = std::move(ring);
    if (options.register_buffers && reservoir != nullptr) {
      std::vector<struct iovec> iov(
          static_cast<size_t>(reservoir->num_slots()));
      for (size_t i = 0; i < iov.size(); ++i) {
        iov[i].iov_base = reservoir->slot_data(static_cast<int32_t>(i));
        iov[i].iov_len = reservoir->slot_bytes();
      }
      const int reg = io_uring_register_buffers(
          &e->ring_->ring, iov.data(), static_cast<unsigned>(iov.size()));
      if (reg < 0) {
        LogWarning("read engine: cannot register the reservoir's ", iov.size(),
                   " slots as io_uring buffers (", std::strerror(-reg),
                   "; RLIMIT_MEMLOCK?); reading without them");
      } else {
        e->buffers_registered_ = true;
      }
    }
  }
  ReadEngine* raw = e.get();
  e->thread_ = std::thread([raw] {
    if (raw->ring_ != nullptr) {
      raw->Loop();
    } else {
      raw->LoopPread();
    }
  });
  return e;
}

ReadEngine::~ReadEngine() {
  stop_ = true;
  Wake();
  if (thread_.joinable()) thread_.join();
}

void ReadEngine::Add(std::shared_ptr<BlockSource> source) {
  {
    MutexLock lock(&mu_);
    changes_.push_back({std::move(source), nullptr});
  }
  Wake();
}

void ReadEngine::Remove(const BlockSource* source) {
  {
    MutexLock lock(&mu_);
    changes_.push_back({nullptr, source});
  }
  Wake();
}

void ReadEngine::Wake() {
  const uint64_t one = 1;
  // EAGAIN means the counter is already non-zero: the engine will wake.
  ssize_t n = ::write(event_fd_.get(), &one, sizeof(one));
  (void)n;
}

void ReadEngine::TakeSourceChanges() {
  std::vector<Change> changes;
  {
    MutexLock lock(&mu_);
    changes.swap(changes_);
  }
  for (Change& c : changes) {
    if (c.add != nullptr) {
      sources_.push_back(std::move(c.add));
      continue;
    }
    const BlockSource* r = c.remove;
    sources_.erase(std::remove_if(sources_.begin(), sources_.end(),
                                  [r](const auto& s) { return s.get() == r; }),
                   sources_.end());
  }
}

void ReadEngine::Plan(size_t budget, std::vector<Op*>* ops,
                      BlockSource::Clock::time_point* retry_at) {
  *retry_at = BlockSource::Clock::time_point();
  const auto now = BlockSource::Clock::now();
  size_t planned = 0, idle = 0;
  while (planned < budget && !sources_.empty() && idle < sources_.size()) {
    const std::shared_ptr<BlockSource>& source =
        sources_[next_source_++ % sources_.size()];
    std::unique_ptr<BlockRead> read = source->NextRead();
    if (read == nullptr) {
      ++idle;
      const auto ready = source->ReadyAt();
      if (ready > now && (*retry_at == BlockSource::Clock::time_point() ||
                          ready < *retry_at)) {
        *retry_at = ready;
      }
      continue;
    }
    idle = 0;
    read->source = source;
    BlockRead* r = read.release();
    const char* slot_begin = r->slot >= 0 && reservoir_ != nullptr
                                 ? reservoir_->slot_data(r->slot)
                                 : nullptr;
    for (const ReadOp& range : r->ranges) {
      char* dest = static_cast<char*>(range.dest);
      const bool fixed =
          buffers_registered_ && slot_begin != nullptr && dest >= slot_begin &&
          dest + range.length <= slot_begin + reservoir_->slot_bytes();
      for (uint64_t at = 0; at < range.length; at += options_.read_bytes) {
        Op* op = new Op{r,
                        range.fd,
                        range.offset + at,
                        static_cast<size_t>(std::min<uint64_t>(
                            options_.read_bytes, range.length - at)),
                        0,
                        dest + at,
                        range.path,
                        fixed};
        ops->push_back(op);
        ++r->ops_left;
        ++planned;
      }
    }
    if (r->ops_left == 0) {
      Finish(r);  // nothing to read: done already
      ++planned;  // (and counted, so such reads cannot keep us here)
    }
  }
}

void ReadEngine::Finish(BlockRead* r) {
  std::unique_ptr<BlockRead> read(r);
  if (read->status.ok()) {
    blocks_read_++;
    bytes_read_ += read->bytes;
  }
  std::shared_ptr<BlockSource> source = std::move(read->source);
  absl::Status status = read->status;
  source->ReadDone(std::move(read), std::move(status));
}

void ReadEngine::Loop() {
  struct io_uring* ring = &ring_->ring;
  bool wake_armed = false;
  bool timer_armed = false;
  BlockSource::Clock::time_point timer_at;
  struct __kernel_timespec timer_ts = {};
  std::deque<Op*> queued;  // planned, not yet submitted (or to resubmit)
  size_t in_flight = 0;    // reads only
  const size_t depth = options_.queue_depth;

  auto drop_queued = [&] {
    while (!queued.empty()) {
      Op* op = queued.front();
      queued.pop_front();
      BlockRead* r = op->read;
      if (r->status.ok()) r->status = absl::CancelledError("daemon stopping");
      delete op;
      if (--r->ops_left == 0) Finish(r);
    }
  };

  while (true) {
    if (stop_.load()) {
      drop_queued();  // what never reached the ring is handed back now
      if (in_flight == 0) break;
    }
    if (!wake_armed) {
      struct io_uring_sqe* sqe = io_uring_get_sqe(ring);
      if (sqe != nullptr) {
        io_uring_prep_read(sqe, event_fd_.get(), &wake_value_,
                           sizeof(wake_value_), 0);
        io_uring_sqe_set_data64(sqe, kWakeTag);
        wake_armed = true;
      }
    }
    TakeSourceChanges();
    if (!stop_.load() && in_flight + queued.size() < depth) {
      std::vector<Op*> planned;
      BlockSource::Clock::time_point retry_at;
      Plan(depth - in_flight - queued.size(), &planned, &retry_at);
      queued.insert(queued.end(), planned.begin(), planned.end());
      // A source waits for a time (a new scan gathering its clients): wake
      // up then, unless a timer for an earlier time is already armed.
      if (retry_at != BlockSource::Clock::time_point() &&
          (!timer_armed || retry_at < timer_at)) {
        struct io_uring_sqe* sqe = io_uring_get_sqe(ring);
        if (sqe != nullptr) {
          const auto wait =
              std::chrono::duration_cast<std::chrono::nanoseconds>(
                  retry_at - BlockSource::Clock::now());
          const int64_t ns = std::max<int64_t>(wait.count(), 1000);
          timer_ts.tv_sec = ns / 1000000000;
          timer_ts.tv_nsec = ns % 1000000000;
          io_uring_prep_timeout(sqe, &timer_ts, 0, 0);
          io_uring_sqe_set_data64(sqe, kTimerTag);
          timer_armed = true;  // a later one fires too; it just replans
          timer_at = retry_at;
        }
      }
    }
    while (!queued.empty() && in_flight < depth) {
      struct io_uring_sqe* sqe = io_uring_get_sqe(ring);
      if (sqe == nullptr) break;
      Op* op = queued.front();
      queued.pop_front();
      const unsigned len = static_cast<unsigned>(op->length - op->done);
      if (op->fixed) {
        io_uring_prep_read_fixed(sqe, op->fd, op->dest + op->done, len,
                                 op->offset + op->done, op->read->slot);
      } else {
        io_uring_prep_read(sqe, op->fd, op->dest + op->done, len,
                           op->offset + op->done);
      }
      io_uring_sqe_set_data(sqe, op);
      ++in_flight;
    }
    const int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -EBUSY && rc != -EAGAIN) {
      LogError("read engine: io_uring_submit_and_wait: ", std::strerror(-rc));
    }
    struct io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        wake_armed = false;  // re-armed at the top of the loop
        continue;
      }
      if (tag == kTimerTag) {
        timer_armed = false;
        continue;
      }
      Op* op = reinterpret_cast<Op*>(tag);
      --in_flight;
      BlockRead* r = op->read;
      bool op_done = true;
      if (cqe->res == -EAGAIN || cqe->res == -EINTR) {
        queued.push_front(op);
        op_done = false;
      } else if (cqe->res < 0) {
        if (r->status.ok()) {
          r->status = ErrnoToStatus(
              -cqe->res,
              absl::StrCat("read ", op->path != nullptr ? *op->path : "file",
                           " at offset ", op->offset + op->done));
        }
      } else if (cqe->res == 0) {
        if (r->status.ok()) {
          r->status = absl::DataLossError(absl::StrCat(
              op->path != nullptr ? *op->path : "file",
              ": file ends early: needed bytes [", op->offset, ", ",
              op->offset + op->length, ") but only ", op->done,
              " were readable (the file was truncated or is shorter than its "
              "metadata says)"));
        }
      } else {
        op->done += static_cast<size_t>(cqe->res);
        r->bytes += static_cast<uint64_t>(cqe->res);
        if (op->done < op->length) {  // short read: continue it
          queued.push_front(op);
          op_done = false;
        }
      }
      if (op_done) {
        delete op;
        if (--r->ops_left == 0) Finish(r);
      }
    }
    io_uring_cq_advance(ring, seen);
  }
  sources_.clear();
}

void ReadEngine::LoopPread() {
  while (!stop_.load()) {
    TakeSourceChanges();
    std::vector<Op*> ops;
    BlockSource::Clock::time_point retry_at;
    Plan(options_.queue_depth, &ops, &retry_at);
    for (Op* op : ops) {
      BlockRead* r = op->read;
      if (r->status.ok()) {
        absl::Status st = PreadFull(op->fd, op->dest, op->length, op->offset,
                                    op->path != nullptr ? *op->path : "file");
        if (st.ok()) r->bytes += op->length;
        r->status = st;
      }
      delete op;
      if (--r->ops_left == 0) Finish(r);
    }
    if (ops.empty()) {
      int timeout_ms = -1;
      if (retry_at != BlockSource::Clock::time_point()) {
        timeout_ms = static_cast<int>(
            std::chrono::duration_cast<std::chrono::milliseconds>(
                retry_at - BlockSource::Clock::now())
                .count() +
            1);
        timeout_ms = std::max(timeout_ms, 0);
      }
      struct pollfd p = {event_fd_.get(), POLLIN, 0};
      if (::poll(&p, 1, timeout_ms) <= 0) continue;
      uint64_t v;
      ssize_t n = ::read(event_fd_.get(), &v, sizeof(v));
      (void)n;
    }
  }
  sources_.clear();
}

}  // namespace shardcast
