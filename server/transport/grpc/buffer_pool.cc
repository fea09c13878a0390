#include "server/transport/grpc/buffer_pool.h"

#include <cstdlib>

#include "common/base/tsan.h"

namespace shardcast {

BufferPool::~BufferPool() {
  MutexLock lock(&mu_);
  for (auto& [size, b] : idle_) {
    std::free(b->data);
    delete b;
  }
}

PooledBuffer* BufferPool::Get(size_t size) {
  {
    MutexLock lock(&mu_);
    auto it = idle_.find(size);
    if (it != idle_.end()) {
      PooledBuffer* b = it->second;
      idle_.erase(it);
      idle_bytes_ -= size;
      return b;
    }
  }
  auto* b = new PooledBuffer;
  b->data = static_cast<char*>(std::malloc(size > 0 ? size : 1));
  b->size = size;
  b->pool = this;
  return b;
}

void BufferPool::Return(void* buffer) {
  // Called by gRPC, after its own reference count, which TSan cannot see.
  TsanAcquire(buffer);
  auto* b = static_cast<PooledBuffer*>(buffer);
  b->pool->Put(b);
}

void BufferPool::Put(PooledBuffer* b) {
  {
    MutexLock lock(&mu_);
    if (idle_bytes_ + b->size <= max_idle_) {
      idle_.emplace(b->size, b);
      idle_bytes_ += b->size;
      return;
    }
  }
  std::free(b->data);
  delete b;
}

uint64_t BufferPool::idle_bytes() const {
  MutexLock lock(&mu_);
  return idle_bytes_;
}

}  // namespace shardcast
