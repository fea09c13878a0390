// Fuzz target: the local channel (server/transport/local/local_channel.h),
// as a hostile client on the daemon's node speaks it. One LocalChannel with
// queries (over the fuzz engine's datasets, fuzz_engine.h) and batch regions
// runs for the whole process. An input is a sequence of packets, each a
// 2-byte little-endian length and that many bytes (the rest of the input if
// shorter), sent one after another on one connection; after each the target
// waits for the reply or the daemon's close. When a reply hands over a query
// region, the target writes valid coordinates of dataset A into it, so that
// vectors requests reach real reads.
//
// Checks: no crash, leak, sanitizer report or hang (a reply within 30 s,
// however often libFuzzer's timer interrupts the wait);
// every reply parses as a LocalReply whose descriptors match; a reply to a
// request the daemon read echoes its id; the channel serves a fresh
// connection after each input.
//
// Run (tests/fuzz/run.sh builds and runs every target):
//   build-asan/local_channel_fuzz -max_total_time=60 -timeout=20 \
//       CORPUS_COPY tests/fuzz/corpus/local_channel
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/local/channel.h"
#include "server/transport/local/batch_regions.h"
#include "server/transport/local/local_channel.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_engine.h"

// The property `cond` holds, or the input is kept as a crash.
#define REQUIRE(cond)                                                 \
  do {                                                                \
    if (!(cond)) {                                                    \
      ::shardcast::fuzz::Fail(std::string("local_channel_fuzz.cc:") + \
                              std::to_string(__LINE__) + ": " #cond); \
    }                                                                 \
  } while (0)

namespace {

using namespace shardcast;  // NOLINT: a fuzz target's file

struct Channel {
  Metrics metrics;
  std::unique_ptr<BatchRegions> regions;
  std::unique_ptr<LocalChannel> channel;
  std::string path;
};

Channel& GetChannel() {
  static Channel* c = [] {
    fuzz::FuzzEngine& fe = fuzz::GetFuzzEngine();
    auto* c = new Channel;
    c->path = fe.root + "/d.sock.local";
    c->regions =
        std::make_unique<BatchRegions>(BatchRegionsOptions(), fe.engine.get());
    LocalChannelOptions o;
    o.path = c->path;
    o.max_query_region_bytes = 1 << 20;
    auto started = LocalChannel::Start(o, &fe.engine->queries(),
                                       c->regions.get(), &c->metrics);
    REQUIRE(started.ok());
    c->channel = std::move(*started);
    return c;
  }();
  return *c;
}

UniqueFd Connect(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr),
                    sizeof(addr)) == 0);
  return fd;
}

// Writes coordinates of dataset A (every 7th vector) into a handed-over
// query region.
void FillRegion(int memfd, uint64_t bytes, const fuzz::FuzzDataset& a) {
  void* p =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
  REQUIRE(p != MAP_FAILED);
  auto* v = static_cast<int64_t*>(p);
  const size_t n = std::min<uint64_t>(bytes / 24, 256);
  for (size_t i = 0; i < n; ++i) {
    v[3 * i] = static_cast<int64_t>(i * 7) % a.n_examples;
    v[3 * i + 1] = a.layers[i % a.layers.size()];
    v[3 * i + 2] = static_cast<int64_t>(i) % a.tokens();
  }
  ::munmap(p, bytes);
}

// Whether `fd` becomes readable (a reply or a close) within `seconds`.
// libFuzzer's -timeout runs a SIGALRM timer: a poll it interrupts (EINTR)
// goes on waiting for what is left; taken for a hang, it failed one run in
// ~20,000 in CI.
bool AnsweredWithin(int fd, int seconds) {
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    struct pollfd pfd = {fd, POLLIN, 0};
    const int n = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (n == 1) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// Replaces a request's dataset "A" or "B" by that dataset's id; whether it
// did.
bool NameDatasets(v1::LocalRequest* r) {
  const fuzz::FuzzEngine& fe = fuzz::GetFuzzEngine();
  std::string* name = r->has_vectors() ? r->mutable_vectors()->mutable_dataset()
                      : r->has_layout() ? r->mutable_layout()->mutable_dataset()
                      : r->has_open_files()
                          ? r->mutable_open_files()->mutable_dataset()
                          : nullptr;
  if (name == nullptr || (*name != "A" && *name != "B")) return false;
  *name = *name == "A" ? fe.a.id : fe.b.id;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  GetChannel();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Channel& ch = GetChannel();
  const fuzz::FuzzDataset& a = fuzz::GetFuzzEngine().a;
  UniqueFd sock = Connect(ch.path);
  size_t at = 0;
  while (at < size) {
    size_t len = 0;
    if (size - at >= 2) {
      len = data[at] | (static_cast<size_t>(data[at + 1]) << 8);
      at += 2;
    } else {
      at = size;
    }
    len = std::min(len, size - at);
    std::string packet(reinterpret_cast<const char*>(data) + at, len);
    at += len;
    v1::LocalRequest parsed;
    const bool is_request = parsed.ParseFromString(packet) &&
                            parsed.descriptors() == 0 && !packet.empty();
    // The seeds name the engine's datasets "A" and "B" (their ids are
    // content hashes): such a request is sent with the real id.
    if (is_request && NameDatasets(&parsed))
      packet = parsed.SerializeAsString();
    if (::send(sock.get(), packet.data(), packet.size(), MSG_NOSIGNAL) < 0) {
      break;  // the daemon closed the connection
    }
    if (packet.empty()) break;  // an empty packet reads as a close
    REQUIRE(AnsweredWithin(sock.get(), 30));  // a reply or a close
    v1::LocalReply reply;
    std::vector<UniqueFd> fds;
    auto got = local::ReceiveMessage(sock.get(), &reply, &fds, MSG_DONTWAIT);
    // A reply is a message whose descriptors match (INVALID_ARGUMENT says it
    // was not); ECONNRESET: the daemon closed with a packet of ours unread.
    REQUIRE(got.ok() || !absl::IsInvalidArgument(got.status()));
    if (!got.ok() || *got != local::Received::kMessage) break;  // closed
    if (is_request && reply.code() != 3) REQUIRE(reply.id() == parsed.id());
    if (reply.has_query_region() && fds.size() == 1) {
      FillRegion(fds[0].get(), reply.query_region().bytes(), a);
    }
  }
  sock.Reset();
  // The channel still serves a fresh connection.
  UniqueFd fresh = Connect(ch.path);
  v1::LocalRequest ask;
  ask.set_id(1);
  ask.mutable_layout()->set_dataset(a.id);
  REQUIRE(local::SendMessage(fresh.get(), ask).ok());
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  auto got = local::ReceiveMessage(fresh.get(), &reply, &fds);
  REQUIRE(got.ok() && *got == local::Received::kMessage);
  REQUIRE(reply.id() == 1);  // FAILED_PRECONDITION: no query region yet
  return 0;
}
