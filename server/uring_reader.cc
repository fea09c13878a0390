#include "server/uring_reader.h"

#include <liburing.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "server/log.h"

namespace shardcast {

struct UringReader::Ring {
  struct io_uring ring;
  bool initialized = false;
  ~Ring() {
    if (initialized) io_uring_queue_exit(&ring);
  }
};

UringReader::UringReader(std::unique_ptr<Ring> ring, unsigned depth)
    : ring_(std::move(ring)), depth_(depth) {}

UringReader::~UringReader() = default;

std::unique_ptr<UringReader> UringReader::Create(unsigned queue_depth) {
  if (queue_depth == 0) queue_depth = 1;
  auto ring = std::make_unique<Ring>();
  const int rc = io_uring_queue_init(queue_depth, &ring->ring, 0);
  if (rc < 0) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      LogWarning("io_uring unavailable (", std::strerror(-rc),
                 "); falling back to pread");
    }
    return std::unique_ptr<UringReader>(new UringReader(nullptr, queue_depth));
  }
  ring->initialized = true;
  return std::unique_ptr<UringReader>(
      new UringReader(std::move(ring), queue_depth));
}

absl::Status UringReader::ReadAllPread(absl::Span<const ReadOp> ops) {
  for (const ReadOp& op : ops) {
    RETURN_IF_ERROR(PreadFull(op.fd, op.dest, op.length, op.offset,
                              op.path != nullptr ? *op.path : "file"));
  }
  return absl::OkStatus();
}

absl::Status UringReader::ReadAll(absl::Span<const ReadOp> ops) {
  if (ring_ == nullptr) return ReadAllPread(ops);
  struct io_uring* ring = &ring_->ring;
  // Progress per op: bytes done so far (short reads are resubmitted).
  std::vector<size_t> done(ops.size(), 0);
  size_t next = 0;  // next op never submitted
  size_t in_flight = 0;
  std::vector<size_t> retry;  // ops to resubmit after a short read
  absl::Status first_error;

  auto submit_one = [&](size_t i) -> bool {
    struct io_uring_sqe* sqe = io_uring_get_sqe(ring);
    if (sqe == nullptr) return false;
    const ReadOp& op = ops[i];
    io_uring_prep_read(sqe, op.fd, static_cast<char*>(op.dest) + done[i],
                       static_cast<unsigned>(op.length - done[i]),
                       op.offset + done[i]);
    io_uring_sqe_set_data64(sqe, i);
    ++in_flight;
    return true;
  };

  while (next < ops.size() || in_flight > 0 || !retry.empty()) {
    while (!retry.empty() && in_flight < depth_ && submit_one(retry.back())) {
      retry.pop_back();
    }
    while (next < ops.size() && in_flight < depth_ && first_error.ok()) {
      if (ops[next].length == 0) {
        ++next;
        continue;
      }
      if (!submit_one(next)) break;
      ++next;
    }
    if (!first_error.ok() && in_flight == 0) break;
    if (in_flight == 0) continue;
    int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR) {
      return ErrnoToStatus(-rc, "io_uring_submit_and_wait");
    }
    struct io_uring_cqe* cqe;
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      --in_flight;
      const size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
      const ReadOp& op = ops[i];
      const std::string path = op.path != nullptr ? *op.path : "file";
      if (cqe->res < 0) {
        if (cqe->res == -EAGAIN || cqe->res == -EINTR) {
          retry.push_back(i);
        } else if (first_error.ok()) {
          first_error = ErrnoToStatus(
              -cqe->res,
              absl::StrCat("read ", path, " at offset ", op.offset + done[i]));
        }
        continue;
      }
      if (cqe->res == 0) {
        if (first_error.ok()) {
          first_error = absl::DataLossError(absl::StrCat(
              path, ": file ends early: needed bytes [", op.offset, ", ",
              op.offset + op.length, ") but only ", done[i],
              " were readable (the file was truncated or is shorter than its "
              "metadata says)"));
        }
        continue;
      }
      done[i] += static_cast<size_t>(cqe->res);
      if (done[i] < op.length) retry.push_back(i);  // short read: continue it
    }
    io_uring_cq_advance(ring, seen);
  }
  return first_error;
}

}  // namespace shardcast
