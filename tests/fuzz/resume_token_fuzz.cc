// Fuzz target: resume-token decoding (server/engine/ordered_stream.cc,
// shuffled_stream.cc, resume_token.h). The input bytes are the resume_token
// of one fixed, valid request (TokenRequest in fuzz_engine.h), given to
// Engine::OpenStream three times: as is (the engine's MAC check, TokenSealer,
// must refuse it), and sealed with the engine's key, as an ordered and as a
// shuffled stream, so that both decoders see every input (the 4-byte magic
// decides which one gets past the first check). Sealing in the target is
// what lets mutations past the MAC: the decoders must be sound on their own.
// The seeds are the unsealed tokens of real streams of exactly this request
// (make_stream_seeds.cc), so their fingerprints match and mutations reach
// the fields behind it: epoch, batch index, position, block bitmap, partial
// blocks. When a stream opens, up to
// 3 batches are pulled and checked as in stream_request_fuzz.cc, and the
// token of the first one must reopen the stream.
//
// Checks: no crash, leak, sanitizer report or hang; a bad token is an
// INVALID_ARGUMENT Status; whatever a token opens serves only rows of the
// selection with the bytes on disk.
//
// Run (tests/fuzz/run.sh builds and runs every target):
//   build-asan/resume_token_fuzz -max_total_time=60 -timeout=10 \
//       CORPUS_COPY tests/fuzz/corpus/resume_token
#include <cstddef>
#include <cstdint>
#include <string>

#include "tests/fuzz/fuzz_engine.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  shardcast::fuzz::GetFuzzEngine();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardcast;  // NOLINT: a fuzz target's one function
  fuzz::FuzzEngine& fe = fuzz::GetFuzzEngine();
  const std::string input(reinterpret_cast<const char*>(data), size);
  // The input as a client would send it: refused by the MAC check unless it
  // is a token the engine sealed.
  StreamOptions raw = fuzz::TokenRequest(fe, StreamOrder::kOrdered);
  raw.resume_token = input;
  const fuzz::StreamRun r = fuzz::ExerciseStream(fe, raw, 3);
  if (!r.open.ok() &&
      (input.empty() || r.open.code() != absl::StatusCode::kInvalidArgument)) {
    fuzz::Fail("OpenStream with an unsealed token: " + r.open.ToString());
  }
  // The input sealed with the engine's key, as if the engine had issued it:
  // what both decoders make of every field.
  for (StreamOrder order : {StreamOrder::kOrdered, StreamOrder::kShuffled}) {
    StreamOptions o = fuzz::TokenRequest(fe, order);
    o.resume_token = fuzz::Sealer().Seal(input);
    const fuzz::StreamRun run = fuzz::ExerciseStream(fe, o, 3);
    if (!run.open.ok() &&
        run.open.code() != absl::StatusCode::kInvalidArgument) {
      fuzz::Fail("OpenStream with a sealed token: " + run.open.ToString());
    }
  }
  return 0;
}
