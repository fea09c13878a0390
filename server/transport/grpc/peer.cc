#include "server/transport/grpc/peer.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/waiter.h"
#include "proto/grpc_status.h"
#include "server/transport/grpc/stream_reactor.h"

namespace shardcast {
grpc::Status PeerService::SharePass(
    grpc::ServerContext* ctx, const v1::SharePassRequest* request,
    grpc::ServerWriter<v1::ShareBlock>* writer) {
  if (request->from_node() < 0 || request->from_node() >= nodes_) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("from_node ", request->from_node(),
                     " is not a node of this sweep of ", nodes_)));
  }
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
                                     request->seed(), ctx->peer());
  if (!feed.ok()) return ToGrpcStatus(feed.status());
  const BlockLayout& layout = (*feed)->layout();
  if (layout.vectors_per_block != request->vectors_per_block() ||
      layout.num_blocks != request->num_blocks()) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "this daemon's blocks of the selection are ", layout.num_blocks, " of ",
        layout.vectors_per_block, " vectors; the peer's are ",
        request->num_blocks(), " of ", request->vectors_per_block(),
        " (give every node's daemon the same --block-bytes)")));
  }
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
    *out.mutable_vectors() = BlockVectors(*t->block);
    t->block.reset();  // its slot goes back before the write waits
    const uint64_t bytes = out.vectors().size();
    if (!writer->Write(out)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the peer went away");
    }
    sent_[static_cast<size_t>(request->from_node())] += bytes;
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "the peer cancelled");
}

PeerLinks::PeerLinks(PeerLinksOptions options)
    : options_(std::move(options)),
      received_(new std::atomic<uint64_t>[options_.peers.size()]()) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // a block is up to --block-bytes
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
      if (reader->Read(&m)) {
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
