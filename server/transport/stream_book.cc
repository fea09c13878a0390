#include "server/transport/stream_book.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace shardcast {

StreamBook::Entry::~Entry() { book_->Remove(key_); }

std::string StreamBook::NextClientId() {
  return absl::StrCat("s", next_id_.fetch_add(1, std::memory_order_relaxed));
}

std::unique_ptr<StreamBook::Entry> StreamBook::Add(StreamInfo info) {
  MutexLock lock(&mu_);
  const uint64_t key = next_key_++;
  std::unique_ptr<Entry> entry(new Entry(this, key));
  entries_.emplace(key, std::make_pair(std::move(info), entry.get()));
  return entry;
}

void StreamBook::Remove(uint64_t key) {
  MutexLock lock(&mu_);
  entries_.erase(key);
}

std::vector<StreamFigures> StreamBook::Snapshot() const {
  MutexLock lock(&mu_);
  std::vector<StreamFigures> out;
  out.reserve(entries_.size());
  for (const auto& [key, e] : entries_) {
    StreamFigures f;
    f.info = e.first;
    // The entry is alive: its destructor takes mu_ to leave the book.
    f.batches = e.second->batches_.load(std::memory_order_relaxed);
    f.bytes = e.second->bytes_.load(std::memory_order_relaxed);
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace shardcast
