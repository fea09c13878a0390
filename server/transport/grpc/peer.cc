#include "server/transport/grpc/peer.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/log.h"
#include "common/base/waiter.h"
#include "common/format/pyjson.h"
#include "proto/grpc_status.h"
#include "server/transport/grpc/stream_reactor.h"

namespace shardcast {

v1::PeerHello SweepHello(const TransportContext& context, const Caller& caller,
                         const SweepOptions& sweep) {
  v1::PeerHello hello;
  hello.set_node(sweep.self);
  for (const std::string& p : sweep.peers) hello.add_peers(p);
  hello.set_block_bytes(sweep.block_bytes);
  for (const auto& entry : context.engine->catalog().List()) {
    if (!entry->status.ok() || !entry->info.has_value() ||
        !CheckCaller(context, caller, entry->id).ok()) {
      continue;
    }
    v1::PeerDataset* out = hello.add_datasets();
    out->set_id(ValidUtf8(entry->id));  // proto strings are UTF-8
    out->set_hash(entry->info->hash);
    out->set_bytes(entry->info->desc.data_bytes());
  }
  return hello;
}

grpc::Status PeerService::Hello(grpc::ServerContext* ctx, const v1::PeerHello*,
                                v1::PeerHello* response) {
  *response = SweepHello(context_, CallerOf(context_, ctx), sweep_);
  return grpc::Status::OK;
}

grpc::Status PeerService::SharePass(
    grpc::ServerContext* ctx, const v1::SharePassRequest* request,
    grpc::ServerWriter<v1::ShareBlock>* writer) {
  if (request->from_node() < 0 || request->from_node() >= nodes_) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("from_node ", request->from_node(),
                     " is not a node of this sweep of ", nodes_)));
  }
  const std::string from = ctx->peer();  // "unknown" once cancelled
  const Caller caller = CallerOf(context_, ctx);
  absl::Status st = CheckCaller(context_, caller, request->dataset());
  if (!st.ok()) return ToGrpcStatus(st);
  // The selection's fields as a stream request has them (checked there).
  v1::StreamRequest as_stream;
  as_stream.set_dataset(request->dataset());
  if (request->has_layer()) as_stream.set_layer(request->layer());
  as_stream.set_tokens(request->tokens());
  absl::StatusOr<StreamOptions> o = ToStreamOptions(as_stream, ctx->peer());
  if (!o.ok()) return ToGrpcStatus(o.status());
  o->spec.sweep_share = request->share();
  o->spec.sweep_shares = request->shares();
  absl::StatusOr<std::unique_ptr<ShareFeed>> feed =
      context_.engine->OpenShareFeed(request->dataset(), o->spec,
                                     request->seed(), from);
  if (!feed.ok()) return ToGrpcStatus(feed.status());
  const std::string& hash = (*feed)->content_hash();
  if (!request->hash().empty() && request->hash() != hash) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "dataset ", PublicDatasetId(request->dataset()), " has content hash ",
        hash, " here, ", request->hash(),
        " on the asking node: another copy (shardcast doctor compares them)")));
  }
  if ((*feed)->vectors_per_block() != request->vectors_per_block() ||
      (*feed)->num_blocks() != request->num_blocks()) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "this daemon's blocks of the selection are ", (*feed)->num_blocks(),
        " of ", (*feed)->vectors_per_block(), " vectors; the peer's are ",
        request->num_blocks(), " of ", request->vectors_per_block(),
        " (give every node's daemon the same --block-bytes)")));
  }
  // A receiver that takes nothing for the timeout while others of this
  // scan starve (a node frozen or cut off; one whose trainers paused while
  // the rest go on): the pass leaves the scan at once (gRPC's Write may stay
  // stuck until the connection dies) and the call ends ABORTED, on which the
  // receiver asks for a new pass when it needs one. One that holds back
  // nobody (every node's trainers paused) is waited for.
  const double limit = std::chrono::duration<double>(stalls_.limit()).count();
  const std::string stalled = absl::StrCat(
      "sweep: node ", request->from_node(), " (", from,
      ") took nothing of share ", request->share(), " of ",
      PublicDatasetId(request->dataset()), " for ", limit,
      " s while others here wait (--sweep-peer-timeout): its pass is "
      "dropped");
  ShareFeed& pass = **feed;
  const auto give_up = [&] {
    if (!pass.HoldsBackOthers()) return false;
    LogWarning(stalled);
    pass.Abandon();
    ctx->TryCancel();
    return true;
  };
  Waiter waiter;
  v1::ShareBlock out;
  while (!ctx->IsCancelled()) {
    waiter.Reset();
    absl::StatusOr<Take> t = (*feed)->Next(waiter.Waker());
    if (!t.ok()) return ToGrpcStatus(t.status());
    if (t->kind == Take::kDelivered) return grpc::Status::OK;
    if (t->kind == Take::kWait) {
      waiter.Wait(std::chrono::milliseconds(100));
      continue;
    }
    out.set_block(t->block->id);
    BlockVectors(*t->block, out.mutable_vectors());
    t->block.reset();  // its slot goes back before the write waits
    const uint64_t bytes = out.vectors().size();
    const int64_t wait = stalls_.Begin(give_up);
    const bool written = writer->Write(out);
    if (stalls_.End(wait)) {
      return grpc::Status(
          grpc::StatusCode::ABORTED,
          absl::StrCat("pass dropped: took nothing for ", limit,
                       " s while others waited; ask again when needed"));
    }
    if (!written) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the peer went away");
    }
    sent_[static_cast<size_t>(request->from_node())] += bytes;
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "the peer cancelled");
}

PeerLinks::PeerLinks(SweepOptions options)
    : options_(std::move(options)),
      received_(new std::atomic<uint64_t>[options_.peers.size()]()),
      // Twice the senders' limit: a peer whose scan a third node's frozen
      // pass holds for up to the limit is not given up for it.
      stalls_(2 * options_.timeout) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // a block is up to --block-bytes
  // A peer that comes up late is tried again within 2 s (gRPC's default
  // backoff grows to 120 s).
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  for (size_t i = 0; i < options_.peers.size(); ++i) {
    if (static_cast<int64_t>(i) == options_.self) {
      stubs_.push_back(nullptr);
      continue;
    }
    stubs_.push_back(v1::Peer::NewStub(grpc::CreateCustomChannel(
        options_.peers[i], options_.credentials, args)));
  }
}

PeerLinks::~PeerLinks() {
  stop_ = true;
  std::vector<Feed> feeds;
  {
    MutexLock lock(&mu_);
    for (grpc::ClientContext* c : calls_) c->TryCancel();
    feeds.swap(feeds_);
  }
  for (Feed& f : feeds) f.thread.join();
}

v1::CheckSweepResponse PeerLinks::Check(const v1::PeerHello& mine) const {
  const size_t n = stubs_.size();
  std::vector<v1::PeerHello> answers(n);
  std::vector<absl::Status> errors(n);
  {
    v1::PeerHello request = mine;
    request.clear_datasets();  // the answer is what counts
    std::vector<std::thread> asks;
    for (size_t i = 0; i < n; ++i) {
      if (stubs_[i] == nullptr) continue;
      asks.emplace_back([&, i] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
        errors[i] =
            FromGrpcStatus(stubs_[i]->Hello(&ctx, request, &answers[i]));
      });
    }
    for (std::thread& t : asks) t.join();
  }
  v1::CheckSweepResponse out;
  out.set_node(options_.self);
  out.set_datasets(mine.datasets_size());
  const std::string order = absl::StrJoin(mine.peers(), ", ");
  for (size_t i = 0; i < n; ++i) {
    if (stubs_[i] == nullptr) continue;
    v1::SweepPeerCheck* c = out.add_peers();
    c->set_node(static_cast<int64_t>(i));
    c->set_address(options_.peers[i]);
    if (!errors[i].ok()) {
      // Not up (yet), or cut off; otherwise it answered and refused (a
      // failed TLS handshake: one side's certificate check; or it is not a
      // sweep's daemon), which waiting does not mend.
      const absl::string_view m = errors[i].message();
      const bool tls = absl::StrContains(m, "andshake") ||
                       absl::StrContains(m, "SSL") ||
                       absl::StrContains(m, "certificate");
      const bool down = !tls && (absl::IsUnavailable(errors[i]) ||
                                 absl::IsDeadlineExceeded(errors[i]));
      c->set_unreachable(down);
      c->add_problems(absl::StrCat(down ? "unreachable: " : "refused: ",
                                   errors[i].ToString()));
      continue;
    }
    const v1::PeerHello& a = answers[i];
    if (a.node() != static_cast<int64_t>(i)) {
      c->add_problems(absl::StrCat("it is node ", a.node(),
                                   " of its sweep (--node-rank), not ", i));
    }
    if (absl::StrJoin(a.peers(), ", ") != order) {
      c->add_problems(absl::StrCat("its peers are [",
                                   absl::StrJoin(a.peers(), ", "),
                                   "], this node's [", order, "]"));
    }
    if (a.block_bytes() != mine.block_bytes()) {
      c->add_problems(absl::StrCat("--block-bytes ", a.block_bytes(),
                                   " there, ", mine.block_bytes(), " here"));
    }
    absl::flat_hash_map<std::string, const v1::PeerDataset*> theirs;
    for (const v1::PeerDataset& d : a.datasets()) theirs[d.id()] = &d;
    for (const v1::PeerDataset& d : mine.datasets()) {
      auto it = theirs.find(d.id());
      if (it == theirs.end()) {
        c->add_problems(absl::StrCat(
            "dataset ", d.id(),
            " is not there (not under its roots, rejected, or this node's "
            "certificate may not read it)"));
      } else if (it->second->hash() != d.hash()) {
        c->add_problems(absl::StrCat("dataset ", d.id(), " has content hash ",
                                     it->second->hash(), " there, ", d.hash(),
                                     " here"));
      } else if (it->second->bytes() != d.bytes()) {
        c->add_problems(absl::StrCat("dataset ", d.id(), " is ",
                                     it->second->bytes(), " bytes there, ",
                                     d.bytes(), " here"));
      }
    }
  }
  return out;
}

void PeerLinks::OnSweepScan(const std::shared_ptr<SharedScan>& scan,
                            const StreamSpec& spec, uint64_t seed) {
  if (stop_) return;
  MutexLock lock(&mu_);
  for (auto it = feeds_.begin(); it != feeds_.end();) {  // ended ones
    if (it->done->load()) {
      it->thread.join();
      it = feeds_.erase(it);
    } else {
      ++it;
    }
  }
  for (size_t peer = 0; peer < stubs_.size(); ++peer) {
    if (stubs_[peer] == nullptr) continue;
    v1::SharePassRequest r;
    r.set_dataset(scan->dataset());
    if (spec.layer.has_value()) r.set_layer(*spec.layer);
    r.set_tokens(static_cast<v1::TokenSelection>(spec.tokens));
    r.set_seed(seed);
    r.set_share(static_cast<int64_t>(peer));
    r.set_shares(spec.sweep_shares);
    r.set_vectors_per_block(scan->layout().vectors_per_block);
    r.set_num_blocks(scan->layout().num_blocks);
    r.set_from_node(options_.self);
    r.set_hash(scan->reader().info().hash);
    auto done = std::make_shared<std::atomic<bool>>(false);
    feeds_.push_back({std::thread([this, weak = std::weak_ptr<SharedScan>(scan),
                                   peer, r, done] {
                        Run(weak, peer, r);
                        *done = true;
                      }),
                      done});
  }
}

void PeerLinks::Run(std::weak_ptr<SharedScan> weak, size_t peer,
                    v1::SharePassRequest request) {
  std::shared_ptr<SharedScan> scan = weak.lock();
  if (scan == nullptr) return;
  const std::string& address = options_.peers[peer];
  // Until the daemon stops or the scan's last subscriber has left (the
  // registry has dropped it then).
  bool subscribed = false;
  auto stop = [&] {
    const int64_t n = scan->subscribers();
    subscribed = subscribed || n > 0;
    return stop_.load() || (subscribed && n == 0);
  };
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReader<v1::ShareBlock>> reader;
  auto end_call = [&] {
    if (ctx == nullptr) return;
    MutexLock lock(&mu_);
    calls_.erase(std::find(calls_.begin(), calls_.end(), ctx.get()));
  };
  auto open_pass = [&]() -> absl::StatusOr<PassReader> {
    if (reader != nullptr) {
      reader.reset();
      end_call();
    }
    ctx = std::make_unique<grpc::ClientContext>();
    {
      MutexLock lock(&mu_);
      if (stop_) return absl::CancelledError("the daemon is stopping");
      calls_.push_back(ctx.get());
    }
    reader = stubs_[peer]->SharePass(ctx.get(), request);
    return PassReader([&]() -> absl::StatusOr<std::optional<PeerBlock>> {
      v1::ShareBlock m;
      const int64_t wait = stalls_.Begin([c = ctx.get()] {
        c->TryCancel();
        return true;
      });
      const bool got = reader->Read(&m);
      if (stalls_.End(wait)) {
        return absl::DeadlineExceededError(
            absl::StrCat("peer ", address, " sent nothing for ",
                         std::chrono::duration<double>(stalls_.limit()).count(),
                         " s (--sweep-peer-timeout)"));
      }
      if (got) {
        received_[peer] += m.vectors().size();
        return PeerBlock{m.block(), std::move(*m.mutable_vectors())};
      }
      absl::Status s = FromGrpcStatus(reader->Finish());
      if (!s.ok()) {
        return absl::Status(s.code(),
                            absl::StrCat("peer ", address, ": ", s.message()));
      }
      return std::nullopt;
    });
  };
  const absl::Status st = FeedScan(*scan, request.share(), open_pass, stop);
  if (reader != nullptr) {
    if (!st.ok() || stop_) ctx->TryCancel();
    reader.reset();
    end_call();
  }
  if (!st.ok() && !stop_) {
    LogWarning("sweep: share ", request.share(), " of ", scan->dataset(),
               " from ", address, " is read here from now on: ", st.ToString());
  }
}

}  // namespace shardcast
