// A protobuf message as JSON text, generically, by reflection: every field by
// its proto name, in declaration order, unset scalars included, 64-bit
// integers as JSON numbers (proto3's JSON mapping quotes them, which would
// make `shardcast status --json`'s counters strings). Used for the status the
// CLI prints: a field added to ServerStatus shows up with no other change.
#ifndef SHARDCAST_CLIENT_MESSAGE_JSON_INTERNAL_H_
#define SHARDCAST_CLIENT_MESSAGE_JSON_INTERNAL_H_

#include <string>

#include "google/protobuf/message.h"

namespace shardcast {
namespace internal_client {

// Compact JSON (no spaces). Bytes fields are base64, as in proto3's mapping;
// enums by name; NaN and infinities as null (JSON has no spelling for them).
std::string MessageJson(const google::protobuf::Message& message);

}  // namespace internal_client
}  // namespace shardcast

#endif  // SHARDCAST_CLIENT_MESSAGE_JSON_INTERNAL_H_
