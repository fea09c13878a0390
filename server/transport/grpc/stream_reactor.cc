#include "server/transport/grpc/stream_reactor.h"

#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "common/base/tsan.h"
#include "proto/grpc_status.h"
#include "server/transport/grpc/batch_outlet.h"
#include "server/transport/grpc/grpc_wire.h"

namespace shardcast {

absl::StatusOr<StreamOptions> ToStreamOptions(const v1::StreamRequest& req,
                                              const std::string& peer) {
  StreamOptions o;
  o.dataset = req.dataset();
  StreamSpec& spec = o.spec;
  if (req.has_layer()) spec.layer = req.layer();
  switch (req.tokens()) {
    case v1::TOKENS_CONTENT:
      spec.tokens = TokenSelection::kContent;
      break;
    case v1::TOKENS_SPECIAL:
      spec.tokens = TokenSelection::kSpecial;
      break;
    case v1::TOKENS_ALL:
      spec.tokens = TokenSelection::kAll;
      break;
    default:  // a number the proto does not name: not streamed as a default
      return absl::InvalidArgumentError(
          absl::StrCat("tokens: ", static_cast<int>(req.tokens()),
                       " is not one of 0 (content), 1 (special), 2 (all)"));
  }
  spec.batch_size = req.batch_size();
  spec.epochs = req.epochs();
  spec.rank = req.rank();
  spec.world_size = req.world_size();
  spec.node_rank = req.node_rank();
  spec.node_count = req.node_count();  // 0: the daemon's --node-count
  spec.drop_last = req.drop_last();
  for (uint32_t l : req.exclude_labels()) {
    if (l > 255) {
      return absl::InvalidArgumentError(
          absl::StrCat("exclude_labels: ", l, " is not a uint8 label (0-255)"));
    }
    spec.exclude_labels.push_back(static_cast<uint8_t>(l));
  }
  switch (req.dtype()) {
    case v1::DTYPE_FLOAT32:
      spec.transform.dtype = OutputDType::kFloat32;
      break;
    case v1::DTYPE_BFLOAT16:
      spec.transform.dtype = OutputDType::kBFloat16;
      break;
    case v1::DTYPE_FLOAT16:
      spec.transform.dtype = OutputDType::kFloat16;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype: ", static_cast<int>(req.dtype()),
          " is not one of 0 (float32), 1 (bfloat16), 2 (float16)"));
  }
  spec.transform.scale_norm = req.scale_norm();
  spec.transform.center = req.center();
  switch (req.order()) {
    case v1::ORDER_SHUFFLED:
      o.order = StreamOrder::kShuffled;
      break;
    case v1::ORDER_ORDERED:
      o.order = StreamOrder::kOrdered;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("order: ", static_cast<int>(req.order()),
                       " is not one of 0 (shuffled), 1 (ordered)"));
  }
  o.seed = req.seed();
  if (req.resume_token().size() > limits::kMaxResumeTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume_token is ", req.resume_token().size(),
        " bytes; a shardcast token is at most ", limits::kMaxResumeTokenBytes));
  }
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
  // `shared`: a SharedStream call (batches in the client's shared memory).
  StreamReactor(const TransportContext& context,
                grpc::GenericCallbackServerContext* ctx, bool shared)
      : context_(context),
        peer_(context.local != nullptr ? context.local->Describe(ctx->peer())
                                       : ctx->peer()),
        local_(context.local != nullptr &&
               context.local->PeerOf(ctx->peer()).has_value()),
        caller_(CallerOf(context, ctx)),
        client_(context.metrics->streams.NextClientId()),
        shared_(shared) {
    Metrics* m = context_.metrics;
    m->calls_total++;
    m->calls_in_flight++;
    m->streams_active++;
    StartRead(&request_);  // queued until CreateReactor returns
    TsanRelease(this);     // hand-off to gRPC (see common/base/tsan.h)
  }

  void OnReadDone(bool ok) override {
    TsanReaction reaction(this);
    if (opened_reads_) {
      if (ok) TakeReleases();  // and reads on
      return;                  // !ok: the client finished writing or went away
    }
    opened_reads_ = true;
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
      TsanHandOff(this, [&] { StartWrite(&reply_); });
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
    outlet_.reset();  // the region is free for another stream
    book_entry_.reset();
    Metrics* m = context_.metrics;
    m->calls_in_flight--;
    m->streams_active--;
    Log(LogLevel::kInfo,
        absl::StrCat("stream ended: ", batches_, " batches, ", payload_bytes_,
                     " vector bytes (", bytes_, " in messages), ",
                     final_status_),
        {{"client", client_}, {"peer", peer_}});
    DeleteReactor(this);
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

  // On a worker: converts the first message, opens the engine's source and
  // the outlet the batches go out through.
  void Open() {
    v1::StreamRequest req;
    std::string region_token;
    absl::Status st;
    if (shared_) {
      v1::SharedStreamMessage first;
      st = ParseRequest(&request_, &first);
      req = first.request();
      region_token = first.region();
    } else {
      st = ParseRequest(&request_, &req);
    }
    if (st.ok()) st = CheckCaller(context_, caller_, req.dataset());
    absl::StatusOr<StreamOptions> options =
        st.ok() ? ToStreamOptions(req, peer_) : st;
    if (options.ok() && shared_) {
      absl::StatusOr<std::unique_ptr<SlotOutlet>> outlet =
          OpenSlotOutlet(region_token);
      if (outlet.ok()) {
        options->max_batch_bytes = (*outlet)->region().slot_bytes();
        slots_ = outlet->get();
        outlet_ = std::move(*outlet);
      } else {
        options = outlet.status();
      }
    } else if (options.ok()) {
      outlet_ = std::make_unique<MessageOutlet>(context_.buffers);
    }
    if (options.ok()) {
      options->client = client_;
      options->owner = OwnerOf(caller_);
    }
    absl::StatusOr<std::unique_ptr<BatchSource>> source =
        options.ok() ? context_.engine->OpenStream(*options) : options.status();
    if (!source.ok()) {
      EndProducer(source.status());
      return;
    }
    source_ = std::move(*source);
    const BatchShape& shape = source_->shape();
    const StreamSpec& spec = options->spec;
    StreamInfo info;
    info.client = client_;
    info.peer = peer_;
    info.dataset = Quoted(PublicDatasetId(req.dataset()));
    info.order =
        options->order == StreamOrder::kShuffled ? "shuffled" : "ordered";
    info.transport = slots_ != nullptr ? "shm" : "grpc";
    info.rank = spec.rank;
    info.world_size = spec.world_size;
    info.started = absl::Now();
    book_entry_ = context_.metrics->streams.Add(info);
    Log(LogLevel::kInfo,
        absl::StrCat(
            "stream opened: ",
            options->order == StreamOrder::kShuffled
                ? absl::StrCat("shuffled (seed ", options->seed, ")")
                : "ordered",
            ", batch ", spec.batch_size, ", rank ", spec.rank, "/",
            spec.world_size, ", ",
            shape.vectors_per_epoch < 0
                ? std::string("(label-filtered)")
                : std::to_string(shape.vectors_per_epoch),
            " vectors per epoch, ", shape.transform,
            slots_ != nullptr
                ? absl::StrCat(", shared memory (", slots_->region().slots(),
                               " slots, pid ", slots_->region().pid(), ")")
                : ", gRPC messages"),
        {{"client", client_}, {"peer", peer_}, {"dataset", info.dataset}});
    if (shared_) {
      // From now on the client's messages return slots.
      TsanHandOff(this, [&] { StartRead(&request_); });
    }
    Produce();
  }

  // The outlet of a SharedStream: the region its token names, attached to
  // this stream. Only on the Unix socket: a region is on this machine.
  absl::StatusOr<std::unique_ptr<SlotOutlet>> OpenSlotOutlet(
      const std::string& token) {
    if (context_.shm == nullptr) {
      return absl::FailedPreconditionError(
          "shared memory is off on this daemon (--disable-shared-memory or "
          "no Unix socket); use the Stream method");
    }
    if (!local_) {
      return absl::FailedPreconditionError(
          "SharedStream is for clients on the daemon's Unix socket");
    }
    ASSIGN_OR_RETURN(std::shared_ptr<ShmRegion> region,
                     context_.shm->Attach(token));
    return std::make_unique<SlotOutlet>(std::move(region));
  }

  // On a gRPC thread: the client returned slots (a small message). A
  // release of a slot it does not hold ends the stream.
  void TakeReleases() {
    v1::SharedStreamMessage m;
    absl::Status st = ParseRequest(&request_, &m);
    for (uint32_t slot : m.release()) {
      if (!st.ok()) break;
      st = slots_->Release(slot);
    }
    if (!st.ok()) {
      {
        MutexLock lock(&mu_);
        client_error_code_ = st.code();
        client_error_ = std::string(st.message());
      }
      Kick(/*cancel=*/true);
      return;
    }
    Kick(/*cancel=*/false);
    {
      MutexLock lock(&mu_);
      if (producer_ == Producer::kDone) return;  // the stream is ending
    }
    TsanHandOff(this, [&] { StartRead(&request_); });
  }

  // On a worker: fills the next batch and starts writing it (or queues it
  // behind the write in flight).
  void Produce() {
    if (Cancelled()) {
      EndProducer(CancelStatus());
      return;
    }
    const BatchShape& shape = source_->shape();
    std::optional<VectorDest> dest =
        outlet_->Acquire(shape.batch_bytes(), source_->CanView());
    absl::StatusOr<BatchSource::Fill> fill =
        dest.has_value()
            ? source_->Next(*dest, &batch_, [this] { Kick(/*cancel=*/false); })
            : BatchSource::Fill::kPending;  // the client has
                                            // every slot
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
    const uint64_t payload =
        static_cast<uint64_t>(batch_.rows) * shape.vector_bytes;
    grpc::ByteBuffer reply = outlet_->Reply(batch_, shape.d_model, payload);
    ++batches_;
    bytes_ += reply.Length();
    payload_bytes_ += payload;
    book_entry_->CountBatch(payload);
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
      TsanHandOff(this, [&] { StartWrite(&reply_); });
      Schedule();
    }
  }

  // Why a cancelled stream ends: a client error, or the client's cancel.
  absl::Status CancelStatus() {
    MutexLock lock(&mu_);
    if (client_error_code_ != absl::StatusCode::kOk) {
      return absl::Status(client_error_code_, client_error_);
    }
    return absl::CancelledError("the client cancelled");
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
    // our waker again (a waker running now finds the producer done). The
    // outlet (a shared-memory region) is let go in OnDone, after the last
    // client message.
    source_.reset();
    absl::Status status;
    {
      MutexLock lock(&mu_);
      status = absl::Status(end_code_, end_message_);
    }
    context_.metrics->CallDone(status.code());
    final_status_ = status.ToString();
    TsanHandOff(this, [&] { Finish(ToGrpcStatus(status)); });
  }

  const TransportContext context_;
  const std::string peer_;
  const bool local_;          // on the Unix socket
  const Caller caller_;       // who asks (the access rule)
  const std::string client_;  // this stream's id in logs, status, metrics
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;  // the batch being written
  const bool shared_;
  bool opened_reads_ = false;            // the first message has been read
  std::unique_ptr<BatchSource> source_;  // set once Open succeeded
  std::unique_ptr<BatchOutlet> outlet_;  // likewise
  SlotOutlet* slots_ = nullptr;          // outlet_ of a SharedStream
  std::unique_ptr<StreamBook::Entry> book_entry_;  // set once Open succeeded
  StreamBatch batch_;
  Mutex mu_;
  Producer producer_ ABSL_GUARDED_BY(mu_) = Producer::kRunning;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool rerun_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::ByteBuffer> ready_ ABSL_GUARDED_BY(mu_);
  absl::StatusCode end_code_ ABSL_GUARDED_BY(mu_) = absl::StatusCode::kOk;
  std::string end_message_ ABSL_GUARDED_BY(mu_);
  // A client message that ends the stream (a bad release), kept as code and
  // text like the end status.
  absl::StatusCode client_error_code_ ABSL_GUARDED_BY(mu_) =
      absl::StatusCode::kOk;
  std::string client_error_ ABSL_GUARDED_BY(mu_);
  int64_t batches_ = 0;
  uint64_t bytes_ = 0;          // gRPC message bytes
  uint64_t payload_bytes_ = 0;  // vector bytes (in messages or slots)
  std::string final_status_;
};

}  // namespace

grpc::ServerGenericBidiReactor* NewStreamReactor(
    const TransportContext& context, grpc::GenericCallbackServerContext* ctx,
    bool shared) {
  return new StreamReactor(context, ctx, shared);
}

}  // namespace shardcast
