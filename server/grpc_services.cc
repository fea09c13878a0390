#include "server/grpc_services.h"

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/metadata.h"
#include "common/pyjson.h"
#include "common/status.h"
#include "common/tsan.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "proto/grpc_status.h"
#include "server/log.h"
#include "server/ordered_stream.h"
#include "server/shuffled_stream.h"

namespace shardcast {
namespace {

constexpr char kQueryPrefix[] = "/shardcast.v1.Query/";
constexpr char kStreamMethod[] = "/shardcast.v1.Stream/Stream";

template <typename Message>
absl::Status ParseRequest(grpc::ByteBuffer* buffer, Message* message) {
  grpc::Status st =
      grpc::SerializationTraits<Message>::Deserialize(buffer, message);
  if (!st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", Message::descriptor()->full_name(),
                     " request: ", st.error_message()));
  }
  return absl::OkStatus();
}

void AppendVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

// Vectors reply: protobuf header (shape) + field 15 (bytes) appended by hand,
// its payload handed to gRPC as a slice that free()s it when sent.
grpc::ByteBuffer VectorsReply(VectorsResult result) {
  v1::Vectors header;
  for (int64_t s : result.shape) header.add_shape(s);
  std::string head = header.SerializeAsString();
  constexpr uint8_t kDataTag = (15 << 3) | 2;  // field 15, length-delimited
  head.push_back(static_cast<char>(kDataTag));
  AppendVarint(head, result.data.size());
  const size_t size = result.data.size();
  grpc::Slice slices[2] = {
      grpc::Slice(head),
      grpc::Slice(result.data.Release(), size, std::free),
  };
  return grpc::ByteBuffer(slices, 2);
}

template <typename Message>
grpc::ByteBuffer ProtoReply(const Message& message) {
  grpc::ByteBuffer buffer;
  bool own = false;
  grpc::SerializationTraits<Message>::Serialize(message, &buffer, &own);
  return buffer;
}

// One unary Query call: read the request, run it on the worker pool, write
// the reply and finish. Deletes itself in OnDone.
class QueryReactor final : public grpc::ServerGenericBidiReactor {
 public:
  QueryReactor(const QueryService* service,
               grpc::GenericCallbackServerContext* ctx)
      : service_(service), method_(ctx->method()) {
    service_->metrics()->calls_total++;
    service_->metrics()->calls_in_flight++;
    LogDebug("call ", method_, " from ", ctx->peer());
    StartRead(&request_);  // queued until CreateReactor returns
    TsanRelease(this);     // hand-off to gRPC (see common/tsan.h)
  }

  void OnReadDone(bool ok) override {
    TsanAcquire(this);
    if (!ok) {
      FinishWith(absl::InvalidArgumentError(
          absl::StrCat(method_, ": the client sent no request message")));
      return;
    }
    service_->pool()->Submit([this] {
      TsanAcquire(this);
      Run();
    });
  }

  void OnWriteDone(bool /*ok*/) override {}

  void OnDone() override {
    TsanAcquire(this);
    service_->metrics()->calls_in_flight--;
    delete this;
  }

 private:
  void Run() {
    absl::StatusOr<grpc::ByteBuffer> reply = Dispatch();
    if (!reply.ok()) {
      FinishWith(reply.status());
      return;
    }
    reply_ = std::move(*reply);
    service_->metrics()->bytes_served += reply_.Length();
    service_->metrics()->CallDone(absl::StatusCode::kOk);
    TsanRelease(this);  // hand-off to gRPC (see common/tsan.h)
    StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
  }

  absl::StatusOr<grpc::ByteBuffer> Dispatch() {
    const QueryEngine* engine = service_->engine();
    const std::string name = method_.substr(sizeof(kQueryPrefix) - 1);
    if (name == "GetVectors") {
      v1::GetVectorsRequest req;
      RETURN_IF_ERROR(ParseRequest(&request_, &req));
      std::vector<Coord> coords;
      coords.reserve(static_cast<size_t>(req.coordinates_size()));
      for (const v1::Coordinate& c : req.coordinates()) {
        coords.push_back({c.example(), c.layer(), c.token()});
      }
      ASSIGN_OR_RETURN(VectorsResult r,
                       engine->GetVectors(req.dataset(), coords));
      return VectorsReply(std::move(r));
    }
    if (name == "GetExample") {
      v1::GetExampleRequest req;
      RETURN_IF_ERROR(ParseRequest(&request_, &req));
      std::optional<int64_t> layer;
      if (req.has_layer()) layer = req.layer();
      ASSIGN_OR_RETURN(VectorsResult r,
                       engine->GetExample(req.dataset(), req.example(), layer));
      return VectorsReply(std::move(r));
    }
    if (name == "GetLabels") {
      v1::GetLabelsRequest req;
      RETURN_IF_ERROR(ParseRequest(&request_, &req));
      ASSIGN_OR_RETURN(std::string labels,
                       engine->GetLabels(req.dataset(), req.example()));
      v1::Labels reply;
      reply.set_example(req.example());
      reply.set_labels(std::move(labels));
      return ProtoReply(reply);
    }
    return absl::UnimplementedError(absl::StrCat("unknown method ", method_));
  }

  void FinishWith(const absl::Status& status) {
    service_->metrics()->CallDone(status.code());
    LogInfo("call ", method_, " failed: ", status.ToString());
    TsanRelease(this);  // hand-off to gRPC (see common/tsan.h)
    Finish(ToGrpcStatus(status));
  }

  const QueryService* service_;
  const std::string method_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
};

// A Batch reply: protobuf header (metadata) + the vectors as field 15,
// appended as their own slice (no copy through protobuf). The slice owns
// `buffer` and returns it to its pool when gRPC is done with it.
grpc::ByteBuffer BatchReply(StreamBatch& b, int64_t d_model,
                            PooledBuffer* buffer, size_t vector_bytes) {
  v1::Batch header;
  header.set_epoch(b.epoch);
  header.set_index(b.index);
  header.set_rows(b.rows);
  header.set_d_model(d_model);
  header.set_example_idx(std::move(b.example_idx));
  header.set_token_idx(std::move(b.token_idx));
  header.set_layer(std::move(b.layer));
  header.set_labels(std::move(b.labels));
  header.set_resume_token(std::move(b.resume_token));
  std::string head = header.SerializeAsString();
  head.push_back(static_cast<char>((15 << 3) | 2));
  AppendVarint(head, vector_bytes);
  grpc::Slice slices[2] = {
      grpc::Slice(head),
      grpc::Slice(buffer->data, vector_bytes, &BufferPool::Return, buffer)};
  return grpc::ByteBuffer(slices, 2);
}

// One Stream call. Batches are assembled on the worker pool while the
// previous one is being written: one write is in flight and at most one
// more batch is ready, so a slow client holds two batches at most and a fast
// one never waits for assembly. A shuffled stream that waits for blocks from
// its scan gives its worker back and is woken by the scan, so no thread
// blocks on the disk.
//
// Two state machines under mu_: the producer (idle: a batch is ready and
// waits for the write slot; running: a worker is assembling; waiting: for
// blocks; done: the stream ended or failed) and the writer (writing or
// not). Finish() is called once, when the producer is done and nothing is
// being written. Deletes itself in OnDone.
class StreamReactor final : public grpc::ServerGenericBidiReactor {
 public:
  StreamReactor(const QueryService* service,
                grpc::GenericCallbackServerContext* ctx)
      : service_(service), peer_(ctx->peer()) {
    Metrics* m = service_->metrics();
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
    service_->pool()->Submit([this] {
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
    Metrics* m = service_->metrics();
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
    service_->pool()->Submit([this] {
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

  void Open() {
    v1::StreamRequest req;
    absl::Status st = ParseRequest(&request_, &req);
    if (!st.ok()) {
      EndProducer(st);
      return;
    }
    absl::StatusOr<std::shared_ptr<const DatasetReader>> reader =
        service_->engine()->catalog()->Resolve(req.dataset());
    if (!reader.ok()) {
      EndProducer(reader.status());
      return;
    }
    StreamSpec spec;
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
        EndProducer(absl::InvalidArgumentError(absl::StrCat(
            "exclude_labels: ", l, " is not a uint8 label (0-255)")));
        return;
      }
      spec.exclude_labels.push_back(static_cast<uint8_t>(l));
    }
    const DatasetDesc& d = (*reader)->desc();
    d_model_ = d.d_model;
    vector_bytes_ = d.vector_bytes();
    if (spec.batch_size > 0 &&
        static_cast<uint64_t>(spec.batch_size) * vector_bytes_ >
            kMaxBatchBytes) {
      EndProducer(absl::InvalidArgumentError(
          absl::StrCat("batch_size ", spec.batch_size, " x d_model ", d.d_model,
                       " x 4 bytes exceeds the ", kMaxBatchBytes >> 20,
                       " MiB message limit; use at most ",
                       kMaxBatchBytes / vector_bytes_, " vectors per batch")));
      return;
    }
    const bool shuffled = req.order() != v1::ORDER_ORDERED;
    int64_t per_epoch = 0;
    if (shuffled) {
      auto stream = ShuffledStream::Create(
          service_->streams().scans, *reader, (*reader)->info().dir_name, spec,
          req.seed(), req.resume_token(), peer_);
      if (!stream.ok()) {
        EndProducer(stream.status());
        return;
      }
      shuffled_ = std::move(*stream);
      per_epoch = shuffled_->vectors_per_epoch();
    } else {
      auto stream = OrderedStream::Create(*reader, (*reader)->info().dir_name,
                                          spec, req.resume_token());
      if (!stream.ok()) {
        EndProducer(stream.status());
        return;
      }
      stream_ = std::move(*stream);
      per_epoch = stream_->vectors_per_epoch();
    }
    batch_bytes_ = static_cast<size_t>(spec.batch_size) * vector_bytes_;
    LogInfo("stream client connected from ", peer_, ": dataset ", req.dataset(),
            shuffled ? ", shuffled (seed " + std::to_string(req.seed()) + ")"
                     : ", ordered",
            ", batch ", spec.batch_size, ", rank ", spec.rank, "/",
            spec.world_size, ", ",
            per_epoch < 0 ? std::string("(label-filtered)")
                          : std::to_string(per_epoch),
            " vectors per epoch");
    Produce();
  }

  void Produce() {
    if (Cancelled()) {
      EndProducer(absl::CancelledError("the client cancelled"));
      return;
    }
    if (buffer_ == nullptr) {
      buffer_ = service_->streams().buffers->Get(batch_bytes_);
    }
    const VectorDest dest{buffer_->data, buffer_->size};
    bool have_batch = false;
    if (stream_ != nullptr) {
      absl::StatusOr<bool> more = stream_->Next(dest, &batch_);
      if (!more.ok()) {
        EndProducer(more.status());
        return;
      }
      have_batch = *more;
      if (have_batch) {
        service_->metrics()->bytes_read_from_disk +=
            static_cast<uint64_t>(batch_.rows) * vector_bytes_;
      }
    } else {
      absl::StatusOr<ShuffledStream::Fill> fill =
          shuffled_->Next(dest, &batch_, [this] { Kick(/*cancel=*/false); });
      if (!fill.ok()) {
        EndProducer(fill.status());
        return;
      }
      if (*fill == ShuffledStream::Fill::kPending) {
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
      have_batch = *fill == ShuffledStream::Fill::kBatch;
    }
    if (!have_batch) {
      EndProducer(absl::OkStatus());
      return;
    }
    const size_t payload = static_cast<size_t>(batch_.rows) * vector_bytes_;
    grpc::ByteBuffer reply = BatchReply(batch_, d_model_, buffer_, payload);
    buffer_ = nullptr;  // the reply's slice owns it now
    ++batches_;
    bytes_ += reply.Length();
    Metrics* m = service_->metrics();
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
    // Leave the scan first: once the subscription is gone the scan never
    // calls our waker again (a waker running now finds the producer done).
    shuffled_.reset();
    stream_.reset();
    if (buffer_ != nullptr) {
      BufferPool::Return(buffer_);
      buffer_ = nullptr;
    }
    absl::Status status;
    {
      MutexLock lock(&mu_);
      status = absl::Status(end_code_, end_message_);
    }
    service_->metrics()->CallDone(status.code());
    final_status_ = status.ToString();
    TsanRelease(this);  // hand-off to gRPC (see common/tsan.h)
    Finish(ToGrpcStatus(status));
  }

  // A batch is one message: stay under the daemon's message limit.
  static constexpr uint64_t kMaxBatchBytes = 64ull << 20;

  const QueryService* service_;
  const std::string peer_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;                    // the batch being written
  std::unique_ptr<OrderedStream> stream_;     // ORDER_ORDERED
  std::unique_ptr<ShuffledStream> shuffled_;  // ORDER_SHUFFLED
  StreamBatch batch_;
  PooledBuffer* buffer_ = nullptr;  // the batch being assembled
  size_t batch_bytes_ = 0;
  int64_t d_model_ = 0;
  uint64_t vector_bytes_ = 0;
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

// Calls refused before any work: unknown methods, or arriving while the
// daemon drains for shutdown.
class RefusingReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit RefusingReactor(grpc::Status status) {
    Finish(status);
    // In a constructor gRPC only queues the call (the reactor is not bound
    // yet), so nothing can run on another thread before we return.
    TsanRelease(this);
  }
  void OnDone() override {
    TsanAcquire(this);
    delete this;
  }
};

}  // namespace

grpc::ServerGenericBidiReactor* QueryService::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  const bool is_stream = ctx->method() == kStreamMethod;
  if (!is_stream && ctx->method().rfind(kQueryPrefix, 0) != 0) {
    return new RefusingReactor(
        grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                     absl::StrCat("unknown method ", ctx->method())));
  }
  if (!serving_->load()) {
    metrics_->CallDone(absl::StatusCode::kUnavailable);
    return new RefusingReactor(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                            "shardcastd is shutting down"));
  }
  if (is_stream) return new StreamReactor(this, ctx);
  return new QueryReactor(this, ctx);
}

void FillDatasetInfo(const CatalogEntry& entry, v1::DatasetInfo* out) {
  // Directory names and messages may hold any bytes; proto3 strings must
  // be valid UTF-8 or the client fails to parse the reply.
  out->set_id(ValidUtf8(entry.id));
  out->set_ok(entry.status.ok());
  out->set_error(ValidUtf8(entry.status.message()));
  if (!entry.info.has_value()) return;
  const DatasetInfo& info = *entry.info;
  const DatasetDesc& d = info.desc;
  out->set_protocol(d.protocol);
  out->set_variant(std::string(VariantName(d.variant)));
  for (int64_t l : d.layers) out->add_layers(l);
  out->set_content_tokens(d.content_tokens);
  out->set_cls_token(d.cls_token);
  out->set_tokens_per_example(d.tokens_per_example);
  out->set_d_model(d.d_model);
  out->set_n_examples(d.n_examples);
  out->set_examples_per_shard(d.examples_per_shard);
  out->set_num_shards(d.num_data_shards());
  out->set_bytes(static_cast<uint64_t>(d.n_examples) * d.example_bytes());
  out->set_has_labels(info.has_labels);
  out->set_hash_matches_dir(info.hash_matches_dir);
  for (const std::string& w : d.warnings) out->add_warnings(ValidUtf8(w));
}

grpc::ServerUnaryReactor* AdminService::Done(grpc::CallbackServerContext* ctx,
                                             const absl::Status& status) {
  metrics_->calls_total++;
  metrics_->CallDone(status.code());
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::ListDatasets(
    grpc::CallbackServerContext* ctx, const v1::ListDatasetsRequest*,
    v1::ListDatasetsResponse* response) {
  for (const auto& entry : catalog_->List()) {
    FillDatasetInfo(*entry, response->add_datasets());
  }
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminService::DescribeDataset(
    grpc::CallbackServerContext* ctx, const v1::DescribeDatasetRequest* request,
    v1::DatasetInfo* response) {
  auto entry = catalog_->Find(request->dataset());
  if (!entry.ok()) return Done(ctx, entry.status());
  FillDatasetInfo(**entry, response);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminService::GetStatus(
    grpc::CallbackServerContext* ctx, const v1::GetStatusRequest*,
    v1::ServerStatus* response) {
  response->set_version("0.1.0");
  response->set_uptime_seconds(
      absl::ToDoubleSeconds(absl::Now() - metrics_->start_time));
  response->set_connected_clients(metrics_->calls_in_flight.load());
  response->set_calls_total(metrics_->calls_total.load() + 1);  // this one too
  response->set_calls_failed(metrics_->CallsFailed());
  response->set_bytes_served(metrics_->bytes_served.load());
  response->set_memory_rss_bytes(ResidentBytes());
  response->set_datasets_ok(metrics_->datasets_ok.load());
  response->set_datasets_failed(metrics_->datasets_failed.load());
  const EngineFigures e = CollectEngineFigures(streams_);
  response->set_bytes_read_from_disk(metrics_->bytes_read_from_disk.load() +
                                     e.bytes_read);
  response->set_reservoir_bytes(e.reservoir_bytes);
  response->set_reservoir_bytes_in_use(e.reservoir_bytes_in_use);
  response->set_reservoir_bytes_reserved(e.reservoir_bytes_reserved);
  response->set_blocks_read(e.blocks_read);
  response->set_bytes_delivered(metrics_->bytes_delivered.load());
  for (const ScanStatus& s : e.scans) {
    v1::ScanStatus* out = response->add_scans();
    out->set_dataset(ValidUtf8(s.dataset));
    out->set_selection(s.selection);
    out->set_blocks(s.num_blocks);
    out->set_cycle(s.cycle);
    out->set_position(s.position);
    out->set_blocks_read(s.blocks_read);
    out->set_bytes_read(s.bytes_read);
    for (const SubscriberStatus& c : s.subscribers) {
      v1::ScanClient* client = out->add_clients();
      client->set_peer(ValidUtf8(c.peer));
      client->set_rank(c.rank);
      client->set_world_size(c.world_size);
      client->set_epoch(c.epoch);
      client->set_lag_blocks(c.queued);
      client->set_blocks_needed(c.blocks_needed);
      client->set_blocks_delivered(c.blocks_delivered);
      client->set_blocks_skipped(c.blocks_skipped);
      client->set_bytes_delivered(c.bytes_delivered);
    }
  }
  return Done(ctx, absl::OkStatus());
}

EngineFigures CollectEngineFigures(const StreamServices& streams) {
  EngineFigures e;
  if (streams.scans == nullptr) return e;
  const Reservoir& r = *streams.scans->reservoir();
  e.reservoir_bytes = r.bytes();
  e.reservoir_bytes_in_use =
      static_cast<uint64_t>(r.slots_in_use()) * r.slot_bytes();
  e.reservoir_bytes_reserved =
      static_cast<uint64_t>(r.slots_reserved()) * r.slot_bytes();
  e.blocks_read = streams.scans->engine()->blocks_read();
  e.bytes_read = streams.scans->engine()->bytes_read();
  e.scans = streams.scans->Status();
  return e;
}

}  // namespace shardcast
