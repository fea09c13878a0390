// Listener addresses: "host:port" and "[v6]:port".
#ifndef SHARDCAST_SERVER_TRANSPORT_ADDRESS_H_
#define SHARDCAST_SERVER_TRANSPORT_ADDRESS_H_

#include <string>

#include "absl/strings/string_view.h"

namespace shardcast {

/// The host part of "host:port" or "[v6]:port".
std::string HostOf(absl::string_view host_port);

/// True for addresses that only this machine can reach: 127.0.0.0/8,
/// [::1], localhost.
bool IsLoopbackAddress(absl::string_view host_port);

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_TRANSPORT_ADDRESS_H_
