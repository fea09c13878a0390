// Fuzz target: request validation of the Stream RPC, the way the daemon takes
// a request. The input is a serialized shardcast.v1.StreamRequest (inputs
// that do not parse are skipped, as gRPC would refuse them); it goes through
// ToStreamOptions (server/transport/grpc/stream_reactor.h) and
// Engine::OpenStream (server/engine/engine.h) on an engine started once over
// two tiny datasets (fuzz_engine.h). When the stream opens, up to 3 batches
// are pulled and checked against the generator, and the first batch's resume
// token must reopen the same request (an ordered one continuing with batch
// 1). A request with a resume_token is opened twice: as sent (the engine's
// MAC check, then the decoder for a token it sealed) and with the token
// sealed by the target (fuzz_engine.h), so that mutated tokens reach the
// decoders of both kinds (ordered and shuffled); resume_token_fuzz.cc
// focuses on that.
//
// Checks: no crash, leak, sanitizer report or hang (a stream that never
// produces its next batch is a libFuzzer timeout); every refusal is a
// Status; every served row is in the selection, carries its label and the
// bytes on disk.
//
// Run (tests/fuzz/run.sh builds and runs every target):
//   build-asan/stream_request_fuzz -max_total_time=60 -timeout=10 \
//       CORPUS_COPY tests/fuzz/corpus/stream_request
// Seeds: tests/fuzz/corpus/stream_request/, made by make_stream_seeds.cc.
#include <cstddef>
#include <cstdint>

#include "google/protobuf/stubs/logging.h"
#include "server/transport/grpc/stream_reactor.h"
#include "shardcast/v1/shardcast.pb.h"
#include "tests/fuzz/fuzz_engine.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // Parsing refuses strings that are not UTF-8 with a log line each: quiet.
  google::protobuf::SetLogHandler(nullptr);
  shardcast::fuzz::GetFuzzEngine();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardcast;  // NOLINT: a fuzz target's one function
  shardcast::v1::StreamRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return -1;
  absl::StatusOr<StreamOptions> options = ToStreamOptions(request, "fuzz");
  if (!options.ok()) return 0;
  fuzz::FuzzEngine& fe = fuzz::GetFuzzEngine();
  fuzz::ExerciseStream(fe, *options, 3);
  if (!options->resume_token.empty()) {
    // The same request with its token sealed by the engine's key, so that a
    // mutated token reaches the stream's decoder instead of the MAC check.
    options->resume_token = fuzz::Sealer().Seal(options->resume_token);
    fuzz::ExerciseStream(fe, *options, 3);
  }
  return 0;
}
