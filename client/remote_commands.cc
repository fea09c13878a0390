// Commands that talk to shardcastd: ls, info, get, status.
#include <cstdio>
#include <cstring>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/commands.h"
#include "common/pyjson.h"
#include "nlohmann/json.hpp"

namespace shardcast {
namespace {

using OrderedJson = nlohmann::ordered_json;

std::string g_address;
ClientOptions g_options;

absl::StatusOr<std::unique_ptr<Client>> Connect() {
  return Client::Connect(g_address, g_options);
}

OrderedJson InfoJson(const v1::DatasetInfo& d) {
  OrderedJson j;
  j["id"] = d.id();
  j["ok"] = d.ok();
  if (!d.ok()) j["error"] = d.error();
  j["protocol"] = d.protocol();
  j["variant"] = d.variant();
  j["hash_matches_dir"] = d.hash_matches_dir();
  j["layers"] = std::vector<int64_t>(d.layers().begin(), d.layers().end());
  j["content_tokens"] = d.content_tokens();
  j["cls_token"] = d.cls_token();
  j["tokens_per_example"] = d.tokens_per_example();
  j["d_model"] = d.d_model();
  j["n_examples"] = d.n_examples();
  j["examples_per_shard"] = d.examples_per_shard();
  j["num_shards"] = d.num_shards();
  j["bytes"] = d.bytes();
  j["has_labels"] = d.has_labels();
  j["warnings"] =
      std::vector<std::string>(d.warnings().begin(), d.warnings().end());
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
    if (d.ok()) {
      std::printf("%-66s %-8s %8lld examples  L=%d T=%lld D=%lld  %.1f MiB\n",
                  d.id().c_str(), d.variant().c_str(),
                  static_cast<long long>(d.n_examples()), d.layers_size(),
                  static_cast<long long>(d.tokens_per_example()),
                  static_cast<long long>(d.d_model()),
                  static_cast<double>(d.bytes()) / (1 << 20));
    } else {
      std::printf("%-66s REJECTED: %s\n", d.id().c_str(), d.error().c_str());
    }
  }
  return kExitOk;
}

int RunInfo(const Args& args) {
  const char* cmd = "info";
  if (args.positional().size() != 1) {
    std::fprintf(stderr, "shardcast info: expected one dataset ID\n");
    return kExitUsage;
  }
  auto client = Connect();
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  auto d = (*client)->DescribeDataset(args.positional()[0]);
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
  const std::string id = args.positional()[0];
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

int RunStream(const Args& args) {
  const char* cmd = "stream";
  if (args.positional().size() != 1) {
    std::fprintf(stderr, "shardcast stream: expected one dataset ID\n");
    return kExitUsage;
  }
  v1::StreamRequest req;
  req.set_dataset(args.positional()[0]);
  auto batch = args.GetInt("batch-size", 4096);
  auto epochs = args.GetInt("epochs", 1);
  auto rank = args.GetInt("rank", 0);
  auto world = args.GetInt("world-size", 1);
  auto seed = args.GetInt("seed", 0);
  auto layer = args.GetInt("layer", 0);
  for (const absl::Status& s :
       {batch.status(), epochs.status(), rank.status(), world.status(),
        seed.status(), layer.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "shardcast stream: %s\n",
                   std::string(s.message()).c_str());
      return kExitUsage;
    }
  }
  if (args.Has("layer")) req.set_layer(*layer);
  const std::string tokens = args.Get("tokens", "content");
  if (tokens == "content") {
    req.set_tokens(v1::TOKENS_CONTENT);
  } else if (tokens == "special") {
    req.set_tokens(v1::TOKENS_SPECIAL);
  } else if (tokens == "all") {
    req.set_tokens(v1::TOKENS_ALL);
  } else {
    std::fprintf(stderr,
                 "shardcast stream: --tokens takes content, special or all\n");
    return kExitUsage;
  }
  const std::string order = args.Get("order", "ordered");
  if (order != "ordered" && order != "shuffled") {
    std::fprintf(stderr,
                 "shardcast stream: --order takes ordered or shuffled\n");
    return kExitUsage;
  }
  req.set_order(order == "ordered" ? v1::ORDER_ORDERED : v1::ORDER_SHUFFLED);
  req.set_batch_size(*batch);
  req.set_epochs(*epochs);
  req.set_rank(*rank);
  req.set_world_size(*world);
  req.set_seed(static_cast<uint64_t>(*seed));
  req.set_drop_last(args.Has("drop-last"));
  auto client = Connect();
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  // --check: the daemon's description gives the selection's size, so the
  // CLI can tell whether every selected vector arrived exactly once.
  auto info = (*client)->DescribeDataset(req.dataset());
  if (!info.ok()) return Fail(cmd, std::string(info.status().message()));
  const bool check = args.Has("check");
  const int64_t T = info->tokens_per_example();
  const int64_t L = args.Has("layer") ? 1 : info->layers_size();
  std::vector<uint8_t> seen;  // per (epoch-local) example, layer, token
  if (check) seen.assign(static_cast<size_t>(info->n_examples() * L * T), 0);
  int64_t duplicates = 0, batches = 0, vectors = 0, current_epoch = -1;
  uint64_t bytes = 0;
  std::string last_token;
  std::vector<std::string> problems;
  auto finish_epoch = [&]() {
    if (!check || current_epoch < 0) return;
    int64_t seen_count = 0;
    for (uint8_t s : seen) seen_count += s;
    problems.push_back(absl::StrCat("epoch ", current_epoch, ": ", seen_count,
                                    " distinct vectors, ", duplicates,
                                    " repeated"));
    std::fill(seen.begin(), seen.end(), 0);
    duplicates = 0;
  };
  const auto start = absl::Now();
  auto stream = (*client)->OpenStream(req);
  v1::Batch b;
  std::vector<std::pair<int64_t, int64_t>> epoch_counts;
  while (stream->Next(&b)) {
    if (b.epoch() != current_epoch) {
      finish_epoch();
      current_epoch = b.epoch();
    }
    ++batches;
    vectors += b.rows();
    bytes += b.vectors().size();
    last_token = b.resume_token();
    if (static_cast<int64_t>(b.vectors().size()) !=
            b.rows() * b.d_model() * 4 ||
        static_cast<int64_t>(b.example_idx().size()) != b.rows() * 8 ||
        static_cast<int64_t>(b.token_idx().size()) != b.rows() * 4) {
      return Fail(cmd, absl::StrCat("batch ", batches, " is malformed"));
    }
    if (check) {
      std::map<int64_t, int64_t> layer_index;
      for (int i = 0; i < info->layers_size(); ++i)
        layer_index[info->layers(i)] = i;
      for (int64_t i = 0; i < b.rows(); ++i) {
        int64_t e;
        int32_t t;
        std::memcpy(&e, b.example_idx().data() + i * 8, 8);
        std::memcpy(&t, b.token_idx().data() + i * 4, 4);
        int64_t li = 0;
        if (!b.layer().empty()) {
          int64_t value;
          std::memcpy(&value, b.layer().data() + i * 8, 8);
          li = layer_index[value];
        }
        const int64_t raw = t + (info->cls_token() ? 1 : 0);
        if (e < 0 || e >= info->n_examples() || raw < 0 || raw >= T) {
          return Fail(cmd, absl::StrCat("batch ", batches, " names example ", e,
                                        " token ", t, " outside the dataset"));
        }
        uint8_t& s = seen[static_cast<size_t>((e * L + li) * T + raw)];
        if (s) ++duplicates;
        s = 1;
      }
    }
  }
  absl::Status st = stream->Finish();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  finish_epoch();
  if (!st.ok()) return Fail(cmd, std::string(st.message()));
  OrderedJson j;
  j["batches"] = batches;
  j["vectors"] = vectors;
  j["bytes"] = bytes;
  j["seconds"] = secs;
  j["bytes_per_second"] = secs > 0 ? static_cast<double>(bytes) / secs : 0.0;
  if (check) j["epochs_checked"] = problems;
  j["last_resume_token_bytes"] = last_token.size();
  if (args.Has("json")) {
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    std::printf("%lld batches, %lld vectors, %.1f MiB in %.2f s (%.0f MiB/s)\n",
                static_cast<long long>(batches),
                static_cast<long long>(vectors),
                static_cast<double>(bytes) / (1 << 20), secs,
                secs > 0 ? static_cast<double>(bytes) / (1 << 20) / secs : 0.0);
    for (const std::string& p : problems) std::printf("%s\n", p.c_str());
  }
  return kExitOk;
}

int RunStatus(const Args& args) {
  const char* cmd = "status";
  auto client = Connect();
  if (!client.ok()) return Fail(cmd, std::string(client.status().message()));
  auto s = (*client)->GetStatus();
  if (!s.ok()) return Fail(cmd, std::string(s.status().message()));
  OrderedJson j;
  j["version"] = s->version();
  j["uptime_seconds"] = s->uptime_seconds();
  j["connected_clients"] = s->connected_clients();
  j["calls_total"] = s->calls_total();
  j["calls_failed"] = s->calls_failed();
  j["bytes_served"] = s->bytes_served();
  j["bytes_read_from_disk"] = s->bytes_read_from_disk();
  j["memory_rss_bytes"] = s->memory_rss_bytes();
  j["datasets_ok"] = s->datasets_ok();
  j["datasets_failed"] = s->datasets_failed();
  if (args.Has("json")) {
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    for (auto it = j.begin(); it != j.end(); ++it) {
      std::printf("%-22s %s\n", it.key().c_str(), JsonText(it.value()).c_str());
    }
  }
  return kExitOk;
}

}  // namespace

void SetRemoteTarget(const std::string& address, const ClientOptions& options) {
  g_address = address;
  g_options = options;
}

std::vector<Command> RemoteCommands() {
  const OptionSpec json{"json", nullptr, "print machine-readable JSON"};
  return {
      {"ls",
       "--server A ls [--json]",
       "list the daemon's datasets (rejected ones too)",
       "Lists every dataset directory the daemon found, with its shape, or the "
       "error that kept it from being served.",
       {json},
       RunLs},
      {"info",
       "--server A info ID [--json]",
       "describe one dataset served by the daemon",
       "ID is the dataset's directory name (content hash) or a unique prefix "
       "of "
       "at least 8 characters. Prints JSON.",
       {json},
       RunInfo},
      {"get",
       "--server A get ID --example E --layer L (--token T | --all-tokens) "
       "[--json|--raw]",
       "read one vector (or one layer of an example) through the daemon",
       "Same output as the local `get`: T is the index on the token axis (0 is "
       "CLS when present).",
       {{"example", "E", "example index (0-based)"},
        {"layer", "L", "layer value as recorded in metadata"},
        {"token", "T", "index on the token axis"},
        {"all-tokens", nullptr, "print all T vectors of the layer, [T, D]"},
        {"raw", nullptr, "write little-endian float32 bytes to stdout"},
        json},
       RunGet},
      {"stream",
       "--server A stream ID [options] [--check] [--json]",
       "stream batches (ordered or shuffled) and print throughput",
       "Opens a Stream and reads every batch, printing batches, vectors, "
       "seconds "
       "and bytes/s. --check also counts, per epoch, how many distinct "
       "(example, layer, token) vectors arrived and how many repeated. "
       "Shuffled streams are reproducible from --seed for a client alone.",
       {{"layer", "L", "layer value to stream (default: all layers)"},
        {"tokens", "SEL", "content (default), special (CLS) or all"},
        {"order", "ORDER", "ordered (default) or shuffled"},
        {"batch-size", "N", "vectors per batch (default 4096)"},
        {"epochs", "N", "epochs to stream (default 1; 0 = endless)"},
        {"rank", "R", "partition rank (default 0)"},
        {"world-size", "W", "partition count (default 1)"},
        {"seed", "S", "shuffle seed"},
        {"drop-last", nullptr, "drop each epoch's short last batch"},
        {"check", nullptr, "count distinct and repeated vectors per epoch"},
        json},
       RunStream},
      {"status",
       "--server A status [--json]",
       "the daemon's uptime, clients, calls, bytes, memory",
       "Prints the daemon's counters (Admin.GetStatus).",
       {json},
       RunStatus},
  };
}

}  // namespace shardcast
