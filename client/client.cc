#include "shardcast/client.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <type_traits>
#include <utility>

#include "absl/base/config.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/local_queries_internal.h"
#include "client/message_json_internal.h"
#include "client/shared_memory_internal.h"
#include "client/vectors_path_internal.h"
#include "common/base/file.h"
#include "common/base/log.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

#ifndef ABSL_IS_LITTLE_ENDIAN
#error "shardcast's client views little-endian wire payloads in place"
#endif

namespace shardcast {
namespace {

constexpr int kMaxMessageBytes = 80 << 20;

// A view of a little-endian `bytes` field as T values. Protobuf keeps a bytes
// field in a std::string of its own (heap buffer, or the inline buffer of the
// 8-aligned string object), so the data is aligned for every T used here.
template <typename T>
absl::Span<const T> View(const std::string& bytes) {
  return absl::Span<const T>(reinterpret_cast<const T*>(bytes.data()),
                             bytes.size() / sizeof(T));
}

DatasetDescription FromProto(const v1::DatasetInfo& d) {
  DatasetDescription out;
  out.id = d.id();
  out.ok = d.ok();
  out.error = d.error();
  out.protocol = d.protocol();
  out.variant = d.variant();
  out.layers.assign(d.layers().begin(), d.layers().end());
  out.content_tokens = d.content_tokens();
  out.cls_token = d.cls_token();
  out.tokens_per_example = d.tokens_per_example();
  out.d_model = d.d_model();
  out.n_examples = d.n_examples();
  out.examples_per_shard = d.examples_per_shard();
  out.num_shards = d.num_shards();
  out.bytes = d.bytes();
  out.has_labels = d.has_labels();
  out.hash_matches_dir = d.hash_matches_dir();
  out.has_example_info = d.has_example_info();
  out.has_stats = d.has_stats();
  out.warnings.assign(d.warnings().begin(), d.warnings().end());
  return out;
}

DaemonStatus::Scan::Client FromProto(const v1::ScanClient& c) {
  DaemonStatus::Scan::Client out;
  out.client = c.client();
  out.peer = c.peer();
  out.rank = c.rank();
  out.world_size = c.world_size();
  out.epoch = c.epoch();
  out.lag_blocks = c.lag_blocks();
  out.blocks_needed = c.blocks_needed();
  out.blocks_delivered = c.blocks_delivered();
  out.blocks_skipped = c.blocks_skipped();
  out.bytes_delivered = c.bytes_delivered();
  return out;
}

DaemonStatus::Scan FromProto(const v1::ScanStatus& s) {
  DaemonStatus::Scan out;
  out.dataset = s.dataset();
  out.selection = s.selection();
  out.io = s.io();
  out.blocks = s.blocks();
  out.cycle = s.cycle();
  out.position = s.position();
  out.blocks_read = s.blocks_read();
  out.bytes_read = s.bytes_read();
  for (const v1::ScanClient& c : s.clients()) {
    out.clients.push_back(FromProto(c));
  }
  return out;
}

DaemonStatus FromProto(const v1::ServerStatus& s) {
  DaemonStatus out;
  out.version = s.version();
  out.uptime_seconds = s.uptime_seconds();
  out.node_rank = s.node_rank();
  out.node_count = std::max<int64_t>(1, s.node_count());
  out.query_threads = s.query_threads();
  out.connected_clients = s.connected_clients();
  out.calls_total = s.calls_total();
  out.calls_failed = s.calls_failed();
  out.bytes_served = s.bytes_served();
  out.bytes_read_from_disk = s.bytes_read_from_disk();
  out.device_read_bytes = s.device_read_bytes();
  out.memory_rss_bytes = s.memory_rss_bytes();
  out.memory_rss_anon_bytes = s.memory_rss_anon_bytes();
  out.memory_rss_file_bytes = s.memory_rss_file_bytes();
  out.memory_rss_shmem_bytes = s.memory_rss_shmem_bytes();
  out.datasets_ok = s.datasets_ok();
  out.datasets_failed = s.datasets_failed();
  out.reservoir_bytes = s.reservoir_bytes();
  out.reservoir_bytes_in_use = s.reservoir_bytes_in_use();
  out.reservoir_bytes_reserved = s.reservoir_bytes_reserved();
  out.reservoir_bytes_touched = s.reservoir_bytes_touched();
  out.blocks_read = s.blocks_read();
  out.bytes_delivered = s.bytes_delivered();
  for (const v1::ScanStatus& scan : s.scans()) {
    out.scans.push_back(FromProto(scan));
  }
  out.shm_regions = s.shm_regions();
  out.shm_bytes = s.shm_bytes();
  out.shm_streams = s.shm_streams();
  for (const v1::ClientStream& c : s.streams()) {
    DaemonStatus::Stream st;
    st.client = c.client();
    st.peer = c.peer();
    st.dataset = c.dataset();
    st.order = c.order();
    st.transport = c.transport();
    st.rank = c.rank();
    st.world_size = c.world_size();
    st.seconds = c.seconds();
    st.batches = c.batches();
    st.bytes = c.bytes();
    out.streams.push_back(std::move(st));
  }
  for (const v1::Figure& f : s.figures()) {
    DaemonStatus::Figure figure;
    figure.name = f.name();
    figure.kind = f.kind();
    figure.unit = f.unit();
    figure.help = f.help();
    figure.label_names.assign(f.label_names().begin(), f.label_names().end());
    for (const v1::FigureSample& sample : f.samples()) {
      figure.samples.push_back(
          {{sample.labels().begin(), sample.labels().end()}, sample.value()});
    }
    out.figures.push_back(std::move(figure));
  }
  return out;
}

v1::StreamRequest ToProto(const StreamRequest& r) {
  v1::StreamRequest out;
  out.set_dataset(r.dataset);
  if (r.layer.has_value()) out.set_layer(*r.layer);
  switch (r.tokens) {
    case StreamRequest::Tokens::kContent:
      out.set_tokens(v1::TOKENS_CONTENT);
      break;
    case StreamRequest::Tokens::kSpecial:
      out.set_tokens(v1::TOKENS_SPECIAL);
      break;
    case StreamRequest::Tokens::kAll:
      out.set_tokens(v1::TOKENS_ALL);
      break;
  }
  out.set_order(r.order == StreamRequest::Order::kOrdered ? v1::ORDER_ORDERED
                                                          : v1::ORDER_SHUFFLED);
  out.set_batch_size(r.batch_size);
  out.set_seed(r.seed);
  out.set_epochs(r.epochs);
  out.set_rank(r.rank);
  out.set_world_size(r.world_size);
  out.set_node_rank(r.node_rank);
  out.set_node_count(r.node_count);
  out.set_drop_last(r.drop_last);
  for (uint32_t l : r.exclude_labels) out.add_exclude_labels(l);
  out.set_resume_token(r.resume_token);
  out.set_scale_norm(r.scale_norm);
  out.set_center(r.center);
  out.set_dtype(static_cast<v1::DType>(r.dtype));
  return out;
}

// Bytes per element of a batch's vectors; 0 for a dtype this client does
// not know.
int64_t ElementBytes(const v1::Batch& b) {
  switch (b.dtype()) {
    case v1::DTYPE_FLOAT32:
      return 4;
    case v1::DTYPE_BFLOAT16:
    case v1::DTYPE_FLOAT16:
      return 2;
    default:
      return 0;
  }
}

// Whether `column` holds `rows` entries of `width` bytes.
bool HoldsRows(const std::string& column, int64_t rows, int64_t width) {
  return rows >= 0 && column.size() % static_cast<uint64_t>(width) == 0 &&
         column.size() / static_cast<uint64_t>(width) ==
             static_cast<uint64_t>(rows);
}

// OK when every column of `b` has the size its rows and d_model call for
// (the optional layer and labels columns may be empty) and, with a `region`
// (shared memory), when its slot exists and holds its vectors; DATA_LOSS
// naming the batch (`number` in the stream, 1-based) and the sizes
// otherwise.
absl::Status CheckBatch(const v1::Batch& b, int64_t number,
                        const internal_client::ClientRegion* region = nullptr) {
  const int64_t rows = b.rows();
  const int64_t d_model = b.d_model();
  const int64_t element = ElementBytes(b);
  bool vectors_ok;
  if (element == 0) {
    vectors_ok = false;
  } else if (region != nullptr) {
    vectors_ok = b.has_slot() && b.slot() < region->slots() &&
                 b.vectors().empty() && rows >= 0 && d_model >= 0 &&
                 (d_model == 0 || static_cast<uint64_t>(rows) <=
                                      region->slot_bytes() /
                                          static_cast<uint64_t>(element) /
                                          static_cast<uint64_t>(d_model));
  } else {
    vectors_ok = d_model == 0
                     ? rows >= 0 && b.vectors().empty()
                     : d_model > 0 && d_model <= INT64_MAX / 4 &&
                           HoldsRows(b.vectors(), rows, d_model * element);
  }
  const bool layer_ok = b.layer().empty() || HoldsRows(b.layer(), rows, 8);
  const bool labels_ok = b.labels().empty() || HoldsRows(b.labels(), rows, 1);
  if (vectors_ok && HoldsRows(b.example_idx(), rows, 8) &&
      HoldsRows(b.token_idx(), rows, 4) && layer_ok && labels_ok) {
    return absl::OkStatus();
  }
  std::string message = absl::StrCat(
      "batch ", number, " (epoch ", b.epoch(), ", index ", b.index(),
      ") is malformed: ", rows, " rows, d_model ", d_model, ", dtype ",
      static_cast<int>(b.dtype()), ", ", b.vectors().size(), " vector bytes, ",
      b.example_idx().size(), " example_idx bytes, ", b.token_idx().size(),
      " token_idx bytes");
  if (region != nullptr) {
    absl::StrAppend(
        &message, ", slot ", b.has_slot() ? absl::StrCat(b.slot()) : "none",
        " of ", region->slots(), " slots of ", region->slot_bytes(), " bytes");
  }
  if (!layer_ok)
    absl::StrAppend(&message, ", ", b.layer().size(), " layer bytes");
  if (!labels_ok) {
    absl::StrAppend(&message, ", ", b.labels().size(), " labels bytes");
  }
  return absl::DataLossError(message);
}

}  // namespace

// Batch.

namespace internal_client {

// What the batches of a shared-memory stream share: the region (kept mapped
// while any batch views it) and the slots batches let go of, which the
// stream returns to the daemon with its next read. Thread-safe.
struct SlotLedger {
  explicit SlotLedger(std::shared_ptr<const ClientRegion> r)
      : region(std::move(r)) {}
  void Return(uint32_t slot) ABSL_LOCKS_EXCLUDED(mu) {
    MutexLock lock(&mu);
    returned.push_back(slot);
  }
  std::vector<uint32_t> TakeReturned() ABSL_LOCKS_EXCLUDED(mu) {
    MutexLock lock(&mu);
    return std::move(returned);
  }
  const std::shared_ptr<const ClientRegion> region;
  Mutex mu;
  std::vector<uint32_t> returned ABSL_GUARDED_BY(mu);
};

}  // namespace internal_client

struct Batch::Rep {
  v1::Batch message;
  // Shared-memory batches: the vectors are in `slot` of the ledger's region.
  std::shared_ptr<internal_client::SlotLedger> ledger;
  int64_t slot = -1;

  ~Rep() { LetGoOfSlot(); }
  // The slot goes back to the daemon (with the stream's next read).
  void LetGoOfSlot() {
    if (slot >= 0) ledger->Return(static_cast<uint32_t>(slot));
    slot = -1;
    ledger.reset();
  }
};

namespace internal_client {

// The library's way into a Batch's message.
class BatchAccess {
 public:
  // The message `batch` holds, created when it has none.
  static v1::Batch* Message(Batch* batch) {
    if (batch->rep_ == nullptr) batch->rep_ = std::make_unique<Batch::Rep>();
    return &batch->rep_->message;
  }
  // Lets go of the slot `batch` viewed, if any.
  static void LetGoOfSlot(Batch* batch) {
    if (batch->rep_ != nullptr) batch->rep_->LetGoOfSlot();
  }
  // Makes `batch`'s vectors the `slot` of the ledger's region.
  static void ViewSlot(Batch* batch,
                       std::shared_ptr<internal_client::SlotLedger> ledger,
                       uint32_t slot) {
    batch->rep_->ledger = std::move(ledger);
    batch->rep_->slot = slot;
  }
  // The message `batch` holds; the (empty) default message when it has none.
  static const v1::Batch& Message(const Batch& batch) {
    return batch.rep_ != nullptr ? batch.rep_->message
                                 : v1::Batch::default_instance();
  }
};

}  // namespace internal_client

using internal_client::BatchAccess;

Batch::Batch() = default;
Batch::~Batch() = default;
Batch::Batch(Batch&& other) noexcept = default;
Batch& Batch::operator=(Batch&& other) noexcept = default;

int64_t Batch::epoch() const { return BatchAccess::Message(*this).epoch(); }
int64_t Batch::index() const { return BatchAccess::Message(*this).index(); }
int64_t Batch::rows() const { return BatchAccess::Message(*this).rows(); }
int64_t Batch::d_model() const { return BatchAccess::Message(*this).d_model(); }
absl::Span<const char> Batch::vector_bytes() const {
  const v1::Batch& m = BatchAccess::Message(*this);
  if (rep_ != nullptr && rep_->slot >= 0) {
    return absl::Span<const char>(
        rep_->ledger->region->slot_data(static_cast<uint32_t>(rep_->slot)),
        static_cast<size_t>(m.rows() * m.d_model() * ElementBytes(m)));
  }
  return absl::Span<const char>(m.vectors().data(), m.vectors().size());
}
absl::Span<const float> Batch::vectors() const {
  if (dtype() != StreamRequest::DType::kFloat32) return {};
  const absl::Span<const char> bytes = vector_bytes();
  return absl::Span<const float>(reinterpret_cast<const float*>(bytes.data()),
                                 bytes.size() / 4);
}
absl::Span<const uint16_t> Batch::vectors16() const {
  if (dtype() == StreamRequest::DType::kFloat32) return {};
  const absl::Span<const char> bytes = vector_bytes();
  return absl::Span<const uint16_t>(
      reinterpret_cast<const uint16_t*>(bytes.data()), bytes.size() / 2);
}
StreamRequest::DType Batch::dtype() const {
  return static_cast<StreamRequest::DType>(BatchAccess::Message(*this).dtype());
}
const std::string& Batch::transform() const {
  return BatchAccess::Message(*this).transform();
}
absl::Span<const int64_t> Batch::example_idx() const {
  return View<int64_t>(BatchAccess::Message(*this).example_idx());
}
absl::Span<const int32_t> Batch::token_idx() const {
  return View<int32_t>(BatchAccess::Message(*this).token_idx());
}
absl::Span<const int64_t> Batch::layer() const {
  return View<int64_t>(BatchAccess::Message(*this).layer());
}
absl::Span<const uint8_t> Batch::labels() const {
  return View<uint8_t>(BatchAccess::Message(*this).labels());
}
const std::string& Batch::resume_token() const {
  return BatchAccess::Message(*this).resume_token();
}

// Client.

struct Client::Impl {
  Impl(std::shared_ptr<grpc::Channel> c, std::string a, ClientOptions o)
      : address(std::move(a)),
        options(std::move(o)),
        channel(std::move(c)),
        admin(v1::Admin::NewStub(channel)),
        query(v1::Query::NewStub(channel)),
        stream(v1::Stream::NewStub(channel)) {}

  const std::string address;
  const ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Admin::Stub> admin;
  std::unique_ptr<v1::Query::Stub> query;
  std::unique_ptr<v1::Stream::Stub> stream;
  // GetVectors' one road, chosen at Connect (vectors_path_internal.h).
  std::unique_ptr<internal_client::VectorsPath> vectors;
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

namespace {

// A Stream call (batches in messages), or a SharedStream call when it has a
// ledger (batches in the ledger's region): `Call` is the sync API's reader
// or reader-writer.
template <typename Call>
class RpcBatchStream final : public BatchStream {
 public:
  using Opener = std::function<std::unique_ptr<Call>(grpc::ClientContext*)>;
  RpcBatchStream(const Opener& open,
                 std::shared_ptr<internal_client::SlotLedger> ledger)
      : call_(open(&ctx_)), ledger_(std::move(ledger)) {}

  ~RpcBatchStream() override {
    if (!finished_) Finish().IgnoreError();
  }

  bool Next(Batch* batch) override {
    BatchAccess::LetGoOfSlot(batch);
    if (ended_) return false;
    ReturnSlots();
    v1::Batch* message = BatchAccess::Message(batch);
    if (!call_->Read(message)) {
      ended_ = true;
      return false;
    }
    malformed_ =
        CheckBatch(*message, ++batches_,
                   ledger_ != nullptr ? ledger_->region.get() : nullptr);
    if (malformed_.ok()) {
      if (ledger_ != nullptr) {
        BatchAccess::ViewSlot(batch, ledger_, message->slot());
      }
      return true;
    }
    message->Clear();
    Stop();
    return false;
  }

  absl::Status Finish() override {
    if (!finished_) {
      if (!ended_) Stop();
      if constexpr (kShared) call_->WritesDone();
      final_ = FromGrpcStatus(call_->Finish());
      // The daemon may free the region; batches still view their slots.
      if (ledger_ != nullptr) ledger_->region->Disconnect();
      if (!malformed_.ok()) final_ = malformed_;
      finished_ = true;
    }
    return final_;
  }

  void Cancel() override { ctx_.TryCancel(); }
  bool shared_memory() const override { return ledger_ != nullptr; }

 private:
  static constexpr bool kShared = std::is_same_v<
      Call, grpc::ClientReaderWriter<v1::SharedStreamMessage, v1::Batch>>;

  // Gives the daemon back the slots batches let go of (shared memory).
  void ReturnSlots() {
    if constexpr (kShared) {
      std::vector<uint32_t> slots = ledger_->TakeReturned();
      if (slots.empty()) return;
      v1::SharedStreamMessage m;
      for (uint32_t s : slots) m.add_release(s);
      call_->Write(m);  // a failure shows as the stream's end
    }
  }

  // Cancels the call and reads what is still in flight, as gRPC wants before
  // Finish.
  void Stop() {
    ctx_.TryCancel();
    v1::Batch discard;
    while (call_->Read(&discard)) {
    }
    ended_ = true;
  }

  grpc::ClientContext ctx_;
  std::unique_ptr<Call> call_;
  const std::shared_ptr<internal_client::SlotLedger> ledger_;
  int64_t batches_ = 0;    // received so far, for error messages
  bool ended_ = false;     // Read returned false
  bool finished_ = false;  // call_->Finish was called; final_ holds it
  absl::Status malformed_;
  absl::Status final_;
};

// A stream that failed before its call began.
class FailedBatchStream final : public BatchStream {
 public:
  explicit FailedBatchStream(absl::Status status)
      : status_(std::move(status)) {}
  bool Next(Batch* batch) override {
    BatchAccess::LetGoOfSlot(batch);
    return false;
  }
  absl::Status Finish() override { return status_; }
  void Cancel() override {}
  bool shared_memory() const override { return false; }

 private:
  const absl::Status status_;
};

}  // namespace

std::unique_ptr<BatchStream> Client::OpenStream(const StreamRequest& request) {
  v1::StreamRequest proto = ToProto(request);
  v1::Stream::Stub* stub = impl_->stream.get();
  const std::string socket = internal_client::LocalChannelPath(impl_->address);
  struct stat st;
  // Shared memory when the daemon offers it (its channel exists and hands
  // out batch regions); a bad batch size gets the daemon's own error on the
  // message path.
  absl::StatusOr<std::shared_ptr<const internal_client::ClientRegion>> region =
      absl::UnimplementedError("no shared memory");
  if (impl_->options.shared_memory && !socket.empty() &&
      ::stat(socket.c_str(), &st) == 0 && request.batch_size > 0) {
    absl::StatusOr<DatasetDescription> d = DescribeDataset(request.dataset);
    if (!d.ok()) return std::make_unique<FailedBatchStream>(d.status());
    const uint64_t vector_bytes =
        static_cast<uint64_t>(d->d_model) *
        (request.dtype == StreamRequest::DType::kFloat32 ? 4 : 2);
    const int slots = std::clamp(impl_->options.shared_memory_slots, 2, 16);
    region =
        vector_bytes == 0 || static_cast<uint64_t>(request.batch_size) >
                                 (uint64_t{1} << 40) / vector_bytes
            ? absl::InvalidArgumentError(
                  absl::StrCat("batch_size ", request.batch_size, " x d_model ",
                               d->d_model, " is too large"))
            : internal_client::ClientRegion::Open(
                  socket, static_cast<uint32_t>(slots),
                  static_cast<uint64_t>(request.batch_size) * vector_bytes);
    // Refused (UNIMPLEMENTED: the daemon's shared memory is off; a
    // per-user cap; the channel busy) or reset: the batches come in gRPC
    // messages, said once per process. A request the daemon refuses
    // altogether is refused on that path too, with its reason.
    if (!region.ok() && !absl::IsUnimplemented(region.status())) {
      static std::atomic<bool> said{false};
      if (!said.exchange(true)) {
        LogInfo("shardcast: shared memory is not available (",
                region.status().ToString(),
                "); this process's streams get their batches in gRPC "
                "messages");
      }
    }
  }
  if (region.ok()) {
    auto ledger = std::make_shared<internal_client::SlotLedger>(*region);
    using Call = grpc::ClientReaderWriter<v1::SharedStreamMessage, v1::Batch>;
    const std::string token = (*region)->token();
    return std::make_unique<RpcBatchStream<Call>>(
        [&](grpc::ClientContext* ctx) {
          std::unique_ptr<Call> call = stub->SharedStream(ctx);
          v1::SharedStreamMessage first;
          *first.mutable_request() = proto;
          first.set_region(token);
          call->Write(first);  // a failure shows as the stream's end
          return call;
        },
        std::move(ledger));
  }
  return std::make_unique<RpcBatchStream<grpc::ClientReader<v1::Batch>>>(
      [&](grpc::ClientContext* ctx) { return stub->Stream(ctx, proto); },
      nullptr);
}

std::string Client::DefaultAddress() {
  const char* v = std::getenv(kAddressVariable);
  return v == nullptr ? std::string() : std::string(v);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const std::string& given_address, const ClientOptions& options) {
  const std::string address =
      given_address.empty() ? DefaultAddress() : given_address;
  if (address.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no daemon address: give one (unix:/path/to.sock or host:port) or "
        "set ",
        kAddressVariable));
  }
  std::shared_ptr<grpc::ChannelCredentials> creds;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  if (!absl::StartsWith(address, "unix:") && !options.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFileToString(options.tls_ca_file));
    if (!options.tls_cert_file.empty()) {
      ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                       ReadFileToString(options.tls_cert_file));
      ASSIGN_OR_RETURN(ssl.pem_private_key,
                       ReadFileToString(options.tls_key_file));
    }
    creds = grpc::SslCredentials(ssl);
    if (!options.tls_server_name.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name);
    }
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  auto channel = grpc::CreateCustomChannel(address, creds, args);
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::seconds(options.connect_timeout_seconds);
  if (!channel->WaitForConnected(deadline)) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to shardcastd at ", address, " within ",
                     options.connect_timeout_seconds,
                     " s (is it running? right address/TLS?)"));
  }
  auto impl = std::make_unique<Impl>(std::move(channel), address, options);
  impl->vectors = internal_client::NewSessionPath(
      impl->query.get(), options.query_calls_in_flight);
  const std::string local = internal_client::LocalChannelPath(address);
  if (options.local_queries && !local.empty()) {
    // Null when the daemon serves no queries on a local channel.
    std::unique_ptr<internal_client::LocalQueries> queries =
        internal_client::LocalQueries::Open(
            local, options.connect_timeout_seconds, options.local_direct_reads);
    if (queries != nullptr) {
      impl->vectors = internal_client::NewLocalPath(std::move(queries),
                                                    std::move(impl->vectors));
    }
  }
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<std::vector<DatasetDescription>> Client::ListDatasets() {
  grpc::ClientContext ctx;
  v1::ListDatasetsRequest req;
  v1::ListDatasetsResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->admin->ListDatasets(&ctx, req, &resp)));
  std::vector<DatasetDescription> out;
  out.reserve(static_cast<size_t>(resp.datasets_size()));
  for (const v1::DatasetInfo& d : resp.datasets()) out.push_back(FromProto(d));
  return out;
}

absl::StatusOr<DatasetDescription> Client::DescribeDataset(
    const std::string& dataset) {
  grpc::ClientContext ctx;
  v1::DescribeDatasetRequest req;
  req.set_dataset(dataset);
  v1::DatasetInfo resp;
  RETURN_IF_ERROR(
      FromGrpcStatus(impl_->admin->DescribeDataset(&ctx, req, &resp)));
  return FromProto(resp);
}

absl::StatusOr<DatasetDescription> Client::AttachDataset(
    const std::string& path) {
  const std::string channel = internal_client::LocalChannelPath(impl_->address);
  if (channel.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        path,
        ": datasets are named by path only on the daemon's node (a "
        "unix: address); name a catalog dataset by its id over TCP"));
  }
  ASSIGN_OR_RETURN(std::string id,
                   internal_client::AttachDataset(
                       channel, path, impl_->options.connect_timeout_seconds));
  return DescribeDataset(id);
}

absl::StatusOr<DaemonStatus> Client::GetStatus() {
  grpc::ClientContext ctx;
  v1::GetStatusRequest req;
  v1::ServerStatus resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->admin->GetStatus(&ctx, req, &resp)));
  return FromProto(resp);
}

absl::StatusOr<std::string> Client::GetStatusJson() {
  grpc::ClientContext ctx;
  v1::GetStatusRequest req;
  v1::ServerStatus resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->admin->GetStatus(&ctx, req, &resp)));
  return internal_client::MessageJson(resp);
}

absl::StatusOr<Client::SweepCheck> Client::CheckSweep() {
  grpc::ClientContext ctx;  // the daemon asks its peers within 5 s
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::CheckSweepRequest req;
  v1::CheckSweepResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->admin->CheckSweep(&ctx, req, &resp)));
  SweepCheck out;
  out.node = resp.node();
  out.datasets = resp.datasets();
  for (const v1::SweepPeerCheck& p : resp.peers()) {
    out.peers.push_back({p.node(),
                         p.address(),
                         {p.problems().begin(), p.problems().end()},
                         p.unreachable()});
  }
  return out;
}

absl::StatusOr<Client::Health> Client::CheckHealth(double timeout_seconds) {
  grpc::health::v1::Health::Stub stub(impl_->channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::microseconds(static_cast<int64_t>(timeout_seconds * 1e6)));
  grpc::health::v1::HealthCheckRequest request;  // "": the whole server
  grpc::health::v1::HealthCheckResponse reply;
  RETURN_IF_ERROR(FromGrpcStatus(stub.Check(&ctx, request, &reply)));
  switch (reply.status()) {
    case grpc::health::v1::HealthCheckResponse::SERVING:
      return Health::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING:
      return Health::kNotServing;
    default:
      return Health::kUnknown;
  }
}

absl::StatusOr<VectorBlock> Client::GetVectors(
    const std::string& dataset, const std::vector<VectorCoord>& coords) {
  return impl_->vectors->GetVectors(dataset, coords);
}

absl::StatusOr<VectorBlock> Client::GetExample(const std::string& dataset,
                                               int64_t example,
                                               std::optional<int64_t> layer) {
  grpc::ClientContext ctx;
  v1::GetExampleRequest req;
  req.set_dataset(dataset);
  req.set_example(example);
  if (layer.has_value()) req.set_layer(*layer);
  auto resp = std::make_shared<v1::Vectors>();
  RETURN_IF_ERROR(
      FromGrpcStatus(impl_->query->GetExample(&ctx, req, resp.get())));
  return internal_client::ToBlock(std::move(resp));
}

absl::StatusOr<std::string> Client::GetLabels(const std::string& dataset,
                                              int64_t example) {
  grpc::ClientContext ctx;
  v1::GetLabelsRequest req;
  req.set_dataset(dataset);
  req.set_example(example);
  v1::Labels resp;
  RETURN_IF_ERROR(FromGrpcStatus(impl_->query->GetLabels(&ctx, req, &resp)));
  return std::move(*resp.mutable_labels());
}

absl::StatusOr<std::string> Client::GetExampleInfo(const std::string& dataset,
                                                   int64_t example) {
  grpc::ClientContext ctx;
  v1::GetExampleInfoRequest req;
  req.set_dataset(dataset);
  req.set_example(example);
  v1::ExampleInfo resp;
  RETURN_IF_ERROR(
      FromGrpcStatus(impl_->query->GetExampleInfo(&ctx, req, &resp)));
  return std::move(*resp.mutable_json());
}

}  // namespace shardcast
