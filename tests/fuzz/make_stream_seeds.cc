// Writes the seeds of the stream fuzz targets, so that they start from
// requests that open streams and from resume tokens a real stream handed out
// (whose fingerprints match, so mutations get past that check):
//
//   make_stream_seeds OUTDIR
//     OUTDIR/stream_request/*  serialized shardcast.v1.StreamRequest: each
//                              kind of request on both datasets, and requests
//                              resuming from tokens captured mid-stream
//                              (sealed, as clients send them, and unsealed)
//     OUTDIR/resume_token/*    unsealed tokens of TokenRequest
//                              (fuzz_engine.h), ordered and shuffled,
//                              captured after several batches of both epochs
//
// The engine, its token key and datasets are fuzz_engine.h's; dataset ids
// are content hashes, so the seeds stay valid as long as the writer and the
// token formats do. tests/fuzz/run.sh runs it into its working copy of the
// corpus before fuzzing; make_corpus.sh into tests/fuzz/corpus/.
#include <sys/stat.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "shardcast/v1/shardcast.pb.h"
#include "tests/fuzz/fuzz_engine.h"

namespace shardcast::fuzz {
namespace {

void WriteSeed(const std::string& dir, const std::string& name,
               const std::string& bytes) {
  std::ofstream f(dir + "/" + name, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f.good()) Fail("cannot write " + dir + "/" + name);
}

// Every batch of the stream `o` opens (at most `max`), tokens included.
std::vector<PulledBatch> Drain(FuzzEngine& fe, const StreamOptions& o,
                               int max) {
  absl::StatusOr<std::unique_ptr<BatchSource>> s = fe.engine->OpenStream(o);
  if (!s.ok()) Fail("seed request does not open: " + s.status().ToString());
  bool ended = false;
  absl::StatusOr<std::vector<PulledBatch>> b =
      PullBatches(*DatasetOf(fe, o.dataset), o, **s, max, &ended);
  if (!b.ok()) Fail("seed stream: " + b.status().ToString());
  return std::move(*b);
}

// A token as a stream made it, before the engine sealed it.
std::string Unsealed(const std::string& sealed) {
  absl::StatusOr<std::string> t = Sealer().Open(sealed);
  if (!t.ok()) Fail("a token the engine issued does not open");
  return *t;
}

v1::StreamRequest ToRequest(const StreamOptions& o) {
  v1::StreamRequest r;
  r.set_dataset(o.dataset);
  if (o.spec.layer.has_value()) r.set_layer(*o.spec.layer);
  r.set_tokens(o.spec.tokens == TokenSelection::kSpecial ? v1::TOKENS_SPECIAL
               : o.spec.tokens == TokenSelection::kAll   ? v1::TOKENS_ALL
                                                         : v1::TOKENS_CONTENT);
  r.set_order(o.order == StreamOrder::kOrdered ? v1::ORDER_ORDERED
                                               : v1::ORDER_SHUFFLED);
  r.set_batch_size(o.spec.batch_size);
  r.set_seed(o.seed);
  r.set_epochs(o.spec.epochs);
  r.set_rank(o.spec.rank);
  r.set_world_size(o.spec.world_size);
  r.set_drop_last(o.spec.drop_last);
  r.set_resume_token(o.resume_token);
  for (uint8_t l : o.spec.exclude_labels) r.add_exclude_labels(l);
  r.set_scale_norm(o.spec.transform.scale_norm);
  r.set_center(o.spec.transform.center);
  r.set_dtype(static_cast<v1::DType>(o.spec.transform.dtype));
  if (o.spec.node_count != 1) {
    r.set_node_rank(o.spec.node_rank);
    r.set_node_count(o.spec.node_count);
  }
  return r;
}

}  // namespace
}  // namespace shardcast::fuzz

int main(int argc, char** argv) {
  using namespace shardcast;        // NOLINT: a tool's main
  using namespace shardcast::fuzz;  // NOLINT
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_stream_seeds OUTDIR\n");
    return 2;
  }
  const std::string out = argv[1];
  const std::string req_dir = out + "/stream_request";
  const std::string tok_dir = out + "/resume_token";
  mkdir(out.c_str(), 0755);
  mkdir(req_dir.c_str(), 0755);
  mkdir(tok_dir.c_str(), 0755);
  FuzzEngine& fe = GetFuzzEngine();

  // Requests: one per feature, on dataset A unless said otherwise.
  struct Seed {
    const char* name;
    StreamOptions o;
  };
  std::vector<Seed> seeds;
  auto base = [&](StreamOrder order) {
    StreamOptions o;
    o.dataset = fe.a.id;
    o.order = order;
    o.spec.layer = 6;
    o.spec.batch_size = 5;
    o.seed = 3;
    return o;
  };
  for (StreamOrder order : {StreamOrder::kOrdered, StreamOrder::kShuffled}) {
    const bool ord = order == StreamOrder::kOrdered;
    StreamOptions o = base(order);
    seeds.push_back({ord ? "a_ordered_layer6" : "a_shuffled_layer6", o});
    o = base(order);
    o.dataset = fe.a.id.substr(0, 8);
    o.spec.layer.reset();
    o.spec.tokens = TokenSelection::kAll;
    o.spec.batch_size = 7;
    seeds.push_back(
        {ord ? "a_ordered_prefix_all" : "a_shuffled_prefix_all", o});
    o = base(order);
    o.spec.layer = -2;
    o.spec.tokens = TokenSelection::kSpecial;
    o.spec.batch_size = 1;
    o.spec.epochs = 0;
    seeds.push_back(
        {ord ? "a_ordered_cls_endless" : "a_shuffled_cls_endless", o});
    o = base(order);
    o.spec.rank = 2;
    o.spec.world_size = 3;
    o.spec.epochs = 3;
    o.spec.drop_last = true;
    o.spec.exclude_labels = {0, 5};
    seeds.push_back(
        {ord ? "a_ordered_rank_labels" : "a_shuffled_rank_labels", o});
    o = base(order);
    o.dataset = fe.b.id;
    o.spec.layer = 3;
    o.spec.batch_size = 4;
    seeds.push_back({ord ? "b_ordered" : "b_shuffled", o});
    o.spec.layer.reset();
    o.spec.tokens = TokenSelection::kAll;
    o.spec.batch_size = 64;
    o.spec.epochs = 2;
    seeds.push_back({ord ? "b_ordered_big_batch" : "b_shuffled_big_batch", o});
    o = base(order);
    o.spec.tokens = TokenSelection::kAll;
    o.spec.transform.scale_norm = true;
    o.spec.transform.center = true;
    o.spec.transform.dtype = OutputDType::kBFloat16;
    seeds.push_back({ord ? "a_ordered_transform" : "a_shuffled_transform", o});
    o = base(order);
    o.spec.transform.dtype = OutputDType::kFloat16;
    o.spec.node_rank = 1;
    o.spec.node_count = 2;
    o.spec.world_size = 2;
    seeds.push_back(
        {ord ? "a_ordered_node_group" : "a_shuffled_node_group", o});
  }
  int requests = 0;
  for (const Seed& s : seeds) {
    WriteSeed(req_dir, s.name, ToRequest(s.o).SerializeAsString());
    ++requests;
    // The same request resuming after its second batch.
    const std::vector<PulledBatch> b = Drain(fe, s.o, 2);
    if (b.size() == 2) {
      // As a client sends it (sealed), and unsealed: the target seals the
      // token it is given a second time (stream_request_fuzz.cc).
      StreamOptions r = s.o;
      r.resume_token = b[1].meta.resume_token;
      WriteSeed(req_dir, std::string(s.name) + "_resumed",
                ToRequest(r).SerializeAsString());
      r.resume_token = Unsealed(b[1].meta.resume_token);
      WriteSeed(req_dir, std::string(s.name) + "_resumed_unsealed",
                ToRequest(r).SerializeAsString());
      requests += 2;
    }
  }

  // Tokens of TokenRequest, from several points of both epochs.
  int tokens = 0;
  for (StreamOrder order : {StreamOrder::kOrdered, StreamOrder::kShuffled}) {
    const bool ord = order == StreamOrder::kOrdered;
    const StreamOptions o = TokenRequest(fe, order);
    const std::vector<PulledBatch> b = Drain(fe, o, 1000);
    for (size_t i = 0; i < b.size(); ++i) {
      const bool last = i + 1 == b.size();
      const bool epoch_start = i > 0 && b[i].meta.epoch != b[i - 1].meta.epoch;
      if (i == 0 || i == 1 || i == 4 || i == 11 || epoch_start || last) {
        WriteSeed(tok_dir,
                  absl::StrCat(ord ? "ordered" : "shuffled", "_epoch",
                               b[i].meta.epoch, "_batch", b[i].meta.index),
                  Unsealed(b[i].meta.resume_token));
        ++tokens;
      }
    }
    if (ord) {
      // A shuffled stream resumed from a token with partly delivered blocks
      // hands out tokens that carry those blocks onward.
      continue;
    }
    StreamOptions r = o;
    if (b.size() < 3) Fail("TokenRequest's shuffled stream is too short");
    r.resume_token = b[2].meta.resume_token;
    const std::vector<PulledBatch> rb = Drain(fe, r, 3);
    if (!rb.empty()) {
      WriteSeed(tok_dir, "shuffled_resumed_twice",
                Unsealed(rb.back().meta.resume_token));
      ++tokens;
    }
  }
  std::printf("%d requests in %s, %d tokens in %s\n", requests, req_dir.c_str(),
              tokens, tok_dir.c_str());
  return 0;
}
