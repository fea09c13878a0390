// Commands on local dataset directories: synth, write, info, verify, get.
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "client/cli/progress.h"
#include "common/base/status.h"
#include "common/convert/npy.h"
#include "common/format/dataset.h"
#include "common/format/pyjson.h"
#include "common/format/reader.h"
#include "common/format/synth.h"
#include "common/format/writer.h"
#include "nlohmann/json.hpp"

namespace shardcast {
namespace {

using OrderedJson = nlohmann::ordered_json;

constexpr size_t kChunkBytes = 16 << 20;

int Usage(const char* command, const std::string& message) {
  std::fprintf(stderr, "shardcast %s: %s (see shardcast %s --help)\n", command,
               message.c_str(), command);
  return kExitUsage;
}

void PrintJson(const OrderedJson& j) {
  std::printf("%s\n", JsonText(j, 2).c_str());
}

// Shortest decimal that round-trips to the same float32 (at most 9
// significant digits). Non-finite values are spelled as Python's json does.
void AppendFloat(std::string& out, float v) {
  if (std::isnan(v)) {
    out += "NaN";
  } else if (std::isinf(v)) {
    out += v > 0 ? "Infinity" : "-Infinity";
  } else {
    char buf[32];
    auto r = std::to_chars(buf, buf + sizeof(buf), v);
    out.append(buf, r.ptr);
    // "-0" or "3" would be read back as integers (losing -0.0's sign in
    // Python's json); keep them floats as Python's repr does.
    if (std::string_view(buf, static_cast<size_t>(r.ptr - buf))
            .find_first_of(".eE") == std::string_view::npos) {
      out += ".0";
    }
  }
}

std::string FloatsJson(const float* v, int64_t n) {
  std::string out = "[";
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) out += ", ";
    AppendFloat(out, v[i]);
  }
  out += "]";
  return out;
}

std::string FloatsText(const float* v, int64_t n) {
  std::string out;
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) out += ' ';
    AppendFloat(out, v[i]);
  }
  return out;
}

OrderedJson WriteResultJson(const WriteResult& r, const DatasetDesc& d) {
  OrderedJson j;
  j["path"] = r.path;
  j["hash"] = r.hash;
  j["reused"] = r.reused;
  j["n_examples"] = d.n_examples;
  j["shards"] = d.num_data_shards();
  j["bytes"] = d.data_bytes();
  return j;
}

void PrintWriteResult(const char* command, const WriteResult& r,
                      const DatasetDesc& d, bool json) {
  if (json) {
    PrintJson(WriteResultJson(r, d));
    return;
  }
  std::printf("%s %s (%lld examples in %lld shards, %.1f MiB)\n",
              r.reused ? "reused identical existing dataset" : "wrote",
              r.path.c_str(), static_cast<long long>(d.n_examples),
              static_cast<long long>(d.num_data_shards()),
              static_cast<double>(d.data_bytes()) / (1 << 20));
  (void)command;
}

// ---------------------------------------------------------------- synth

int RunSynth(const Args& args) {
  const char* cmd = "synth";
  if (args.positional().size() != 1)
    return Usage(cmd, "expected one ROOT directory");
  WriterOptions o;
  o.root = args.positional()[0];
  auto layers = args.GetIntList("layers", "6,12");
  auto tokens = args.GetInt("tokens", 256);
  auto d_model = args.GetInt("d-model", 1024);
  auto examples = args.GetInt("examples", 16);
  auto budget = args.GetInt("budget", 2400000);
  auto seed = args.GetInt("seed", 0);
  auto variant = ParseVariantName(args.Get("variant", "2.1"));
  for (const absl::Status& s :
       {layers.status(), tokens.status(), d_model.status(), examples.status(),
        budget.status(), seed.status(), variant.status()}) {
    if (!s.ok()) return Usage(cmd, std::string(s.message()));
  }
  o.layers = *layers;
  o.content_tokens = *tokens;
  o.cls_token = args.Has("cls");
  o.d_model = *d_model;
  o.n_examples = *examples;
  o.token_budget = *budget;
  o.variant = *variant;
  o.family = args.Get("family", "synthetic");
  o.ckpt = args.Get("ckpt", "synthetic");
  o.with_labels = args.Has("labels");
  o.full_size_last_shard = args.Has("full-last-shard");
  o.trailing_empty_entry = args.Has("trailing-empty-shard");
  o.dataset = "synthetic";
  const std::string descr = absl::StrCat("shardcast synth seed=", *seed);
  if (o.variant == Variant::kV1) {
    o.data = Json{{"__class__", "Synthetic"}, {"seed", *seed}};
  } else {
    o.data = descr;
  }

  auto writer = DatasetWriter::Create(o);
  if (!writer.ok()) return Fail(cmd, std::string(writer.status().message()));
  const DatasetDesc& d = (*writer)->desc();
  const uint64_t per_example = d.example_bytes() / 4;
  const int64_t chunk = std::max<int64_t>(
      1, static_cast<int64_t>(kChunkBytes / d.example_bytes()));
  std::vector<float> values;
  std::vector<uint8_t> labels;
  Progress progress("synth",
                    static_cast<uint64_t>(d.n_examples) * d.example_bytes());
  const uint64_t useed = static_cast<uint64_t>(*seed);
  for (int64_t e0 = 0; e0 < d.n_examples; e0 += chunk) {
    const int64_t n = std::min(chunk, d.n_examples - e0);
    values.resize(static_cast<size_t>(n) * per_example);
    const uint64_t base = static_cast<uint64_t>(e0) * per_example;
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = SynthValue(useed, base + i);
    absl::Status st = (*writer)->Append(values.data(), values.size() * 4);
    if (st.ok() && o.with_labels) {
      const uint64_t ct = static_cast<uint64_t>(d.content_tokens);
      labels.resize(static_cast<size_t>(n) * ct);
      for (size_t i = 0; i < labels.size(); ++i) {
        labels[i] = SynthLabel(useed, static_cast<uint64_t>(e0) * ct + i);
      }
      st = (*writer)->AppendLabels(labels.data(), labels.size());
    }
    if (!st.ok()) return Fail(cmd, std::string(st.message()));
    progress.Update(static_cast<uint64_t>(e0 + n) * d.example_bytes());
  }
  auto result = (*writer)->Finish();
  progress.Finish();
  if (!result.ok()) return Fail(cmd, std::string(result.status().message()));
  PrintWriteResult(cmd, *result, d, args.Has("json"));
  return kExitOk;
}

// ---------------------------------------------------------------- write

void PrintNotes(const char* cmd, const ResumeInfo& info) {
  for (const std::string& note : info.notes) {
    std::fprintf(stderr, "shardcast %s: note: %s\n", cmd, note.c_str());
  }
}

// The options `write` takes in both modes (metadata, layout, resume).
absl::Status WriterOptionsFromArgs(const Args& args, WriterOptions* o) {
  auto layers = args.GetIntList("layers", "");
  RETURN_IF_ERROR(layers.status());
  auto budget = args.GetInt("budget", 2400000);
  RETURN_IF_ERROR(budget.status());
  auto variant = ParseVariantName(args.Get("variant", "2.1"));
  RETURN_IF_ERROR(variant.status());
  o->root = args.positional()[0];
  o->layers = *layers;
  o->cls_token = args.Has("cls");
  o->token_budget = *budget;
  o->family = args.Get("family", "unknown");
  o->ckpt = args.Get("ckpt", "unknown");
  o->data = args.Get("data", "");
  o->dataset = args.Get("dataset", "");
  o->variant = *variant;
  o->full_size_last_shard = args.Has("full-last-shard");
  if (args.Has("pixel-agg")) o->pixel_agg = args.Get("pixel-agg");
  o->resume = args.Has("resume");
  return absl::OkStatus();
}

// `write --stdin`: frames of a 4-byte ASCII kind and a little-endian uint64
// payload length, then the payload (docs/cli.md).
constexpr size_t kFrameHeaderBytes = 12;

// Reads up to `n` bytes from stdin; fewer only at end of input.
absl::StatusOr<size_t> ReadStdin(char* out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::read(0, out + done, n - done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "read stdin");
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

void PrintJsonLine(const OrderedJson& j) {
  std::printf("%s\n", JsonText(j).c_str());
  std::fflush(stdout);
}

int RunWriteStdin(const Args& args, WriterOptions o) {
  const char* cmd = "write";
  const bool json = args.Has("json");
  for (const char* name : {"tokens", "d-model", "examples"}) {
    if (!args.Has(name)) {
      return Usage(cmd, absl::StrCat("--", name, " is required with --stdin"));
    }
  }
  if (args.Has("labels-from")) {
    return Usage(cmd,
                 "--labels-from is for --from; with --stdin, --labels "
                 "announces LABL frames");
  }
  auto tokens = args.GetInt("tokens", 0);
  auto d_model = args.GetInt("d-model", 0);
  auto examples = args.GetInt("examples", 0);
  for (const absl::Status& s :
       {tokens.status(), d_model.status(), examples.status()}) {
    if (!s.ok()) return Usage(cmd, std::string(s.message()));
  }
  o.content_tokens = *tokens;
  o.d_model = *d_model;
  o.n_examples = *examples;
  o.with_labels = args.Has("labels");

  // With --json, stdout carries one JSON object per line: "ready" once the
  // writer stands (where to continue after a resume), then "done" or
  // "error".
  auto fail = [&](const absl::Status& st, const std::string& message) {
    if (json) {
      OrderedJson j;
      j["event"] = "error";
      j["code"] = absl::StatusCodeToString(st.code());
      j["message"] = message;
      PrintJsonLine(j);
    }
    return Fail(cmd, message);
  };
  auto created = DatasetWriter::Create(o);
  if (!created.ok()) {
    return fail(created.status(), std::string(created.status().message()));
  }
  std::unique_ptr<DatasetWriter> writer = std::move(*created);
  const DatasetDesc& d = writer->desc();
  const ResumeInfo& info = writer->resume_info();
  PrintNotes(cmd, info);
  if (json) {
    OrderedJson j;
    j["event"] = "ready";
    j["hash"] = writer->hash();
    j["path"] = JoinPath(o.root, writer->hash());
    j["temp_dir"] = writer->temp_dir();
    j["n_examples"] = d.n_examples;
    j["examples_written"] = writer->examples_written();
    j["example_bytes"] = d.example_bytes();
    j["shards"] = d.num_data_shards();
    j["examples_per_shard"] = d.examples_per_shard;
    j["resumed"] = info.resumed;
    j["resumed_from"] = info.from;
    j["complete"] = info.complete;
    j["notes"] = info.notes;
    PrintJsonLine(j);
  } else if (info.resumed || info.complete) {
    std::fprintf(stderr, "shardcast write: %s at example %lld of %lld\n",
                 info.complete ? "already complete" : "resumed",
                 static_cast<long long>(writer->examples_written()),
                 static_cast<long long>(d.n_examples));
  }

  // Any failure but an abort frame keeps the complete shards for --resume:
  // input that ends early means the producer died, and a full disk can be
  // emptied.
  auto abandon = [&](const absl::Status& st) {
    const std::string dir = writer->temp_dir();
    const int64_t at = writer->examples_written();
    writer->Abandon();
    std::string message(st.message());
    if (!dir.empty()) {
      absl::StrAppend(&message, " (", at, " of ", d.n_examples,
                      " examples received; the complete shards stay in ", dir,
                      " for --resume)");
    }
    return fail(st, message);
  };
  Progress progress(
      "write", static_cast<uint64_t>(d.n_examples) * d.example_bytes(), !json);
  std::vector<char> buffer(kChunkBytes);
  for (;;) {
    char header[kFrameHeaderBytes];
    absl::StatusOr<size_t> got = ReadStdin(header, sizeof(header));
    if (!got.ok()) return abandon(got.status());
    if (*got < sizeof(header)) {
      return abandon(
          absl::AbortedError(*got == 0 ? "input ended without a DONE frame"
                                       : "input ended inside a frame header"));
    }
    const std::string kind(header, 4);
    uint64_t length = 0;
    for (int i = 7; i >= 0; --i) {
      length = (length << 8) | static_cast<uint8_t>(header[4 + i]);
    }
    if (kind == "DONE" || kind == "ABRT") {
      if (length != 0) {
        return abandon(absl::InvalidArgumentError(
            absl::StrCat("a ", kind, " frame has no payload, this one has ",
                         length, " bytes")));
      }
      if (kind == "ABRT") {
        writer.reset();  // removes the temporary directory
        return fail(absl::AbortedError(""),
                    "aborted by the producer (ABRT frame); nothing was kept");
      }
      auto result = writer->Finish();
      progress.Finish();
      if (!result.ok()) {
        // ALREADY_EXISTS keeps the new data for inspection, not for resume.
        if (result.status().code() == absl::StatusCode::kAlreadyExists) {
          return fail(result.status(), std::string(result.status().message()));
        }
        return abandon(result.status());
      }
      if (json) {
        OrderedJson j;
        j["event"] = "done";
        j.update(WriteResultJson(*result, d));
        PrintJsonLine(j);
      } else {
        PrintWriteResult(cmd, *result, d, false);
      }
      return kExitOk;
    }
    if (kind != "ACTS" && kind != "LABL") {
      return abandon(absl::InvalidArgumentError(
          absl::StrCat("unknown frame kind ", Quoted(kind),
                       " (expected ACTS, LABL, DONE or ABRT)")));
    }
    for (uint64_t left = length; left > 0;) {
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(left, buffer.size()));
      got = ReadStdin(buffer.data(), n);
      if (!got.ok()) return abandon(got.status());
      absl::Status st =
          kind == "ACTS"
              ? writer->Append(buffer.data(), *got)
              : writer->AppendLabels(
                    reinterpret_cast<const uint8_t*>(buffer.data()), *got);
      if (!st.ok()) return abandon(st);
      if (*got < n) {
        return abandon(absl::AbortedError(
            absl::StrCat("input ended inside a ", kind, " frame")));
      }
      left -= n;
    }
    progress.Update(static_cast<uint64_t>(writer->examples_written()) *
                    d.example_bytes());
  }
}

int RunWrite(const Args& args) {
  const char* cmd = "write";
  if (args.positional().size() != 1)
    return Usage(cmd, "expected one ROOT directory");
  if (args.Has("stdin") == args.Has("from")) {
    return Usage(cmd, "give --from FILE.npy (repeatable) or --stdin");
  }
  if (!args.Has("layers"))
    return Usage(cmd,
                 "--layers is required (the recorded layer values, e.g. 6,12)");
  WriterOptions o;
  if (absl::Status st = WriterOptionsFromArgs(args, &o); !st.ok()) {
    return Usage(cmd, std::string(st.message()));
  }
  if (args.Has("stdin")) return RunWriteStdin(args, std::move(o));
  for (const char* name : {"tokens", "d-model", "examples", "labels"}) {
    if (args.Has(name)) {
      return Usage(cmd, absl::StrCat("--", name,
                                     " is for --stdin; with --from the .npy "
                                     "shapes say it"));
    }
  }

  std::vector<NpyFile> inputs;
  int64_t n_total = 0;
  for (const std::string& path : args.GetAll("from")) {
    auto npy = OpenNpy(path);
    if (!npy.ok()) return Fail(cmd, std::string(npy.status().message()));
    if (npy->descr != "<f4" || npy->shape.size() != 4) {
      return Fail(cmd, absl::StrCat(path,
                                    ": expected a float32 array shaped "
                                    "[N, L, T, D], got dtype ",
                                    npy->descr, " with shape [",
                                    absl::StrJoin(npy->shape, ", "), "]"));
    }
    if (!inputs.empty()) {
      const auto& first = inputs.front().shape;
      if (!std::equal(first.begin() + 1, first.end(), npy->shape.begin() + 1)) {
        return Fail(
            cmd,
            absl::StrCat(path, ": shape [", absl::StrJoin(npy->shape, ", "),
                         "] does not match ", inputs.front().path, " [",
                         absl::StrJoin(first, ", "), "] after the first axis"));
      }
    }
    n_total += npy->shape[0];
    inputs.push_back(std::move(*npy));
  }
  const auto& shape = inputs.front().shape;
  const bool cls = o.cls_token;
  if (shape[1] != static_cast<int64_t>(o.layers.size())) {
    return Fail(cmd,
                absl::StrCat(inputs.front().path, ": axis 1 has ", shape[1],
                             " layers but --layers lists ", o.layers.size()));
  }
  if (cls && shape[2] < 1) return Fail(cmd, "--cls needs at least one token");
  o.content_tokens = shape[2] - (cls ? 1 : 0);
  o.d_model = shape[3];
  o.n_examples = n_total;

  NpyFile labels;
  if (args.Has("labels-from")) {
    auto npy = OpenNpy(args.Get("labels-from"));
    if (!npy.ok()) return Fail(cmd, std::string(npy.status().message()));
    if ((npy->descr != "|u1" && npy->descr != "<u1") ||
        npy->shape.size() != 2 || npy->shape[0] != n_total ||
        npy->shape[1] != o.content_tokens) {
      return Fail(
          cmd,
          absl::StrCat(npy->path, ": labels must be uint8 shaped [", n_total,
                       ", ", o.content_tokens,
                       "] (examples, content tokens), got dtype ", npy->descr,
                       " with shape [", absl::StrJoin(npy->shape, ", "), "]"));
    }
    labels = std::move(*npy);
    o.with_labels = true;
  }

  auto writer = DatasetWriter::Create(o);
  if (!writer.ok()) return Fail(cmd, std::string(writer.status().message()));
  const DatasetDesc& d = (*writer)->desc();
  const ResumeInfo& info = (*writer)->resume_info();
  PrintNotes(cmd, info);
  if (info.resumed || info.complete) {
    std::fprintf(stderr, "shardcast write: %s at example %lld of %lld\n",
                 info.complete ? "already complete" : "resumed",
                 static_cast<long long>((*writer)->examples_written()),
                 static_cast<long long>(d.n_examples));
  }
  Progress progress(
      "write",
      static_cast<uint64_t>(n_total) * d.example_bytes() + labels.data_bytes);
  std::vector<char> buffer(kChunkBytes);
  uint64_t done = 0;
  // A resumed writer already holds the first bytes of each stream.
  auto copy = [&](const NpyFile& in, bool is_labels,
                  uint64_t* skip) -> absl::Status {
    const uint64_t first = std::min(*skip, in.data_bytes);
    *skip -= first;
    done += first;
    for (uint64_t pos = first; pos < in.data_bytes;) {
      const size_t n = static_cast<size_t>(
          std::min<uint64_t>(buffer.size(), in.data_bytes - pos));
      RETURN_IF_ERROR(PreadFull(in.fd.get(), buffer.data(), n,
                                in.data_offset + pos, in.path));
      if (is_labels) {
        RETURN_IF_ERROR((*writer)->AppendLabels(
            reinterpret_cast<const uint8_t*>(buffer.data()), n));
      } else {
        RETURN_IF_ERROR((*writer)->Append(buffer.data(), n));
      }
      pos += n;
      done += n;
      progress.Update(done);
    }
    return absl::OkStatus();
  };
  uint64_t skip =
      static_cast<uint64_t>((*writer)->examples_written()) * d.example_bytes();
  for (const NpyFile& in : inputs) {
    absl::Status st = copy(in, false, &skip);
    if (!st.ok()) return Fail(cmd, std::string(st.message()));
  }
  if (o.with_labels) {
    uint64_t label_skip = (*writer)->label_bytes_written();
    absl::Status st = copy(labels, true, &label_skip);
    if (!st.ok()) return Fail(cmd, std::string(st.message()));
  }
  auto result = (*writer)->Finish();
  progress.Finish();
  if (!result.ok()) return Fail(cmd, std::string(result.status().message()));
  PrintWriteResult(cmd, *result, d, args.Has("json"));
  return kExitOk;
}

// ---------------------------------------------------------------- info

int RunInfo(const Args& args) {
  const char* cmd = "info";
  if (args.positional().size() != 1)
    return Usage(cmd, "expected one dataset DIR");
  if (IsSafetensorsOrLmprobe(args.positional()[0])) {
    return InfoSafetensorsOrLmprobe(cmd, args.positional()[0],
                                    args.Has("json"));
  }
  auto info = ReadDatasetInfo(args.positional()[0]);
  if (!info.ok()) return Fail(cmd, std::string(info.status().message()));
  const DatasetDesc& d = info->desc;
  for (const std::string& w : d.warnings)
    std::fprintf(stderr, "warning: %s\n", w.c_str());
  const uint64_t bytes =
      static_cast<uint64_t>(d.n_examples) * d.example_bytes();
  if (args.Has("json")) {
    OrderedJson j;
    j["path"] = info->dir;
    j["protocol"] = d.protocol;
    j["variant"] = std::string(VariantName(d.variant));
    j["hash"] = info->hash;
    j["hash_kind"] = d.variant == Variant::kV2Saev ? "sha256-file-order-8"
                                                   : "sha256-sorted-keys";
    j["hash_matches_dir"] = info->hash_matches_dir;
    j["layers"] = d.layers;
    j["content_tokens"] = d.content_tokens;
    j["cls_token"] = d.cls_token;
    j["tokens_per_example"] = d.tokens_per_example;
    j["d_model"] = d.d_model;
    j["n_examples"] = d.n_examples;
    j["token_budget"] = d.token_budget;
    j["examples_per_shard"] = d.examples_per_shard;
    OrderedJson shards = OrderedJson::array();
    for (const ShardEntry& s : d.shards) {
      shards.push_back({{"name", s.name}, {"n_examples", s.n_examples}});
    }
    j["shards"] = shards;
    j["has_labels"] = info->has_labels;
    j["has_checksums"] = info->has_checksums;
    j["bytes"] = bytes;
    j["warnings"] = d.warnings;
    PrintJson(j);
    return kExitOk;
  }
  std::printf("path        %s\n", info->dir.c_str());
  std::printf("protocol    %s (variant %s)\n", d.protocol.c_str(),
              std::string(VariantName(d.variant)).c_str());
  std::printf("hash        %s (%s)\n", info->hash.c_str(),
              info->hash_matches_dir ? "matches the directory name"
                                     : "does NOT match the directory name");
  std::printf("layers      [%s]\n", absl::StrJoin(d.layers, ", ").c_str());
  std::printf("tokens      %lld content%s = %lld per example\n",
              static_cast<long long>(d.content_tokens),
              d.cls_token ? " + CLS" : "",
              static_cast<long long>(d.tokens_per_example));
  std::printf("d_model     %lld\n", static_cast<long long>(d.d_model));
  std::printf("examples    %lld in %lld shard(s) of up to %lld\n",
              static_cast<long long>(d.n_examples),
              static_cast<long long>(d.num_data_shards()),
              static_cast<long long>(d.examples_per_shard));
  std::printf("size        %.1f MiB of float32\n",
              static_cast<double>(bytes) / (1 << 20));
  std::printf("labels      %s\n", info->has_labels ? "yes" : "no");
  std::printf("checksums   %s\n", info->has_checksums ? "SHA256SUMS" : "none");
  return kExitOk;
}

// ---------------------------------------------------------------- verify

Progress* g_verify_progress = nullptr;

int RunVerify(const Args& args) {
  const char* cmd = "verify";
  if (args.positional().size() != 1)
    return Usage(cmd, "expected one dataset DIR");
  const std::string dir = args.positional()[0];
  std::vector<std::string> problems;
  std::vector<std::string> warnings;
  bool checked_sums = false;
  auto info = ReadDatasetInfo(dir);
  if (!info.ok()) {
    problems.emplace_back(info.status().message());
  } else {
    warnings = info->desc.warnings;
    for (const absl::Status& s : CheckDataFiles(*info)) {
      problems.emplace_back(s.message());
    }
    if (!info->hash_matches_dir) {
      problems.push_back(
          absl::StrCat(dir, ": directory name \"", info->dir_name,
                       "\" does not match the content hash of metadata.json (",
                       info->hash, ")"));
    }
    if (info->has_checksums) {
      Progress progress("verify checksums", 0, !args.Has("json"));
      g_verify_progress = &progress;
      for (const absl::Status& s :
           VerifyChecksums(*info, [](uint64_t done, uint64_t) {
             g_verify_progress->Update(done);
           })) {
        problems.emplace_back(s.message());
      }
      progress.Finish();
      g_verify_progress = nullptr;
      checked_sums = true;
    }
  }
  for (const std::string& w : warnings)
    std::fprintf(stderr, "warning: %s\n", w.c_str());
  if (args.Has("json")) {
    OrderedJson j;
    j["path"] = dir;
    j["ok"] = problems.empty();
    j["problems"] = problems;
    j["warnings"] = warnings;
    j["checksums_verified"] = checked_sums;
    PrintJson(j);
  } else if (problems.empty()) {
    std::printf("ok: %s: %lld examples in %lld shard(s); %s\n", dir.c_str(),
                static_cast<long long>(info->desc.n_examples),
                static_cast<long long>(info->desc.num_data_shards()),
                checked_sums ? "all SHA256SUMS entries match"
                             : "no SHA256SUMS to check");
  } else {
    for (const std::string& p : problems) std::printf("%s\n", p.c_str());
    std::fprintf(stderr, "shardcast verify: %zu problem(s) in %s\n",
                 problems.size(), dir.c_str());
  }
  return problems.empty() ? kExitOk : kExitFailure;
}

// ---------------------------------------------------------------- get

int RunGet(const Args& args) {
  const char* cmd = "get";
  if (args.positional().size() != 1)
    return Usage(cmd, "expected one dataset DIR");
  if (!args.Has("example")) return Usage(cmd, "--example is required");
  if (!args.Has("layer")) return Usage(cmd, "--layer is required");
  const bool all_tokens = args.Has("all-tokens");
  if (all_tokens == args.Has("token")) {
    return Usage(cmd, "give exactly one of --token T and --all-tokens");
  }
  auto example = args.GetInt("example", 0);
  auto layer = args.GetInt("layer", 0);
  auto token = args.GetInt("token", 0);
  for (const absl::Status& s :
       {example.status(), layer.status(), token.status()}) {
    if (!s.ok()) return Usage(cmd, std::string(s.message()));
  }
  auto reader = DatasetReader::Open(args.positional()[0]);
  if (!reader.ok()) return Fail(cmd, std::string(reader.status().message()));
  const DatasetDesc& d = (*reader)->desc();
  const int64_t rows = all_tokens ? d.tokens_per_example : 1;
  std::vector<float> v(static_cast<size_t>(rows * d.d_model));
  absl::Status st =
      all_tokens ? (*reader)->ReadLayerSlice(*example, *layer, v.data())
                 : (*reader)->ReadVector(*example, *layer, *token, v.data());
  if (!st.ok()) return Fail(cmd, std::string(st.message()));
  return PrintVectors(cmd, v.data(), all_tokens ? rows : -1, d.d_model,
                      args.Has("json"), args.Has("raw"));
}

}  // namespace

int PrintVectors(const char* command, const float* v, int64_t rows, int64_t d,
                 bool json, bool raw) {
  const bool matrix = rows >= 0;
  const int64_t n = matrix ? rows : 1;
  if (raw) {
    // Little-endian float32, exactly as stored.
    const size_t count = static_cast<size_t>(n * d);
    if (std::fwrite(v, 4, count, stdout) != count || std::fflush(stdout) != 0) {
      return Fail(command, "writing to stdout failed");
    }
    return kExitOk;
  }
  std::string out;
  if (json) {
    if (!matrix) {
      out = FloatsJson(v, d);
    } else {
      out = "[";
      for (int64_t t = 0; t < n; ++t) {
        if (t > 0) out += ",\n ";
        out += FloatsJson(v + t * d, d);
      }
      out += "]";
    }
  } else {
    for (int64_t t = 0; t < n; ++t) {
      if (t > 0) out += "\n";
      out += FloatsText(v + t * d, d);
    }
  }
  std::printf("%s\n", out.c_str());
  return kExitOk;
}

int Fail(const char* command, const std::string& message) {
  std::fprintf(stderr, "shardcast %s: error: %s\n", command, message.c_str());
  return kExitFailure;
}

std::vector<Command> LocalCommands() {
  const OptionSpec json{"json", nullptr, "print machine-readable JSON"};
  return {
      {"synth",
       "synth ROOT [options]",
       "write a deterministic synthetic dataset (tests, demos, benchmarks)",
       "Writes a dataset of seeded pseudo-random float32 values into "
       "ROOT/<HASH> with the crash-safe writer and prints its path and hash.\n"
       "Element i of the logical C-order tensor [N, L, T, D] is\n"
       "float32((h >> 40) / 2^24 * 2 - 1), h = splitmix64(seed * 0x100000001B3 "
       "XOR i),\nso any reader can recompute the expected values.",
       {{"layers", "L1,L2,...",
         "recorded layer values (default 6,12; negative allowed)"},
        {"tokens", "N",
         "content tokens (patches) per example, without CLS (default 256)"},
        {"cls", nullptr, "add a CLS token at token index 0"},
        {"d-model", "D", "activation width (default 1024)"},
        {"examples", "N", "number of examples (default 16)"},
        {"budget", "TOKENS",
         "tokens per shard budget, patches_per_shard (default 2400000)"},
        {"labels", nullptr, "also write labels.bin (uint8 per content token)"},
        {"seed", "S", "seed of the values (default 0)"},
        {"variant", "V",
         "2.1 (default, what we write), 2.1-saev or 1.0.0 (as other tools "
         "write)"},
        {"full-last-shard", nullptr,
         "pad the last shard file to full size (as saev does)"},
        {"trailing-empty-shard", nullptr,
         "add saev's trailing {n_examples: 0} entry (not with 2.1)"},
        {"family", "F",
         "model family recorded in metadata (default synthetic)"},
        {"ckpt", "C", "checkpoint recorded in metadata (default synthetic)"},
        json},
       RunSynth},
      {"write",
       "write ROOT (--from FILE.npy [--from FILE2.npy ...] | --stdin --tokens "
       "T --d-model D --examples N) --layers L1,L2 [options]",
       "write a protocol 2.1 dataset from float32 .npy arrays or a stream",
       "Streams float32 arrays shaped [N, L, T, D] (T includes the CLS token "
       "when --cls) into a new dataset ROOT/<HASH>, concatenating the files "
       "along N, in one pass. The data is written to a temporary directory, "
       "fsynced and renamed into place, so an interrupted write never leaves "
       "a complete-looking dataset. If an identical dataset exists it is "
       "reused; if a different one has the same hash the command fails and "
       "keeps the new data in the temporary directory.\n"
       "With --stdin the examples come as frames on stdin, each a 4-byte kind "
       "(ACTS: float32 bytes of the [N, L, T, D] stream, any split; LABL: "
       "uint8 labels [N, T - cls], any split; DONE: finish; ABRT: give up "
       "and remove everything), a little-endian uint64 payload length, then "
       "the payload. Input that ends without DONE, or any error, keeps the "
       "complete shards for --resume. With --json, stdout has one JSON object "
       "per line: {\"event\": \"ready\", \"examples_written\": ...} once the "
       "writer stands, then \"done\" (the result) or \"error\" (code, "
       "message).\n"
       "--resume continues an interrupted write of the same dataset under "
       "ROOT (same metadata, labels and padding) from its last complete "
       "shard, after re-hashing the kept shards against the writer's "
       "journal; with --from it skips the input already written, with "
       "--stdin \"examples_written\" says where the producer continues.",
       {{"from", "FILE.npy", "input array [N, L, T, D] float32 (repeatable)",
         true},
        {"stdin", nullptr, "read framed examples from stdin (see above)"},
        {"layers", "L1,L2,...", "layer values of axis 1 (required)"},
        {"cls", nullptr, "token 0 of axis 2 is the CLS token"},
        {"tokens", "T", "--stdin: content tokens per example, without CLS"},
        {"d-model", "D", "--stdin: activation width"},
        {"examples", "N", "--stdin: number of examples"},
        {"labels", nullptr, "--stdin: LABL frames bring labels.bin"},
        {"budget", "TOKENS",
         "patches_per_shard token budget (default 2400000)"},
        {"labels-from", "FILE.npy",
         "uint8 labels [N, content tokens] for labels.bin"},
        {"resume", nullptr,
         "continue an interrupted write of the same dataset"},
        {"family", "F", "model family (clip, siglip, dinov2, ...)"},
        {"ckpt", "C", "model checkpoint identifier"},
        {"data", "STR", "opaque dataset description (seed 000: base64 pickle)"},
        {"dataset", "PATH", "path of the source dataset"},
        {"variant", "V",
         "2.1 (default, seed 000) or 2.1-saev (saev's field names and "
         "8-hex directory)"},
        {"pixel-agg", "A",
         "2.1-saev: metadata pixel_agg (saev's Metadata.load wants majority "
         "or prefer-fg; default null)"},
        {"full-last-shard", nullptr,
         "pad the last shard file to full size (saev's loaders map it whole)"},
        json},
       RunWrite},
      {"info",
       "info DIR|FILE.safetensors [--json]",
       "describe a dataset (any protocol variant, lmprobe, safetensors)",
       "Parses metadata.json and shards.json (protocol 1.0.0/1.1, 2.1, or 2.1 "
       "as saev writes it) and prints the dataset's shape, shards and content "
       "hash. Does not read shard files; use `verify` for that.\n"
       "Given an lmprobe dataset directory (lmprobe_info.json and/or "
       "tensors/*.safetensors, no metadata.json), reads and validates every "
       "shard's safetensors header and prints the layers, rows, dim, dtype, "
       "storage and the byte range of every layer's tensor in every shard, "
       "and what is not available without the parquet index (which is not "
       "read). Given a file, validates and prints its safetensors header.",
       {json},
       RunInfo},
      {"verify",
       "verify DIR [--json]",
       "check a dataset's files, hash and SHA256SUMS",
       "Checks the metadata, every shard file's size, labels.bin, that the "
       "directory is named by the content hash, and every SHA256SUMS entry. "
       "Exit 0 when sound; exit 1 with one line per problem on stdout.",
       {json},
       RunVerify},
      {"get",
       "get DIR --example E --layer L (--token T | --all-tokens) "
       "[--json|--raw]",
       "print one activation vector (or all tokens of one layer of an example)",
       "Reads the vector of (example E, layer value L, token index T) at the "
       "protocol's offset. T is the index on the token axis, 0..T-1; with a "
       "CLS token, 0 is CLS and content tokens start at 1. Numbers are printed "
       "with the shortest decimal form that round-trips to the stored float32.",
       {{"example", "E", "example index (0-based)"},
        {"layer", "L", "layer value as recorded in metadata (e.g. -2 or 12)"},
        {"token", "T", "index on the token axis (0 is CLS when present)"},
        {"all-tokens", nullptr, "print all T vectors of the layer, [T, D]"},
        {"raw", nullptr, "write little-endian float32 bytes to stdout"},
        json},
       RunGet},
      DoctorCommand(),
  };
}

}  // namespace shardcast
