// Where QueryEngine reads vectors from: cold ones of a dataset whose vectors
// are 4 KiB multiples with O_DIRECT (left out of the page cache), cached ones
// and every one of other datasets through the page cache. Expected values
// come from the generator (common/format/synth.h) at the protocol's offsets;
// what is cached is asked of the kernel (RWF_NOWAIT reads, mincore).
#include "server/engine/query.h"

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/base/file.h"
#include "common/format/synth.h"
#include "common/format/writer.h"
#include "common/testing/testing.h"
#include "gtest/gtest.h"
#include "server/engine/catalog.h"
#include "server/io/page_residency.h"

namespace shardcast {
namespace {

constexpr uint64_t kSeed = 5;
// 6 examples, layers {3, 7}, 4 content tokens without CLS; 2 examples per
// shard (3 shards). D = 1024: 4 KiB vectors.
constexpr int64_t kN = 6, kL = 2, kT = 4;

class QueryEngineReadsTest : public ::testing::Test {
 protected:
  void Write(int64_t d_model) {
    d_ = d_model;
    WriterOptions o;
    o.root = root_.path();
    o.layers = {3, 7};
    o.content_tokens = kT;
    o.d_model = d_model;
    o.n_examples = kN;
    o.token_budget = 2 * kL * kT;  // two examples of every layer
    auto w = DatasetWriter::Create(o);
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<float> v(static_cast<size_t>(kN * kL * kT * d_model));
    for (size_t i = 0; i < v.size(); ++i) v[i] = SynthValue(kSeed, i);
    ASSERT_TRUE((*w)->Append(v.data(), v.size() * 4).ok());
    auto r = (*w)->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    dir_ = r->path;
    id_ = BaseName(dir_);
    if (catalog_ == nullptr) {
      catalog_ =
          std::make_unique<Catalog>(std::vector<std::string>{root_.path()});
    }
    catalog_->Rescan();
    shards_.clear();
    for (int s = 0; s < 3; ++s) {
      shards_.push_back(dir_ + "/acts00000" + std::to_string(s) + ".bin");
      ASSERT_EQ(ReadFile(shards_.back()).size(),
                static_cast<size_t>(2 * kL * kT * d_model * 4));
    }
    ASSERT_TRUE(ReadFile(dir_ + "/acts000003.bin").empty());
  }

  // Every shard out of the page cache; false where they stay (tmpfs).
  bool EvictAll() {
    for (const std::string& path : shards_) {
      auto fd = OpenFile(path, O_RDONLY);
      if (!fd.ok() || ::fdatasync(fd->get()) != 0 ||
          ::posix_fadvise(fd->get(), 0, 0, POSIX_FADV_DONTNEED) != 0) {
        return false;
      }
    }
    return !Cached(Coord{0, 3, 0});
  }

  // Reads `c`'s vector into the page cache (nothing around it).
  void CacheOne(const Coord& c) {
    auto fd = OpenFile(shards_[static_cast<size_t>(c.example / 2)], O_RDONLY);
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_EQ(::posix_fadvise(fd->get(), 0, 0, POSIX_FADV_RANDOM), 0);
    std::vector<char> bytes(static_cast<size_t>(d_) * 4);
    ASSERT_EQ(::pread(fd->get(), bytes.data(), bytes.size(), Offset(c)),
              static_cast<ssize_t>(bytes.size()));
  }

  // Byte offset of `c` in its shard: [examples, layers, tokens, D] float32,
  // two examples per shard, layer index 0 for layer 3 and 1 for 7.
  off_t Offset(const Coord& c) const {
    const int64_t li = c.layer == 3 ? 0 : 1;
    return static_cast<off_t>((((c.example % 2) * kL + li) * kT + c.token) *
                              d_ * 4);
  }

  // Whether `c`'s vector is cached, by mincore (PageResidency is checked
  // against RWF_NOWAIT reads in page_residency_test.cc).
  bool Cached(const Coord& c) const {
    auto fd = OpenFile(shards_[static_cast<size_t>(c.example / 2)], O_RDONLY);
    if (!fd.ok()) return true;
    struct stat st;
    ::fstat(fd->get(), &st);
    auto r = PageResidency::Open(fd->get(), static_cast<uint64_t>(st.st_size),
                                 "shard");
    return !r.ok() || (*r)->Cached(static_cast<uint64_t>(Offset(c)),
                                   static_cast<uint64_t>(d_) * 4);
  }

  // Row `i` of `r` against the generator.
  void ExpectVector(const VectorsResult& r, size_t i, const Coord& c) const {
    const int64_t li = c.layer == 3 ? 0 : 1;
    const float* got = reinterpret_cast<const float*>(r.data.data()) + i * d_;
    for (int64_t k = 0; k < d_; ++k) {
      ASSERT_EQ(
          got[k],
          SynthValue(kSeed,
                     static_cast<uint64_t>(
                         ((c.example * kL + li) * kT + c.token) * d_ + k)))
          << "row " << i << " float " << k;
    }
  }

  // Every vector, in one call that may read them with O_DIRECT, checked.
  void GetEveryVector(const QueryEngine& q) const {
    const std::vector<Coord> all = Every();
    auto r = q.GetVectors(id_, all, ColdReads::kDirect);
    ASSERT_TRUE(r.ok()) << r.status();
    for (size_t i = 0; i < all.size(); ++i) ExpectVector(*r, i, all[i]);
  }

  static std::vector<Coord> Every() {
    std::vector<Coord> all;
    for (int64_t e = kN - 1; e >= 0; --e) {
      for (int64_t layer : {7, 3}) {
        for (int64_t t = 0; t < kT; ++t) all.push_back({e, layer, t});
      }
    }
    return all;
  }

  TempRoot root_;
  std::string dir_, id_;
  std::vector<std::string> shards_;
  std::unique_ptr<Catalog> catalog_;
  int64_t d_ = 0;
};

TEST_F(QueryEngineReadsTest, ColdVectorsAreReadWithODirectAndNotCached) {
  Write(1024);
  if (!EvictAll()) GTEST_SKIP() << "cannot evict pages here";
  QueryEngine q(catalog_.get(), QueryLimits{});
  const std::vector<Coord> all = Every();
  GetEveryVector(q);
  EXPECT_EQ(q.direct_bytes_read(), all.size() * 4096);
  EXPECT_EQ(q.bytes_read(), all.size() * 4096);
  for (const Coord& c : all) EXPECT_FALSE(Cached(c)) << c.example;
}

TEST_F(QueryEngineReadsTest, CachedVectorsComeFromThePageCache) {
  Write(1024);
  if (!EvictAll()) GTEST_SKIP() << "cannot evict pages here";
  QueryEngine q(catalog_.get(), QueryLimits{});
  // Every other vector cached: the probe never trusts the call as warm.
  const std::vector<Coord> all = Every();
  for (size_t i = 0; i < all.size(); i += 2) CacheOne(all[i]);
  VectorsResult result;
  std::vector<int> seen(all.size(), 0);
  absl::Status st = q.StreamVectors(
      id_, all, 5, &result,
      [&](absl::Span<const int64_t> rows, bool) {
        for (int64_t row : rows) ++seen[static_cast<size_t>(row)];
      },
      ColdReads::kDirect);
  ASSERT_TRUE(st.ok()) << st;
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(seen[i], 1) << "row " << i;
    ExpectVector(result, i, all[i]);
  }
  EXPECT_EQ(q.direct_bytes_read(), all.size() / 2 * 4096);
  // The cold half was read around the cache.
  for (size_t i = 1; i < all.size(); i += 2) EXPECT_FALSE(Cached(all[i]));
}

TEST_F(QueryEngineReadsTest, ACallThatStartsWarmIsReadThroughTheCache) {
  Write(1024);
  if (!EvictAll()) GTEST_SKIP() << "cannot evict pages here";
  QueryEngine q(catalog_.get(), QueryLimits{});
  // The first 8 vectors cached: the rest are not probed (a warm call would
  // pay a system call per vector) and go through the cache as well.
  const std::vector<Coord> all = Every();
  for (size_t i = 0; i < 8; ++i) CacheOne(all[i]);
  auto r = q.GetVectors(id_, all, ColdReads::kDirect);
  ASSERT_TRUE(r.ok()) << r.status();
  for (size_t i = 0; i < all.size(); ++i) ExpectVector(*r, i, all[i]);
  EXPECT_EQ(q.direct_bytes_read(), 0u);
  EXPECT_TRUE(Cached(all.back()));
}

TEST_F(QueryEngineReadsTest, ACallThatStartsColdIsReadWithODirect) {
  Write(1024);
  if (!EvictAll()) GTEST_SKIP() << "cannot evict pages here";
  QueryEngine q(catalog_.get(), QueryLimits{});
  // The first 8 vectors cold, the next 8 cached: those are not probed
  // (a cold call would pay a system call per vector before its first read)
  // and come from the disk as well.
  const std::vector<Coord> all = Every();
  for (size_t i = 8; i < 16; ++i) CacheOne(all[i]);
  GetEveryVector(q);
  EXPECT_EQ(q.direct_bytes_read(), all.size() * 4096);
}

TEST_F(QueryEngineReadsTest, PageCacheReadsWhenTheCallOrTheEngineAsks) {
  Write(1024);
  if (!EvictAll()) GTEST_SKIP() << "cannot evict pages here";
  const std::vector<Coord> all = Every();
  QueryEngine q(catalog_.get(), QueryLimits{});
  auto r = q.GetVectors(id_, {all[0], all[1]}, ColdReads::kPageCache);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectVector(*r, 0, all[0]);
  ExpectVector(*r, 1, all[1]);
  EXPECT_EQ(q.direct_bytes_read(), 0u);
  EXPECT_TRUE(Cached(all[1]));
  // --query-buffered: direct = false.
  QueryEngine buffered(catalog_.get(), QueryLimits{}, /*direct=*/false);
  r = buffered.GetVectors(id_, {all[5]}, ColdReads::kDirect);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectVector(*r, 0, all[5]);
  EXPECT_EQ(buffered.direct_bytes_read(), 0u);
  EXPECT_TRUE(Cached(all[5]));
}

TEST_F(QueryEngineReadsTest, VectorsOfOtherSizesAreReadThroughTheCache) {
  Write(100);  // 400-byte vectors: O_DIRECT cannot read them in place
  if (!EvictAll()) GTEST_SKIP() << "cannot evict pages here";
  QueryEngine q(catalog_.get(), QueryLimits{});
  GetEveryVector(q);
  EXPECT_EQ(q.direct_bytes_read(), 0u);
  EXPECT_EQ(q.bytes_read(), Every().size() * 400);
}

// Read system calls this process has made (/proc/self/io syscr).
int64_t ReadSyscalls() {
  const std::string io = ReadFile("/proc/self/io");
  const size_t at = io.find("syscr: ");
  return at == std::string::npos ? -1 : std::stoll(io.substr(at + 7));
}

// A call whose vectors are all cached is answered without a worker; one
// that misses is not, however fast the disk: that is decided from the page
// cache's residency, with no read (an RWF_NOWAIT read that misses starts
// the read, and here it sometimes completed before the check: a cold call
// answered on the caller's thread). The missing vector's read is started
// for the worker that reads the call next.
TEST_F(QueryEngineReadsTest, GetVectorsIfCachedAnswersOnlyCachedCalls) {
  for (int64_t d_model : {100, 1024}) {  // 400-byte and 4 KiB vectors
    SCOPED_TRACE(d_model);
    Write(d_model);
    if (!EvictAll()) GTEST_SKIP() << "cannot evict pages here";
    QueryEngine q(catalog_.get(), QueryLimits{});
    const std::vector<Coord> all = Every();
    const std::vector<Coord> call = {all[0], all[9], all[17]};
    CacheOne(all[0]);
    CacheOne(all[17]);
    // Two counts in a row: the reads of the count itself.
    const int64_t before = ReadSyscalls(), reads = ReadSyscalls();
    ASSERT_GE(before, 0);
    auto r = q.GetVectorsIfCached(id_, call, 64);
    EXPECT_FALSE(r.has_value());
    EXPECT_EQ(ReadSyscalls() - reads, reads - before) << "asking read files";
    EXPECT_EQ(q.bytes_read(), 0u);
    for (int i = 0; i < 500 && !Cached(all[9]); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_TRUE(Cached(all[9])) << "the missing vector's read was not started";
    if (d_model == 1024) {  // the next page holds the next vector alone
      EXPECT_FALSE(Cached(all[10])) << "read-ahead around the missing vector";
    }

    r = q.GetVectorsIfCached(id_, call, 64);
    ASSERT_TRUE(r.has_value());
    ASSERT_TRUE(r->ok()) << r->status();
    for (size_t i = 0; i < call.size(); ++i) ExpectVector(**r, i, call[i]);
    EXPECT_EQ(q.bytes_read(), call.size() * static_cast<uint64_t>(d_model) * 4);
    // More vectors than the caller serves inline: not asked at all.
    EXPECT_FALSE(q.GetVectorsIfCached(id_, call, 2).has_value());
    // A bad coordinate is refused here, cached or not, naming it.
    r = q.GetVectorsIfCached(id_, {all[5], {kN, 3, 0}}, 64);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kOutOfRange);
    EXPECT_NE(r->status().message().find("coordinates[1]"), std::string::npos)
        << r->status();
    r = q.GetVectorsIfCached("no-such-dataset", call, 64);
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(r->status().code(), absl::StatusCode::kNotFound);
  }
}

// Descriptors of this process that name a deleted file of dataset `id`.
int DeletedFilesHeld(const std::string& id) {
  int held = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.find("/" + id + "/") != std::string::npos &&
        target.find("(deleted)") != std::string::npos) {
      ++held;
    }
  }
  return held;
}

TEST_F(QueryEngineReadsTest, ADatasetDeletedFromTheCatalogIsLetGo) {
  Write(1024);
  const std::string first = dir_, first_id = id_;
  QueryEngine q(catalog_.get(), QueryLimits{});
  ASSERT_TRUE(q.GetVectors(first_id, Every(), ColdReads::kDirect).ok());
  Write(2048);  // a second dataset beside it
  std::filesystem::remove_all(first);
  catalog_->Rescan();
  // The catalog has let the first go; the engine's O_DIRECT descriptors of
  // it go at its next call, whichever dataset that call reads.
  EXPECT_GT(DeletedFilesHeld(first_id), 0);
  ASSERT_TRUE(q.GetVectors(id_, {{0, 3, 0}}, ColdReads::kDirect).ok());
  EXPECT_EQ(DeletedFilesHeld(first_id), 0);
  EXPECT_EQ(q.GetVectors(first_id, {{0, 3, 0}}).status().code(),
            absl::StatusCode::kNotFound);
}

// A transport performs planned reads after PlanVectorReads returned; a
// rescan meanwhile replaces the dataset's reader, and the old reader's
// descriptors must stay open until the reads are done (closed, their numbers
// go to the next files opened, and the reads would fail with EBADF or serve
// another file's bytes: the soak's "read <garbage>: Bad file descriptor").
TEST_F(QueryEngineReadsTest, PlannedReadsKeepTheirFilesAcrossARescan) {
  Write(1024);
  QueryEngine q(catalog_.get(), QueryLimits{});
  const bool evicted = EvictAll();  // cold: O_DIRECT descriptors too
  CacheOne(Coord{5, 7, 0});         // and one read through the cache
  const std::vector<Coord> all = Every();
  VectorsResult r;
  absl::StatusOr<QueryEngine::VectorReads> plan =
      q.PlanVectorReads(id_, all, ColdReads::kDirect,
                        [&r](uint64_t bytes) -> absl::StatusOr<char*> {
                          r.data = Payload(static_cast<size_t>(bytes));
                          return r.data.data();
                        });
  ASSERT_TRUE(plan.ok()) << plan.status();
  if (evicted) {
    EXPECT_GT(plan->direct_bytes, 0u);
  }
  catalog_->Rescan();  // a new reader; the catalog lets the old one go
  // Any descriptor the old reader closed is reused by these.
  std::vector<UniqueFd> others;
  for (int i = 0; i < 16; ++i) {
    auto fd = OpenFile("/dev/zero", O_RDONLY);
    ASSERT_TRUE(fd.ok()) << fd.status();
    others.push_back(std::move(*fd));
  }
  ASSERT_TRUE(UringReader::ThisThread().ReadAll(plan->ops).ok());
  for (size_t i = 0; i < all.size(); ++i) ExpectVector(r, i, all[i]);
}

TEST_F(QueryEngineReadsTest, ResultsAreAlignedForDirectReads) {
  for (size_t size : {size_t{0}, size_t{1}, size_t{4096}, size_t{12345}}) {
    Payload p(size);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data()) % 4096, 0u) << size;
    EXPECT_EQ(p.size(), size);
  }
}

}  // namespace
}  // namespace shardcast
