#include <vector>

#include "absl/strings/str_cat.h"
#include "client/shared_memory_internal.h"
#include "common/base/status.h"

namespace shardcast {
namespace internal_client {

absl::StatusOr<std::shared_ptr<const ClientRegion>> ClientRegion::Open(
    const std::string& channel_path, uint32_t slots, uint64_t slot_bytes) {
  ASSIGN_OR_RETURN(LocalConnection connection,
                   LocalConnection::Connect(channel_path));
  std::shared_ptr<ClientRegion> r(new ClientRegion(std::move(connection)));
  v1::LocalRequest request;
  request.mutable_batch_region()->set_slots(slots);
  request.mutable_batch_region()->set_slot_bytes(slot_bytes);
  v1::LocalReply reply;
  std::vector<UniqueFd> fds;
  RETURN_IF_ERROR(
      r->connection_.AskOk(request, &reply, &fds, "shared memory: "));
  const v1::LocalReply::BatchRegion& got = reply.batch_region();
  if (!reply.has_batch_region() || fds.size() != 1 || got.slots() != slots ||
      got.slot_bytes() < slot_bytes ||
      got.region_bytes() != uint64_t{got.slots()} * got.slot_bytes() ||
      got.token().empty()) {
    return absl::DataLossError(absl::StrCat(
        channel_path, " handed over a region that does not match its reply"));
  }
  ASSIGN_OR_RETURN(
      r->mapping_,
      SharedMapping::Map(fds[0].get(), got.region_bytes(),
                         /*writable=*/false, "shared-memory region"));
  r->slots_ = got.slots();
  r->slot_bytes_ = got.slot_bytes();
  r->token_ = got.token();
  return std::shared_ptr<const ClientRegion>(std::move(r));
}

}  // namespace internal_client
}  // namespace shardcast
