// C++ client library for shardcastd.
//
// The public API is plain C++ (Abseil types, no protobuf or gRPC): the wire
// messages of proto/shardcast/v1/shardcast.proto stay inside client.cc.
// Vector payloads are not copied out of the received replies: VectorBlock and
// Batch hand out views of them together with what keeps them alive.
//
// The payloads are little-endian on the wire and are viewed in place, so the
// library builds for little-endian hosts only.
#ifndef SHARDCAST_CLIENT_INCLUDE_SHARDCAST_CLIENT_H_
#define SHARDCAST_CLIENT_INCLUDE_SHARDCAST_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardcast {

/// How to reach the daemon. TLS applies to TCP addresses only.
struct ClientOptions {
  std::string tls_ca_file;    // PEM roots to verify the server (enables TLS)
  std::string tls_cert_file;  // client certificate for mutual TLS
  std::string tls_key_file;
  std::string tls_server_name;  // override the name checked in the cert
  int connect_timeout_seconds = 5;
  /// On a Unix socket, streams get their batches in shared memory (the
  /// daemon writes each batch's vectors straight into a slot that this
  /// process maps; docs/local-clients.md, "Shared memory") when the daemon
  /// offers it. False: always in gRPC messages.
  bool shared_memory = true;
  /// Slots of a stream's region: how many batches the daemon may have ready
  /// for this client, the one it reads included (2 to 16).
  int shared_memory_slots = 4;
  /// GetVectors takes one road, chosen at Connect (docs/architecture.md,
  /// "Query roads"): the daemon's local channel when the address is its
  /// Unix socket and it serves queries there (local_queries), else messages
  /// on one long-lived VectorsSession call the daemon answers by id.
  ///
  /// Session requests this process's threads may have running at once.
  /// A request that finds this many running waits for one to finish and
  /// goes out together with the requests that queued meanwhile, as one
  /// request (each caller still gets exactly its own rows, or its own
  /// error). A thread calling alone is never delayed. With 16 threads it
  /// took 1.5 x the calls/s of one request each (tests/bench/results/
  /// HISTORY.md, "Two roads for a query"). 0: one request each.
  int query_calls_in_flight = 4;
  /// On a Unix socket, GetVectors goes through the daemon's local channel
  /// when it serves queries there (docs/local-clients.md, "Local queries"):
  /// one small message each way per call, the vectors read by the daemon
  /// straight into memory this process shares with it, and no gRPC on
  /// either side. Each thread calling at once has a connection of its own,
  /// so their calls are in flight together. False: the session.
  bool local_queries = true;
  /// With local_queries: a GetVectors of one vector is read by this
  /// process itself, with pread on a read-only descriptor of the dataset's
  /// file that the daemon hands over (with the dataset's layout, asked
  /// again each second), when the daemon offers it: one wake-up per read
  /// instead of the daemon's and then this thread's. Coordinates the
  /// layout does not hold, and any failed read, go to the daemon, which
  /// says why. False: the daemon reads every vector.
  bool local_direct_reads = true;
};

/// One vector/coordinate request.
struct VectorCoord {
  int64_t example = 0;
  int64_t layer = 0;  // layer value as recorded (may be negative)
  int64_t token = 0;  // token axis index in [0, T)
};

/// Float32 values and their shape, C order. `values` is a view of the
/// received reply, which `storage` keeps alive: the payload is not copied.
/// Copying a VectorBlock shares the storage (the values stay valid while any
/// copy lives); the values are read-only. A default-constructed block is
/// empty.
struct VectorBlock {
  std::vector<int64_t> shape;
  absl::Span<const float> values;  // product(shape) floats
  std::shared_ptr<const void> storage;
};

/// A dataset as the daemon describes it (Admin.DescribeDataset); plain data
/// mirroring shardcast.v1.DatasetInfo field for field.
struct DatasetDescription {
  std::string id;   // directory name (the content hash)
  bool ok = false;  // false: rejected at load, see `error`
  std::string error;
  std::string protocol;  // as written in metadata.json
  std::string variant;   // "1.0.0", "2.1" or "2.1-saev"
  std::vector<int64_t> layers;
  int64_t content_tokens = 0;
  bool cls_token = false;
  int64_t tokens_per_example = 0;
  int64_t d_model = 0;
  int64_t n_examples = 0;
  int64_t examples_per_shard = 0;
  int64_t num_shards = 0;
  uint64_t bytes = 0;  // float32 payload bytes in the dataset
  bool has_labels = false;
  bool hash_matches_dir = false;
  bool has_example_info = false;  // samples.json: GetExampleInfo answers
  bool has_stats = false;         // shardcast_stats.json
  std::vector<std::string> warnings;
};

/// The daemon's counters (Admin.GetStatus); plain data mirroring
/// shardcast.v1.ServerStatus field for field.
struct DaemonStatus {
  /// One shared scan: a disk pass over a dataset selection feeding every
  /// shuffled stream of that selection (shardcast.v1.ScanStatus).
  struct Scan {
    /// One stream fed by the scan (shardcast.v1.ScanClient).
    struct Client {
      std::string client;  // the stream's id (Stream::client)
      std::string peer;
      int64_t rank = 0;
      int64_t world_size = 0;
      int64_t epoch = 0;          // epoch the scan is feeding it
      int64_t lag_blocks = 0;     // blocks delivered to it, not yet taken
      int64_t blocks_needed = 0;  // blocks still to come in that epoch
      uint64_t blocks_delivered = 0;
      uint64_t blocks_skipped = 0;   // deferred to a later cycle (lag bound)
      uint64_t bytes_delivered = 0;  // vector bytes sent to it
    };
    std::string dataset;
    std::string selection;  // e.g. "layer 12, content tokens"
    std::string io;         // "direct", "buffered" or "buffered-random"
    int64_t blocks = 0;     // blocks in the selection
    int64_t cycle = 0;      // permutation cycle the scan is in
    int64_t position = 0;   // position in the cycle
    uint64_t blocks_read = 0;
    uint64_t bytes_read = 0;  // from disk, by this scan
    std::vector<Client> clients;
  };
  std::string version;
  double uptime_seconds = 0;
  int64_t node_rank = 0;  // node group of streams that name none
  int64_t node_count = 1;
  int64_t query_threads = 0;      // the daemon's worker threads
  int64_t connected_clients = 0;  // calls in flight
  uint64_t calls_total = 0;
  uint64_t calls_failed = 0;
  uint64_t bytes_served = 0;          // payload bytes sent to clients
  uint64_t bytes_read_from_disk = 0;  // what the daemon asked the kernel for
  uint64_t device_read_bytes = 0;     // what the disks read (/proc/self/io)
  uint64_t memory_rss_bytes = 0;
  // By kind (they add up to memory_rss_bytes): the daemon's own memory,
  // mapped files (shard pages, the program), local clients' regions.
  uint64_t memory_rss_anon_bytes = 0;
  uint64_t memory_rss_file_bytes = 0;
  uint64_t memory_rss_shmem_bytes = 0;
  int64_t datasets_ok = 0;
  int64_t datasets_failed = 0;
  uint64_t reservoir_bytes = 0;           // --reservoir-bytes (whole blocks)
  uint64_t reservoir_bytes_in_use = 0;    // blocks held by scans and clients
  uint64_t reservoir_bytes_reserved = 0;  // reserved by shuffled streams
  uint64_t reservoir_bytes_touched = 0;   // pages in memory (--prefault)
  uint64_t blocks_read = 0;               // by the shared scans
  uint64_t bytes_delivered = 0;           // vector bytes in stream batches
  std::vector<Scan> scans;                // active shared scans
  int64_t shm_regions = 0;  // shared-memory regions mapped for local clients
  uint64_t shm_bytes = 0;   // their size (leased from the reservoir)
  int64_t shm_streams = 0;  // streams writing batches into one
  /// One stream being served (shardcast.v1.ClientStream).
  struct Stream {
    std::string client;  // id in the daemon's logs and /metrics ("s7")
    std::string peer;
    std::string dataset;
    std::string order;      // "shuffled" or "ordered"
    std::string transport;  // "shm" or "grpc"
    int64_t rank = 0;
    int64_t world_size = 1;
    double seconds = 0;  // since it opened
    uint64_t batches = 0;
    uint64_t bytes = 0;  // vector bytes sent
  };
  std::vector<Stream> streams;
  /// Every figure the daemon exports, as its /metrics page has them
  /// (shardcast.v1.Figure); empty from a daemon before 0.1.0's figures.
  struct Figure {
    struct Sample {
      std::vector<std::string> labels;  // values, in label_names' order
      double value = 0;
    };
    std::string name;  // the Prometheus name
    std::string kind;  // "counter" or "gauge"
    std::string unit;  // "bytes", "seconds" or "" (a count)
    std::string help;
    std::vector<std::string> label_names;
    std::vector<Sample> samples;
  };
  std::vector<Figure> figures;
};

/// What to stream (Stream.Stream); mirrors shardcast.v1.StreamRequest. The
/// selection, order and partition rules are those of shardcast.proto.
struct StreamRequest {
  /// Which tokens of each (example, layer) are selected.
  enum class Tokens {
    kContent,  // patch/content tokens (not CLS)
    kSpecial,  // the CLS token only (needs cls_token)
    kAll,      // every token
  };
  /// Seeded shuffle through the daemon's shared scan, or disk order.
  enum class Order { kShuffled, kOrdered };

  std::string dataset;           // id or unique prefix (>= 8 characters)
  std::optional<int64_t> layer;  // recorded layer value; empty = all layers
  Tokens tokens = Tokens::kContent;
  Order order = Order::kShuffled;
  int64_t batch_size = 4096;  // vectors per batch, >= 1
  uint64_t seed = 0;
  int64_t epochs = 1;      // 0 = endless
  int64_t rank = 0;        // this client's rank in [0, world_size)
  int64_t world_size = 1;  // 0 or 1: no partition
  // Node group (see shardcast.proto): node_count 0 takes the daemon's
  // --node-rank/--node-count.
  int64_t node_rank = 0;
  int64_t node_count = 0;
  bool drop_last = false;  // drop each epoch's last, short batch
  // Drop content tokens whose label (labels.bin) is one of these (0-255).
  std::vector<uint32_t> exclude_labels;
  // From Batch::resume_token() of an interrupted stream; empty: from the
  // start.
  std::string resume_token;
  // Transforms the daemon applies while gathering each batch (see
  // shardcast.proto, StreamRequest.scale_norm): mean-centering, scaling to
  // a mean L2 norm of sqrt(d_model), and the element type delivered.
  bool scale_norm = false;
  bool center = false;
  enum class DType { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
  DType dtype = DType::kFloat32;
};

namespace internal_client {
class BatchAccess;
}  // namespace internal_client

/// One batch of a stream. The accessors are views of the received message,
/// which the Batch owns, and, on the shared-memory path, of the slot holding
/// its vectors: they stay valid until the next BatchStream::Next into this
/// Batch, or its destruction (no copy of the payload); then the slot goes
/// back to the daemon. Holding more Batches of a shared-memory stream at
/// once than its region has slots stalls the stream. Reusing one Batch for
/// a whole stream reuses its memory. Move-only; moving keeps the views valid
/// (they move with the message), and the moved-from Batch is empty. A Batch
/// that BatchStream::Next filled has been checked: every per-row column holds
/// `rows()` entries (or none, where optional) and vectors() holds rows() *
/// d_model() floats. Not thread-safe for writing; const accessors may be called
/// from several threads.
class Batch {
 public:
  /// An empty batch (0 rows, empty views), ready for BatchStream::Next.
  Batch();
  ~Batch();
  Batch(Batch&& other) noexcept;
  Batch& operator=(Batch&& other) noexcept;
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  /// The epoch this batch belongs to (0-based).
  int64_t epoch() const;
  /// Batch number within the epoch (0-based).
  int64_t index() const;
  /// Vectors in this batch.
  int64_t rows() const;
  /// Floats per vector.
  int64_t d_model() const;
  /// [rows, d_model] float32, row-major; empty when the stream asked for a
  /// 16-bit dtype (see vectors16()).
  absl::Span<const float> vectors() const;
  /// The element type of the vectors, and the transform the daemon applied
  /// ("float32", "scale_norm, bfloat16 (statistics from ...)").
  StreamRequest::DType dtype() const;
  const std::string& transform() const;
  /// [rows, d_model] bfloat16 or float16 bit patterns, row-major, for
  /// streams of those dtypes; empty for float32.
  absl::Span<const uint16_t> vectors16() const;
  /// The vectors' bytes whatever their type: rows * d_model * element size.
  absl::Span<const char> vector_bytes() const;
  /// [rows] example index of each row.
  absl::Span<const int64_t> example_idx() const;
  /// [rows] content token index of each row; -1 for the CLS token.
  absl::Span<const int32_t> token_idx() const;
  /// [rows] recorded layer value of each row when all layers are selected;
  /// empty otherwise.
  absl::Span<const int64_t> layer() const;
  /// [rows] uint8 label of each row when the dataset has labels (255 for
  /// CLS); empty otherwise.
  absl::Span<const uint8_t> labels() const;
  /// Opaque bytes: a StreamRequest with the same fields and this
  /// resume_token continues the stream right after this batch.
  const std::string& resume_token() const;

 private:
  friend class internal_client::BatchAccess;
  struct Rep;                 // holds the received shardcast.v1.Batch
  std::unique_ptr<Rep> rep_;  // null: empty batch
};

/// A server stream of batches (Stream.Stream). Not thread-safe: one reader
/// per stream, except Cancel, which may be called from any thread. Destroying
/// a stream that has not finished cancels it.
class BatchStream {
 public:
  virtual ~BatchStream() = default;
  /// Receives the next batch into `batch` (replacing what it held, and
  /// invalidating its views); false at the end of the stream, after which
  /// Finish gives the final status. A batch whose field sizes do not match
  /// its rows and d_model ends the stream: Next returns false, the stream is
  /// cancelled, and Finish returns DATA_LOSS naming the batch (its number in
  /// the stream, epoch and index) and the sizes.
  virtual bool Next(Batch* batch) = 0;
  /// The stream's final status: OK after all requested epochs, the daemon's
  /// status code and message when it failed the stream (INVALID_ARGUMENT,
  /// NOT_FOUND, FAILED_PRECONDITION, DATA_LOSS, ...), CANCELLED after
  /// Cancel, DATA_LOSS for a malformed batch (see Next). Call it once Next
  /// has returned false; called earlier, it cancels the stream first. Later
  /// calls return the same status.
  virtual absl::Status Finish() = 0;
  /// Asks the daemon to stop sending; Next soon returns false and Finish then
  /// reports CANCELLED (or the stream's own end, if that came first).
  /// Thread-safe.
  virtual void Cancel() = 0;
  /// True when the batches arrive in shared memory (SharedStream), false
  /// when in gRPC messages (Stream).
  virtual bool shared_memory() const = 0;
};

/// A connection to one daemon. Thread-safe: any number of threads may call
/// its methods at once, and several streams may be open at a time. Every call
/// returns the daemon's status code and message on failure (see
/// shardcast.proto), or UNAVAILABLE when the daemon cannot be reached. The
/// Client must outlive the streams it opened.
class Client {
 public:
  /// The environment variable naming the daemon on this node
  /// ("unix:/run/shardcast/shardcastd.sock"); the CLI, this library and the
  /// Python package read it when no address is given.
  static constexpr char kAddressVariable[] = "SHARDCAST_ADDRESS";
  /// $SHARDCAST_ADDRESS, or "" when unset.
  static std::string DefaultAddress();

  /// Connects to `address`: "unix:/path/to.sock" or "host:port"; an empty
  /// address means DefaultAddress() (INVALID_ARGUMENT when that is unset
  /// too). Returns UNAVAILABLE naming the address when it cannot connect
  /// within options.connect_timeout_seconds; the error reading a TLS file
  /// otherwise.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& address, const ClientOptions& options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  /// All datasets the daemon found, the rejected ones included (ok == false,
  /// with their error).
  absl::StatusOr<std::vector<DatasetDescription>> ListDatasets();
  /// One dataset by id or unique prefix (>= 8 characters): NOT_FOUND when
  /// unknown, INVALID_ARGUMENT when the prefix is short or ambiguous.
  absl::StatusOr<DatasetDescription> DescribeDataset(
      const std::string& dataset);
  /// The dataset in directory `path`, named by its path: this process
  /// opens the directory's dataset files with its own permissions and hands
  /// them to the daemon over its local channel (docs/local-clients.md,
  /// "Datasets by path"); the description's `id` names it in every other
  /// call. The same files reached by any path are one dataset. The errno's
  /// code naming `path` when it cannot be opened; the daemon's validation
  /// error (NOT_FOUND naming a missing file, DATA_LOSS, ...) when it is not
  /// a dataset; FAILED_PRECONDITION for a daemon not on this node.
  absl::StatusOr<DatasetDescription> AttachDataset(const std::string& path);
  /// The daemon's counters and its active shared scans.
  absl::StatusOr<DaemonStatus> GetStatus();
  /// The same reply as JSON text, whole and generic: every field of
  /// shardcast.v1.ServerStatus by its proto name (unset ones included),
  /// integers as JSON numbers. What `shardcast status --json` prints; a
  /// field the daemon adds shows up here with no change to the client.
  absl::StatusOr<std::string> GetStatusJson();
  /// A sweep's daemon asks each of its peers who it is and whether they
  /// agree (Admin.CheckSweep): one entry per other node, in node order.
  struct SweepPeer {
    int64_t node = 0;
    std::string address;
    /// Empty: it answered and agrees (node order, --block-bytes, the
    /// content hash of every dataset this caller may read).
    std::vector<std::string> problems;
    /// It did not answer (not up yet, or cut off): asking again may mend
    /// it, unlike a refusal or a disagreement.
    bool unreachable = false;
  };
  struct SweepCheck {
    int64_t node = 0;      // the asked daemon's place in the sweep
    int64_t datasets = 0;  // datasets compared
    std::vector<SweepPeer> peers;
  };
  /// FAILED_PRECONDITION when the daemon is not in a sweep; UNIMPLEMENTED
  /// from a daemon older than sweeps.
  absl::StatusOr<SweepCheck> CheckSweep();
  /// grpc.health.v1 serving states.
  enum class Health { kUnknown = 0, kServing = 1, kNotServing = 2 };
  /// Asks the standard grpc.health.v1.Health/Check ("" = the whole server)
  /// within `timeout_seconds`. NOT_SERVING while the daemon drains for
  /// shutdown. The call's error (UNAVAILABLE, DEADLINE_EXCEEDED) otherwise;
  /// DATA_LOSS for a reply that is not a HealthCheckResponse.
  absl::StatusOr<Health> CheckHealth(double timeout_seconds = 5);
  /// The vectors at `coords`, [N, D] in the order of `coords`. DATA_LOSS
  /// when the reply's shape does not match its payload; the daemon's
  /// INVALID_ARGUMENT / OUT_OF_RANGE / RESOURCE_EXHAUSTED for bad or
  /// oversized requests. On the local channel
  /// (ClientOptions::local_queries) the block views the vectors where the
  /// daemon wrote them, in memory shared with it, and holds that memory
  /// until its last copy goes (beyond 16 such blocks held at once, later
  /// ones are copies). Over gRPC concurrent calls may share one call to the
  /// daemon (ClientOptions::query_calls_in_flight); the block then views
  /// its rows of the shared reply, or holds a copy of them when they are
  /// under a quarter of it.
  absl::StatusOr<VectorBlock> GetVectors(
      const std::string& dataset, const std::vector<VectorCoord>& coords);
  /// All tokens of one example: [T, D] of one layer, or [L, T, D] when
  /// `layer` is empty. DATA_LOSS when the reply's shape does not match its
  /// payload.
  absl::StatusOr<VectorBlock> GetExample(const std::string& dataset,
                                         int64_t example,
                                         std::optional<int64_t> layer);
  /// The example's content-token labels, one uint8 per byte. NOT_FOUND when
  /// the dataset has no labels.
  /// The JSON record `shardcast import` kept of one example (samples.json:
  /// sample_idx, dataset_idx, text preview, ...). NOT_FOUND when the
  /// dataset has none (DatasetDescription::has_example_info).
  absl::StatusOr<std::string> GetExampleInfo(const std::string& dataset,
                                             int64_t example);
  absl::StatusOr<std::string> GetLabels(const std::string& dataset,
                                        int64_t example);
  /// Opens a stream of batches: in shared memory when the options allow it
  /// and the daemon, on this client's Unix socket, offers it (it looks up
  /// the dataset's d_model first, to size the slots); in gRPC messages
  /// otherwise. Never null; errors in the request (bad layer, batch size,
  /// resume token, unknown dataset) and a region the daemon refuses
  /// (RESOURCE_EXHAUSTED) come from BatchStream::Finish.
  std::unique_ptr<BatchStream> OpenStream(const StreamRequest& request);

 private:
  struct Impl;  // the gRPC channel and stubs
  explicit Client(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
};

}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_INCLUDE_SHARDCAST_CLIENT_H_
