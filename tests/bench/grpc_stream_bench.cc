// grpc_stream_bench: the reference for the Stream throughput requirement
// ("warm gRPC path >= 0.8 x a bare gRPC byte-streaming loop on the same
// socket", docs/benchmarks.md). It measures that bare loop: no dataset, no
// disk, no batch assembly, only gRPC moving bytes over a Unix socket.
//
// The server is the daemon's Stream pattern minus the data work
// (server/transport/grpc/stream_reactor.cc): a grpc::CallbackGenericService
// whose reactor reads the request, then writes `--messages` messages of
// `--message-bytes`, one write in flight, the next started from OnWriteDone.
// Every message is a pre-filled buffer handed to gRPC as a static
// grpc::Slice, so nothing is copied per message on our side: by default the
// same buffer each time (it stays in the CPU's caches), with
// --source-bytes N the next message-sized window of an N-byte source in
// turn (a source larger than the caches comes from memory, as the daemon's
// page cache and reservoir do). Message size
// limits are the daemon's and the client library's (80 MiB).
//
// Clients (threads, or processes with --fork; each with its own connection)
// open the call once all are connected and read every message:
//   default           a raw ByteBuffer reader (the sync ClientReader that
//                     generated stubs use, with grpc::ByteBuffer as message):
//                     Dump into slices, sum one byte per slice;
//   --parse-protobuf  each message is a valid shardcast.v1.Batch with only
//                     `vectors` (field 15) set, read with
//                     v1::Stream::Stub::Stream into a reused v1::Batch, the
//                     way client/client.cc reads batches; sums one byte.
// A client's time runs from opening the call (the channel is connected
// already) to Finish after the last message, as `shardcast stream --json`
// times it; bytes are payload bytes (--message-bytes per message).
// total_bytes_per_second is all clients' bytes over the span from the first
// start to the last end.
//
//
// --unary N is the reference for single queries ("warm single-vector p50
// <= 1.5 x a bare gRPC unary round trip", issue 11): N unary calls, each
// answered at once from the callback (read the request, write
// --reply-bytes, finish: no thread hop, no work), from one client thread
// one after another, or with --threads T from T threads at once on one
// connection (the ceiling of concurrent single queries on this machine);
// it prints the round trip's p50/p99 and the calls per second.
//
//   grpc_stream_bench --socket /tmp/x.sock --message-bytes 16777216
//       --messages 400 [--clients N] [--fork] [--parse-protobuf] [--json]
//   grpc_stream_bench --socket /tmp/x.sock --unary 20000 [--threads T] [--json]
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/base/cli_args.h"
#include "common/base/cpu_time.h"
#include "common/base/exit_now.h"
#include "common/base/mutex.h"
#include "common/base/status.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "nlohmann/json.hpp"
#include "shardcast/v1/shardcast.grpc.pb.h"

namespace shardcast {
namespace {

// As server/daemon.cc and client/client.cc.
constexpr int kMaxMessageBytes = 80 << 20;
constexpr char kMethod[] = "/shardcast.v1.Stream/Stream";
constexpr uint8_t kVectorsTag = (15 << 3) | 2;  // Batch.vectors, bytes

const std::vector<OptionSpec> kSpecs = {
    {"socket", "PATH", "Unix socket to serve and stream on (required)"},
    {"message-bytes", "N",
     "payload bytes per message (default 16777216; K/M suffixes)"},
    {"messages", "N", "messages per client (default 400)"},
    {"source-bytes", "N",
     "send windows of an N-byte source in turn instead of one buffer again "
     "and again (default: the message size; K/M/G suffixes)"},
    {"clients", "N", "concurrent clients, one connection each (default 1)"},
    {"fork", nullptr, "run each client in its own process"},
    {"parse-protobuf", nullptr,
     "send valid shardcast.v1.Batch messages and read them with the "
     "generated v1::Stream stub into a v1::Batch, like client/client.cc"},
    {"malloc-keep", nullptr,
     "clients: mallopt M_MMAP_THRESHOLD 64 MiB / M_TRIM_THRESHOLD 1 GiB "
     "(as query_bench), so message buffers are not faulted in afresh"},
    {"unary", "N",
     "instead of streaming: N sequential unary calls with an empty handler "
     "(the round-trip reference for single queries); prints p50/p99"},
    {"reply-bytes", "N", "--unary: bytes in each reply (default 0)"},
    {"session", nullptr,
     "--unary: each thread's round trips are messages on one long-lived "
     "bidirectional call instead of unary calls"},
    {"threads", "T",
     "--unary: client threads calling at once on the one connection, "
     "calls/T each (default 1; the reference for concurrent queries)"},
    {"json", nullptr, "print one JSON object on stdout"},
};

constexpr char kUnaryMethod[] = "/shardcast.bench.Bench/Unary";
constexpr char kSessionMethod[] = "/shardcast.bench.Bench/Session";

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC: same in forks

double Seconds(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// The bytes every message is made of, filled once and never copied by us.
struct Payload {
  std::vector<char> data;  // windows of message_bytes (one by default)
  size_t message_bytes = 0;
  std::string header;  // --parse-protobuf: tag and length of `vectors`
  int64_t messages = 0;
  mutable std::atomic<int64_t> calls{0};  // stream calls so far

  // Message `i` of a call: window i mod windows of `data` (callers offset
  // `i` per call, so that concurrent calls do not send the same windows at
  // the same time out of a shared cache).
  grpc::ByteBuffer Message(int64_t i) const {
    const size_t windows = message_bytes == 0 ? 1 : data.size() / message_bytes;
    grpc::Slice body(
        data.data() + static_cast<size_t>(i) % windows * message_bytes,
        message_bytes, grpc::Slice::STATIC_SLICE);
    if (header.empty()) return grpc::ByteBuffer(&body, 1);
    grpc::Slice slices[2] = {
        grpc::Slice(header.data(), header.size(), grpc::Slice::STATIC_SLICE),
        body};
    return grpc::ByteBuffer(slices, 2);
  }
};

// One call: read the request, then write every message, one in flight.
class StreamReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit StreamReactor(const Payload* payload)
      : payload_(payload),
        // Calls start a prime number of windows apart.
        first_(payload->calls.fetch_add(1) * 7919) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
      return;
    }
    WriteNext();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (sent_ == payload_->messages) {
      Finish(grpc::Status::OK);
      return;
    }
    reply_ = payload_->Message(first_ + sent_);
    ++sent_;
    StartWrite(&reply_);
  }

  const Payload* const payload_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
  const int64_t first_;
  int64_t sent_ = 0;
};

// A unary call answered from the callback that reads its request.
class UnaryReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit UnaryReactor(const Payload* payload) : payload_(payload) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
      return;
    }
    reply_ = payload_->Message(0);
    StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  const Payload* const payload_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
};

// --session: one long-lived call per client thread; every message read is
// answered at once with one reply message, the next read started when the
// reply is written.
class SessionReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit SessionReactor(const Payload* payload) : payload_(payload) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    reply_ = payload_->Message(0);
    StartWrite(&reply_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
      return;
    }
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  const Payload* const payload_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer reply_;
};

class BenchService final : public grpc::CallbackGenericService {
 public:
  explicit BenchService(const Payload* payload) : payload_(payload) {}
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override {
    if (ctx->method() == kUnaryMethod) return new UnaryReactor(payload_);
    if (ctx->method() == kSessionMethod) return new SessionReactor(payload_);
    return new StreamReactor(payload_);
  }

 private:
  const Payload* const payload_;
};

struct ClientResult {
  double start = 0, end = 0;  // Seconds(Clock) at open and after Finish
  uint64_t bytes = 0;         // payload bytes read
  int64_t messages = 0;
  uint64_t checksum = 0;    // one byte per slice (keeps the reads honest)
  double cpu_seconds = -1;  // --fork: the client process's user + system
  char error[256] = {0};    // empty when the call succeeded
};

struct ClientConfig {
  std::string address;
  uint64_t message_bytes = 0;
  int64_t messages = 0;
  bool parse_protobuf = false;
};

// A connected channel of its own (the local subchannel pool keeps clients
// of one process from sharing a connection, as separate trainers would).
absl::StatusOr<std::shared_ptr<grpc::Channel>> Connect(
    const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(
      address, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() +
                                 std::chrono::seconds(10))) {
    return absl::UnavailableError(
        absl::StrCat("cannot connect to ", address, " within 10 s"));
  }
  return channel;
}

void SetError(ClientResult* r, const std::string& what) {
  std::snprintf(r->error, sizeof(r->error), "%s", what.c_str());
}

ClientResult ReadRaw(grpc::Channel* channel, const ClientConfig& c) {
  ClientResult r;
  const grpc::internal::RpcMethod method(
      kMethod, grpc::internal::RpcMethod::SERVER_STREAMING);
  grpc::Slice empty;
  const grpc::ByteBuffer request(&empty, 1);
  grpc::ClientContext ctx;
  grpc::ByteBuffer message;
  std::vector<grpc::Slice> slices;
  r.start = Seconds(Clock::now());
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
          channel, method, &ctx, request));
  while (reader->Read(&message)) {
    const size_t length = message.Length();
    if (length != c.message_bytes && r.error[0] == 0) {
      SetError(&r, absl::StrCat("message ", r.messages, " has ", length,
                                " bytes, not ", c.message_bytes));
    }
    if (!message.Dump(&slices).ok()) {
      SetError(&r, "ByteBuffer::Dump failed");
      break;
    }
    for (const grpc::Slice& s : slices) {
      if (s.size() > 0) r.checksum += static_cast<uint8_t>(s.begin()[0]);
    }
    r.bytes += length;
    ++r.messages;
    // Drop the message before the next arrives, as a parsing client does:
    // holding two messages' slices makes malloc map fresh memory for every
    // message, and first touch of fresh pages is slow on these VMs.
    slices.clear();
    message.Clear();
  }
  const grpc::Status st = reader->Finish();
  r.end = Seconds(Clock::now());
  if (!st.ok()) SetError(&r, absl::StrCat("Finish: ", st.error_message()));
  return r;
}

ClientResult ReadProtobuf(const std::shared_ptr<grpc::Channel>& channel,
                          const ClientConfig& c) {
  ClientResult r;
  auto stub = v1::Stream::NewStub(channel);
  v1::StreamRequest request;
  request.set_dataset("grpc_stream_bench");
  grpc::ClientContext ctx;
  v1::Batch batch;
  r.start = Seconds(Clock::now());
  std::unique_ptr<grpc::ClientReader<v1::Batch>> reader =
      stub->Stream(&ctx, request);
  while (reader->Read(&batch)) {
    const std::string& v = batch.vectors();
    if (v.size() != c.message_bytes && r.error[0] == 0) {
      SetError(&r, absl::StrCat("batch ", r.messages, " has ", v.size(),
                                " vector bytes, not ", c.message_bytes));
    }
    if (!v.empty()) r.checksum += static_cast<uint8_t>(v[0]);
    r.bytes += v.size();
    ++r.messages;
  }
  const grpc::Status st = reader->Finish();
  r.end = Seconds(Clock::now());
  if (!st.ok()) SetError(&r, absl::StrCat("Finish: ", st.error_message()));
  return r;
}

ClientResult RunClient(const std::shared_ptr<grpc::Channel>& channel,
                       const ClientConfig& c) {
  ClientResult r =
      c.parse_protobuf ? ReadProtobuf(channel, c) : ReadRaw(channel.get(), c);
  if (r.error[0] == 0 && r.messages != c.messages) {
    SetError(&r,
             absl::StrCat("read ", r.messages, " messages, not ", c.messages));
  }
  return r;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartServer(
    const std::string& socket, BenchService* service) {
  ::unlink(socket.c_str());  // a stale socket from an earlier run
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.AddListeningPort(absl::StrCat("unix:", socket),
                           grpc::InsecureServerCredentials());
  builder.RegisterCallbackGenericService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on unix:", socket));
  }
  return server;
}

// Clients as threads of this process: connect all, then start together.
std::vector<ClientResult> RunThreads(const ClientConfig& c, int clients) {
  Mutex mu;
  CondVar cv;
  int connected = 0;
  bool go = false;
  std::vector<ClientResult> results(static_cast<size_t>(clients));
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
          Connect(c.address);
      {
        MutexLock lock(&mu);
        ++connected;
        cv.SignalAll();
        cv.Wait(&mu, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return go; });
      }
      if (!channel.ok()) {
        SetError(&results[static_cast<size_t>(i)],
                 std::string(channel.status().message()));
        return;
      }
      results[static_cast<size_t>(i)] = RunClient(*channel, c);
    });
  }
  {
    MutexLock lock(&mu);
    cv.Wait(&mu, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return connected == clients;
    });
    go = true;
    cv.SignalAll();
  }
  for (auto& t : threads) t.join();
  return results;
}

bool ReadFull(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool WriteAll(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= static_cast<size_t>(put);
  }
  return true;
}

// Clients as processes. They are forked before this process touches gRPC
// (gRPC's threads do not survive fork), wait until the server is up,
// connect, and start on the parent's word; each writes its result back.
class ForkedClients {
 public:
  ~ForkedClients() {
    for (int fd : {up_[0], up_[1], ready_[0], ready_[1], go_[0], go_[1],
                   results_[0], results_[1]}) {
      if (fd >= 0) ::close(fd);
    }
  }

  absl::Status Fork(const ClientConfig& c, int clients, bool malloc_keep) {
    for (int* p : {up_, ready_, go_, results_}) {
      if (::pipe(p) != 0) return absl::ErrnoToStatus(errno, "pipe");
    }
    for (int i = 0; i < clients; ++i) {
      const pid_t pid = ::fork();
      if (pid < 0) return absl::ErrnoToStatus(errno, "fork");
      if (pid == 0) ::_exit(Child(c, malloc_keep));
      pids_.push_back(pid);
    }
    return absl::OkStatus();
  }

  // After the server is up: lets the clients connect, then start together.
  absl::StatusOr<std::vector<ClientResult>> Run() {
    const size_t n = pids_.size();
    std::string bytes(n, 'x');
    if (!WriteAll(up_[1], bytes.data(), n) ||
        !ReadFull(ready_[0], bytes.data(), n) ||
        !WriteAll(go_[1], bytes.data(), n)) {
      return absl::InternalError("a client process died before starting");
    }
    std::vector<ClientResult> results(n);
    for (size_t i = 0; i < n; ++i) {
      if (!ReadFull(results_[0], &results[i], sizeof(ClientResult))) {
        return absl::InternalError("a client process died without a result");
      }
    }
    for (pid_t pid : pids_) {
      int status = 0;
      ::waitpid(pid, &status, 0);
    }
    return results;
  }

 private:
  int Child(const ClientConfig& c, bool malloc_keep) {
    if (malloc_keep) {
      mallopt(M_MMAP_THRESHOLD, 64 << 20);
      mallopt(M_TRIM_THRESHOLD, 1 << 30);
    }
    char b;
    if (!ReadFull(up_[0], &b, 1)) return 1;
    ClientResult r;
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = Connect(c.address);
    if (!WriteAll(ready_[1], &b, 1) || !ReadFull(go_[0], &b, 1)) return 1;
    if (channel.ok()) {
      r = RunClient(*channel, c);
    } else {
      SetError(&r, std::string(channel.status().message()));
    }
    r.cpu_seconds = ProcessCpuSeconds();
    // Smaller than PIPE_BUF: one atomic write, results never interleave.
    static_assert(sizeof(ClientResult) <= PIPE_BUF, "result too large");
    return WriteAll(results_[1], &r, sizeof(r)) ? 0 : 1;
  }

  int up_[2] = {-1, -1}, ready_[2] = {-1, -1}, go_[2] = {-1, -1},
      results_[2] = {-1, -1};
  std::vector<pid_t> pids_;
};

// --unary: `calls` round trips on one connection, from `threads` client
// threads each calling one after another (calls/threads each); the
// latencies in microseconds, sorted, and the calls per second of the whole
// run (first call's start to the last call's end).
struct UnaryResult {
  std::vector<double> micros;
  double calls_per_second = 0;
};

absl::StatusOr<UnaryResult> RunUnary(const std::string& address, int64_t calls,
                                     int threads, bool session) {
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, Connect(address));
  const grpc::internal::RpcMethod method(kUnaryMethod,
                                         grpc::internal::RpcMethod::NORMAL_RPC);
  // About the size of a one-vector GetVectorsRequest.
  const std::string body(40, 'q');
  struct PerThread {
    std::vector<double> micros;
    std::string error;
  };
  std::vector<PerThread> per(static_cast<size_t>(threads));
  auto worker = [&](int t) {
    PerThread& me = per[static_cast<size_t>(t)];
    grpc::Slice slice(body);
    const grpc::ByteBuffer request(&slice, 1);
    if (session) {
      const grpc::internal::RpcMethod bidi(
          kSessionMethod, grpc::internal::RpcMethod::BIDI_STREAMING);
      grpc::ClientContext ctx;
      std::unique_ptr<
          grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
          stream(grpc::internal::ClientReaderWriterFactory<
                 grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(),
                                                             bidi, &ctx));
      grpc::ByteBuffer reply;
      for (int64_t i = t; i < calls; i += threads) {
        const auto t0 = Clock::now();
        if (!stream->Write(request) || !stream->Read(&reply)) {
          me.error = absl::StrCat("session round trip ", i, " failed");
          return;
        }
        const auto t1 = Clock::now();
        me.micros.push_back(
            std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      stream->WritesDone();
      const grpc::Status st = stream->Finish();
      if (!st.ok()) me.error = absl::StrCat("session: ", st.error_message());
      return;
    }
    for (int64_t i = t; i < calls; i += threads) {
      grpc::ClientContext ctx;
      grpc::ByteBuffer reply;
      const auto t0 = Clock::now();
      const grpc::Status st =
          grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer,
                                            grpc::ByteBuffer, grpc::ByteBuffer>(
              channel.get(), method, &ctx, request, &reply);
      const auto t1 = Clock::now();
      if (!st.ok()) {
        me.error = absl::StrCat("unary call ", i, ": ", st.error_message());
        return;
      }
      me.micros.push_back(
          std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  };
  const auto start = Clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (std::thread& t : pool) t.join();
  const double seconds =
      std::chrono::duration<double>(Clock::now() - start).count();
  UnaryResult r;
  for (PerThread& p : per) {
    if (!p.error.empty()) return absl::UnavailableError(p.error);
    r.micros.insert(r.micros.end(), p.micros.begin(), p.micros.end());
  }
  std::sort(r.micros.begin(), r.micros.end());
  r.calls_per_second = static_cast<double>(r.micros.size()) / seconds;
  return r;
}

int Usage(const std::string& error) {
  if (!error.empty()) std::cerr << "grpc_stream_bench: " << error << "\n";
  std::cerr << "Usage: grpc_stream_bench --socket PATH [options]\n\n"
               "Streams fixed messages over gRPC on a Unix socket (no data "
               "work): the\nreference loop for shardcastd's Stream "
               "throughput.\n\n"
            << FormatOptions(kSpecs);
  return error.empty() ? 0 : 2;
}

int Main(int argc, char** argv) {
  std::vector<std::string> argv_list(argv + 1, argv + argc);
  for (const std::string& a : argv_list) {
    if (a == "--help" || a == "-h") return Usage("");
  }
  absl::StatusOr<Args> args = Args::Parse(argv_list, kSpecs);
  if (!args.ok()) return Usage(std::string(args.status().message()));
  const std::string socket = args->Get("socket");
  if (socket.empty() || socket.front() != '/') {
    return Usage("--socket must be an absolute path");
  }
  absl::StatusOr<uint64_t> message_bytes =
      args->GetBytes("message-bytes", 16u << 20);
  absl::StatusOr<int64_t> messages = args->GetInt("messages", 400);
  absl::StatusOr<int64_t> clients = args->GetInt("clients", 1);
  absl::StatusOr<uint64_t> source_bytes =
      args->GetBytes("source-bytes", message_bytes.ok() ? *message_bytes : 0);
  for (const absl::Status& s : {message_bytes.status(), messages.status(),
                                clients.status(), source_bytes.status()}) {
    if (!s.ok()) return Usage(std::string(s.message()));
  }
  // Room for the Batch field header under the 80 MiB message limit.
  if (*message_bytes < 1 || *message_bytes > kMaxMessageBytes - 16) {
    return Usage(absl::StrCat("--message-bytes must be in [1, ",
                              kMaxMessageBytes - 16, "]"));
  }
  if (*messages < 1) return Usage("--messages must be >= 1");
  if (*source_bytes > (64ull << 30)) {
    return Usage("--source-bytes must be at most 64G");
  }
  if (*clients < 1 || *clients > 256) {
    return Usage("--clients must be in [1, 256]");
  }
  if (args->Has("unary")) {
    absl::StatusOr<int64_t> calls = args->GetInt("unary", 0);
    absl::StatusOr<uint64_t> reply_bytes = args->GetBytes("reply-bytes", 0);
    if (!calls.ok()) return Usage(std::string(calls.status().message()));
    if (!reply_bytes.ok()) {
      return Usage(std::string(reply_bytes.status().message()));
    }
    absl::StatusOr<int64_t> threads = args->GetInt("threads", 1);
    if (!threads.ok()) return Usage(std::string(threads.status().message()));
    if (*calls < 1) return Usage("--unary must be >= 1");
    if (*threads < 1 || *threads > 256) {
      return Usage("--threads must be in [1, 256]");
    }
    if (args->Has("malloc-keep")) {  // as for streams (below)
      mallopt(M_MMAP_THRESHOLD, 64 << 20);
      mallopt(M_TRIM_THRESHOLD, 1 << 30);
    }
    if (*reply_bytes > kMaxMessageBytes - 16) {
      return Usage("--reply-bytes is over the message limit");
    }
    Payload payload;
    payload.data.assign(*reply_bytes, 'r');
    payload.message_bytes = *reply_bytes;
    BenchService service(&payload);
    absl::StatusOr<std::unique_ptr<grpc::Server>> server =
        StartServer(socket, &service);
    if (!server.ok()) {
      std::cerr << "grpc_stream_bench: " << server.status() << "\n";
      return 1;
    }
    absl::StatusOr<UnaryResult> unary = RunUnary(
        absl::StrCat("unix:", socket), *calls, *threads, args->Has("session"));
    (*server)->Shutdown(std::chrono::system_clock::now() +
                        std::chrono::seconds(5));
    ::unlink(socket.c_str());
    if (!unary.ok()) {
      std::cerr << "grpc_stream_bench: " << unary.status() << "\n";
      ExitNow(1);
    }
    const std::vector<double>* micros = &unary->micros;
    const auto at = [&](double q) {
      return (*micros)[static_cast<size_t>(q * (micros->size() - 1))];
    };
    double sum = 0;
    for (double m : *micros) sum += m;
    nlohmann::ordered_json out;
    out["mode"] = args->Has("session") ? "session" : "unary";
    out["calls"] = *calls;
    out["threads"] = *threads;
    out["reply_bytes"] = *reply_bytes;
    out["p50_us"] = at(0.5);
    out["p99_us"] = at(0.99);
    out["mean_us"] = sum / static_cast<double>(micros->size());
    out["calls_per_second"] = unary->calls_per_second;
    if (args->Has("json")) {
      std::cout << out.dump() << std::endl;
    } else {
      std::printf("%s round trip: p50 %.1f us, p99 %.1f us, %.0f calls/s\n",
                  out["mode"].get<std::string>().c_str(), at(0.5), at(0.99),
                  out["calls_per_second"].get<double>());
    }
    ExitNow(0);
  }
  const bool parse_protobuf = args->Has("parse-protobuf");
  const bool fork = args->Has("fork");
  const bool malloc_keep = args->Has("malloc-keep");

  ClientConfig config;
  config.address = absl::StrCat("unix:", socket);
  config.message_bytes = *message_bytes;
  config.messages = *messages;
  config.parse_protobuf = parse_protobuf;

  ForkedClients forked;
  if (fork) {
    absl::Status st =
        forked.Fork(config, static_cast<int>(*clients), malloc_keep);
    if (!st.ok()) {
      std::cerr << "grpc_stream_bench: " << st << "\n";
      return 1;
    }
  } else if (malloc_keep) {
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }

  Payload payload;
  payload.messages = *messages;
  payload.message_bytes = *message_bytes;
  // Whole windows only, at least one.
  payload.data.resize(std::max<uint64_t>(1, *source_bytes / *message_bytes) *
                      *message_bytes);
  for (size_t i = 0; i < payload.data.size(); ++i) {
    payload.data[i] = static_cast<char>(i * 131 + 7);
  }
  if (parse_protobuf) {
    // A Batch with only `vectors` set: tag, varint length, bytes. Checked
    // against protobuf itself, so the clients parse what the daemon sends.
    payload.header.push_back(static_cast<char>(kVectorsTag));
    for (uint64_t v = *message_bytes;; v >>= 7) {
      if (v < 0x80) {
        payload.header.push_back(static_cast<char>(v));
        break;
      }
      payload.header.push_back(static_cast<char>((v & 0x7f) | 0x80));
    }
    v1::Batch check;
    const std::string first(payload.data.data(), *message_bytes);
    check.set_vectors(first);
    if (check.SerializeAsString() != payload.header + first) {
      std::cerr << "grpc_stream_bench: the hand-made Batch header does not "
                   "match protobuf's serialization\n";
      return 1;
    }
  }

  BenchService service(&payload);
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      StartServer(socket, &service);
  if (!server.ok()) {
    std::cerr << "grpc_stream_bench: " << server.status() << "\n";
    return 1;
  }

  std::vector<ClientResult> results;
  // --fork: the server's CPU time over the streams (this process holds only
  // the server then), to set beside shardcast bench's daemon_cpu_seconds.
  const double cpu_before = ProcessCpuSeconds();
  double server_cpu = -1;
  if (fork) {
    absl::StatusOr<std::vector<ClientResult>> r = forked.Run();
    server_cpu = ProcessCpuSeconds() - cpu_before;
    if (!r.ok()) {
      std::cerr << "grpc_stream_bench: " << r.status() << "\n";
      ExitNow(1);
    }
    results = std::move(*r);
  } else {
    results = RunThreads(config, static_cast<int>(*clients));
  }
  (*server)->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(5));
  ::unlink(socket.c_str());

  nlohmann::ordered_json out;
  out["message_bytes"] = *message_bytes;
  out["source_bytes"] = payload.data.size();
  out["messages"] = *messages;
  out["mode"] = parse_protobuf ? "protobuf" : "raw";
  out["processes"] = fork;
  out["malloc_keep"] = malloc_keep;
  double first = 0, last = 0;
  uint64_t total = 0;
  bool failed = false;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (size_t i = 0; i < results.size(); ++i) {
    const ClientResult& r = results[i];
    const double secs = r.end - r.start;
    nlohmann::ordered_json j;
    j["bytes_per_second"] = secs > 0 ? static_cast<double>(r.bytes) / secs : 0;
    j["seconds"] = secs;
    j["bytes"] = r.bytes;
    j["messages"] = r.messages;
    j["cpu_seconds"] = r.cpu_seconds >= 0
                           ? nlohmann::ordered_json(r.cpu_seconds)
                           : nlohmann::ordered_json(nullptr);
    if (r.error[0] != 0) {
      j["error"] = r.error;
      failed = true;
      std::cerr << "grpc_stream_bench: client " << i << ": " << r.error << "\n";
    }
    list.push_back(j);
    first = i == 0 ? r.start : std::min(first, r.start);
    last = i == 0 ? r.end : std::max(last, r.end);
    total += r.bytes;
  }
  out["clients"] = list;
  out["total_bytes_per_second"] =
      last > first ? static_cast<double>(total) / (last - first) : 0;
  out["server_cpu_seconds"] = server_cpu >= 0
                                  ? nlohmann::ordered_json(server_cpu)
                                  : nlohmann::ordered_json(nullptr);
  const double server_ns_per_byte =
      server_cpu >= 0 && total > 0
          ? server_cpu * 1e9 / static_cast<double>(total)
          : -1;
  out["server_cpu_ns_per_byte"] =
      server_ns_per_byte >= 0 ? nlohmann::ordered_json(server_ns_per_byte)
                              : nlohmann::ordered_json(nullptr);
  if (args->Has("json")) {
    std::cout << out.dump() << std::endl;
  } else {
    for (size_t i = 0; i < list.size(); ++i) {
      std::printf("client %zu: %.1f MB/s (%.2f s)\n", i,
                  list[i]["bytes_per_second"].get<double>() / 1e6,
                  list[i]["seconds"].get<double>());
    }
    std::printf("total: %.1f MB/s over %zu client(s), %s, %s\n",
                out["total_bytes_per_second"].get<double>() / 1e6, list.size(),
                parse_protobuf ? "protobuf" : "raw",
                fork ? "processes" : "threads");
    if (server_ns_per_byte >= 0) {
      std::printf("server CPU %.2f s (%.3f ns per byte)\n", server_cpu,
                  server_ns_per_byte);
    }
  }
  ExitNow(failed ? 1 : 0);
}

}  // namespace
}  // namespace shardcast

int main(int argc, char** argv) { return shardcast::Main(argc, argv); }
