// C++ client library for shardcastd.
#ifndef SHARDCAST_CLIENT_CLIENT_H_
#define SHARDCAST_CLIENT_CLIENT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {

/// How to reach the daemon. TLS applies to TCP addresses only.
struct ClientOptions {
  std::string tls_ca_file;    // PEM roots to verify the server (enables TLS)
  std::string tls_cert_file;  // client certificate for mutual TLS
  std::string tls_key_file;
  std::string tls_server_name;  // override the name checked in the cert
  int connect_timeout_seconds = 5;
};

/// One vector/coordinate request.
struct VectorCoord {
  int64_t example = 0;
  int64_t layer = 0;  // layer value as recorded (may be negative)
  int64_t token = 0;  // token axis index in [0, T)
};

/// A block of float32 values and its shape.
struct VectorBlock {
  std::vector<int64_t> shape;
  std::vector<float> values;
};

/// A server stream of batches. Not thread-safe; one reader per stream.
class BatchStream {
 public:
  virtual ~BatchStream() = default;
  /// Reads the next batch into `batch`; false at the end of the stream
  /// (then call Finish for the final status).
  virtual bool Next(v1::Batch* batch) = 0;
  /// The stream's final status (OK after all requested epochs).
  virtual absl::Status Finish() = 0;
  /// Asks the daemon to stop sending; Finish then reports CANCELLED.
  virtual void Cancel() = 0;
};

/// A connection to one daemon. Thread-safe (gRPC stubs are). Every call
/// returns the daemon's status code and message on failure.
class Client {
 public:
  /// `address`: "unix:/path/to.sock" or "host:port". UNAVAILABLE naming the
  /// address when it cannot connect within the timeout; errors reading the
  /// TLS files otherwise.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& address, const ClientOptions& options = {});

  absl::StatusOr<std::vector<v1::DatasetInfo>> ListDatasets();
  absl::StatusOr<v1::DatasetInfo> DescribeDataset(const std::string& dataset);
  absl::StatusOr<v1::ServerStatus> GetStatus();
  /// [N, D] vectors in the order of `coords`.
  absl::StatusOr<VectorBlock> GetVectors(
      const std::string& dataset, const std::vector<VectorCoord>& coords);
  /// [T, D] of one layer, or [L, T, D] when `layer` is empty.
  absl::StatusOr<VectorBlock> GetExample(const std::string& dataset,
                                         int64_t example,
                                         std::optional<int64_t> layer);
  /// The example's content-token labels (uint8 each).
  absl::StatusOr<std::string> GetLabels(const std::string& dataset,
                                        int64_t example);
  /// Opens a stream of batches (Stream.Stream).
  std::unique_ptr<BatchStream> OpenStream(const v1::StreamRequest& request);

 private:
  explicit Client(std::shared_ptr<grpc::Channel> channel);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Admin::Stub> admin_;
  std::unique_ptr<v1::Query::Stub> query_;
  std::unique_ptr<v1::Stream::Stub> stream_;
};

}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_CLIENT_H_
