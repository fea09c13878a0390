// Tests of the .npy header reader, on files written by hand (format 1.0 and
// 2.0 headers built byte by byte here) and by /usr/bin/python3 numpy.
#include "common/convert/npy.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/testing/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A format 1.0 (major 1: 2-byte little-endian header length) or 2.0 (4-byte
// length) .npy file: magic, version, length, the dict padded with spaces and
// ended by '\n' so that the data starts at a multiple of 64, then `data`.
std::string Npy(const std::string& dict, const std::string& data,
                int major = 1) {
  const size_t prefix = major == 1 ? 10 : 12;
  std::string header = dict;
  while ((prefix + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string out("\x93NUMPY", 6);
  out.push_back(static_cast<char>(major));
  out.push_back('\0');
  const uint32_t len = static_cast<uint32_t>(header.size());
  out.push_back(static_cast<char>(len & 0xff));
  out.push_back(static_cast<char>((len >> 8) & 0xff));
  if (major != 1) {
    out.push_back(static_cast<char>((len >> 16) & 0xff));
    out.push_back(static_cast<char>((len >> 24) & 0xff));
  }
  return out + header + data;
}

std::string Floats(int n) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    const float v = static_cast<float>(i) + 0.5f;
    out.append(reinterpret_cast<const char*>(&v), 4);
  }
  return out;
}

TEST(OpenNpy, HandWrittenV1HeaderIsParsed) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path,
            Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                Floats(6)));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_TRUE(npy.ok()) << npy.status();
  EXPECT_EQ(npy->path, path);
  EXPECT_EQ(npy->descr, "<f4");
  EXPECT_EQ(npy->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(npy->data_offset, 128u);  // 10 + 59-char dict, padded to 64n
  EXPECT_EQ(npy->data_bytes, 6u * 4);
  ASSERT_TRUE(npy->fd.valid());
  float v[6];
  ASSERT_EQ(
      pread(npy->fd.get(), v, sizeof v, static_cast<off_t>(npy->data_offset)),
      static_cast<ssize_t>(sizeof v));
  EXPECT_EQ(v[0], 0.5f);
  EXPECT_EQ(v[5], 5.5f);
}

TEST(OpenNpy, KeysInAnyOrderAndOneDimensionalShapeAreParsed) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path, Npy("{'shape': (7,), 'fortran_order': False, 'descr': '|u1'}",
                      std::string(7, '\x03')));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_TRUE(npy.ok()) << npy.status();
  EXPECT_EQ(npy->descr, "|u1");
  EXPECT_EQ(npy->shape, (std::vector<int64_t>{7}));
  EXPECT_EQ(npy->data_bytes, 7u);
}

TEST(OpenNpy, ScalarShapeHasOneElement) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path, Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
                      Floats(1)));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_TRUE(npy.ok()) << npy.status();
  EXPECT_TRUE(npy->shape.empty());
  EXPECT_EQ(npy->data_bytes, 4u);
}

TEST(OpenNpy, HandWrittenV2HeaderIsParsed) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path,
            Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 1), }",
                Floats(3), /*major=*/2));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_TRUE(npy.ok()) << npy.status();
  EXPECT_EQ(npy->shape, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(npy->data_offset, 128u);  // 12 + 59-char dict, padded to 64n
  EXPECT_EQ(npy->data_bytes, 12u);
}

TEST(OpenNpy, ZeroLengthArrayIsAccepted) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(
      path,
      Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4), }", ""));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_TRUE(npy.ok()) << npy.status();
  EXPECT_EQ(npy->data_bytes, 0u);
}

TEST(OpenNpy, FilesSavedByNumpyAreParsed) {
  if (access("/usr/bin/python3", X_OK) != 0)
    GTEST_SKIP() << "no /usr/bin/python3";
  TempRoot tmp;
  const std::string cmd =
      "/usr/bin/python3 -c 'import numpy as np, sys\n"
      "d = sys.argv[1]\n"
      "np.save(d + \"/f.npy\", np.arange(24, dtype=\"<f4\").reshape(4, 2, 3))\n"
      "np.save(d + \"/u.npy\", np.arange(5, dtype=np.uint8))\n"
      "np.save(d + \"/fortran.npy\", np.asfortranarray(np.zeros((2, 3), "
      "dtype=\"<f4\")))\n"
      "np.save(d + \"/f8.npy\", np.zeros((2, 3)))\n"
      "np.save(d + \"/be.npy\", np.zeros((2, 3), dtype=\">f4\"))\n"
      "with open(d + \"/v2.npy\", \"wb\") as f:\n"
      "    np.lib.format.write_array(f, np.arange(6, dtype=\"<f4\"), "
      "version=(2, 0))\n"
      "' '" +
      tmp.File("") + "'";
  if (system(cmd.c_str()) != 0) GTEST_SKIP() << "numpy is not available";

  // Offsets and sizes as numpy 1.24 lays the files out (header padded to 64
  // bytes: 10 + 118 for format 1.0, 12 + 116 for 2.0).
  absl::StatusOr<NpyFile> f = OpenNpy(tmp.File("f.npy"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->descr, "<f4");
  EXPECT_EQ(f->shape, (std::vector<int64_t>{4, 2, 3}));
  EXPECT_EQ(f->data_offset, 128u);
  EXPECT_EQ(f->data_bytes, 96u);
  EXPECT_EQ(f->data_offset + f->data_bytes, fs::file_size(tmp.File("f.npy")));
  float v[24];
  ASSERT_EQ(pread(f->fd.get(), v, sizeof v, static_cast<off_t>(f->data_offset)),
            static_cast<ssize_t>(sizeof v));
  for (int i = 0; i < 24; ++i) EXPECT_EQ(v[i], static_cast<float>(i));

  absl::StatusOr<NpyFile> u = OpenNpy(tmp.File("u.npy"));
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->descr, "|u1");
  EXPECT_EQ(u->shape, (std::vector<int64_t>{5}));
  EXPECT_EQ(u->data_bytes, 5u);

  absl::StatusOr<NpyFile> v2 = OpenNpy(tmp.File("v2.npy"));
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_EQ(v2->shape, (std::vector<int64_t>{6}));
  EXPECT_EQ(v2->data_offset, 128u);
  EXPECT_EQ(v2->data_bytes, 24u);

  absl::StatusOr<NpyFile> fortran = OpenNpy(tmp.File("fortran.npy"));
  EXPECT_EQ(fortran.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fortran.status().message()), HasSubstr("Fortran"));
  EXPECT_EQ(OpenNpy(tmp.File("f8.npy")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenNpy(tmp.File("be.npy")).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(OpenNpy, FortranOrderIsRejected) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path,
            Npy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
                Floats(6)));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_FALSE(npy.ok());
  EXPECT_EQ(npy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(npy.status().message()), HasSubstr(path));
}

TEST(OpenNpy, Float64IsRejectedNamingTheDtype) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path,
            Npy("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }",
                Floats(6)));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_FALSE(npy.ok());
  EXPECT_EQ(npy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(npy.status().message()), HasSubstr("<f8"));
}

TEST(OpenNpy, BigEndianFloatIsRejected) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path,
            Npy("{'descr': '>f4', 'fortran_order': False, 'shape': (3,), }",
                Floats(3)));
  EXPECT_EQ(OpenNpy(path).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpenNpy, BadMagicIsRejected) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  std::string bytes = Npy(
      "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", Floats(3));
  bytes[1] = 'X';
  WriteFile(path, bytes);
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_FALSE(npy.ok());
  EXPECT_EQ(npy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(npy.status().message()), HasSubstr(path));
}

TEST(OpenNpy, TinyFileIsRejected) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path, std::string("\x93NUM", 4));
  EXPECT_EQ(OpenNpy(path).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpenNpy, UnsupportedVersionIsRejected) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  std::string bytes = Npy(
      "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", Floats(3));
  bytes[6] = 4;
  WriteFile(path, bytes);
  EXPECT_EQ(OpenNpy(path).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpenNpy, TruncatedDataIsDataLoss) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path,
            Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                Floats(5)));  // one float short
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_FALSE(npy.ok());
  EXPECT_EQ(npy.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(npy.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(npy.status().message()), HasSubstr("24"));
  EXPECT_THAT(std::string(npy.status().message()), HasSubstr("20"));
}

TEST(OpenNpy, TruncatedHeaderIsDataLoss) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  std::string bytes = Npy(
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", Floats(6));
  WriteFile(path, bytes.substr(0, 40));
  EXPECT_EQ(OpenNpy(path).status().code(), absl::StatusCode::kDataLoss);
}

TEST(OpenNpy, MalformedShapeIsRejected) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path,
            Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }",
                Floats(6)));
  EXPECT_EQ(OpenNpy(path).status().code(), absl::StatusCode::kInvalidArgument);
  WriteFile(path,
            Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (-2, 3), }",
                Floats(6)));
  EXPECT_EQ(OpenNpy(path).status().code(), absl::StatusCode::kInvalidArgument);
  WriteFile(path, Npy("{'descr': '<f4', 'fortran_order': False}", Floats(6)));
  EXPECT_EQ(OpenNpy(path).status().code(), absl::StatusCode::kInvalidArgument);
}

// A header whose element count overflows 64 bits must not wrap around to a
// small data size: (2**32, 2**32) float32 claims 2**66 bytes, not 0.
TEST(OpenNpy, ShapeWhoseByteSizeOverflowsIsRejected) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  WriteFile(path, Npy("{'descr': '<f4', 'fortran_order': False, "
                      "'shape': (4294967296, 4294967296), }",
                      ""));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  EXPECT_FALSE(npy.ok()) << "accepted with data_bytes = " << npy->data_bytes;
  // (2**62,) float32: elements fit, elements * 4 wraps to 0.
  WriteFile(path, Npy("{'descr': '<f4', 'fortran_order': False, "
                      "'shape': (4611686018427387904,), }",
                      ""));
  npy = OpenNpy(path);
  EXPECT_FALSE(npy.ok()) << "accepted with data_bytes = " << npy->data_bytes;
}

TEST(OpenNpy, MissingFileIsNotFound) {
  TempRoot tmp;
  EXPECT_EQ(OpenNpy(tmp.File("nope.npy")).status().code(),
            absl::StatusCode::kNotFound);
}

// Found by tests/fuzz/npy_fuzz: the CLI crashed on the first, accepted
// the second as holding 2^64 - 2 bytes.
TEST(OpenNpy, ShapeThatIsNotATupleIsRejected) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  for (const char* shape : {"", "3"}) {
    WriteFile(path, Npy(absl::StrCat("{'descr': '<f4', 'fortran_order': "
                                     "False, 'shape': ",
                                     shape, ", }"),
                        Floats(3)));
    absl::StatusOr<NpyFile> npy = OpenNpy(path);
    ASSERT_FALSE(npy.ok()) << shape;
    EXPECT_EQ(npy.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(OpenNpy, DataSizeThatWrapsPastTheFileIsDataLoss) {
  TempRoot tmp;
  const std::string path = tmp.File("a.npy");
  // (2^63 - 1) x 2 one-byte elements: data_offset + bytes wraps 64 bits.
  WriteFile(path, Npy("{'descr': '|u1', 'fortran_order': False, 'shape': "
                      "(9223372036854775807, 2), }",
                      ""));
  absl::StatusOr<NpyFile> npy = OpenNpy(path);
  ASSERT_FALSE(npy.ok());
  EXPECT_EQ(npy.status().code(), absl::StatusCode::kDataLoss) << npy.status();
}

}  // namespace
}  // namespace shardcast
