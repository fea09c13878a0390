#include "server/transport/metrics.h"

#include "common/base/proc_fields.h"

namespace shardcast {

uint64_t Metrics::CallsFailed() const {
  uint64_t n = 0;
  for (size_t i = 1; i < calls_by_code.size(); ++i)
    n += calls_by_code[i].load();
  return n;
}

ResidentMemory ReadResidentMemory() {
  const absl::StatusOr<ProcFields> f = ProcFields::Read("/proc/self/status");
  if (!f.ok()) return {};
  return {.total = f->Get("VmRSS").value_or(0),
          .anon = f->Get("RssAnon").value_or(0),
          .file = f->Get("RssFile").value_or(0),
          .shmem = f->Get("RssShmem").value_or(0)};
}

uint64_t DeviceReadBytes() {
  const absl::StatusOr<ProcFields> f = ProcFields::Read("/proc/self/io");
  return f.ok() ? f->Get("read_bytes").value_or(0) : 0;
}

}  // namespace shardcast
