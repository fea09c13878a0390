// What the stream fuzz targets (stream_request_fuzz.cc, resume_token_fuzz.cc)
// and the seed maker (make_stream_seeds.cc) share: one Engine over two tiny
// datasets written with the project's writer into a temporary root, started
// once per process with a fixed resume-token key, and a driver that pulls a
// few batches from a stream and checks them against the generator
// (common/format/synth.h), never against the code under test. Test code only.
//
// The datasets (content known to every reader from the seed):
//   A: protocol "2.1", 23 examples, layers {-2, 6}, 5 content tokens + CLS
//      (T = 6), d_model 4, budget 60 -> 5 examples per shard (5 shards, the
//      last partial), labels.bin; values SynthValue(21, i).
//   B: protocol "2.1-saev" (8-hex id), 7 examples, layer {3}, 3 content
//      tokens, no CLS, d_model 8, budget 9 -> 3 examples per shard, the last
//      shard file full-size and a trailing {n_examples: 0} entry, no labels;
//      values SynthValue(22, i).
// Blocks (--block-bytes) are 64 bytes: 4 vectors of A, 2 of B, so that a
// stream has many blocks and its resume tokens real bitmaps.
#ifndef SHARDCAST_TESTS_FUZZ_FUZZ_ENGINE_H_
#define SHARDCAST_TESTS_FUZZ_FUZZ_ENGINE_H_

#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/file.h"
#include "common/base/log.h"
#include "common/format/synth.h"
#include "common/format/writer.h"
#include "server/engine/engine.h"
#include "server/engine/transform.h"
#include "tests/fuzz/fuzz_check.h"

namespace shardcast::fuzz {

/// One of the engine's datasets and what a checker needs to know about it.
struct FuzzDataset {
  std::string id;  // directory name, what a request names
  uint64_t seed = 0;
  std::vector<int64_t> layers;
  int64_t n_examples = 0, content_tokens = 0, d_model = 0;
  bool cls = false, labels = false;
  int64_t tokens() const { return content_tokens + (cls ? 1 : 0); }
};

/// The engine's resume-token key (EngineOptions::token_key): fixed, so that
/// tokens captured into the seeds stay valid across runs.
inline constexpr char kTokenKey[] = "shardcast fuzz token key (fixed)";

/// Seals a token as the engine does (resume_token.h): the targets seal the
/// tokens they make up, so that the streams' decoders see them rather than
/// the MAC check refusing every mutation.
inline const TokenSealer& Sealer() {
  static const TokenSealer* sealer = new TokenSealer(kTokenKey);
  return *sealer;
}

/// The process's engine. Plain struct; lives until exit.
struct FuzzEngine {
  std::string root;
  FuzzDataset a, b;
  std::unique_ptr<Engine> engine;
};

inline FuzzDataset WriteFuzzDataset(const std::string& root, bool first) {
  FuzzDataset ds;
  WriterOptions o;
  o.root = root;
  if (first) {
    ds.seed = 21;
    ds.layers = {-2, 6};
    ds.n_examples = 23;
    ds.content_tokens = 5;
    ds.d_model = 4;
    ds.cls = true;
    ds.labels = true;
    o.token_budget = 60;
  } else {
    ds.seed = 22;
    ds.layers = {3};
    ds.n_examples = 7;
    ds.content_tokens = 3;
    ds.d_model = 8;
    o.token_budget = 9;
    o.variant = Variant::kV2Saev;
    o.full_size_last_shard = true;
    o.trailing_empty_entry = true;
  }
  o.layers = ds.layers;
  o.content_tokens = ds.content_tokens;
  o.cls_token = ds.cls;
  o.d_model = ds.d_model;
  o.n_examples = ds.n_examples;
  o.with_labels = ds.labels;
  absl::StatusOr<std::unique_ptr<DatasetWriter>> w = DatasetWriter::Create(o);
  if (!w.ok()) Fail(absl::StrCat("writer: ", w.status().ToString()));
  std::vector<float> v(static_cast<size_t>(
      ds.n_examples * static_cast<int64_t>(ds.layers.size()) * ds.tokens() *
      ds.d_model));
  for (size_t i = 0; i < v.size(); ++i) v[i] = SynthValue(ds.seed, i);
  absl::Status st = (*w)->Append(v.data(), v.size() * 4);
  if (st.ok() && ds.labels) {
    std::vector<uint8_t> l(
        static_cast<size_t>(ds.n_examples * ds.content_tokens));
    for (size_t i = 0; i < l.size(); ++i) l[i] = SynthLabel(ds.seed, i);
    st = (*w)->AppendLabels(l.data(), l.size());
  }
  if (!st.ok()) Fail(absl::StrCat("writer: ", st.ToString()));
  absl::StatusOr<WriteResult> r = (*w)->Finish();
  if (!r.ok()) Fail(absl::StrCat("writer: ", r.status().ToString()));
  ds.id = BaseName(r->path);
  return ds;
}

/// The engine, started on first use (call it from LLVMFuzzerInitialize).
/// The temporary root is under $TMPDIR (tests/fuzz/run.sh points it into
/// build-asan/) and removed at exit.
inline FuzzEngine& GetFuzzEngine() {
  static FuzzEngine* fe = [] {
    auto* f = new FuzzEngine;  // never deleted: streams may run until exit
    const char* tmp = getenv("TMPDIR");
    std::string t = absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp",
                                 "/shardcast-fuzz-XXXXXX");
    if (mkdtemp(t.data()) == nullptr) Fail("mkdtemp " + t);
    f->root = t;
    static std::string root_to_remove = t;
    atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(root_to_remove, ec);
    });
    SetLogLevel(LogLevel::kError);  // no line per stream while fuzzing
    f->a = WriteFuzzDataset(f->root, true);
    f->b = WriteFuzzDataset(f->root, false);
    EngineOptions o;
    o.roots = {f->root};
    o.reservoir.slot_bytes = 64;
    o.reservoir.bytes = 1 << 20;  // 16384 blocks: room for many streams
    o.scans.window_blocks = 2;
    o.scans.lag_blocks = 4;
    o.reads.queue_depth = 4;
    o.token_key = kTokenKey;
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Start(o);
    if (!e.ok()) Fail(absl::StrCat("Engine::Start: ", e.status().ToString()));
    f->engine = std::move(*e);
    return f;
  }();
  return *fe;
}

/// The request every token of resume_token_fuzz.cc belongs to
/// (make_stream_seeds.cc captures the seeds from it): dataset A, all layers
/// and tokens, rank 1 of 2, a label filter, two epochs, batches of 5.
inline StreamOptions TokenRequest(const FuzzEngine& fe, StreamOrder order) {
  StreamOptions o;
  o.dataset = fe.a.id;
  o.spec.layer.reset();
  o.spec.tokens = TokenSelection::kAll;
  o.spec.batch_size = 5;
  o.spec.epochs = 2;
  o.spec.rank = 1;
  o.spec.world_size = 2;
  o.spec.exclude_labels = {3};
  o.order = order;
  o.seed = 7;
  o.peer = "fuzz";
  o.max_batch_bytes = 64 << 20;
  return o;
}

/// The dataset a stream of `options` reads, or null (a request naming
/// neither never opens).
inline const FuzzDataset* DatasetOf(const FuzzEngine& fe,
                                    const std::string& name) {
  if (!name.empty() && fe.a.id.compare(0, name.size(), name) == 0) return &fe.a;
  if (!name.empty() && fe.b.id.compare(0, name.size(), name) == 0) return &fe.b;
  return nullptr;
}

/// One batch as a client sees it: its metadata and a copy of its vectors.
struct PulledBatch {
  StreamBatch meta;
  std::string vectors;
};

/// Checks a batch the engine filled against the generator: sizes of every
/// column, each row's example/token/layer in range, its label (and that it
/// is not excluded) and its vector bit for bit. Aborts on a mismatch.
inline void CheckBatch(const FuzzDataset& ds, const StreamOptions& o,
                       const BatchShape& shape, const StreamBatch& b,
                       const char* vectors) {
  const size_t rows = static_cast<size_t>(b.rows);
  if (b.rows < 1 || b.rows > shape.batch_size) {
    Fail(absl::StrCat("batch of ", b.rows, " rows, batch_size ",
                      shape.batch_size));
  }
  const bool all_layers = !o.spec.layer.has_value();
  if (b.example_idx.size() != rows * 8 || b.token_idx.size() != rows * 4 ||
      b.layer.size() != (all_layers ? rows * 8 : 0) ||
      b.labels.size() != (ds.labels ? rows : 0)) {
    Fail(absl::StrCat("batch columns: rows ", rows, " example_idx ",
                      b.example_idx.size(), " token_idx ", b.token_idx.size(),
                      " layer ", b.layer.size(), " labels ", b.labels.size()));
  }
  if (shape.d_model != ds.d_model) Fail("d_model");
  for (size_t i = 0; i < rows; ++i) {
    int64_t example, layer = o.spec.layer.value_or(0);
    int32_t token;
    std::memcpy(&example, b.example_idx.data() + i * 8, 8);
    std::memcpy(&token, b.token_idx.data() + i * 4, 4);
    if (all_layers) std::memcpy(&layer, b.layer.data() + i * 8, 8);
    int64_t li = -1;
    for (size_t k = 0; k < ds.layers.size(); ++k) {
      if (ds.layers[k] == layer) li = static_cast<int64_t>(k);
    }
    const int32_t first = ds.cls ? -1 : 0;
    if (example < 0 || example >= ds.n_examples || li < 0 || token < first ||
        token >= ds.content_tokens) {
      Fail(absl::StrCat("row ", i, ": example ", example, " layer ", layer,
                        " token ", token, " is not in the dataset"));
    }
    const TokenSelection sel = o.spec.tokens;
    if ((sel == TokenSelection::kContent && token < 0) ||
        (sel == TokenSelection::kSpecial && token >= 0)) {
      Fail(absl::StrCat("row ", i, ": token ", token, " not selected"));
    }
    if (ds.labels) {
      const uint8_t got = static_cast<uint8_t>(b.labels[i]);
      const uint8_t want =
          token < 0
              ? 255
              : SynthLabel(ds.seed, static_cast<uint64_t>(
                                        example * ds.content_tokens + token));
      if (got != want) {
        Fail(absl::StrCat("row ", i, ": label ", got, ", labels.bin has ",
                          want));
      }
      for (uint8_t x : o.spec.exclude_labels) {
        if (token >= 0 && x == got) {
          Fail(absl::StrCat("row ", i, ": label ", got, " is excluded"));
        }
      }
    }
    const int64_t raw = token + (ds.cls ? 1 : 0);  // token-axis index
    const int64_t L = static_cast<int64_t>(ds.layers.size());
    // Transforms (StreamRequest.scale_norm/center/dtype): 16-bit output
    // alone is the disk value rounded (transform_test checks the rounding
    // itself); centered or scaled values depend on the statistics, so only
    // their finiteness is checked here (test_transforms.py checks them).
    const TransformSpec& t = o.spec.transform;
    const uint64_t element = OutputDTypeBytes(t.dtype);
    if (shape.vector_bytes != static_cast<uint64_t>(ds.d_model) * element) {
      Fail(absl::StrCat("vector_bytes ", shape.vector_bytes, " for d_model ",
                        ds.d_model, " of ", OutputDTypeName(t.dtype)));
    }
    for (int64_t k = 0; k < ds.d_model; ++k) {
      const uint64_t index = static_cast<uint64_t>(
          ((example * L + li) * ds.tokens() + raw) * ds.d_model + k);
      const float want = SynthValue(ds.seed, index);
      const char* at =
          vectors + (i * ds.d_model + k) * static_cast<int64_t>(element);
      const std::string where =
          absl::StrCat("row ", i, " (example ", example, ", layer ", layer,
                       ", token ", token, ") element ", k, ": ");
      if (t.needs_stats()) {
        if (element == 4) {
          float got;
          std::memcpy(&got, at, 4);
          if (!std::isfinite(got)) Fail(absl::StrCat(where, got, " served"));
        } else {
          uint16_t got;
          std::memcpy(&got, at, 2);
          if ((got & 0x7F80) == 0x7F80 && t.dtype == OutputDType::kBFloat16) {
            Fail(absl::StrCat(where, "bfloat16 ", got, " is not finite"));
          }
        }
      } else if (element == 2) {
        uint16_t got;
        std::memcpy(&got, at, 2);
        const uint16_t rounded = t.dtype == OutputDType::kBFloat16
                                     ? FloatToBFloat16(want)
                                     : FloatToHalf(want);
        if (got != rounded) {
          Fail(absl::StrCat(where, got, " served, ", rounded, " is ", want,
                            " on disk rounded"));
        }
      } else {
        float got;
        std::memcpy(&got, at, 4);
        if (std::memcmp(&got, &want, 4) != 0) {
          Fail(absl::StrCat(where, got, " served, ", want, " on disk"));
        }
      }
    }
  }
}

/// Pulls up to `max_batches` batches from `source`, waiting for the waker
/// like a transport on kPending (a stream that never wakes it hangs here, and
/// libFuzzer's -timeout reports the input). Every batch is checked with
/// CheckBatch. Returns the batches, and in `*ended` whether the stream said
/// kEnd; a Next error is returned as is.
inline absl::StatusOr<std::vector<PulledBatch>> PullBatches(
    const FuzzDataset& ds, const StreamOptions& o, BatchSource& source,
    int max_batches, bool* ended) {
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
    bool woken = false;
  };
  auto waiter = std::make_shared<Waiter>();
  const uint64_t bytes = source.shape().batch_bytes();
  // Not zeroed: the engine must write every byte of the rows it reports.
  std::unique_ptr<char[]> buffer(new char[bytes]);
  std::vector<PulledBatch> out;
  *ended = false;
  // Kept across kPending: the partly assembled batch is in it.
  StreamBatch b;
  while (static_cast<int>(out.size()) < max_batches) {
    {
      std::lock_guard<std::mutex> lock(waiter->mu);
      waiter->woken = false;
    }
    absl::StatusOr<BatchSource::Fill> fill =
        source.Next(VectorDest{buffer.get(), bytes}, &b, [waiter] {
          std::lock_guard<std::mutex> lock(waiter->mu);
          waiter->woken = true;
          waiter->cv.notify_all();
        });
    if (!fill.ok()) return fill.status();
    if (*fill == BatchSource::Fill::kEnd) {
      *ended = true;
      break;
    }
    if (*fill == BatchSource::Fill::kPending) {
      std::unique_lock<std::mutex> lock(waiter->mu);
      waiter->cv.wait(lock, [&] { return waiter->woken; });
      continue;
    }
    CheckBatch(ds, o, source.shape(), b, buffer.get());
    PulledBatch p;
    p.vectors.assign(buffer.get(),
                     static_cast<size_t>(b.rows) * source.shape().vector_bytes);
    p.meta = std::move(b);
    b = StreamBatch();
    out.push_back(std::move(p));
  }
  return out;
}

/// What ExerciseStream saw.
struct StreamRun {
  absl::Status open;  // OpenStream's status
  std::vector<PulledBatch> batches;
};

/// Waits until the engine holds nothing for streams that are gone: no
/// reservoir block in use or reserved, no shared scan. Aborts after 5 s (a
/// stream that keeps its reservation or blocks after it was destroyed).
/// Also what makes each input start from the same idle engine, and keeps
/// the per-input leak check from seeing reads still in flight, whose only
/// pointer is in the io_uring ring where LeakSanitizer cannot see it.
inline void WaitIdle(const FuzzEngine& fe) {
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (true) {
    const EngineFigures f = fe.engine->Figures();
    if (f.reservoir_bytes_in_use == 0 && f.reservoir_bytes_reserved == 0 &&
        f.scans.empty()) {
      return;
    }
    if (std::chrono::steady_clock::now() > give_up) {
      Fail(absl::StrCat("5 s after every stream closed the engine still has ",
                        f.reservoir_bytes_in_use, " reservoir bytes in use, ",
                        f.reservoir_bytes_reserved, " reserved, ",
                        f.scans.size(), " scan(s)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

/// One stream of ExerciseStream, its sources gone when it returns.
inline StreamRun ExerciseStreamOnce(FuzzEngine& fe, const StreamOptions& o,
                                    int max_batches) {
  StreamRun run;
  absl::StatusOr<std::unique_ptr<BatchSource>> source =
      fe.engine->OpenStream(o);
  run.open = source.status();
  if (!source.ok()) return run;
  const FuzzDataset* ds = DatasetOf(fe, o.dataset);
  if (ds == nullptr) Fail("OpenStream opened a dataset it was not asked for");
  bool ended = false;
  absl::StatusOr<std::vector<PulledBatch>> batches =
      PullBatches(*ds, o, **source, max_batches, &ended);
  if (!batches.ok()) {
    // Nothing on disk is damaged: every Next error is a bug.
    Fail(absl::StrCat("Next: ", batches.status().ToString()));
  }
  run.batches = std::move(*batches);
  if (run.batches.empty()) return run;

  StreamOptions again = o;
  again.resume_token = run.batches[0].meta.resume_token;
  absl::StatusOr<std::unique_ptr<BatchSource>> resumed =
      fe.engine->OpenStream(again);
  if (!resumed.ok()) {
    Fail(absl::StrCat("the token of batch 0 does not reopen its stream: ",
                      resumed.status().ToString()));
  }
  if (o.order == StreamOrder::kOrdered) {
    bool resumed_ended = false;
    absl::StatusOr<std::vector<PulledBatch>> next =
        PullBatches(*ds, again, **resumed, 1, &resumed_ended);
    if (!next.ok()) Fail(absl::StrCat("Next: ", next.status().ToString()));
    if (run.batches.size() >= 2) {
      const PulledBatch& want = run.batches[1];
      if (next->size() != 1 || (*next)[0].vectors != want.vectors ||
          (*next)[0].meta.example_idx != want.meta.example_idx ||
          (*next)[0].meta.token_idx != want.meta.token_idx ||
          (*next)[0].meta.epoch != want.meta.epoch ||
          (*next)[0].meta.index != want.meta.index) {
        Fail(
            "an ordered stream resumed after batch 0 does not continue "
            "with batch 1");
      }
    } else if (ended && !next->empty()) {
      Fail("an ordered stream resumed after its last batch goes on");
    }
  }
  return run;
}

/// Opens `o` on the engine, pulls up to `max_batches`, and checks that the
/// resume token of the first batch reopens the same request: for an ordered
/// stream the reopened one continues with exactly the original's second
/// batch (or ends with it). Then waits for the engine to be idle (WaitIdle).
/// Aborts when a check fails; an error status from the engine is an answer,
/// not a failure.
inline StreamRun ExerciseStream(FuzzEngine& fe, const StreamOptions& o,
                                int max_batches) {
  StreamRun run = ExerciseStreamOnce(fe, o, max_batches);
  WaitIdle(fe);
  return run;
}

}  // namespace shardcast::fuzz

#endif  // SHARDCAST_TESTS_FUZZ_FUZZ_ENGINE_H_
