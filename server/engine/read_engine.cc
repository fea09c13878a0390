#include "server/engine/read_engine.h"

#include <linux/time_types.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace shardcast {

// One read of at most read_bytes: a range, or a piece of one.
struct ReadEngine::Op {
  BlockRead* read;
  ReadOp range;
  size_t done = 0;
  int fixed_buffer = -1;  // the registered slot `range` lies in, if any
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
  // One entry more than the reads: the eventfd read that wakes the loop.
  absl::StatusOr<UringRing> ring = UringRing::Create(options.queue_depth + 1);
  if (!ring.ok()) {
    LogWarning("read engine: io_uring unavailable (", ring.status().message(),
               "); falling back to pread on the engine thread");
  } else {
    e->ring_ = std::move(*ring);
    if (options.register_buffers && reservoir != nullptr) {
      std::vector<struct iovec> iov(
          static_cast<size_t>(reservoir->num_slots()));
      for (size_t i = 0; i < iov.size(); ++i) {
        iov[i].iov_base = reservoir->slot_data(static_cast<int32_t>(i));
        iov[i].iov_len = reservoir->slot_bytes();
      }
      absl::Status reg = e->ring_->RegisterBuffers(iov);
      if (!reg.ok()) {
        LogWarning("read engine: cannot register the reservoir's slots (",
                   reg.message(), "; RLIMIT_MEMLOCK?); reading without them");
      } else {
        e->buffers_registered_ = true;
        reservoir->SetPinned();
      }
    }
  }
  ReadEngine* raw = e.get();
  e->thread_ = std::thread([raw] {
    if (raw->ring_.has_value()) {
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
    for (const BlockRead::Touch& t : r->touch) {
      // Cached pages (the reason to map): page-table work only.
      absl::Status st = t.file->Populate(t.offset, t.length);
      if (!st.ok()) {
        r->status = std::move(st);
        break;
      }
      r->bytes += t.length;
    }
    const char* slot_begin = r->slot >= 0 && reservoir_ != nullptr
                                 ? reservoir_->slot_data(r->slot)
                                 : nullptr;
    for (const ReadOp& range : r->ranges) {
      char* dest = static_cast<char*>(range.dest);
      const bool fixed =
          buffers_registered_ && slot_begin != nullptr && dest >= slot_begin &&
          dest + range.length <= slot_begin + reservoir_->slot_bytes();
      for (uint64_t at = 0; at < range.length; at += options_.read_bytes) {
        ReadOp piece = range;
        piece.offset += at;
        piece.dest = dest + at;
        piece.length = static_cast<size_t>(
            std::min<uint64_t>(options_.read_bytes, range.length - at));
        ops->push_back(new Op{r, piece, 0, fixed ? r->slot : -1});
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
  UringRing& ring = *ring_;
  const ReadOp wake_read{event_fd_.get(), 0, sizeof(wake_value_), &wake_value_,
                         nullptr};
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
    if (!wake_armed) wake_armed = ring.PrepareRead(wake_read, 0, kWakeTag);
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
        const auto wait = std::chrono::duration_cast<std::chrono::nanoseconds>(
            retry_at - BlockSource::Clock::now());
        const int64_t ns = std::max<int64_t>(wait.count(), 1000);
        timer_ts.tv_sec = ns / 1000000000;
        timer_ts.tv_nsec = ns % 1000000000;
        if (ring.PrepareTimeout(&timer_ts, kTimerTag)) {
          timer_armed = true;  // a later one fires too; it just replans
          timer_at = retry_at;
        }
      }
    }
    while (!queued.empty() && in_flight < depth) {
      Op* op = queued.front();
      if (!ring.PrepareRead(op->range, op->done, reinterpret_cast<uint64_t>(op),
                            op->fixed_buffer)) {
        break;
      }
      queued.pop_front();
      ++in_flight;
    }
    const int rc = ring.SubmitAndWait(1);
    if (rc < 0 && rc != -EINTR && rc != -EBUSY && rc != -EAGAIN) {
      LogError("read engine: io_uring_submit_and_wait: ", std::strerror(-rc));
    }
    ring.ForEachCompletion([&](uint64_t tag, int res) {
      if (tag == kWakeTag) {
        wake_armed = false;  // re-armed at the top of the loop
        return;
      }
      if (tag == kTimerTag) {
        timer_armed = false;
        return;
      }
      Op* op = reinterpret_cast<Op*>(tag);
      --in_flight;
      BlockRead* r = op->read;
      const size_t before = op->done;
      absl::Status error;
      const ReadStep step = ApplyReadResult(op->range, res, &op->done, &error);
      r->bytes += op->done - before;
      if (step == ReadStep::kContinue) {
        queued.push_front(op);  // the rest of a short read, or EAGAIN
        return;
      }
      if (step == ReadStep::kFailed && r->status.ok()) r->status = error;
      delete op;
      if (--r->ops_left == 0) Finish(r);
    });
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
        const ReadOp& range = op->range;
        absl::Status st =
            PreadFull(range.fd, range.dest, range.length, range.offset,
                      range.path != nullptr ? *range.path : "file");
        if (st.ok()) r->bytes += range.length;
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
