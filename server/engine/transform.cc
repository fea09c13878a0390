#include "server/engine/transform.h"

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardcast {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The F16C instruction converts 8 floats at once with the same rounding
// (nearest even) as the portable code; used when the processor has it.
__attribute__((target("avx,f16c"))) void FloatsToHalfF16c(uint16_t* dst,
                                                          const float* src,
                                                          int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(src + i);
    const __m128i h =
        _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = FloatToHalf(src[i]);
}

bool HasF16c() {
  // CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports has no "f16c").
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 &&
           (ecx & (1u << 29)) != 0 && __builtin_cpu_supports("avx") != 0;
  }();
  return has;
}

constexpr int64_t kChunk = 256;  // floats transformed at a time, on the stack

// Four bfloat16 conversions in SSE2 (every x86-64 has it), the same
// arithmetic as FloatToBFloat16: the rounded upper halves, sign-extended in
// 32-bit lanes (an arithmetic shift), so that a signed pack keeps them
// exactly.
inline __m128i BFloat16Lanes(__m128 v) {
  const __m128i x = _mm_castps_si128(v);
  const __m128i one = _mm_set1_epi32(1);
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(x, 16), one);
  const __m128i rounded = _mm_srai_epi32(
      _mm_add_epi32(_mm_add_epi32(x, _mm_set1_epi32(0x7fff)), odd), 16);
  const __m128i nan = _mm_cmpgt_epi32(
      _mm_and_si128(x, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
  const __m128i quiet =
      _mm_or_si128(_mm_srai_epi32(x, 16), _mm_set1_epi32(0x40));
  return _mm_or_si128(_mm_and_si128(nan, quiet),
                      _mm_andnot_si128(nan, rounded));
}

// The same eight at a time with AVX2 (dispatched at run time): the pack
// works within 128-bit halves, so a permute puts the halves in order.
__attribute__((target("avx2"))) inline __m256i BFloat16Lanes8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i odd =
      _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srai_epi32(
      _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd),
      16);
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet =
      _mm256_or_si256(_mm256_srai_epi32(x, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

// y = (x - mean) * s for the first d - d % 16 floats, as float32 or
// bfloat16; returns how many it did. AVX2 processors only.
__attribute__((target("avx2"))) int64_t AffineAvx2(char* dst, const char* src,
                                                   int64_t d, const float* mean,
                                                   float s, bool bf16) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const float* x = reinterpret_cast<const float*>(src) + i;
    __m256 a = _mm256_loadu_ps(x);
    __m256 b = _mm256_loadu_ps(x + 8);
    if (mean != nullptr) {
      a = _mm256_sub_ps(a, _mm256_loadu_ps(mean + i));
      b = _mm256_sub_ps(b, _mm256_loadu_ps(mean + i + 8));
    }
    a = _mm256_mul_ps(a, sv);
    b = _mm256_mul_ps(b, sv);
    if (!bf16) {
      float* y = reinterpret_cast<float*>(dst) + i;
      _mm256_storeu_ps(y, a);
      _mm256_storeu_ps(y + 8, b);
    } else {
      const __m256i packed =
          _mm256_packs_epi32(BFloat16Lanes8(a), BFloat16Lanes8(b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * 2),
                          _mm256_permute4x64_epi64(packed, 0xD8));
    }
  }
  return i;
}

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") != 0;
  return has;
}

// y = (x - mean) * s on four floats; mean may be null (no centering).
inline __m128 Affine4(const char* src, const float* mean, __m128 s) {
  __m128 v = _mm_loadu_ps(reinterpret_cast<const float*>(src));
  if (mean != nullptr) v = _mm_sub_ps(v, _mm_loadu_ps(mean));
  return _mm_mul_ps(v, s);
}

}  // namespace

bool HasF16cConversion() { return HasF16c(); }

absl::string_view OutputDTypeName(OutputDType dtype) {
  switch (dtype) {
    case OutputDType::kFloat32:
      return "float32";
    case OutputDType::kBFloat16:
      return "bfloat16";
    case OutputDType::kFloat16:
      return "float16";
  }
  return "float32";
}

uint64_t OutputDTypeBytes(OutputDType dtype) {
  return dtype == OutputDType::kFloat32 ? 4 : 2;
}

uint16_t FloatToBFloat16(float f) {
  const uint32_t x = Bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  }
  // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even;
  // a carry into the exponent is the right answer (up to infinity).
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

uint16_t FloatToHalf(float f) {
  uint32_t x = Bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  uint32_t h;
  if (x >= 0x47800000u) {  // |f| >= 65536 (or inf, NaN): infinity or NaN
    h = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (x < 0x38800000u) {  // |f| < 2^-14: a subnormal half, or zero
    // Adding 0.5 (2^-1) lines the half's subnormal step (2^-24) up with the
    // float's last mantissa bit: the float addition rounds to nearest even
    // exactly as the half must, and the low bits are the half's mantissa.
    h = Bits(FromBits(x) + 0.5f) - 0x3f000000u;
  } else {
    // Rebias the exponent (127 -> 15) and round the 13 dropped mantissa
    // bits to nearest even; a carry into the exponent is correct, up to
    // infinity for [65520, 65536).
    const uint32_t odd = (x >> 13) & 1u;
    h = (x - 0x38000000u + 0x0fffu + odd) >> 13;
  }
  return static_cast<uint16_t>(h | sign);
}

void FloatsToBFloat16(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i lo = BFloat16Lanes(_mm_loadu_ps(src + i));
    const __m128i hi = BFloat16Lanes(_mm_loadu_ps(src + i + 4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_packs_epi32(lo, hi));
  }
  for (; i < n; ++i) dst[i] = FloatToBFloat16(src[i]);
}

void FloatsToHalf(uint16_t* dst, const float* src, int64_t n) {
  if (HasF16c()) {
    FloatsToHalfF16c(dst, src, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = FloatToHalf(src[i]);
}

absl::StatusOr<VectorTransform> VectorTransform::Create(
    const TransformSpec& spec, const DatasetDesc& desc,
    const DatasetStats* stats, StatsGroup group,
    absl::string_view stats_origin) {
  VectorTransform t;
  t.dtype_ = spec.dtype;
  t.center_ = spec.center;
  t.scale_ = spec.scale_norm;
  t.identity_ = !spec.needs_stats() && spec.dtype == OutputDType::kFloat32;
  std::vector<std::string> parts;
  if (spec.center) parts.push_back("center");
  if (spec.scale_norm) parts.push_back("scale_norm");
  parts.push_back(std::string(OutputDTypeName(spec.dtype)));
  t.name_ = absl::StrJoin(parts, ", ");
  if (!spec.needs_stats()) return t;
  if (stats == nullptr) {
    return absl::FailedPreconditionError(
        "scale_norm and center need the dataset's statistics");
  }
  absl::StrAppend(&t.name_, " (", stats_origin, ")");
  const char* group_name = group == StatsGroup::kContent   ? "content"
                           : group == StatsGroup::kSpecial ? "special"
                                                           : "all";
  const size_t d = static_cast<size_t>(desc.d_model);
  const double root_d = std::sqrt(static_cast<double>(desc.d_model));
  for (int64_t layer : desc.layers) {
    const LayerStats* ls = stats->Find(layer);
    const GroupStats* g =
        ls == nullptr                   ? nullptr
        : group == StatsGroup::kContent ? &ls->content
        : group == StatsGroup::kSpecial
            ? (ls->special.has_value() ? &*ls->special : nullptr)
            : &ls->all;
    if (g == nullptr || g->count <= 0 || g->mean.size() != d) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the statistics have no ", group_name, " tokens of layer ", layer));
    }
    const double norm = spec.center ? g->centered_mean_norm : g->mean_norm;
    if (spec.scale_norm && !(std::isfinite(norm) && norm > 0)) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot scale layer ", layer, ": the mean norm of its ",
                       group_name, " tokens is ", norm));
    }
    // The transform computes in float32: a scale or a mean that is finite
    // as a double but not as a float (a norm of 1e-300, a mean of 1e300)
    // would stream Inf or zeros silently. Refused, naming the field.
    const std::string field =
        absl::StrCat(stats_origin, ": layers[", ls - stats->layers.data(),
                     "] (layer ", layer, ").", group_name, ".");
    const double scale = root_d / norm;
    if (spec.scale_norm && !(scale >= std::numeric_limits<float>::min() &&
                             scale <= std::numeric_limits<float>::max())) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, spec.center ? "centered_mean_norm" : "mean_norm", " = ", norm,
          " gives the scale sqrt(d_model) / norm = ", scale,
          ", which float32 cannot hold (", std::numeric_limits<float>::min(),
          " to ", std::numeric_limits<float>::max(), ")"));
    }
    t.scales_.push_back(spec.scale_norm ? static_cast<float>(scale) : 1.0f);
    if (spec.center) {
      std::vector<float> mean(d);
      for (size_t i = 0; i < d; ++i) {
        if (!(std::fabs(g->mean[i]) <= std::numeric_limits<float>::max())) {
          return absl::FailedPreconditionError(
              absl::StrCat(field, "mean[", i, "] = ", g->mean[i],
                           " is not finite as float32 (at most ",
                           std::numeric_limits<float>::max(), ")"));
        }
        mean[i] = static_cast<float>(g->mean[i]);
      }
      t.means_.push_back(std::move(mean));
    }
  }
  return t;
}

void VectorTransform::Apply(char* dst, const char* src, int64_t d,
                            int64_t layer_index) const {
  if (identity_) {
    std::memcpy(dst, src, static_cast<size_t>(d) * 4);
    return;
  }
  const size_t l = static_cast<size_t>(layer_index);
  const float* mean = center_ ? means_[l].data() : nullptr;
  const float s = scale_ ? scales_[l] : 1.0f;
  if (dtype_ != OutputDType::kFloat16) {
    // One pass, eight floats at a time: (x - mean) * s (multiplying by 1
    // without scale_norm is exact), stored as float32 or rounded to
    // bfloat16. The tail goes through the scalar code below.
    const __m128 sv = _mm_set1_ps(s);
    int64_t i = 0;
    if (HasAvx2()) {
      i = AffineAvx2(dst, src, d, mean, s, dtype_ == OutputDType::kBFloat16);
    }
    for (; i + 8 <= d; i += 8) {
      const __m128 a =
          Affine4(src + i * 4, mean == nullptr ? nullptr : mean + i, sv);
      const __m128 b = Affine4(src + i * 4 + 16,
                               mean == nullptr ? nullptr : mean + i + 4, sv);
      if (dtype_ == OutputDType::kFloat32) {
        _mm_storeu_ps(reinterpret_cast<float*>(dst + i * 4), a);
        _mm_storeu_ps(reinterpret_cast<float*>(dst + i * 4 + 16), b);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * 2),
                         _mm_packs_epi32(BFloat16Lanes(a), BFloat16Lanes(b)));
      }
    }
    for (; i < d; ++i) {
      float x;
      std::memcpy(&x, src + i * 4, 4);
      const float y = (mean != nullptr ? x - mean[i] : x) * s;
      if (dtype_ == OutputDType::kFloat32) {
        std::memcpy(dst + i * 4, &y, 4);
      } else {
        const uint16_t h = FloatToBFloat16(y);
        std::memcpy(dst + i * 2, &h, 2);
      }
    }
    return;
  }
  alignas(64) float tmp[kChunk];
  for (int64_t off = 0; off < d; off += kChunk) {
    const int64_t n = std::min(kChunk, d - off);
    std::memcpy(tmp, src + off * 4, static_cast<size_t>(n) * 4);
    if (mean != nullptr && scale_) {
      for (int64_t i = 0; i < n; ++i) tmp[i] = (tmp[i] - mean[off + i]) * s;
    } else if (mean != nullptr) {
      for (int64_t i = 0; i < n; ++i) tmp[i] = tmp[i] - mean[off + i];
    } else if (scale_) {
      for (int64_t i = 0; i < n; ++i) tmp[i] = tmp[i] * s;
    }
    switch (dtype_) {
      case OutputDType::kFloat32:
        std::memcpy(dst + off * 4, tmp, static_cast<size_t>(n) * 4);
        break;
      case OutputDType::kBFloat16:
        FloatsToBFloat16(reinterpret_cast<uint16_t*>(dst) + off, tmp, n);
        break;
      case OutputDType::kFloat16:
        FloatsToHalf(reinterpret_cast<uint16_t*>(dst) + off, tmp, n);
        break;
    }
  }
}

}  // namespace shardcast
