// Where the vectors of a validated dataset lie (common/local/vector_layout.h),
// for clients on the node that read single vectors themselves.
#ifndef SHARDCAST_COMMON_FORMAT_LAYOUT_OF_H_
#define SHARDCAST_COMMON_FORMAT_LAYOUT_OF_H_

#include "common/format/metadata.h"
#include "common/local/vector_layout.h"

namespace shardcast {

/// The layout of `desc` (which ParseMetadata/ParseShards or the lmprobe
/// reader validated).
VectorLayout LayoutOf(const DatasetDesc& desc);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_FORMAT_LAYOUT_OF_H_
