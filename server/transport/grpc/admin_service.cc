#include "server/transport/grpc/admin_service.h"

#include "absl/time/clock.h"
#include "common/base/tsan.h"
#include "common/base/version.h"
#include "common/format/metadata.h"
#include "common/format/pyjson.h"
#include "proto/grpc_status.h"
#include "server/transport/figures.h"

namespace shardcast {

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
  out->set_variant(d.external != nullptr ? d.external->format
                                         : std::string(VariantName(d.variant)));
  for (int64_t l : d.layers) out->add_layers(l);
  out->set_content_tokens(d.content_tokens);
  out->set_cls_token(d.cls_token);
  out->set_tokens_per_example(d.tokens_per_example);
  out->set_d_model(d.d_model);
  out->set_n_examples(d.n_examples);
  out->set_examples_per_shard(d.examples_per_shard);
  out->set_num_shards(d.num_data_shards());
  out->set_bytes(d.data_bytes());
  out->set_has_labels(info.has_labels);
  out->set_hash_matches_dir(info.hash_matches_dir);
  out->set_has_example_info(info.has_samples);
  out->set_has_stats(info.has_stats);
  for (const std::string& w : d.warnings) out->add_warnings(ValidUtf8(w));
}

grpc::ServerUnaryReactor* AdminService::Done(grpc::CallbackServerContext* ctx,
                                             const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  Finish(reactor, status);
  return reactor;
}

void AdminService::Finish(grpc::ServerUnaryReactor* reactor,
                          const absl::Status& status) {
  context_.metrics->calls_total++;
  context_.metrics->CallDone(status.code());
  // The daemon tears the engine down after the server's Wait(), which
  // orders it after this handler; ThreadSanitizer cannot see inside gRPC,
  // so the handler says so (the daemon acquires after Wait,
  // common/base/tsan.h).
  TsanRelease(context_.metrics);
  reactor->Finish(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* AdminService::CheckSweep(
    grpc::CallbackServerContext* ctx, const v1::CheckSweepRequest*,
    v1::CheckSweepResponse* response) {
  if (sweep_ == nullptr) {
    return Done(ctx, absl::FailedPreconditionError(
                         "this daemon is not in a sweep (no --sweep-peer)"));
  }
  // Asking the peers blocks (up to 5 s): on a worker, not gRPC's thread.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  context_.pool->Submit([this, caller = CallerOf(context_, ctx), response,
                         reactor] {
    *response = sweep_->Check(SweepHello(context_, caller, sweep_->sweep()));
    Finish(reactor, absl::OkStatus());
  });
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::ListDatasets(
    grpc::CallbackServerContext* ctx, const v1::ListDatasetsRequest*,
    v1::ListDatasetsResponse* response) {
  // A local caller sees the datasets its user could open (a dataset's
  // metadata is the dataset's too: AccessChecker), and those rejected.
  const Caller caller = CallerOf(context_, ctx);
  for (const auto& entry : context_.engine->catalog().List()) {
    if (caller.local && !CheckCaller(context_, caller, entry->id).ok()) {
      continue;
    }
    FillDatasetInfo(*entry, response->add_datasets());
  }
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminService::DescribeDataset(
    grpc::CallbackServerContext* ctx, const v1::DescribeDatasetRequest* request,
    v1::DatasetInfo* response) {
  auto entry = context_.engine->catalog().Find(request->dataset());
  if (!entry.ok()) return Done(ctx, entry.status());
  // Its metadata is the dataset's too: a local caller sees it only when its
  // user could open the files (the check runs here, on gRPC's thread, at
  // most once per user and dataset in a while: AccessChecker).
  absl::Status allowed =
      CheckCaller(context_, CallerOf(context_, ctx), (*entry)->id);
  if (!allowed.ok()) return Done(ctx, allowed);
  FillDatasetInfo(**entry, response);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* AdminService::GetStatus(
    grpc::CallbackServerContext* ctx, const v1::GetStatusRequest*,
    v1::ServerStatus* response) {
  const Metrics& m = *context_.metrics;
  const EngineFigures e = context_.engine->Figures();
  response->set_version(kShardcastVersion);
  response->set_node_rank(context_.engine->node_group().first);
  response->set_node_count(context_.engine->node_group().second);
  response->set_query_threads(context_.pool->threads());
  response->set_uptime_seconds(
      absl::ToDoubleSeconds(absl::Now() - m.start_time));
  response->set_connected_clients(m.calls_in_flight.load());
  response->set_calls_total(m.calls_total.load() + 1);  // this one too
  response->set_calls_failed(m.CallsFailed());
  response->set_bytes_served(m.bytes_served.load());
  const ResidentMemory rss = ReadResidentMemory();
  response->set_memory_rss_bytes(rss.total);
  response->set_memory_rss_anon_bytes(rss.anon);
  response->set_memory_rss_file_bytes(rss.file);
  response->set_memory_rss_shmem_bytes(rss.shmem);
  response->set_datasets_ok(e.datasets_ok);
  response->set_datasets_failed(e.datasets_failed);
  response->set_bytes_read_from_disk(e.bytes_read);
  response->set_device_read_bytes(DeviceReadBytes());
  response->set_reservoir_bytes(e.reservoir_bytes);
  response->set_reservoir_bytes_in_use(e.reservoir_bytes_in_use);
  response->set_reservoir_bytes_touched(e.reservoir_bytes_touched);
  response->set_reservoir_bytes_reserved(e.reservoir_bytes_reserved);
  response->set_blocks_read(e.blocks_read);
  response->set_bytes_delivered(m.bytes_delivered.load());
  if (context_.shm != nullptr) {
    const ShmFigures shm = context_.shm->Figures();
    response->set_shm_regions(shm.regions);
    response->set_shm_bytes(shm.bytes);
    response->set_shm_streams(shm.attached);
  }
  if (context_.local != nullptr) {
    const LocalAcceptorFigures local = context_.local->Figures();
    response->set_local_connections(local.connections);
    response->set_local_refused(local.refused_busy + local.refused_denied);
    response->set_local_accept_starved(local.starved);
    for (const LocalPeer& p : local.peers) {
      v1::LocalClient* c = response->add_local_clients();
      c->set_pid(p.pid);
      c->set_uid(p.uid);
      c->set_gid(p.gid);
    }
  }
  for (const ScanStatus& s : e.scans) {
    v1::ScanStatus* out = response->add_scans();
    out->set_dataset(ValidUtf8(s.dataset));
    out->set_selection(s.selection);
    out->set_io(s.io);
    out->set_blocks(s.num_blocks);
    out->set_cycle(s.cycle);
    out->set_position(s.position);
    out->set_blocks_read(s.blocks_read);
    out->set_bytes_read(s.bytes_read);
    for (const SubscriberStatus& c : s.subscribers) {
      v1::ScanClient* client = out->add_clients();
      client->set_peer(ValidUtf8(c.peer));
      client->set_client(c.client);
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
  for (const Figure& f :
       context_.figures ? context_.figures(&e) : std::vector<Figure>()) {
    v1::Figure* out = response->add_figures();
    out->set_name(f.name);
    out->set_kind(FigureKindName(f.kind));
    out->set_unit(f.unit);
    out->set_help(f.help);
    for (const char* label : f.label_names) out->add_label_names(label);
    for (const FigureSample& sample : f.samples) {
      v1::FigureSample* s = out->add_samples();
      for (const std::string& v : sample.labels) s->add_labels(ValidUtf8(v));
      s->set_value(sample.value);
    }
  }
  const absl::Time now = absl::Now();
  for (const StreamFigures& f : m.streams.Snapshot()) {
    v1::ClientStream* out = response->add_streams();
    out->set_client(f.info.client);
    out->set_peer(ValidUtf8(f.info.peer));
    out->set_dataset(ValidUtf8(f.info.dataset));
    out->set_order(f.info.order);
    out->set_transport(f.info.transport);
    out->set_rank(f.info.rank);
    out->set_world_size(f.info.world_size);
    out->set_seconds(absl::ToDoubleSeconds(now - f.info.started));
    out->set_batches(f.batches);
    out->set_bytes(f.bytes);
  }
  return Done(ctx, absl::OkStatus());
}

}  // namespace shardcast
