#include "server/engine/transform.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace shardcast {
namespace {

float F(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Expected bit patterns below come from IEEE 754 arithmetic by hand: the
// formats' layouts and round-to-nearest-even.
TEST(Transform, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBFloat16(F(0x3F808000)), 0x3F80);  // tie, even below
  EXPECT_EQ(FloatToBFloat16(F(0x3F818000)), 0x3F82);  // tie, even above
  EXPECT_EQ(FloatToBFloat16(F(0x3F808001)), 0x3F81);  // above the tie
  EXPECT_EQ(FloatToBFloat16(F(0x7F7FFFFF)), 0x7F80);  // max float -> inf
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  const uint16_t nan = FloatToBFloat16(std::nanf(""));
  EXPECT_EQ(nan & 0x7F80, 0x7F80);
  EXPECT_NE(nan & 0x007F, 0) << "NaN must stay NaN";
  EXPECT_NE(FloatToBFloat16(F(0x7F800001)) & 0x007F, 0) << "signalling NaN";
}

TEST(Transform, HalfRoundsToNearestEvenWithSubnormalsAndOverflow) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);  // largest half
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);  // below the tie
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie -> even: infinity
  EXPECT_EQ(FloatToHalf(1e6f), 0x7C00);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // least subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie -> 0
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);  // tie -> 2
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // least normal
  EXPECT_EQ(FloatToHalf(F(0x3F801000)), 0x3C00);  // 1 + 2^-11: tie, even
  EXPECT_EQ(FloatToHalf(F(0x3F803000)), 0x3C02);  // 1 + 3*2^-11: tie, even
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7C00);
  const uint16_t nan = FloatToHalf(std::nanf(""));
  EXPECT_EQ(nan & 0x7C00, 0x7C00);
  EXPECT_NE(nan & 0x03FF, 0);
}

__attribute__((target("f16c"))) uint16_t HardwareHalf(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

TEST(Transform, PortableHalfMatchesTheProcessorsConversion) {
  if (!HasF16cConversion()) GTEST_SKIP() << "no F16C here";
  std::mt19937 rng(7);
  std::vector<float> src;
  for (int i = 0; i < 2000000; ++i) {
    const float f = F(static_cast<uint32_t>(rng()));
    if (!std::isnan(f)) src.push_back(f);
  }
  // Every exponent a half can reach, densely.
  for (uint32_t bits = 0x33000000; bits < 0x47900000; bits += 0x1F1) {
    src.push_back(F(bits));
    src.push_back(-F(bits));
  }
  std::vector<uint16_t> batch(src.size());
  FloatsToHalf(batch.data(), src.data(), static_cast<int64_t>(src.size()));
  for (size_t i = 0; i < src.size(); ++i) {
    const uint16_t want = HardwareHalf(src[i]);
    ASSERT_EQ(FloatToHalf(src[i]), want) << src[i];
    ASSERT_EQ(batch[i], want) << src[i];
  }
}

TEST(Transform, VectorBFloat16MatchesTheScalarConversion) {
  // Every kind of bit pattern, NaNs and infinities included, through the
  // SSE2 lanes (8 at a time) and the scalar tail.
  std::mt19937 rng(11);
  std::vector<float> src;
  for (int i = 0; i < 1000003; ++i)
    src.push_back(F(static_cast<uint32_t>(rng())));
  for (uint32_t bits :
       {0x7F800000u, 0xFF800000u, 0x7F800001u, 0xFFC00000u, 0x7F7FFFFFu,
        0xFF7FFFFFu, 0x00000001u, 0x80008000u, 0x3F808000u, 0x3F818000u}) {
    src.push_back(F(bits));
  }
  std::vector<uint16_t> got(src.size());
  FloatsToBFloat16(got.data(), src.data(), static_cast<int64_t>(src.size()));
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(got[i], FloatToBFloat16(src[i])) << std::hex << i;
  }
}

TEST(Transform, EveryPathOfApplyRoundsLikeTheScalarCode) {
  // d = 1000: the AVX2 loop (16 at a time, where the processor has it),
  // the SSE2 loop (8) and the scalar tail (8) all run; random bit patterns
  // with scale 1 (multiplying by 1 is exact but quiets a signalling NaN, so
  // NaNs are compared as NaNs).
  std::mt19937 rng(13);
  const int64_t d = 1000;
  DatasetDesc desc;
  desc.layers = {0};
  desc.d_model = d;
  TransformSpec spec;
  spec.dtype = OutputDType::kBFloat16;
  auto t = VectorTransform::Create(spec, desc, nullptr, StatsGroup::kAll, "");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->identity());
  for (int round = 0; round < 200; ++round) {
    std::vector<float> x(d);
    for (float& f : x) f = F(static_cast<uint32_t>(rng()));
    std::vector<uint16_t> y(d);
    t->Apply(reinterpret_cast<char*>(y.data()),
             reinterpret_cast<const char*>(x.data()), d, 0);
    for (int64_t i = 0; i < d; ++i) {
      const uint16_t want = FloatToBFloat16(x[i]);
      const bool nan = (want & 0x7F80) == 0x7F80 && (want & 0x7F) != 0;
      if (nan) {
        ASSERT_TRUE((y[i] & 0x7F80) == 0x7F80 && (y[i] & 0x7F) != 0) << i;
      } else {
        ASSERT_EQ(y[i], want) << i << " of round " << round;
      }
    }
  }
}

DatasetDesc Desc(int64_t d) {
  DatasetDesc desc;
  desc.layers = {-2, 5};
  desc.d_model = d;
  return desc;
}

DatasetStats Stats(int64_t d) {
  DatasetStats s;
  s.d_model = d;
  for (int64_t layer : {-2, 5}) {
    LayerStats l;
    l.layer = layer;
    for (GroupStats* g : {&l.content, &l.all}) {
      g->count = 10;
      g->mean_norm = layer == 5 ? 4.0 : 2.0;
      g->centered_mean_norm = layer == 5 ? 8.0 : 1.0;
      g->mean.assign(static_cast<size_t>(d), layer == 5 ? 0.5 : -1.0);
    }
    s.layers.push_back(l);
  }
  return s;
}

TEST(Transform, ScaleNormAndCenterUseTheLayersStatistics) {
  const int64_t d = 300;  // more than one chunk
  const DatasetStats stats = Stats(d);
  std::vector<float> x(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) x[static_cast<size_t>(i)] = 0.25f * i - 3;
  std::vector<float> y(static_cast<size_t>(d));

  TransformSpec spec;
  spec.scale_norm = true;
  auto t = VectorTransform::Create(spec, Desc(d), &stats, StatsGroup::kContent,
                                   "test statistics");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->identity());
  EXPECT_EQ(t->name(), "scale_norm, float32 (test statistics)");
  t->Apply(reinterpret_cast<char*>(y.data()),
           reinterpret_cast<const char*>(x.data()), d, 1);  // layer 5
  const float s5 = static_cast<float>(std::sqrt(300.0) / 4.0);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], x[i] * s5) << i;

  spec.center = true;
  t = VectorTransform::Create(spec, Desc(d), &stats, StatsGroup::kContent,
                              "test statistics");
  ASSERT_TRUE(t.ok()) << t.status();
  t->Apply(reinterpret_cast<char*>(y.data()),
           reinterpret_cast<const char*>(x.data()), d, 0);  // layer -2
  const float s2 = static_cast<float>(std::sqrt(300.0) / 1.0);
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_EQ(y[i], (x[i] - -1.0f) * s2) << i;
  }

  spec.scale_norm = false;
  spec.dtype = OutputDType::kBFloat16;
  t = VectorTransform::Create(spec, Desc(d), &stats, StatsGroup::kAll, "s");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->out_vector_bytes(d), static_cast<uint64_t>(d) * 2);
  std::vector<uint16_t> h(static_cast<size_t>(d));
  t->Apply(reinterpret_cast<char*>(h.data()),
           reinterpret_cast<const char*>(x.data()), d, 1);
  for (size_t i = 0; i < h.size(); ++i) {
    ASSERT_EQ(h[i], FloatToBFloat16(x[i] - 0.5f)) << i;
  }
}

TEST(Transform, MissingOrUnusableStatisticsAreRefused) {
  const int64_t d = 8;
  TransformSpec spec;
  spec.scale_norm = true;
  EXPECT_EQ(
      VectorTransform::Create(spec, Desc(d), nullptr, StatsGroup::kContent, "")
          .status()
          .code(),
      absl::StatusCode::kFailedPrecondition);
  DatasetStats stats = Stats(d);
  // No CLS group recorded.
  auto t =
      VectorTransform::Create(spec, Desc(d), &stats, StatsGroup::kSpecial, "");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("special"), std::string::npos);
  stats.layers[1].content.mean_norm = 0;
  t = VectorTransform::Create(spec, Desc(d), &stats, StatsGroup::kContent, "");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("layer 5"), std::string::npos);
  stats.layers.pop_back();
  t = VectorTransform::Create(spec, Desc(d), &stats, StatsGroup::kContent, "");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
}

// Statistics finite as doubles but not as the float32 the transform
// computes in (issue 42): a mean norm whose scale overflows or underflows,
// a mean past FLT_MAX. Each is refused naming the sidecar field; values
// float32 holds at the edge are accepted.
TEST(Transform, StatisticsFloat32CannotHoldAreRefusedNamingTheField) {
  const int64_t d = 8;
  TransformSpec spec;
  spec.scale_norm = true;
  for (double norm : {1e-300, 1e-40, 1e300}) {
    DatasetStats stats = Stats(d);
    stats.layers[1].content.mean_norm = norm;
    auto t = VectorTransform::Create(spec, Desc(d), &stats,
                                     StatsGroup::kContent, "stats.json");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << norm;
    EXPECT_NE(t.status().message().find(
                  "stats.json: layers[1] (layer 5).content.mean_norm"),
              std::string::npos)
        << t.status();
  }
  {
    DatasetStats stats = Stats(d);
    stats.layers[1].content.mean_norm = 1e30;  // scale ~2.8e-30: a float
    EXPECT_TRUE(
        VectorTransform::Create(spec, Desc(d), &stats, StatsGroup::kContent, "")
            .ok());
  }
  spec.scale_norm = false;
  spec.center = true;
  for (double mean : {1e300, -1e39}) {
    DatasetStats stats = Stats(d);
    stats.layers[0].content.mean[3] = mean;
    auto t = VectorTransform::Create(spec, Desc(d), &stats,
                                     StatsGroup::kContent, "stats.json");
    EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << mean;
    EXPECT_NE(t.status().message().find(
                  "stats.json: layers[0] (layer -2).content.mean[3]"),
              std::string::npos)
        << t.status();
  }
  DatasetStats stats = Stats(d);
  stats.layers[0].content.mean[3] = 3.4e38;  // below FLT_MAX
  EXPECT_TRUE(
      VectorTransform::Create(spec, Desc(d), &stats, StatsGroup::kContent, "")
          .ok());
}

TEST(Transform, PlainFloat32IsTheIdentity) {
  auto t = VectorTransform::Create(TransformSpec{}, Desc(4), nullptr,
                                   StatsGroup::kContent, "");
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t->identity());
  EXPECT_EQ(t->name(), "float32");
  const float x[4] = {1.5f, -2, 3, std::nanf("")};
  float y[4];
  t->Apply(reinterpret_cast<char*>(y), reinterpret_cast<const char*>(x), 4, 0);
  EXPECT_EQ(std::memcmp(x, y, sizeof(x)), 0);
}

}  // namespace
}  // namespace shardcast
