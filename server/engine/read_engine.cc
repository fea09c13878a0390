#include "server/engine/read_engine.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

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

ReadEngine::ReadEngine(ReadEngineOptions options, Reservoir* reservoir)
    : options_(options), reservoir_(reservoir) {}

absl::StatusOr<std::unique_ptr<ReadEngine>> ReadEngine::Start(
    ReadEngineOptions options, Reservoir* reservoir) {
  if (options.queue_depth < 1) options.queue_depth = 1;
  options.read_bytes = std::clamp<uint64_t>(options.read_bytes / 4096 * 4096,
                                            4096, uint64_t{1} << 30);
  std::unique_ptr<ReadEngine> e(new ReadEngine(options, reservoir));
  // Polled by the loop, then read (the counter is non-zero by then).
  const int efd = ::eventfd(0, EFD_CLOEXEC);
  if (efd < 0) return ErrnoToStatus(errno, "eventfd for the read engine");
  e->event_fd_.Reset(efd);
  e->loop_ = RingLoop::Create(options.queue_depth, "the shared scans' reads");
  if (e->loop_->uses_uring() && options.register_buffers &&
      reservoir != nullptr) {
    std::vector<struct iovec> iov(static_cast<size_t>(reservoir->num_slots()));
    for (size_t i = 0; i < iov.size(); ++i) {
      iov[i].iov_base = reservoir->slot_data(static_cast<int32_t>(i));
      iov[i].iov_len = reservoir->slot_bytes();
    }
    absl::Status reg = e->loop_->RegisterBuffers(iov);
    if (!reg.ok()) {
      LogWarning("read engine: cannot register the reservoir's slots (",
                 reg.message(), "; RLIMIT_MEMLOCK?); reading without them");
    } else {
      e->buffers_registered_ = true;
      reservoir->SetPinned();
    }
  }
  ReadEngine* raw = e.get();
  e->thread_ = std::thread([raw] { raw->Loop(); });
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

void ReadEngine::ArmWake() {
  wake_armed_ = true;
  loop_->Poll(event_fd_.get(), POLLIN, [this](int) {
    uint64_t v;
    ssize_t n = ::read(event_fd_.get(), &v, sizeof(v));
    (void)n;  // readable: the counter is reset, whatever it was
    wake_armed_ = false;
  });
}

void ReadEngine::Submit(Op* op) {
  loop_->Read(
      op->range, op->done, [this, op](int res) { OnRead(op, res); },
      op->fixed_buffer);
}

void ReadEngine::OnRead(Op* op, int res) {
  BlockRead* r = op->read;
  const size_t before = op->done;
  absl::Status error;
  ReadStep step = ApplyReadResult(op->range, res, &op->done, &error);
  r->bytes += op->done - before;
  if (step == ReadStep::kContinue) {
    if (!stop_.load()) {
      Submit(op);  // the rest of a short read, or EAGAIN
      return;
    }
    step = ReadStep::kFailed;
    error = absl::CancelledError("daemon stopping");
  }
  if (step == ReadStep::kFailed && r->status.ok()) r->status = error;
  delete op;
  if (--r->ops_left == 0) Finish(r);
}

void ReadEngine::Loop() {
  const size_t depth = options_.queue_depth;
  bool cancelled = false;
  while (true) {
    if (stop_.load()) {
      // What never reached the disk is handed back now; the reads on it
      // complete first.
      if (!cancelled) loop_->CancelWaiting();
      cancelled = true;
      if (loop_->reads_pending() == 0) break;
    }
    if (!wake_armed_) ArmWake();
    TakeSourceChanges();
    if (!stop_.load() && loop_->reads_pending() < depth) {
      std::vector<Op*> planned;
      BlockSource::Clock::time_point retry_at;
      Plan(depth - loop_->reads_pending(), &planned, &retry_at);
      for (Op* op : planned) Submit(op);
      // A source waits for a time (a new scan gathering its clients): wake
      // up then, unless a timer for an earlier time is already armed.
      if (retry_at != BlockSource::Clock::time_point() &&
          (!timer_armed_ || retry_at < timer_at_)) {
        const auto wait = std::chrono::duration_cast<std::chrono::nanoseconds>(
            retry_at - BlockSource::Clock::now());
        timer_armed_ = true;  // a later one fires too; it just replans
        timer_at_ = retry_at;
        loop_->Timeout(std::max<int64_t>(wait.count(), 1000),
                       [this](int) { timer_armed_ = false; });
      }
    }
    loop_->RunOnce();
  }
  sources_.clear();
}

}  // namespace shardcast
