// Fuzz target: the pickle importer's reader (common/convert/pickle.h) behind
// `shardcast import pkl`: gzip (GzipDecoder) and the unpickler, with
// memory bounds as the importer sets them, only smaller, so that libFuzzer's
// -rss_limit_mb and -malloc_limit_mb catch any allocation that escapes them.
// The first input byte chooses how the rest is read: even, a raw pickle;
// odd, gzip data whose output is unpickled.
//
// Checks: no crash, leak, sanitizer report, hang or allocation past the
// limits; every refusal is a Status with a code the header documents; the
// decoder never produces more than its max_output; an accepted pickle's
// JSON rendering (PickleToJson) stays within its node and byte budget
// however the value is shared or cyclic.
//
// Run (tests/fuzz/run.sh builds and runs every target):
//   build-asan/pickle_fuzz -max_total_time=60 -timeout=10 \
//       -malloc_limit_mb=256 CORPUS_COPY tests/fuzz/corpus/pickle
// Seeds: tests/fuzz/corpus/pickle/ (make_corpus.sh): seed-002 shards (dicts
// of sample lists with numpy arrays) pickled by /usr/bin/python3 with
// protocols 2, 4 and 5, raw and gzipped, and a few hostile ones.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/convert/pickle.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

using namespace shardcast;  // NOLINT: test code
using fuzz::Fail;

constexpr uint64_t kMaxOutput = 16 << 20;

void CheckCode(const absl::Status& s, const char* what) {
  switch (s.code()) {
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kResourceExhausted:
      return;
    default:
      Fail(absl::StrCat(what, " refused with an undocumented code: ",
                        s.ToString()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  absl::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string raw;
  if (data[0] % 2 == 1) {
    GzipDecoder gz(kMaxOutput);
    // Fed in two pieces: any split of the stream must do.
    const size_t cut = input.size() / 3;
    absl::Status st = gz.Feed(input.substr(0, cut), &raw);
    if (st.ok()) st = gz.Feed(input.substr(cut), &raw);
    if (st.ok()) st = gz.Finish();
    if (raw.size() > kMaxOutput || gz.total_out() > kMaxOutput) {
      Fail(absl::StrCat("gzip produced ", raw.size(), " bytes past ",
                        kMaxOutput));
    }
    if (!st.ok()) {
      if (st.code() != absl::StatusCode::kDataLoss &&
          st.code() != absl::StatusCode::kResourceExhausted) {
        Fail(absl::StrCat("gzip refused with ", st.ToString()));
      }
      return 0;
    }
  } else {
    raw.assign(input.data(), input.size());
  }
  UnpickleOptions options;
  options.max_objects = 1 << 16;
  options.max_memo = 1 << 12;
  absl::StatusOr<Pickle> pickle = Unpickle(std::move(raw), options);
  if (!pickle.ok()) {
    CheckCode(pickle.status(), "Unpickle");
    return 0;
  }
  const std::string json = PickleToJson(pickle->root(), 16, 4096, 64 << 10)
                               .dump(-1, ' ', false,
                                     nlohmann::json::error_handler_t::replace);
  // 4096 nodes of at most a few dozen bytes of syntax, plus 64 KiB of
  // strings (keys included), however shared or cyclic the value is.
  if (json.size() > (64 << 10) + 4096 * 64) {
    Fail(absl::StrCat("PickleToJson rendered ", json.size(), " bytes"));
  }
  return 0;
}
