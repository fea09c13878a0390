#include "client/client.h"

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"

namespace shardcast {
namespace {

constexpr int kMaxMessageBytes = 80 << 20;

absl::StatusOr<VectorBlock> ToBlock(const v1::Vectors& reply) {
  VectorBlock block;
  int64_t count = 1;
  for (int64_t s : reply.shape()) {
    block.shape.push_back(s);
    count *= s;
  }
  if (static_cast<uint64_t>(count) * 4 != reply.data().size()) {
    return absl::DataLossError(absl::StrCat("reply shape holds ", count,
                                            " floats but carries ",
                                            reply.data().size(), " bytes"));
  }
  // One copy out of the protobuf string, without zero-filling first.
  const float* first = reinterpret_cast<const float*>(reply.data().data());
  block.values.assign(first, first + count);
  return block;
}

}  // namespace

Client::Client(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      admin_(v1::Admin::NewStub(channel_)),
      query_(v1::Query::NewStub(channel_)),
      stream_(v1::Stream::NewStub(channel_)) {}

namespace {

class GrpcBatchStream final : public BatchStream {
 public:
  GrpcBatchStream(v1::Stream::Stub* stub, const v1::StreamRequest& request)
      : reader_(stub->Stream(&ctx_, request)) {}
  bool Next(v1::Batch* batch) override { return reader_->Read(batch); }
  absl::Status Finish() override { return FromGrpcStatus(reader_->Finish()); }
  void Cancel() override { ctx_.TryCancel(); }

 private:
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::Batch>> reader_;
};

}  // namespace

std::unique_ptr<BatchStream> Client::OpenStream(
    const v1::StreamRequest& request) {
  return std::make_unique<GrpcBatchStream>(stream_.get(), request);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const std::string& address, const ClientOptions& options) {
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
  return std::unique_ptr<Client>(new Client(std::move(channel)));
}

absl::StatusOr<std::vector<v1::DatasetInfo>> Client::ListDatasets() {
  grpc::ClientContext ctx;
  v1::ListDatasetsRequest req;
  v1::ListDatasetsResponse resp;
  RETURN_IF_ERROR(FromGrpcStatus(admin_->ListDatasets(&ctx, req, &resp)));
  return std::vector<v1::DatasetInfo>(resp.datasets().begin(),
                                      resp.datasets().end());
}

absl::StatusOr<v1::DatasetInfo> Client::DescribeDataset(
    const std::string& dataset) {
  grpc::ClientContext ctx;
  v1::DescribeDatasetRequest req;
  req.set_dataset(dataset);
  v1::DatasetInfo resp;
  RETURN_IF_ERROR(FromGrpcStatus(admin_->DescribeDataset(&ctx, req, &resp)));
  return resp;
}

absl::StatusOr<v1::ServerStatus> Client::GetStatus() {
  grpc::ClientContext ctx;
  v1::GetStatusRequest req;
  v1::ServerStatus resp;
  RETURN_IF_ERROR(FromGrpcStatus(admin_->GetStatus(&ctx, req, &resp)));
  return resp;
}

absl::StatusOr<VectorBlock> Client::GetVectors(
    const std::string& dataset, const std::vector<VectorCoord>& coords) {
  grpc::ClientContext ctx;
  v1::GetVectorsRequest req;
  req.set_dataset(dataset);
  for (const VectorCoord& c : coords) {
    v1::Coordinate* p = req.add_coordinates();
    p->set_example(c.example);
    p->set_layer(c.layer);
    p->set_token(c.token);
  }
  v1::Vectors resp;
  RETURN_IF_ERROR(FromGrpcStatus(query_->GetVectors(&ctx, req, &resp)));
  return ToBlock(resp);
}

absl::StatusOr<VectorBlock> Client::GetExample(const std::string& dataset,
                                               int64_t example,
                                               std::optional<int64_t> layer) {
  grpc::ClientContext ctx;
  v1::GetExampleRequest req;
  req.set_dataset(dataset);
  req.set_example(example);
  if (layer.has_value()) req.set_layer(*layer);
  v1::Vectors resp;
  RETURN_IF_ERROR(FromGrpcStatus(query_->GetExample(&ctx, req, &resp)));
  return ToBlock(resp);
}

absl::StatusOr<std::string> Client::GetLabels(const std::string& dataset,
                                              int64_t example) {
  grpc::ClientContext ctx;
  v1::GetLabelsRequest req;
  req.set_dataset(dataset);
  req.set_example(example);
  v1::Labels resp;
  RETURN_IF_ERROR(FromGrpcStatus(query_->GetLabels(&ctx, req, &resp)));
  return resp.labels();
}

}  // namespace shardcast
