// Commands that talk to shardcastd: ls, info, get, status.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
  j["warnings"] = std::vector<std::string>(d.warnings().begin(), d.warnings().end());
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
  if (args.positional().size() != 1 || !args.Has("example") || !args.Has("layer") ||
      args.Has("all-tokens") == args.Has("token")) {
    std::fprintf(stderr,
                 "shardcast get: expected ID --example E --layer L "
                 "(--token T | --all-tokens)\n");
    return kExitUsage;
  }
  auto example = args.GetInt("example", 0);
  auto layer = args.GetInt("layer", 0);
  auto token = args.GetInt("token", 0);
  for (const absl::Status& s : {example.status(), layer.status(), token.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "shardcast get: %s\n", std::string(s.message()).c_str());
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
      {"ls", "--server A ls [--json]", "list the daemon's datasets (rejected ones too)",
       "Lists every dataset directory the daemon found, with its shape, or the "
       "error that kept it from being served.",
       {json}, RunLs},
      {"info", "--server A info ID [--json]", "describe one dataset served by the daemon",
       "ID is the dataset's directory name (content hash) or a unique prefix of "
       "at least 8 characters. Prints JSON.",
       {json}, RunInfo},
      {"get", "--server A get ID --example E --layer L (--token T | --all-tokens) [--json|--raw]",
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
      {"status", "--server A status [--json]", "the daemon's uptime, clients, calls, bytes, memory",
       "Prints the daemon's counters (Admin.GetStatus).", {json}, RunStatus},
  };
}

}  // namespace shardcast
