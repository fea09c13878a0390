// Commands that talk to shardcastd: ls, info, get, stream, status (bench is
// in bench_command.cc).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cli/commands.h"
#include "client/cli/stream_check_internal.h"
#include "common/base/file.h"
#include "common/base/status.h"
#include "common/format/pyjson.h"
#include "nlohmann/json.hpp"
#include "shardcast/client.h"

namespace shardcast {
namespace {

using OrderedJson = nlohmann::ordered_json;

std::string g_address;
ClientOptions g_options;

absl::StatusOr<std::unique_ptr<Client>> Connect() {
  return Client::Connect(g_address, g_options);
}

}  // namespace

bool IsDatasetPath(const std::string& arg) {
  return arg.find('/') != std::string::npos || arg == "." || arg == "..";
}

absl::StatusOr<std::string> ResolveDataset(Client& client,
                                           const std::string& arg) {
  if (!IsDatasetPath(arg)) return arg;
  ASSIGN_OR_RETURN(DatasetDescription d, client.AttachDataset(arg));
  return d.id;
}

namespace {

OrderedJson InfoJson(const DatasetDescription& d) {
  OrderedJson j;
  j["id"] = d.id;
  j["ok"] = d.ok;
  if (!d.ok) j["error"] = d.error;
  j["protocol"] = d.protocol;
  j["variant"] = d.variant;
  j["hash_matches_dir"] = d.hash_matches_dir;
  j["layers"] = d.layers;
  j["content_tokens"] = d.content_tokens;
  j["cls_token"] = d.cls_token;
  j["tokens_per_example"] = d.tokens_per_example;
  j["d_model"] = d.d_model;
  j["n_examples"] = d.n_examples;
  j["examples_per_shard"] = d.examples_per_shard;
  j["num_shards"] = d.num_shards;
  j["bytes"] = d.bytes;
  j["has_labels"] = d.has_labels;
  j["warnings"] = d.warnings;
  return j;
}

int RunLs(const Args& args) {
  const char* cmd = "ls";
  auto client = Connect();
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  auto list = (*client)->ListDatasets();
  if (!list.ok()) return Fail(cmd, std::string(list.status().message()));
  if (args.Has("json")) {
    OrderedJson a = OrderedJson::array();
    for (const auto& d : *list) a.push_back(InfoJson(d));
    std::printf("%s\n", JsonText(a, 2).c_str());
    return kExitOk;
  }
  for (const auto& d : *list) {
    if (d.ok) {
      std::printf("%-66s %-8s %8lld examples  L=%d T=%lld D=%lld  %.1f MiB\n",
                  d.id.c_str(), d.variant.c_str(),
                  static_cast<long long>(d.n_examples),
                  static_cast<int>(d.layers.size()),
                  static_cast<long long>(d.tokens_per_example),
                  static_cast<long long>(d.d_model),
                  static_cast<double>(d.bytes) / (1 << 20));
    } else {
      std::printf("%-66s REJECTED: %s\n", d.id.c_str(), d.error.c_str());
    }
  }
  return kExitOk;
}

int RunInfo(const Args& args) {
  const char* cmd = "info";
  if (args.positional().size() != 1) {
    std::fprintf(stderr,
                 "shardcast info: expected one dataset (a directory or an "
                 "ID)\n");
    return kExitUsage;
  }
  auto client = Connect();
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  const std::string& arg = args.positional()[0];
  auto d = IsDatasetPath(arg) ? (*client)->AttachDataset(arg)
                              : (*client)->DescribeDataset(arg);
  if (!d.ok()) return Fail(cmd, std::string(d.status().message()));
  std::printf("%s\n", JsonText(InfoJson(*d), 2).c_str());
  return kExitOk;
}

int RunGet(const Args& args) {
  const char* cmd = "get";
  if (args.positional().size() != 1 || !args.Has("example") ||
      !args.Has("layer") || args.Has("all-tokens") == args.Has("token")) {
    std::fprintf(stderr,
                 "shardcast get: expected ID --example E --layer L "
                 "(--token T | --all-tokens)\n");
    return kExitUsage;
  }
  auto example = args.GetInt("example", 0);
  auto layer = args.GetInt("layer", 0);
  auto token = args.GetInt("token", 0);
  for (const absl::Status& s :
       {example.status(), layer.status(), token.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "shardcast get: %s\n",
                   std::string(s.message()).c_str());
      return kExitUsage;
    }
  }
  auto client = Connect();
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  auto resolved = ResolveDataset(**client, args.positional()[0]);
  if (!resolved.ok()) return Fail(cmd, std::string(resolved.status().message()));
  const std::string& id = *resolved;
  absl::StatusOr<VectorBlock> block =
      args.Has("all-tokens")
          ? (*client)->GetExample(id, *example, *layer)
          : (*client)->GetVectors(id, {{*example, *layer, *token}});
  if (!block.ok()) return Fail(cmd, std::string(block.status().message()));
  const int64_t d = block->shape.back();
  return PrintVectors(cmd, block->values.data(),
                      args.Has("all-tokens") ? block->shape[0] : -1, d,
                      args.Has("json"), args.Has("raw"));
}

// Reads a resume token written by --resume-token-out.
absl::StatusOr<std::string> ReadResumeToken(const std::string& path) {
  absl::StatusOr<std::string> token = ReadFileToString(path, 64 << 20);
  if (!token.ok()) {
    return Annotate(token.status(), absl::StrCat("--resume-token-in ", path));
  }
  if (token->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--resume-token-in ", path,
        " is empty (a resume token is the bytes --resume-token-out wrote)"));
  }
  return token;
}

// Replaces `path` with `bytes` (temporary file, fsync, rename), so an
// interrupted write never leaves half a token.
absl::Status WriteResumeToken(const std::string& path,
                              const std::string& bytes) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    ASSIGN_OR_RETURN(UniqueFd fd,
                     OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644));
    RETURN_IF_ERROR(WriteFull(fd.get(), bytes.data(), bytes.size(), tmp));
    RETURN_IF_ERROR(Fsync(fd.get(), tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, absl::StrCat("rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// Builds the StreamRequest from `stream`'s options; a usage message
// otherwise.
absl::StatusOr<StreamRequest> StreamRequestFromArgs(const Args& args) {
  StreamRequest req;
  req.dataset = args.positional()[0];
  auto batch = args.GetInt("batch-size", 4096);
  auto epochs = args.GetInt("epochs", 1);
  auto rank = args.GetInt("rank", 0);
  auto world = args.GetInt("world-size", 1);
  auto node_rank = args.GetInt("node-rank", 0);
  auto node_count = args.GetInt("node-count", 0);
  auto seed = args.GetInt("seed", 0);
  auto layer = args.GetInt("layer", 0);
  auto exclude = args.GetIntList("exclude-labels", "");
  for (const absl::Status& s : {batch.status(), epochs.status(), rank.status(),
                                world.status(), seed.status(), layer.status(),
                                node_rank.status(), node_count.status()}) {
    RETURN_IF_ERROR(s);
  }
  if (args.Has("exclude-labels")) {
    RETURN_IF_ERROR(exclude.status());
    for (int64_t l : *exclude) {
      if (l < 0 || l > 255) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--exclude-labels: ", l, " is not a uint8 label (0-255)"));
      }
      req.exclude_labels.push_back(static_cast<uint32_t>(l));
    }
  }
  if (args.Has("layer")) req.layer = *layer;
  const std::string dtype = args.Get("dtype", "float32");
  if (dtype == "float32") {
    req.dtype = StreamRequest::DType::kFloat32;
  } else if (dtype == "bfloat16") {
    req.dtype = StreamRequest::DType::kBFloat16;
  } else if (dtype == "float16") {
    req.dtype = StreamRequest::DType::kFloat16;
  } else {
    return absl::InvalidArgumentError(
        "--dtype takes float32, bfloat16 or float16");
  }
  req.scale_norm = args.Has("scale-norm");
  req.center = args.Has("center");
  const std::string tokens = args.Get("tokens", "content");
  if (tokens == "content") {
    req.tokens = StreamRequest::Tokens::kContent;
  } else if (tokens == "special") {
    req.tokens = StreamRequest::Tokens::kSpecial;
  } else if (tokens == "all") {
    req.tokens = StreamRequest::Tokens::kAll;
  } else {
    return absl::InvalidArgumentError("--tokens takes content, special or all");
  }
  const std::string order = args.Get("order", "shuffled");
  if (order != "ordered" && order != "shuffled") {
    return absl::InvalidArgumentError("--order takes ordered or shuffled");
  }
  req.order = order == "ordered" ? StreamRequest::Order::kOrdered
                                 : StreamRequest::Order::kShuffled;
  req.batch_size = *batch;
  req.epochs = *epochs;
  req.rank = *rank;
  req.node_rank = *node_rank;
  req.node_count = *node_count;
  req.world_size = *world;
  req.seed = static_cast<uint64_t>(*seed);
  req.drop_last = args.Has("drop-last");
  return req;
}

int RunStream(const Args& args) {
  const char* cmd = "stream";
  if (args.positional().size() != 1) {
    std::fprintf(stderr,
                 "shardcast stream: expected one dataset (a directory or "
                 "an ID)\n");
    return kExitUsage;
  }
  absl::StatusOr<StreamRequest> parsed = StreamRequestFromArgs(args);
  auto max_batches = args.GetInt("max-batches", 0);
  if (parsed.ok() && !max_batches.ok()) parsed = max_batches.status();
  if (parsed.ok() && args.Has("max-batches") && *max_batches < 1) {
    parsed = absl::InvalidArgumentError("--max-batches must be >= 1");
  }
  if (!parsed.ok()) {
    std::fprintf(stderr, "shardcast stream: %s\n",
                 std::string(parsed.status().message()).c_str());
    return kExitUsage;
  }
  StreamRequest& req = *parsed;
  if (args.Has("resume-token-in")) {
    auto token = ReadResumeToken(args.Get("resume-token-in"));
    if (!token.ok()) return Fail(cmd, std::string(token.status().message()));
    req.resume_token = std::move(*token);
  }
  auto client = Connect();
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  auto resolved = ResolveDataset(**client, req.dataset);
  if (!resolved.ok()) return Fail(cmd, std::string(resolved.status().message()));
  req.dataset = *resolved;
  const bool check = args.Has("check");
  std::unique_ptr<StreamChecker> checker;
  if (check) {
    // The expected selection comes from the dataset's description and the
    // protocol's rules, not from the stream itself.
    auto info = (*client)->DescribeDataset(req.dataset);
    if (!info.ok()) return Fail(cmd, std::string(info.status().message()));
    auto created = StreamChecker::Create(client->get(), req, *info);
    if (!created.ok()) {
      return Fail(cmd, std::string(created.status().message()));
    }
    checker = std::move(*created);
  }
  if (args.Has("start-sync")) {
    // bench: say we are connected, then wait until every client is.
    auto fds = args.GetIntList("start-sync", "");
    if (!fds.ok() || fds->size() != 2) {
      std::fprintf(stderr,
                   "shardcast stream: --start-sync takes READY_FD,GO_FD\n");
      return kExitUsage;
    }
    const int ready = static_cast<int>((*fds)[0]);
    const int go = static_cast<int>((*fds)[1]);
    ssize_t n;
    do {
      n = ::write(ready, "r", 1);
    } while (n < 0 && errno == EINTR);
    ::close(ready);
    char c;
    do {
      n = ::read(go, &c, 1);
    } while (n > 0 || (n < 0 && errno == EINTR));
    ::close(go);
  }
  int64_t batches = 0, vectors = 0;
  uint64_t bytes = 0;
  std::string last_token;
  bool stopped = false;  // by --max-batches
  const auto start = absl::Now();
  // A malformed batch ends the stream with DATA_LOSS from Finish.
  auto stream = (*client)->OpenStream(req);
  Batch b;
  while (stream->Next(&b)) {
    ++batches;
    vectors += b.rows();
    bytes += b.vector_bytes().size();
    last_token = b.resume_token();
    if (checker) checker->AddBatch(b);
    if (*max_batches > 0 && batches >= *max_batches) {
      stopped = true;
      stream->Cancel();
      break;
    }
  }
  if (stopped) {
    while (stream->Next(&b)) {
    }
  }
  absl::Status st = stream->Finish();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  if (stopped && absl::IsCancelled(st)) st = absl::OkStatus();
  if (args.Has("resume-token-out")) {
    const std::string path = args.Get("resume-token-out");
    if (last_token.empty()) {
      std::fprintf(stderr,
                   "shardcast stream: no batch arrived, so %s was not "
                   "written\n",
                   path.c_str());
    } else if (absl::Status w = WriteResumeToken(path, last_token); !w.ok()) {
      return Fail(cmd, std::string(w.message()));
    }
  }
  if (!st.ok()) return Fail(cmd, std::string(st.message()));
  OrderedJson j;
  j["batches"] = batches;
  j["vectors"] = vectors;
  j["bytes"] = bytes;
  j["seconds"] = secs;
  j["bytes_per_second"] = secs > 0 ? static_cast<double>(bytes) / secs : 0.0;
  std::vector<std::string> epoch_lines;
  if (checker) {
    checker->Finish(stopped ? StreamChecker::End::kInterrupted
                            : StreamChecker::End::kComplete);
    epoch_lines = checker->EpochLines();
    j["epochs_checked"] = epoch_lines;
  }
  j["last_resume_token_bytes"] = last_token.size();
  j["shared_memory"] = stream->shared_memory();
  if (checker) j["check"] = checker->Json();
  if (args.Has("json")) {
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    std::printf(
        "%lld batches, %lld vectors, %.1f MiB in %.2f s (%.0f MiB/s, %s)\n",
        static_cast<long long>(batches), static_cast<long long>(vectors),
        static_cast<double>(bytes) / (1 << 20), secs,
        secs > 0 ? static_cast<double>(bytes) / (1 << 20) / secs : 0.0,
        stream->shared_memory() ? "shared memory" : "gRPC messages");
    if (checker) {
      for (const std::string& line : epoch_lines) {
        std::printf("%s\n", line.c_str());
      }
      if (!checker->note().empty()) {
        std::printf("note: %s\n", checker->note().c_str());
      }
      std::printf(
          "check: %s (%lld sampled vectors compared with GetVectors, "
          "%lld differ)\n",
          checker->ok() ? "ok" : "FAILED",
          static_cast<long long>(checker->sampled_vectors()),
          static_cast<long long>(checker->mismatched_vectors()));
    }
  }
  std::fflush(stdout);
  if (checker && !checker->ok()) {
    std::string message =
        absl::StrCat("--check found ", checker->problem_count(), " problem",
                     checker->problem_count() == 1 ? "" : "s");
    for (const std::string& p : checker->problems()) {
      absl::StrAppend(&message, "\n  ", p);
    }
    if (checker->problem_count() >
        static_cast<int64_t>(checker->problems().size())) {
      absl::StrAppend(&message, "\n  ...");
    }
    return Fail(cmd, message);
  }
  return kExitOk;
}

int RunHealth(const Args& args) {
  const char* cmd = "health";
  double timeout = 5;
  if (args.Has("timeout") &&
      (!absl::SimpleAtod(args.Get("timeout"), &timeout) || !(timeout > 0) ||
       timeout > 3600)) {
    std::fprintf(stderr,
                 "shardcast health: --timeout must be seconds in (0, 3600], "
                 "got \"%s\"\n",
                 args.Get("timeout").c_str());
    return kExitUsage;
  }
  ClientOptions options = g_options;
  options.connect_timeout_seconds =
      std::max(1, static_cast<int>(std::ceil(timeout)));
  auto client = Client::Connect(g_address, options);
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  auto health = (*client)->CheckHealth(timeout);
  if (!health.ok()) return Fail(cmd, std::string(health.status().message()));
  const char* name = *health == Client::Health::kServing      ? "SERVING"
                     : *health == Client::Health::kNotServing ? "NOT_SERVING"
                                                              : "UNKNOWN";
  if (args.Has("json")) {
    OrderedJson j;
    j["address"] = g_address;
    j["status"] = name;
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    std::printf("%s: %s\n", g_address.c_str(), name);
  }
  return *health == Client::Health::kServing ? kExitOk : kExitFailure;
}

int RunStatus(const Args& args) {
  const char* cmd = "status";
  auto client = Connect();
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  // The reply as the client gets it, every field by its proto name: nothing
  // here names a counter, so a figure the daemon adds is printed too.
  absl::StatusOr<std::string> text = (*client)->GetStatusJson();
  if (!text.ok()) return Fail(cmd, std::string(text.status().message()));
  absl::StatusOr<Json> parsed = ParseJson(*text, "the daemon's status");
  if (!parsed.ok()) return Fail(cmd, std::string(parsed.status().message()));
  const Json& j = *parsed;
  if (args.Has("json")) {
    std::printf("%s\n", JsonText(j, 2).c_str());
    return kExitOk;
  }
  // Text: the scalar fields one per line, then a line per scan, per client
  // of a scan and per stream (the lists of figures and local clients are in
  // --json and on /metrics).
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.value().is_structured()) continue;
    std::printf("%-26s %s\n", it.key().c_str(), JsonText(it.value()).c_str());
  }
  auto str = [](const Json& o, const char* key) {
    const Json& v = o.at(key);
    return v.is_string() ? v.get<std::string>() : JsonText(v);
  };
  auto num = [](const Json& o, const char* key) {
    return o.at(key).get<double>();
  };
  for (const Json& sj : j.at("scans")) {
    std::printf(
        "scan %s (%s, %s reads): cycle %.0f, position %.0f of %.0f blocks, "
        "%.0f blocks read\n",
        str(sj, "dataset").substr(0, 12).c_str(), str(sj, "selection").c_str(),
        str(sj, "io").c_str(), num(sj, "cycle"), num(sj, "position"),
        num(sj, "blocks"), num(sj, "blocks_read"));
    for (const Json& cj : sj.at("clients")) {
      std::printf(
          "  client %s (%s) rank %.0f/%.0f: epoch %.0f, lag %.0f blocks, "
          "%.0f still needed, %.0f delivered, %.0f deferred\n",
          str(cj, "client").c_str(), str(cj, "peer").c_str(), num(cj, "rank"),
          num(cj, "world_size"), num(cj, "epoch"), num(cj, "lag_blocks"),
          num(cj, "blocks_needed"), num(cj, "blocks_delivered"),
          num(cj, "blocks_skipped"));
    }
  }
  for (const Json& cj : j.at("streams")) {
    const double seconds = num(cj, "seconds");
    const double mib = num(cj, "bytes") / (1 << 20);
    std::printf(
        "stream %s (%s): %s %s over %s, rank %.0f/%.0f, %.0f batches, "
        "%.1f MiB in %.1f s (%.1f MiB/s)\n",
        str(cj, "client").c_str(), str(cj, "peer").c_str(),
        str(cj, "order").c_str(), str(cj, "dataset").substr(0, 12).c_str(),
        str(cj, "transport").c_str(), num(cj, "rank"), num(cj, "world_size"),
        num(cj, "batches"), mib, seconds, seconds > 0 ? mib / seconds : 0.0);
  }
  return kExitOk;
}

}  // namespace

void SetRemoteTarget(const std::string& address, const ClientOptions& options) {
  g_address = address;
  g_options = options;
}

const std::string& RemoteAddress() { return g_address; }
const ClientOptions& RemoteOptions() { return g_options; }

std::vector<OptionSpec> StreamRequestOptions() {
  return {
      {"layer", "L", "layer value to stream (default: all layers)"},
      {"tokens", "SEL", "content (default), special (CLS) or all"},
      {"order", "ORDER",
       "shuffled (default: what trainers use, a seeded shuffle through the "
       "daemon's shared scan) or ordered (disk order: evaluation and "
       "visualiser passes)"},
      {"batch-size", "N", "vectors per batch (default 4096)"},
      {"epochs", "N", "epochs to stream (default 1; 0 = endless)"},
      {"rank", "R", "partition rank (default 0)"},
      {"world-size", "W", "partition count (default 1)"},
      {"node-rank", "N", "node group of this stream (default: the daemon's)"},
      {"node-count", "N",
       "node groups the data is shared out among (default: the daemon's "
       "--node-count)"},
      {"seed", "S", "shuffle seed"},
      {"drop-last", nullptr, "drop each epoch's short last batch"},
      {"exclude-labels", "L1,L2,...",
       "drop content tokens with these labels (labels.bin, 0-255)"},
      {"dtype", "T",
       "element type delivered: float32 (default), bfloat16 or float16 "
       "(rounded to nearest even by the daemon)"},
      {"scale-norm", nullptr,
       "scale each layer's vectors to a mean L2 norm of sqrt(d_model), with "
       "the dataset's statistics (`shardcast stats`)"},
      {"center", nullptr,
       "subtract each layer's mean vector (statistics as "
       "for --scale-norm)"},
      {"max-batches", "N",
       "stop after N batches, cancelling the stream (to resume it later)"},
      {"check", nullptr,
       "verify every batch against the selection and sampled vectors against "
       "GetVectors; exit 1 on any problem"},
  };
}

std::vector<Command> RemoteCommands() {
  const OptionSpec json{"json", nullptr, "print machine-readable JSON"};
  std::vector<OptionSpec> stream_options = StreamRequestOptions();
  stream_options.push_back(
      {"resume-token-out", "FILE", "write the last batch's resume token here"});
  stream_options.push_back(
      {"resume-token-in", "FILE",
       "continue the stream a --resume-token-out FILE was written for"});
  stream_options.push_back(
      {"start-sync", "READY,GO",
       "(used by bench) once connected, write a byte to descriptor READY, "
       "then wait for descriptor GO to reach EOF before opening the stream"});
  stream_options.push_back(json);
  return {
      {"ls",
       "[--server A] ls [--json]",
       "list the daemon's datasets (rejected ones too)",
       "Lists every dataset directory the daemon found, with its shape, or the "
       "error that kept it from being served.",
       {json},
       RunLs},
      {"info",
       "[--server A] info DATASET [--json]",
       "describe one dataset served by the daemon",
       "DATASET is a dataset directory, named by a path with a '/' in it "
       "(./HASH, /fs/acts/HASH): this process opens its files and hands them "
       "to the daemon on this node, which serves only what you can open. Or "
       "a catalog id: a directory name (content hash) under the daemon's "
       "--root, or a unique prefix of at least 8 characters. Prints JSON.",
       {json},
       RunInfo},
      {"get",
       "[--server A] get DATASET --example E --layer L (--token T | --all-tokens) "
       "[--json|--raw]",
       "read one vector (or one layer of an example) through the daemon",
       "Same output as the local `get`: T is the index on the token axis (0 is "
       "CLS when present). DATASET: a directory or an id, as for `info`.",
       {{"example", "E", "example index (0-based)"},
        {"layer", "L", "layer value as recorded in metadata"},
        {"token", "T", "index on the token axis"},
        {"all-tokens", nullptr, "print all T vectors of the layer, [T, D]"},
        {"raw", nullptr, "write little-endian float32 bytes to stdout"},
        json},
       RunGet},
      {"stream", "[--server A] stream DATASET [options] [--check] [--json]",
       "stream batches (ordered or shuffled) and print throughput",
       "Opens a Stream of DATASET (a directory or an id, as for `info`) and "
       "reads every batch, printing batches, vectors, "
       "seconds and bytes/s. Shuffled streams are reproducible from --seed "
       "for a client alone.\n\n"
       "Interrupting and resuming: --max-batches N stops after N batches "
       "(cancelling the stream); --resume-token-out FILE saves the last "
       "batch's resume token, and --resume-token-in FILE with the same "
       "options continues right after it.\n\n"
       "--check verifies the stream against an account of the selection "
       "made without the daemon's help (DescribeDataset, the rules of "
       "shardcast.proto and, with --exclude-labels, every example's labels "
       "from GetLabels): per epoch, every row is inside the dataset and the "
       "selection (layer, tokens, this rank's partition, label filter), no "
       "(example, layer, token) repeats, and at the end of a complete epoch "
       "every expected vector arrived. The first row of every batch and "
       "every 997th row are fetched again with GetVectors and compared byte "
       "for byte. An epoch begun with --resume-token-in or cut short by "
       "--max-batches is only checked for repeats and selection membership. "
       "Problems go to stderr and the exit status is 1. --json adds "
       "\"check\": {ok, epochs: [{epoch, vectors, distinct, expected, "
       "repeated, outside, complete}], sampled_vectors, "
       "mismatched_vectors}.",
       stream_options, RunStream},
      BenchCommand(),
      DoctorCommand(),
      {"health",
       "[--server A] health [--timeout S] [--json]",
       "ask the daemon's grpc.health.v1 service; exit 0 only when SERVING",
       "Calls grpc.health.v1.Health/Check for the whole server. Exit status "
       "0 when it answers SERVING; 1 when it answers NOT_SERVING (draining "
       "for shutdown) or cannot be reached within --timeout (default 5 s). "
       "Suited to Kubernetes exec probes and job scripts waiting for a "
       "daemon.",
       {{"timeout", "S", "seconds to wait for the connection and the answer"},
        json},
       RunHealth},
      {"status",
       "[--server A] status [--json]",
       "the daemon's uptime, clients, calls, bytes, memory, shared scans",
       "Prints the daemon's counters (Admin.GetStatus): calls, bytes served "
       "and read, memory, the reservoir, and each shared scan with its "
       "clients (epoch, lag in blocks, blocks still needed, delivered and "
       "deferred by the lag bound).",
       {json},
       RunStatus},
  };
}

}  // namespace shardcast
