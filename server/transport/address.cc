#include "server/transport/address.h"

#include "absl/strings/match.h"

namespace shardcast {

std::string HostOf(absl::string_view host_port) {
  if (absl::StartsWith(host_port, "[")) {
    const size_t end = host_port.find(']');
    return std::string(
        host_port.substr(1, end == absl::string_view::npos ? end : end - 1));
  }
  const size_t colon = host_port.rfind(':');
  return std::string(host_port.substr(0, colon));
}

bool IsLoopbackAddress(absl::string_view host_port) {
  const std::string host = HostOf(host_port);
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

}  // namespace shardcast
