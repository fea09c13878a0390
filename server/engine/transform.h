// What a stream does to each vector on its way into a batch: optional
// mean-centering and scale_norm (with a dataset's statistics,
// common/format/stats.h) and the output element type. Applied while a batch is
// gathered, in place of the plain copy, so a transform costs no extra pass over
// the batch and bfloat16/float16 output halves the bytes a trainer receives.
//
//   center:     y = x - mean
//   scale_norm: y = x * sqrt(D) / mean_norm         (mean L2 norm -> sqrt(D))
//   both:       y = (x - mean) * sqrt(D) / centered_mean_norm
//
// mean, mean_norm and centered_mean_norm are those of the stream's layer and
// token group (content, CLS, all); the arithmetic is float32 (mean and scale
// rounded to float32 once), then the result is rounded to the output type
// with round-to-nearest-even (NaN stays NaN, overflow becomes infinity), as
// numpy's astype(float16) and torch's .to(torch.bfloat16) do.
#ifndef SHARDCAST_SERVER_ENGINE_TRANSFORM_H_
#define SHARDCAST_SERVER_ENGINE_TRANSFORM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/format/metadata.h"
#include "common/format/stats.h"

namespace shardcast {

/// Element type of the vectors a stream delivers.
enum class OutputDType { kFloat32, kBFloat16, kFloat16 };

/// "float32", "bfloat16", "float16".
absl::string_view OutputDTypeName(OutputDType dtype);
/// Bytes per element: 4 or 2.
uint64_t OutputDTypeBytes(OutputDType dtype);

/// What a stream asks for. Plain data.
struct TransformSpec {
  bool scale_norm = false;
  bool center = false;
  OutputDType dtype = OutputDType::kFloat32;
  /// Whether statistics are needed (scale_norm or center).
  bool needs_stats() const { return scale_norm || center; }
};

/// Which statistics group a token selection reads (common/format/stats.h).
enum class StatsGroup { kContent, kSpecial, kAll };

/// A ready-to-apply transform for one dataset and token group. Immutable;
/// thread-safe.
class VectorTransform {
 public:
  /// The identity: float32 copies.
  VectorTransform() = default;

  /// `stats` must be given when spec.needs_stats() (FAILED_PRECONDITION
  /// otherwise, and when they lack a layer of `desc` or the group, or a
  /// norm is zero or not finite). `stats_origin` ends the name, e.g.
  /// "statistics from shardcast_stats.json".
  static absl::StatusOr<VectorTransform> Create(const TransformSpec& spec,
                                                const DatasetDesc& desc,
                                                const DatasetStats* stats,
                                                StatsGroup group,
                                                absl::string_view stats_origin);

  /// True for the plain float32 copy.
  bool identity() const { return identity_; }
  OutputDType dtype() const { return dtype_; }
  /// Bytes of one transformed vector: D * 4 or D * 2.
  uint64_t out_vector_bytes(int64_t d_model) const {
    return static_cast<uint64_t>(d_model) * OutputDTypeBytes(dtype_);
  }
  /// What the stream does, for batches, status and logs: "float32",
  /// "center, scale_norm, bfloat16 (statistics from ...)".
  const std::string& name() const { return name_; }

  /// Writes the transform of the `d` floats at `src` (of the layer with
  /// index `layer_index` in the dataset's `layers`) to `dst` (d elements of
  /// the output type). `src` need not be aligned.
  void Apply(char* dst, const char* src, int64_t d, int64_t layer_index) const;

 private:
  bool identity_ = true;
  bool center_ = false;
  bool scale_ = false;
  OutputDType dtype_ = OutputDType::kFloat32;
  std::string name_ = "float32";
  std::vector<float> scales_;              // per layer index
  std::vector<std::vector<float>> means_;  // per layer index (center)
};

/// float32 -> bfloat16 bits, round to nearest even (quiet NaN kept).
uint16_t FloatToBFloat16(float f);
/// float32 -> IEEE half bits, round to nearest even (subnormals, inf, NaN).
uint16_t FloatToHalf(float f);
/// Converts n floats (dst and src may not overlap).
void FloatsToBFloat16(uint16_t* dst, const float* src, int64_t n);
void FloatsToHalf(uint16_t* dst, const float* src, int64_t n);
/// Whether FloatsToHalf uses the processor's F16C conversion.
bool HasF16cConversion();

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_TRANSFORM_H_
