#include "server/transport/stream_reactor.h"

#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/tsan.h"
#include "proto/grpc_status.h"
#include "server/transport/grpc_wire.h"

namespace shardcast {

absl::StatusOr<StreamOptions> ToStreamOptions(const v1::StreamRequest& req,
                                              const std::string& peer) {
  StreamOptions o;
  o.dataset = req.dataset();
  StreamSpec& spec = o.spec;
  if (req.has_layer()) spec.layer = req.layer();
  spec.tokens = req.tokens() == v1::TOKENS_SPECIAL ? TokenSelection::kSpecial
                : req.tokens() == v1::TOKENS_ALL   ? TokenSelection::kAll
                                                   : TokenSelection::kContent;
  spec.batch_size = req.batch_size();
  spec.epochs = req.epochs();
  spec.rank = req.rank();
  spec.world_size = req.world_size();
  spec.drop_last = req.drop_last();
  for (uint32_t l : req.exclude_labels()) {
    if (l > 255) {
      return absl::InvalidArgumentError(
          absl::StrCat("exclude_labels: ", l, " is not a uint8 label (0-255)"));
    }
    spec.exclude_labels.push_back(static_cast<uint8_t>(l));
  }
  o.order = req.order() == v1::ORDER_ORDERED ? StreamOrder::kOrdered
                                             : StreamOrder::kShuffled;
  o.seed = req.seed();
  o.resume_token = req.resume_token();
  o.peer = peer;
  o.max_batch_bytes = kMaxBatchBytes;
  return o;
}

namespace {

// One Stream call. Batches are assembled on the worker pool while the
// previous one is being written: one write is in flight and at most one
// more batch is ready, so a slow client holds two batches at most and a fast
// one never waits for assembly. A source that waits for blocks (kPending)
// gives its worker back and is woken by its waker, so no thread blocks on
// the disk.
//
// Two state machines under mu_: the producer (idle: a batch is ready and
// waits for the write slot; running: a worker is assembling; waiting: for
// blocks; done: the stream ended or failed) and the writer (writing or
// not). Finish() is called once, when the producer is done and nothing is
// being written. Deletes itself in OnDone.
class StreamReactor final : public grpc::ServerGenericBidiReactor {
 public:
  StreamReactor(const TransportContext& context,
                grpc::GenericCallbackServerContext* ctx)
      : context_(context), peer_(ctx->peer()) {
    Metrics* m = context_.metrics;
    m->calls_total++;
    m->calls_in_flight++;
    m->streams_active++;
    StartRead(&request_);  // queued until CreateReactor returns
    TsanRelease(this);     // hand-off to gRPC (see common/tsan.h)
  }

  void OnReadDone(bool ok) override {
    TsanReaction reaction(this);
    if (!ok) {
      EndProducer(
          absl::InvalidArgumentError("Stream: the client sent no request"));
      return;
    }
    context_.pool->Submit([this] {
      TsanAcquire(this);
      Open();
    });
  }

  void OnWriteDone(bool ok) override {
    TsanReaction reaction(this);
    bool start = false, schedule = false, finish = false;
    {
      MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        cancelled_ = true;  // the client went away
        ready_.reset();
        if (producer_ == Producer::kRunning) return;  // it ends and finishes
        producer_ = Producer::kDone;
        SetEnd(absl::CancelledError("the client went away"));
        finish = true;
      } else if (ready_.has_value()) {
        reply_ = std::move(*ready_);
        ready_.reset();
        writing_ = start = true;
        if (producer_ == Producer::kIdle) {
          producer_ = Producer::kRunning;
          schedule = true;
        }
      } else if (producer_ == Producer::kDone) {
        finish = true;
      }
    }
    if (start) {
      TsanRelease(this);  // hand-off to gRPC (see common/tsan.h)
      StartWrite(&reply_);
    }
    if (schedule) Schedule();
    if (finish) Done();
  }

  void OnCancel() override {
    TsanReaction reaction(this);
    Kick(/*cancel=*/true);
  }

  void OnDone() override {
    TsanAcquire(this);
    Metrics* m = context_.metrics;
    m->calls_in_flight--;
    m->streams_active--;
    LogInfo("stream from ", peer_, " ended: ", batches_, " batches, ", bytes_,
            " bytes, ", final_status_);
    delete this;
  }

 private:
  enum class Producer { kIdle, kRunning, kWaiting, kDone };

  void Schedule() {
    TsanRelease(this);
    context_.pool->Submit([this] {
      TsanAcquire(this);
      Produce();
    });
  }

  // From the scan (its lock held) when blocks arrived, or from OnCancel: run
  // the producer again if it waits for blocks, or tell a running one to
  // look again before it waits.
  void Kick(bool cancel) {
    bool schedule = false;
    {
      MutexLock lock(&mu_);
      if (cancel) cancelled_ = true;
      if (producer_ == Producer::kWaiting) {
        producer_ = Producer::kRunning;
        schedule = true;
      } else if (producer_ == Producer::kRunning) {
        rerun_ = true;
      }
    }
    if (schedule) Schedule();
  }

  // The producer is done (end of stream, error or cancellation): finish now
  // if nothing is being written, else once the write completes.
  void EndProducer(const absl::Status& status) {
    bool finish = false;
    {
      MutexLock lock(&mu_);
      producer_ = Producer::kDone;
      SetEnd(status);
      if (!status.ok()) ready_.reset();  // an error goes out at once
      finish = !writing_ && !ready_.has_value();
    }
    if (finish) Done();
  }

  // On a worker: converts the request and opens the engine's source.
  void Open() {
    v1::StreamRequest req;
    absl::Status st = ParseRequest(&request_, &req);
    absl::StatusOr<StreamOptions> options =
        st.ok() ? ToStreamOptions(req, peer_) : st;
    absl::StatusOr<std::unique_ptr<BatchSource>> source =
        options.ok() ? context_.engine->OpenStream(*options) : options.status();
    if (!source.ok()) {
      EndProducer(source.status());
      return;
    }
    source_ = std::move(*source);
    const BatchShape& shape = source_->shape();
    const StreamSpec& spec = options->spec;
    LogInfo("stream client connected from ", peer_, ": dataset ", req.dataset(),
            options->order == StreamOrder::kShuffled
                ? absl::StrCat(", shuffled (seed ", options->seed, ")")
                : ", ordered",
            ", batch ", spec.batch_size, ", rank ", spec.rank, "/",
            spec.world_size, ", ",
            shape.vectors_per_epoch < 0
                ? std::string("(label-filtered)")
                : std::to_string(shape.vectors_per_epoch),
            " vectors per epoch");
    Produce();
  }

  // On a worker: fills the next batch and starts writing it (or queues it
  // behind the write in flight).
  void Produce() {
    if (Cancelled()) {
      EndProducer(absl::CancelledError("the client cancelled"));
      return;
    }
    const BatchShape& shape = source_->shape();
    if (buffer_ == nullptr) {
      buffer_ = context_.buffers->Get(static_cast<size_t>(shape.batch_bytes()));
    }
    absl::StatusOr<BatchSource::Fill> fill =
        source_->Next(VectorDest{buffer_->data, buffer_->size}, &batch_,
                      [this] { Kick(/*cancel=*/false); });
    if (!fill.ok()) {
      EndProducer(fill.status());
      return;
    }
    if (*fill == BatchSource::Fill::kPending) {
      bool again = false;
      {
        MutexLock lock(&mu_);
        if (rerun_ || cancelled_) {
          rerun_ = false;
          again = true;
        } else {
          producer_ = Producer::kWaiting;
        }
      }
      if (again) Schedule();
      return;
    }
    if (*fill == BatchSource::Fill::kEnd) {
      EndProducer(absl::OkStatus());
      return;
    }
    const size_t payload =
        static_cast<size_t>(batch_.rows) * shape.vector_bytes;
    grpc::ByteBuffer reply =
        BatchReply(batch_, shape.d_model, buffer_, payload);
    buffer_ = nullptr;  // the reply's slice owns it now
    ++batches_;
    bytes_ += reply.Length();
    Metrics* m = context_.metrics;
    m->batches_sent++;
    m->bytes_served += reply.Length();
    m->bytes_delivered += payload;
    bool start = false;
    {
      MutexLock lock(&mu_);
      rerun_ = false;
      if (!writing_) {
        reply_ = std::move(reply);
        writing_ = start = true;  // and go on with the next batch
      } else {
        ready_ = std::move(reply);  // wait for the write slot
        producer_ = Producer::kIdle;
      }
    }
    if (start) {
      TsanRelease(this);  // hand-off to gRPC (see common/tsan.h)
      StartWrite(&reply_);
      Schedule();
    }
  }

  bool Cancelled() {
    MutexLock lock(&mu_);
    return cancelled_;
  }

  // The end status is kept as code and text, not as an absl::Status: a
  // Status shared between threads is released inside Debian's Abseil,
  // which ThreadSanitizer cannot see synchronise.
  void SetEnd(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    end_code_ = status.code();
    end_message_ = std::string(status.message());
  }

  // Called once: the producer is done and nothing is being written.
  void Done() {
    // Leave the engine first: once the source is gone the scan never calls
    // our waker again (a waker running now finds the producer done).
    source_.reset();
    if (buffer_ != nullptr) {
      BufferPool::Return(buffer_);
      buffer_ = nullptr;
    }
    absl::Status status;
    {
      MutexLock lock(&mu_);
      status = absl::Status(end_code_, end_message_);
    }
    context_.metrics->CallDone(status.code());
    final_status_ = status.ToString();
    TsanRelease(this);  // hand-off to gRPC (see common/tsan.h)
    Finish(ToGrpcStatus(status));
  }

  const TransportContext context_;
  const std::string peer_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;               // the batch being written
  std::unique_ptr<BatchSource> source_;  // set once Open succeeded
  StreamBatch batch_;
  PooledBuffer* buffer_ = nullptr;  // the batch being assembled
  Mutex mu_;
  Producer producer_ ABSL_GUARDED_BY(mu_) = Producer::kRunning;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool rerun_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::ByteBuffer> ready_ ABSL_GUARDED_BY(mu_);
  absl::StatusCode end_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;
  std::string end_message_ ABSL_GUARDED_BY(mu_);
  int64_t batches_ = 0;
  uint64_t bytes_ = 0;
  std::string final_status_;
};

}  // namespace

grpc::ServerGenericBidiReactor* NewStreamReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx) {
  return new StreamReactor(context, ctx);
}

}  // namespace shardcast
