#include "server/engine/catalog.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <map>
#include <vector>

#include "common/base/file.h"
#include "common/format/writer.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

class CatalogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = JoinPath(::testing::TempDir(), "catalog_test_XXXXXX");
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    root_a_ = JoinPath(dir_, "a");
    root_b_ = JoinPath(dir_, "b");
    ASSERT_EQ(::mkdir(root_a_.c_str(), 0755), 0);
    ASSERT_EQ(::mkdir(root_b_.c_str(), 0755), 0);
  }
  void TearDown() override { RemoveTree(dir_).IgnoreError(); }

  std::string Write(const std::string& root, int64_t n) {
    WriterOptions o;
    o.root = root;
    o.layers = {1};
    o.content_tokens = 2;
    o.d_model = 4;
    o.n_examples = n;
    o.token_budget = 100;
    auto w = DatasetWriter::Create(o);
    EXPECT_TRUE(w.ok());
    std::vector<float> v(static_cast<size_t>(n * 2 * 4), 1.5f);
    EXPECT_TRUE((*w)->Append(v.data(), v.size() * 4).ok());
    auto r = (*w)->Finish();
    EXPECT_TRUE(r.ok()) << r.status();
    return r->hash;
  }

  std::string dir_, root_a_, root_b_;
};

TEST_F(CatalogTest, FindsByIdAndByUniquePrefixOfAtLeastEightCharacters) {
  const std::string id = Write(root_a_, 3);
  Catalog catalog({root_a_});
  EXPECT_EQ(catalog.Rescan(), (std::pair<int64_t, int64_t>{1, 0}));
  ASSERT_TRUE(catalog.Resolve(id).ok());
  ASSERT_TRUE(catalog.Resolve(id.substr(0, 8)).ok());
  EXPECT_EQ(catalog.Resolve(id.substr(0, 7)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(catalog.Resolve("ffffffffffff").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(CatalogTest, AmbiguousPrefixIsAnError) {
  // Two dataset directories sharing an 8-character prefix (copies are
  // served under any name; the name mismatch is only a warning).
  const std::string id = Write(root_a_, 3);
  ASSERT_EQ(std::system(("cp -r " + JoinPath(root_a_, id) + " " +
                         JoinPath(root_a_, id.substr(0, 8) + "_copy"))
                            .c_str()),
            0);
  Catalog catalog({root_a_});
  catalog.Rescan();
  auto r = catalog.Resolve(id.substr(0, 8));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
      << r.status();
  EXPECT_TRUE(catalog.Resolve(id).ok());  // the exact id still works
}

TEST_F(CatalogTest, SameIdUnderTwoRootsKeepsTheFirstAndReportsTheSecond) {
  const std::string id = Write(root_a_, 3);
  ASSERT_EQ(Write(root_b_, 3), id);
  Catalog catalog({root_a_, root_b_});
  EXPECT_EQ(catalog.Rescan(), (std::pair<int64_t, int64_t>{1, 1}));
  auto entry = catalog.Find(id);
  ASSERT_TRUE(entry.ok());
  EXPECT_EQ((*entry)->dir, JoinPath(root_a_, id));
}

TEST_F(CatalogTest, BrokenDatasetIsListedWithItsErrorAndNotServed) {
  const std::string bad = JoinPath(root_a_, "broken");
  ASSERT_EQ(::mkdir(bad.c_str(), 0755), 0);
  std::ofstream(JoinPath(bad, "shards.json")) << "[]";
  Catalog catalog({root_a_});
  EXPECT_EQ(catalog.Rescan(), (std::pair<int64_t, int64_t>{0, 1}));
  auto list = catalog.List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0]->status.code(),
            absl::StatusCode::kNotFound);  // no metadata.json
  EXPECT_EQ(catalog.Resolve("broken").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(CatalogTest, FilesAndDirectoriesLeadingOutOfTheirRootAreRefused) {
  // A dataset whose shard is a link to a file outside the root (what a user
  // who may write under a root would do to read another user's file), one
  // whose directory is a link out of the root, and one whose shard links to
  // another place under the same root (allowed).
  const std::string out = JoinPath(dir_, "outside");
  ASSERT_EQ(::mkdir(out.c_str(), 0755), 0);
  const std::string shard_out = Write(root_b_, 3);
  const std::string dir_out = Write(out, 4);
  const std::string inside = Write(root_a_, 5);
  const std::string linked = Write(root_a_, 6);
  const std::string shard =
      JoinPath(JoinPath(root_a_, shard_out), "acts000000.bin");
  ASSERT_EQ(std::rename(JoinPath(root_b_, shard_out).c_str(),
                        JoinPath(root_a_, shard_out).c_str()),
            0);
  const std::string secret = JoinPath(root_b_, "secret.bin");
  ASSERT_EQ(std::rename(shard.c_str(), secret.c_str()), 0);
  ASSERT_EQ(::symlink(secret.c_str(), shard.c_str()), 0);
  ASSERT_EQ(::symlink(JoinPath(out, dir_out).c_str(),
                      JoinPath(root_a_, dir_out).c_str()),
            0);
  const std::string kept = JoinPath(root_a_, "kept.bin");
  const std::string linked_shard =
      JoinPath(JoinPath(root_a_, linked), "acts000000.bin");
  ASSERT_EQ(std::rename(linked_shard.c_str(), kept.c_str()), 0);
  ASSERT_EQ(::symlink("../kept.bin", linked_shard.c_str()), 0);

  Catalog catalog({root_a_});
  EXPECT_EQ(catalog.Rescan(), (std::pair<int64_t, int64_t>{2, 2}));
  EXPECT_TRUE(catalog.Resolve(inside).ok());
  EXPECT_TRUE(catalog.Resolve(linked).ok());
  for (const auto& [id, leads_to] :
       {std::pair{shard_out, secret},
        std::pair{dir_out, JoinPath(out, dir_out)}}) {
    const absl::Status st = catalog.Resolve(id).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("leads to " + leads_to),
              absl::string_view::npos)
        << st;
    EXPECT_NE(st.message().find("outside its dataset root"),
              absl::string_view::npos)
        << st;
  }
  // A root declared to trust its links serves all four.
  Catalog trusting({root_a_}, {root_a_});
  EXPECT_EQ(trusting.Rescan(), (std::pair<int64_t, int64_t>{4, 0}));
}

TEST_F(CatalogTest, DirectoriesWithoutProtocolFilesAndDotDirsAreIgnored) {
  Write(root_a_, 2);
  ASSERT_EQ(::mkdir(JoinPath(root_a_, "lost+found").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(JoinPath(root_a_, ".shardcast-tmp-x").c_str(), 0755), 0);
  std::ofstream(
      JoinPath(JoinPath(root_a_, ".shardcast-tmp-x"), "metadata.json"))
      << "{";
  Catalog catalog({root_a_});
  EXPECT_EQ(catalog.Rescan(), (std::pair<int64_t, int64_t>{1, 0}));
  EXPECT_EQ(catalog.List().size(), 1u);
}

TEST_F(CatalogTest, RescanDropsDeletedDatasetsAndAddsNewOnes) {
  const std::string first = Write(root_a_, 2);
  Catalog catalog({root_a_});
  catalog.Rescan();
  ASSERT_TRUE(RemoveTree(JoinPath(root_a_, first)).ok());
  const std::string second = Write(root_a_, 5);
  catalog.Rescan();
  EXPECT_EQ(catalog.Resolve(first).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(catalog.Resolve(second).ok());
}

// A rescan keeps the entry, and its reader's descriptors, of a dataset whose
// files have not changed, and replaces it when one has.
TEST_F(CatalogTest, RescanKeepsAnUnchangedEntryAndReplacesAChangedOne) {
  const std::string id = Write(root_a_, 3);
  Catalog catalog({root_a_});
  catalog.Rescan();
  auto first = catalog.Resolve(id);
  ASSERT_TRUE(first.ok()) << first.status();
  catalog.Rescan();
  auto again = catalog.Resolve(id);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->get(), first->get());
  // A shard rewritten (a new modification time): a new entry and reader.
  const std::string shard = JoinPath(JoinPath(root_a_, id), "acts000000.bin");
  struct timespec times[2] = {{0, UTIME_OMIT}, {1234567890, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, shard.c_str(), times, 0), 0);
  catalog.Rescan();
  auto changed = catalog.Resolve(id);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_NE(changed->get(), first->get());
}

TEST_F(CatalogTest, ARootThatCannotBeListedKeepsItsDatasets) {
  // A hiccup of the filesystem (here: the root renamed away) must not empty
  // the catalog; the other root is rescanned as usual.
  const std::string a = Write(root_a_, 2);
  const std::string b = Write(root_b_, 3);
  Catalog catalog({root_a_, root_b_});
  catalog.Rescan();
  const std::string away = JoinPath(dir_, "away");
  ASSERT_EQ(::rename(root_a_.c_str(), away.c_str()), 0);
  const std::string b2 = Write(root_b_, 4);
  auto [ok, failed] = catalog.Rescan();
  EXPECT_EQ(ok, 3);
  EXPECT_EQ(failed, 0);
  EXPECT_TRUE(catalog.Resolve(a).ok()) << "root a's dataset was dropped";
  EXPECT_TRUE(catalog.Resolve(b2).ok());
}

TEST_F(CatalogTest, OutOfDescriptorsARescanKeepsTheCatalog) {
  const std::string a = Write(root_a_, 2);
  Catalog catalog({root_a_});
  catalog.Rescan();
  // Use up the descriptors below a low limit, as a flood of connections
  // would; every open of the rescan would fail with EMFILE.
  struct rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  std::vector<int> fds;
  struct rlimit low = old;
  low.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  while (true) {
    const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) break;
    fds.push_back(fd);
  }
  auto [ok, failed] = catalog.Rescan();
  for (int fd : fds) ::close(fd);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_EQ(ok, 1);
  EXPECT_EQ(failed, 0);
  EXPECT_TRUE(catalog.Resolve(a).ok()) << "the catalog was emptied";
}

// The files of `dir` as a client hands them over: each opened here.
std::shared_ptr<const DatasetFiles> Hand(const std::string& dir,
                                         const std::string& shown) {
  std::map<std::string, HandedFile> files;
  for (const char* name : {"metadata.json", "shards.json", "acts000000.bin"}) {
    HandedFile f;
    f.fd.Reset(::open(JoinPath(dir, name).c_str(), O_RDONLY | O_CLOEXEC));
    if (!f.fd.valid()) f.error = errno;
    files.emplace(name, std::move(f));
  }
  return HandedFiles(shown, BaseName(dir), std::move(files));
}

TEST_F(CatalogTest,
       AttachedFilesAreOneDatasetWhateverTheirPathAndACopyIsAnother) {
  const std::string id = Write(root_a_, 3);
  const std::string dir = JoinPath(root_a_, id);
  Catalog catalog({root_b_});  // the root does not serve it
  catalog.Rescan();
  auto first = catalog.Attach(Hand(dir, "/some/path"));
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string attached = (*first)->id;
  // "@" + 16 hex of the content hash + "." + 32 random hex.
  ASSERT_EQ(attached.size(), 1u + 16 + 1 + 32);
  EXPECT_EQ(attached.substr(0, 17), "@" + id.substr(0, 16));
  EXPECT_EQ(PublicDatasetId(attached), "@" + id.substr(0, 16));
  EXPECT_EQ((*first)->dir, "/some/path");
  auto again = catalog.Attach(Hand(dir, "/another/path"));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->id, attached);
  EXPECT_EQ(catalog.attached(), 1);
  // Found by the whole id only, and not listed.
  EXPECT_TRUE(catalog.Resolve(attached).ok());
  EXPECT_EQ(catalog.Find(attached.substr(0, 20)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(catalog.List().empty());
  // A copy of the same bytes (same content hash) is another dataset.
  const std::string copy = JoinPath(root_b_, "copy");
  ASSERT_EQ(::mkdir(copy.c_str(), 0755), 0);
  for (const char* name : {"metadata.json", "shards.json", "acts000000.bin"}) {
    auto text = ReadFileToString(JoinPath(dir, name));
    ASSERT_TRUE(text.ok());
    ASSERT_TRUE(WriteNewFile(JoinPath(copy, name), *text).ok());
  }
  auto other = catalog.Attach(Hand(copy, copy));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE((*other)->id, attached);
  EXPECT_EQ(catalog.attached(), 2);
}

TEST_F(CatalogTest, AttachingFilesARootServesGivesTheCatalogEntry) {
  const std::string id = Write(root_a_, 3);
  Catalog catalog({root_a_});
  catalog.Rescan();
  auto entry = catalog.Attach(Hand(JoinPath(root_a_, id), "/elsewhere"));
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ((*entry)->id, id);
  EXPECT_EQ(catalog.attached(), 0);
}

TEST_F(CatalogTest, AttachingWhatIsNotADatasetNamesTheClientsPath) {
  const std::string id = Write(root_a_, 3);
  const std::string dir = JoinPath(root_a_, id);
  Catalog catalog({root_b_});
  // A shard the client could not open: its errno, naming the client's path.
  std::map<std::string, HandedFile> files;
  for (const char* name : {"metadata.json", "shards.json"}) {
    files[name].fd.Reset(::open(JoinPath(dir, name).c_str(), O_RDONLY));
  }
  files["acts000000.bin"].error = EACCES;
  auto denied = catalog.Attach(HandedFiles("/user/path", id, std::move(files)));
  EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(denied.status().message().find("/user/path/acts000000.bin"),
            std::string::npos)
      << denied.status();
  // No metadata.json at all.
  auto empty = catalog.Attach(HandedFiles("/user/empty", "empty", {}));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(empty.status().message().find("/user/empty/metadata.json"),
            std::string::npos)
      << empty.status();
  EXPECT_EQ(catalog.attached(), 0);
}

TEST_F(CatalogTest, AnAttachedDatasetUnusedForLongIsDroppedWhileOneInUseStays) {
  const std::string a = Write(root_a_, 3);
  const std::string b = Write(root_a_, 4);
  const std::string c = Write(root_a_, 5);
  Catalog catalog({root_b_});
  auto first = catalog.Attach(Hand(JoinPath(root_a_, a), "/a"));
  auto second = catalog.Attach(Hand(JoinPath(root_a_, b), "/b"));
  ASSERT_TRUE(first.ok() && second.ok());
  const std::string first_id = (*first)->id, second_id = (*second)->id;
  // A stream holds the second's reader; nothing holds the first's.
  std::shared_ptr<const DatasetReader> in_use = (*second)->reader;
  first->reset();
  second->reset();
  ::usleep(20 * 1000);
  // Another dataset's attach with a tiny idle bound sweeps.
  ASSERT_TRUE(catalog.Attach(Hand(JoinPath(root_a_, c), "/c"), 0.001).ok());
  EXPECT_EQ(catalog.attached(), 2);
  EXPECT_TRUE(catalog.Resolve(second_id).ok()) << "in use: kept";
  EXPECT_EQ(catalog.Resolve(first_id).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shardcast
