#include "server/engine/scan.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/file.h"
#include "common/base/log.h"
#include "common/base/random.h"
#include "common/base/status.h"
#include "server/io/page_residency.h"

namespace shardcast {

// ------------------------------------------------------------- BlockLayout

absl::StatusOr<BlockLayout> BlockLayout::Make(const DatasetDesc& d,
                                              const Selection& sel,
                                              uint64_t block_bytes) {
  BlockLayout l;
  l.sel = sel;
  l.vector_bytes = d.vector_bytes();
  l.vectors_per_block = static_cast<int64_t>(block_bytes / l.vector_bytes);
  if (l.vectors_per_block < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "one vector (d_model ", d.d_model, " x 4 = ", l.vector_bytes,
        " bytes) does not fit in a block of ", block_bytes,
        " bytes; raise --block-bytes"));
  }
  const int64_t v = sel.num_vectors();
  l.num_blocks = (v + l.vectors_per_block - 1) / l.vectors_per_block;
  return l;
}

Block::~Block() {
  if (reservoir != nullptr && slot >= 0) reservoir->Release(slot);
}

namespace {

// `file`'s size now: from `sizes` when this pass has read it, else from the
// file (and kept in `sizes`).
absl::StatusOr<uint64_t> SizeOf(const MappedFile* file,
                                Block::FileSizes* sizes) {
  if (sizes != nullptr) {
    for (const auto& [known, size] : *sizes) {
      if (known == file) return size;
    }
  }
  ASSIGN_OR_RETURN(const uint64_t size, file->CurrentSize());
  if (sizes != nullptr) sizes->emplace_back(file, size);
  return size;
}

}  // namespace

absl::Status Block::CheckMapped(FileSizes* sizes) const {
  if (pieces.empty()) return absl::OkStatus();
  // A repaired fault leaves a page of zeros in the map for good: every
  // block of that file is damaged from then on, not only those read before.
  if (MapFaults() != 0) {
    return absl::DataLossError(absl::StrCat(
        "data of ", pieces.front().file->path(),
        " became unreadable while it was being served (the file shrank or "
        "the disk failed)"));
  }
  // One size check per run of pieces in the same file.
  for (size_t i = 0; i < pieces.size();) {
    const MappedFile* file = pieces[i].file;
    uint64_t end = 0;
    for (; i < pieces.size() && pieces[i].file == file; ++i) {
      end = std::max(end, pieces[i].offset + pieces[i].length);
    }
    ASSIGN_OR_RETURN(const uint64_t size, SizeOf(file, sizes));
    if (size < end) {
      return absl::DataLossError(
          absl::StrCat(file->path(), " shrank to ", size,
                       " bytes while it was being served (it had ",
                       file->size(), "); its data is gone"));
    }
  }
  return absl::OkStatus();
}

uint64_t Block::MapFaults() const {
  uint64_t sum = 0;
  const MappedFile* last = nullptr;
  for (const Piece& p : pieces) {
    if (p.file != last) sum += p.file->faults();
    last = p.file;
  }
  return sum;
}

// -------------------------------------------------------------- SharedScan

SharedScan::SharedScan(std::shared_ptr<const DatasetReader> reader,
                       std::string dataset, BlockLayout layout,
                       ScanOptions options, Reservoir* reservoir,
                       std::function<void()> wake_reads,
                       std::vector<UniqueFd> fds, uint64_t seed,
                       int64_t first_cycle)
    : reader_(std::move(reader)),
      dataset_(std::move(dataset)),
      layout_(std::move(layout)),
      options_(options),
      reservoir_(reservoir),
      wake_reads_(std::move(wake_reads)),
      fds_(std::move(fds)),
      seed_(seed),
      selection_name_(layout_.sel.Name(reader_->desc())),
      labels_path_(reader_->labels_path()),
      start_at_(Clock::now() + options.start_delay) {
  MutexLock lock(&mu_);
  need_count_.assign(static_cast<size_t>(layout_.num_blocks), 0);
  cycle_ = first_cycle;
  NewCycle();
}

SharedScan::~SharedScan() = default;

void SharedScan::NewCycle() {
  // Fisher-Yates with SplitMix64, seeded by (seed, cycle): the permutation
  // of a cycle is a pure function of the two.
  order_.resize(static_cast<size_t>(layout_.num_blocks));
  std::iota(order_.begin(), order_.end(), 0);
  uint64_t state = seed_ ^ SplitMix64(static_cast<uint64_t>(cycle_) + 1);
  for (size_t i = order_.size(); i > 1; --i) {
    state += 0x9E3779B97F4A7C15ULL;
    std::swap(order_[i - 1], order_[UniformIndex(SplitMix64(state), i)]);
  }
  position_ = 0;
}

IndexSet SharedScan::BaseSet(const SubscriberSpec& spec) const {
  // The blocks of the subscriber's node group (b mod node_count ==
  // node_rank) holding at least one vector of its partition (g mod
  // world_size == rank).
  IndexSet s(layout_.num_blocks);
  for (int64_t b = spec.node_rank; b < layout_.num_blocks;
       b += spec.node_count) {
    if (layout_.vectors_of_rank(b, spec.rank, spec.world_size) > 0) s.Set(b);
  }
  return s;
}

void SharedScan::Need(Subscriber& s, IndexSet blocks) {
  for (int64_t b = 0; b < layout_.num_blocks; ++b) {
    if (!blocks.Has(b)) continue;
    ++need_count_[static_cast<size_t>(b)];
    ++share_need_[static_cast<size_t>(b % share_count_)];
    if (ReadHere(b)) ++disk_need_;
  }
  total_need_ += blocks.count();
  s.needed = std::move(blocks);
  for (int64_t share = 0; share < share_count_; ++share) WakeShare(share);
}

void SharedScan::Need(Subscriber& s, int64_t block) {
  if (s.needed.Has(block)) return;
  s.needed.Set(block);
  ++need_count_[static_cast<size_t>(block)];
  ++total_need_;
  ++share_need_[static_cast<size_t>(block % share_count_)];
  if (ReadHere(block)) ++disk_need_;
  WakeShare(block % share_count_);
}

void SharedScan::WakeShare(int64_t share) {
  std::function<void()>& w = share_wakers_[static_cast<size_t>(share)];
  if (w && share_need_[static_cast<size_t>(share)] > 0) {
    std::function<void()> call = std::move(w);
    w = nullptr;
    call();
  }
}

void SharedScan::Unneed(Subscriber& s, int64_t block) {
  if (!s.needed.Has(block)) return;
  s.needed.Clear(block);
  --need_count_[static_cast<size_t>(block)];
  --total_need_;
  --share_need_[static_cast<size_t>(block % share_count_)];
  if (ReadHere(block)) --disk_need_;
}

void SharedScan::DropNeeds(Subscriber& s) {
  for (int64_t b = 0; b < layout_.num_blocks && s.needed.count() > 0; ++b) {
    Unneed(s, b);
  }
}

void SharedScan::Arm(Subscriber& s) {
  if (s.spec.epochs != 0 && s.deliver_epoch + 1 >= s.spec.epochs) return;
  ++s.deliver_epoch;
  Need(s, s.base);
}

bool SharedScan::Enqueue(Subscriber& s, uint64_t read_id, int64_t block,
                         BlockRef data, bool resident) {
  Queued q{read_id, block, s.deliver_epoch, std::move(data)};
  const bool beyond_lag =
      static_cast<int64_t>(s.queue.size()) >= options_.lag_blocks;
  if (beyond_lag && ((!s.spec.borrow && !resident) || !HoldOver(s, q))) {
    return false;
  }
  Unneed(s, block);
  s.queue.push_back(std::move(q));
  ++s.delivered;
  // Blocks issued later may already be the next epoch's for the others.
  if (s.needed.count() == 0) Arm(s);
  return true;
}

bool SharedScan::HoldOver(Subscriber& s, Queued& q) {
  int32_t& holders = over_holders_[q.read_id];
  if (holders == 0 && !reservoir_->TryTakeOverflow()) {
    over_holders_.erase(q.read_id);
    return false;
  }
  ++holders;
  q.over = true;
  ++s.overflow;
  return true;
}

bool SharedScan::ReleaseOver(Subscriber& s, Queued& q) {
  if (!q.over) return false;
  q.over = false;
  --s.overflow;
  auto it = over_holders_.find(q.read_id);
  if (it == over_holders_.end() || --it->second > 0) return false;
  over_holders_.erase(it);
  reservoir_->ReturnOverflow(1);
  return true;
}

void SharedScan::Settle(Subscriber& s) {
  // Entries are marked when queued beyond the bound; after pops the first
  // lag_blocks are within it again.
  const size_t within =
      std::min(s.queue.size(), static_cast<size_t>(options_.lag_blocks));
  for (size_t i = 0; i < within && s.overflow > 0; ++i) {
    ReleaseOver(s, s.queue[i]);
  }
}

void SharedScan::ClearQueue(Subscriber& s) {
  for (Queued& q : s.queue) ReleaseOver(s, q);
  s.queue.clear();
}

bool SharedScan::Starving(const Subscriber& s) const {
  // Its client is blocked waiting for a block that has not been read: the
  // only case in which waiting for a laggard holds someone back.
  return s.error.ok() && s.waker != nullptr && s.queue.empty() &&
         s.needed.count() > 0;
}

void SharedScan::Wake(Subscriber& s) {
  if (s.waker) {
    std::function<void()> w = std::move(s.waker);
    s.waker = nullptr;
    w();
  }
}

bool SharedScan::DeliveringLocked() {
  if (delivering_) return true;
  if (Clock::now() < start_at_) return false;
  delivering_ = true;
  for (auto& [id, s] : subs_) Wake(s);
  return true;
}

uint64_t SharedScan::Subscribe(SubscriberSpec spec) {
  uint64_t id;
  {
    MutexLock lock(&mu_);
    id = next_id_++;
    Subscriber& s = subs_[id];
    if (spec.world_size < 1) spec.world_size = 1;
    s.base = BaseSet(spec);
    s.deliver_epoch = spec.epoch;
    IndexSet needed = s.base;
    if (spec.needed.has_value()) {
      needed = IndexSet(layout_.num_blocks);
      for (int64_t b = 0; b < layout_.num_blocks; ++b) {
        if (spec.needed->Has(b) && s.base.Has(b)) needed.Set(b);
      }
    }
    s.spec = std::move(spec);
    s.spec.needed.reset();
    Need(s, std::move(needed));
    if (s.needed.count() == 0) Arm(s);
    ClaimResident(s);
  }
  wake_reads_();
  return id;
}

void SharedScan::ClaimResident(Subscriber& s) {
  for (auto it = resident_.begin(); it != resident_.end();) {
    const bool reading = pending_.count(it->first) != 0;
    // A block being read exists already but must not be handed out before
    // ReadDone: queue it as pending, like the subscribers it was issued for.
    std::shared_ptr<Block> data = reading ? nullptr : it->second.data.lock();
    if (!reading && data == nullptr) {
      it = resident_.erase(it);  // nobody holds it any more
      continue;
    }
    if (s.needed.Has(it->second.block)) {
      Enqueue(s, it->first, it->second.block, std::move(data),
              /*resident=*/true);
    }
    ++it;
  }
}

void SharedScan::Unsubscribe(uint64_t id) {
  {
    MutexLock lock(&mu_);
    auto it = subs_.find(id);
    if (it == subs_.end()) return;
    Log(LogLevel::kInfo,
        absl::StrCat("scan of ", dataset_, ": client left (epoch ",
                     it->second.deliver_epoch, ", ", it->second.delivered,
                     " blocks delivered, ", it->second.skipped,
                     " deferred by the lag bound); scan has read ",
                     blocks_read_, " blocks, ", bytes_read_, " bytes"),
        {{"client", it->second.spec.client},
         {"peer", it->second.spec.peer},
         {"dataset", dataset_}});
    DropNeeds(it->second);
    ClearQueue(it->second);
    subs_.erase(it);  // drops its queued blocks
  }
  wake_reads_();
}

int64_t SharedScan::subscribers() const {
  MutexLock lock(&mu_);
  return static_cast<int64_t>(subs_.size());
}

bool SharedScan::OthersStarving(uint64_t id) const {
  MutexLock lock(&mu_);
  for (const auto& [other, s] : subs_) {
    if (other != id && Starving(s)) return true;
  }
  return false;
}

absl::StatusOr<Take> SharedScan::TakeBlock(uint64_t id, int64_t epoch,
                                           std::function<void()> waker) {
  Take t;
  {
    MutexLock lock(&mu_);
    auto it = subs_.find(id);
    if (it == subs_.end()) {
      return absl::InternalError("stream is not subscribed to its scan");
    }
    Subscriber& s = it->second;
    if (!s.error.ok()) return s.error;
    s.waker = nullptr;
    if (!s.queue.empty() && s.queue.front().epoch < epoch) {
      return absl::InternalError(
          "stream moved past an epoch with blocks queued");
    }
    if (!s.queue.empty() && s.queue.front().epoch == epoch &&
        s.queue.front().data != nullptr && DeliveringLocked()) {
      t.kind = Take::kBlock;  // the queue has room again: wake the engine
      t.block = std::move(s.queue.front().data);
      ReleaseOver(s, s.queue.front());  // only with lag_blocks 0
      s.queue.pop_front();
      Settle(s);
      if (deliver_waker_) {  // and a peer's feed waiting for room
        std::function<void()> w = std::move(deliver_waker_);
        deliver_waker_ = nullptr;
        w();
      }
    } else if ((s.queue.empty() || s.queue.front().epoch > epoch) &&
               (s.deliver_epoch > epoch || s.needed.count() == 0)) {
      t.kind = Take::kDelivered;
      return t;
    } else {
      // Being read, not read yet, or read within the start delay (the
      // engine's call at ReadyAt() ends the delay and wakes it). Waiting
      // for a block not read may make this subscriber starving, which the
      // engine must know to skip a laggard.
      s.waker = std::move(waker);
    }
  }
  wake_reads_();
  return t;
}

IndexSet SharedScan::Untaken(uint64_t id, int64_t epoch) const {
  MutexLock lock(&mu_);
  IndexSet out(layout_.num_blocks);
  auto it = subs_.find(id);
  if (it == subs_.end()) return out;
  const Subscriber& s = it->second;
  if (s.deliver_epoch == epoch) out = s.needed;
  for (const Queued& q : s.queue) {
    if (q.epoch == epoch) out.Set(q.block);
  }
  return out;
}

int64_t SharedScan::ReclaimOverflow(int64_t n) {
  int64_t given = 0;
  {
    MutexLock lock(&mu_);
    // The newest read held beyond a bound goes first, from every queue that
    // ends with it: a block several laggards hold returns its unit with the
    // last of them. Each round drops at least one entry.
    const auto droppable = [](const Subscriber& s) {
      return !s.queue.empty() && s.queue.back().over &&
             s.queue.back().epoch == s.deliver_epoch;
    };
    while (given < n) {
      std::optional<uint64_t> newest;
      for (const auto& [id, s] : subs_) {
        if (droppable(s) && (!newest || s.queue.back().read_id > *newest)) {
          newest = s.queue.back().read_id;
        }
      }
      if (!newest) break;
      for (auto& [id, s] : subs_) {
        if (!droppable(s) || s.queue.back().read_id != *newest) continue;
        Need(s, s.queue.back().block);
        if (ReleaseOver(s, s.queue.back())) ++given;
        s.queue.pop_back();
        ++s.skipped;
      }
    }
  }
  if (given > 0) wake_reads_();
  return given;
}

void SharedScan::AddDelivered(uint64_t id, uint64_t bytes) {
  MutexLock lock(&mu_);
  auto it = subs_.find(id);
  if (it != subs_.end()) it->second.bytes += bytes;
}

std::unique_ptr<BlockRead> SharedScan::NextRead() {
  bool pressed = false;
  std::unique_ptr<BlockRead> read = NextReadOrPressure(&pressed);
  if (pressed && on_pressure_) on_pressure_();
  return read;
}

std::unique_ptr<BlockRead> SharedScan::NextReadOrPressure(bool* pressed) {
  MutexLock lock(&mu_);
  // Reads go on within the start delay; the engine calls again at ReadyAt()
  // when it has nothing to read, so the delay's end wakes the subscribers.
  DeliveringLocked();
  if (subs_.empty()) return nullptr;
  // Bounded: a starving subscriber needs some block, which it can take, so
  // one full cycle always finds a block to read or a reason to wait.
  for (int64_t steps = 0; steps <= 2 * layout_.num_blocks + 1; ++steps) {
    if (disk_need_ == 0) return nullptr;  // (the rest comes from peers)
    if (position_ >= layout_.num_blocks) {
      ++cycle_;
      NewCycle();
    }
    const int64_t b = order_[static_cast<size_t>(position_)];
    if (need_count_[static_cast<size_t>(b)] == 0 || !ReadHere(b)) {
      ++position_;
      continue;
    }
    const Admit admit = AdmitBlock(b, /*may_skip=*/true);
    if (admit == Admit::kWait) return nullptr;
    if (admit == Admit::kSkip) {
      ++position_;
      continue;
    }
    const std::optional<int32_t> slot = reservoir_->TryAcquire();
    if (!slot.has_value()) {  // a release wakes the engine
      *pressed = reservoir_->overflow_excess() > 0;
      return nullptr;
    }
    std::shared_ptr<Block> block;
    absl::StatusOr<std::unique_ptr<BlockRead>> made =
        MakeRead(b, *slot, &block);
    if (!made.ok()) {
      // A mapped shard shorter than the block needs (it shrank before it
      // was mapped): the block can never be made, so its needers get the
      // error as for a failed read, instead of the scan asking for it again
      // forever while they wait.
      LogWarning("scan of ", dataset_, ": block ", b,
                 " failed: ", made.status().ToString());
      FailNeeders(b, made.status());
      continue;  // `block` returns the slot
    }
    std::unique_ptr<BlockRead> read = std::move(*made);
    ++position_;
    read->tag = Issue(b, block, /*ready=*/false);
    pending_[read->tag] = std::move(block);  // until ReadDone
    return read;
  }
  LogError("scan of ", dataset_, ": no block to read although ", total_need_,
           " are needed (bug); waiting");
  return nullptr;
}

bool SharedScan::RoomFor(int64_t b, bool* any_room, bool* full_feed) const {
  const size_t lag = static_cast<size_t>(options_.lag_blocks);
  *any_room = false;
  *full_feed = false;
  int64_t full = 0;  // needers a full lag bound behind
  for (const auto& [id, s] : subs_) {
    if (!s.needed.Has(b)) continue;
    const bool room = s.queue.size() < lag;
    *any_room = *any_room || room;
    if (!room) ++full;
    if (!room && !s.spec.borrow) *full_feed = true;
  }
  // Full needers may still take it with spare reservoir memory: one unit
  // for the block, however many of them hold it.
  return full == 0 || (!*full_feed && reservoir_->overflow_available() >= 1);
}

uint64_t SharedScan::Issue(int64_t b, std::shared_ptr<Block> block,
                           bool ready) {
  const uint64_t read_id = next_read_id_++;
  if (static_cast<int64_t>(resident_.size()) > 2 * reservoir_->num_slots()) {
    for (auto it = resident_.begin(); it != resident_.end();) {
      it = it->second.data.expired() && pending_.count(it->first) == 0
               ? resident_.erase(it)
               : std::next(it);
    }
  }
  resident_[read_id] = {b, block};
  for (auto& [id, s] : subs_) {
    if (!s.needed.Has(b)) continue;
    if (!Enqueue(s, read_id, b, ready ? block : nullptr)) {
      ++s.skipped;
    } else if (ready && s.queue.front().data != nullptr) {
      Wake(s);
    }
  }
  return read_id;
}

void SharedScan::set_shares(int64_t count, int64_t own) {
  MutexLock lock(&mu_);
  share_count_ = std::max<int64_t>(1, count);
  read_here_.assign(static_cast<size_t>(share_count_), false);
  read_here_[static_cast<size_t>(own % share_count_)] = true;
  disk_need_ = 0;
  share_need_.assign(static_cast<size_t>(share_count_), 0);
  share_wakers_.assign(static_cast<size_t>(share_count_), nullptr);
  for (int64_t b = 0; b < layout_.num_blocks; ++b) {
    const int64_t need = need_count_[static_cast<size_t>(b)];
    share_need_[static_cast<size_t>(b % share_count_)] += need;
    if (ReadHere(b)) disk_need_ += need;
  }
}

int64_t SharedScan::ShareNeed(int64_t share, std::function<void()> waker) {
  MutexLock lock(&mu_);
  if (share < 0 || share >= share_count_) return 0;
  const int64_t need = share_need_[static_cast<size_t>(share)];
  if (need == 0 && waker) {
    share_wakers_[static_cast<size_t>(share)] = std::move(waker);
  }
  return need;
}

void SharedScan::ReadShare(int64_t share) {
  {
    MutexLock lock(&mu_);
    if (share < 0 || share >= share_count_ ||
        read_here_[static_cast<size_t>(share)]) {
      return;
    }
    read_here_[static_cast<size_t>(share)] = true;
    int64_t needed = 0;
    for (int64_t b = share; b < layout_.num_blocks; b += share_count_) {
      needed += need_count_[static_cast<size_t>(b)];
    }
    disk_need_ += needed;
    LogWarning("scan of ", dataset_, " (", selection_name_, "): reading share ",
               share, " of ", share_count_,
               " here from now on (its peer is lost); ", needed,
               " block need(s) of it are still open");
  }
  wake_reads_();
}

bool SharedScan::ReadsShare(int64_t share) const {
  MutexLock lock(&mu_);
  return share >= 0 && share < share_count_ &&
         read_here_[static_cast<size_t>(share)];
}

absl::StatusOr<Delivery> SharedScan::Deliver(int64_t b,
                                             absl::string_view vectors,
                                             std::function<void()> waker,
                                             bool skip_laggards) {
  if (b < 0 || b >= layout_.num_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block ", b, " is not one of the selection's ", layout_.num_blocks));
  }
  const uint64_t bytes =
      static_cast<uint64_t>(layout_.vectors(b)) * layout_.vector_bytes;
  if (vectors.size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("block ", b, " has ", bytes,
                                                   " bytes of vectors, not ",
                                                   vectors.size()));
  }
  std::shared_ptr<Block> block;  // released after the lock, if unclaimed
  MutexLock lock(&mu_);
  if (ReadHere(b)) {
    // Asked of no peer (or taken over since): the peer is out of step.
    return absl::InvalidArgumentError(
        absl::StrCat("block ", b, " is of share ", b % share_count_,
                     ", which this daemon reads itself"));
  }
  if (need_count_[static_cast<size_t>(b)] == 0) return Delivery::kUnneeded;
  const Admit admit = AdmitBlock(b, skip_laggards);
  if (admit == Admit::kSkip) return Delivery::kUnneeded;
  const std::optional<int32_t> slot =
      admit == Admit::kIssue ? reservoir_->TryAcquire() : std::nullopt;
  if (!slot.has_value()) {
    deliver_waker_ = std::move(waker);
    return Delivery::kFull;
  }
  uint64_t labels_offset = 0;
  block = NewBlock(b, *slot, &labels_offset);
  block->data = reservoir_->slot_data(*slot);
  std::memcpy(block->data, vectors.data(), vectors.size());
  if (!block->labels.empty()) {
    // The labels are not sent: they are this daemon's to read (a few
    // bytes per example).
    RETURN_IF_ERROR(PreadFull(reader_->labels_fd(), block->labels.data(),
                              block->labels.size(), labels_offset,
                              labels_path_));
  }
  ++blocks_delivered_;
  bytes_delivered_ += bytes;
  Issue(b, std::move(block), /*ready=*/true);
  return Delivery::kTaken;
}

SharedScan::Admit SharedScan::AdmitBlock(int64_t b, bool may_skip) {
  bool any_room = false;
  bool full_feed = false;
  if (RoomFor(b, &any_room, &full_feed)) return Admit::kIssue;
  // A peer's feed a full lag bound behind is waited for: in a sweep every
  // trainer needs every block, so trainers here that go on without the
  // peer would only wait for its share later, and the block skipped would
  // be read again.
  if (full_feed) return Admit::kWait;
  // Someone who needs this block is a full lag bound behind. Wait for it,
  // unless another subscriber is starving: then leave the laggard to a
  // later cycle.
  bool starving = false;
  for (const auto& [id, s] : subs_) starving = starving || Starving(s);
  if (!starving || !may_skip) return Admit::kWait;
  if (any_room) return Admit::kIssue;
  for (auto& [id, s] : subs_) {
    if (s.needed.Has(b)) ++s.skipped;
  }
  return Admit::kSkip;
}

std::shared_ptr<Block> SharedScan::NewBlock(int64_t b, int32_t slot,
                                            uint64_t* labels_offset) const {
  auto block = std::make_shared<Block>();
  block->id = b;
  block->first_vector = layout_.first_vector(b);
  block->vectors = layout_.vectors(b);
  block->vector_bytes = layout_.vector_bytes;
  block->reservoir = reservoir_;
  block->slot = slot;
  if (reader_->info().has_labels && block->vectors > 0) {
    const Selection& sel = layout_.sel;
    const int64_t k = sel.vectors_per_row;
    const int64_t first = sel.example_of(block->first_vector / k);
    const int64_t last =
        sel.example_of((block->first_vector + block->vectors - 1) / k);
    const uint64_t c = static_cast<uint64_t>(reader_->desc().content_tokens);
    block->first_example = first;
    block->labels.resize(static_cast<size_t>(last - first + 1) * c);
    *labels_offset = static_cast<uint64_t>(first) * c;
  }
  return block;
}

absl::StatusOr<std::unique_ptr<BlockRead>> SharedScan::MakeRead(
    int64_t b, int32_t slot, std::shared_ptr<Block>* out) {
  const DatasetDesc& d = reader_->desc();
  const Selection& sel = layout_.sel;
  uint64_t labels_offset = 0;
  std::shared_ptr<Block> block = NewBlock(b, slot, &labels_offset);
  *out = block;  // owns the slot from here on, also on error
  auto read = std::make_unique<BlockRead>();
  const uint64_t vb = layout_.vector_bytes;
  const int64_t k = sel.vectors_per_row;
  const int64_t g0 = block->first_vector, g1 = g0 + block->vectors;
  if (maps_ != nullptr) {
    block->maps = maps_;
    block->row_vectors = k;
    block->row_skip = g0 % k;
    // The pages a mapped scan populates stay in the daemon's page tables
    // (its RSS, as RssFile: page cache, not the daemon's memory) until
    // dropped. Dropping each block's pages when it is let go split the
    // kernel's huge mappings of the page cache and flushed TLBs per block
    // (a quarter of the daemon's time); dropping whole maps every 64 MiB
    // made the blocks in use fault back in 16 pages at a time (a quarter
    // of the throughput on this VM, where page-table changes are costly).
    // So: whole maps, once a reservoir's worth has been populated, which
    // bounds the mapped pages by the reservoir's size.
    if (populated_since_trim_ >=
        std::max<uint64_t>(reservoir_->bytes(), 64ull << 20)) {
      for (const auto& m : *maps_) {
        if (m != nullptr) m->Unmap(0, m->size());
      }
      populated_since_trim_ = 0;
    }
    populated_since_trim_ +=
        static_cast<uint64_t>(block->vectors) * layout_.vector_bytes;
  } else {
    block->data = reservoir_->slot_data(slot);
    read->slot = slot;
  }
  for (int64_t g = g0; g < g1;) {
    const int64_t row = g / k;
    const int64_t j0 = g % k;
    const int64_t j1 = std::min<int64_t>(k, j0 + (g1 - g));
    ASSIGN_OR_RETURN(VectorLocation loc, sel.Locate(d, row, j0));
    if (maps_ != nullptr) {
      // The whole row from its first selected vector (the piece indexing
      // counts from there), though only [j0, j1) is populated.
      const MappedFile* file = (*maps_)[static_cast<size_t>(loc.shard)].get();
      if (file == nullptr) {
        return absl::InternalError(
            absl::StrCat("shard ", loc.shard, " is not mapped"));
      }
      const uint64_t length = static_cast<uint64_t>(j1 - j0) * vb;
      const uint64_t row_start = loc.offset - static_cast<uint64_t>(j0) * vb;
      if (loc.offset > file->size() || length > file->size() - loc.offset) {
        // Shorter than the catalog saw: shrunk before it was mapped.
        return absl::DataLossError(absl::StrCat(
            file->path(), " is ", file->size(), " bytes; the selection needs ",
            loc.offset + length, " (the file shrank)"));
      }
      block->pieces.push_back(
          {file, loc.offset, length, file->data() + row_start});
      BlockRead::Touch* prev =
          read->touch.empty() ? nullptr : &read->touch.back();
      if (prev != nullptr && prev->file == file &&
          prev->offset + prev->length == loc.offset) {
        prev->length += length;  // adjacent rows
      } else {
        read->touch.push_back({file, loc.offset, length});
      }
      g += j1 - j0;
      continue;
    }
    ReadOp r;
    r.fd = fds_[static_cast<size_t>(loc.shard)].get();
    r.offset = loc.offset;
    r.length = static_cast<size_t>(j1 - j0) * vb;
    r.dest = block->data + static_cast<size_t>(g - g0) * vb;
    r.path = &reader_->shard_path(loc.shard);
    ReadOp* prev = read->ranges.empty() ? nullptr : &read->ranges.back();
    if (prev != nullptr && prev->fd == r.fd &&
        prev->offset + prev->length == r.offset &&
        static_cast<char*>(prev->dest) + prev->length == r.dest) {
      prev->length += r.length;  // adjacent on disk and in the slot
    } else {
      read->ranges.push_back(r);
    }
    g += j1 - j0;
  }
  if (!block->labels.empty()) {  // sized by NewBlock
    ReadOp r;
    r.fd = reader_->labels_fd();
    r.offset = labels_offset;
    r.length = block->labels.size();
    r.dest = block->labels.data();
    r.path = &labels_path_;
    read->ranges.push_back(r);
  }
  return read;
}

void SharedScan::Fail(Subscriber& s, const absl::Status& error) {
  if (s.error.ok()) s.error = error;
  DropNeeds(s);
  ClearQueue(s);
  Wake(s);
}

void SharedScan::FailNeeders(int64_t b, const absl::Status& error) {
  for (auto& [id, s] : subs_) {
    if (s.needed.Has(b)) Fail(s, error);
  }
}

void SharedScan::ReadDone(std::unique_ptr<BlockRead> read,
                          absl::Status status) {
  std::shared_ptr<Block> block;  // released after the lock, if unclaimed
  MutexLock lock(&mu_);
  auto it = pending_.find(read->tag);
  if (it == pending_.end()) return;
  block = std::move(it->second);
  pending_.erase(it);
  if (status.ok()) {
    ++blocks_read_;
    bytes_read_ += read->bytes;
  } else {
    LogWarning("scan of ", dataset_, ": block ", block->id,
               " failed: ", status.ToString());
  }
  for (auto& [id, s] : subs_) {
    bool failed = false;
    for (Queued& q : s.queue) {
      if (q.read_id != read->tag) continue;
      if (status.ok()) {
        q.data = block;
      } else {
        failed = true;
      }
    }
    if (failed || !s.error.ok()) {
      Fail(s, status);
    } else if (!s.queue.empty() && s.queue.front().data != nullptr) {
      Wake(s);
    }
  }
}

ScanStatus SharedScan::Status() const {
  MutexLock lock(&mu_);
  ScanStatus st;
  st.dataset = dataset_;
  st.selection = selection_name_;
  st.io = io_;
  st.num_blocks = layout_.num_blocks;
  st.cycle = cycle_;
  st.position = position_;
  st.blocks_read = blocks_read_;
  st.bytes_read = bytes_read_;
  st.shares = share_count_;
  st.shares_read_here = std::count(read_here_.begin(), read_here_.end(), true);
  st.blocks_from_peers = blocks_delivered_;
  st.bytes_from_peers = bytes_delivered_;
  for (const auto& [id, s] : subs_) {
    SubscriberStatus ss;
    ss.id = id;
    ss.peer = s.spec.peer;
    ss.client = s.spec.client;
    ss.rank = s.spec.rank;
    ss.world_size = s.spec.world_size;
    ss.epoch = s.deliver_epoch;
    ss.queued = static_cast<int64_t>(s.queue.size());
    ss.blocks_needed = s.needed.count();
    ss.blocks_delivered = s.delivered;
    ss.blocks_skipped = s.skipped;
    ss.bytes_delivered = s.bytes;
    st.subscribers.push_back(std::move(ss));
  }
  return st;
}

// ------------------------------------------------------------ read modes

absl::StatusOr<ScanReadMode> ParseScanReadMode(absl::string_view name) {
  if (name == "auto") return ScanReadMode::kAuto;
  if (name == "direct") return ScanReadMode::kDirect;
  if (name == "buffered") return ScanReadMode::kBuffered;
  if (name == "mapped") return ScanReadMode::kMapped;
  return absl::InvalidArgumentError(absl::StrCat(
      "read mode '", name, "' is not one of auto, direct, buffered, mapped"));
}

namespace {

// The fraction of a sample of the selection's pages that sits in the page
// cache. Asked with mincore() (PageResidency: no I/O) where the kernel tells
// this process the truth about the file (it owns it, may write it, or has
// CAP_FOWNER); elsewhere with RWF_NOWAIT reads, which return EAGAIN instead
// of waiting for the disk but still start the read of the page they miss.
// So each probe draws its pages at random (a fixed sample would be found
// cached by the next probe of the same cold data: a cold scan started right
// after another one was served from maps, at 60 MB/s), a page is asked once
// (on a small file, a second sample of a page just missed found it read:
// a cold 544 KiB dataset looked 62 % cached), and the read descriptors are
// advised POSIX_FADV_RANDOM so that a miss starts no read-ahead. -1 when
// the filesystem cannot answer.
double CachedFraction(const DatasetReader& r, const BlockLayout& layout) {
  constexpr int64_t kSamples = 32;
  const int64_t rows = layout.sel.num_rows;
  const int64_t per_row = layout.sel.vectors_per_row;
  if (rows <= 0 || per_row <= 0) return -1;
  // A shard's probe: a residency map, or else a descriptor to read with
  // RWF_NOWAIT; neither until the shard is first sampled.
  struct Probe {
    std::unique_ptr<PageResidency> residency;
    UniqueFd fd;
  };
  std::vector<Probe> probes(r.desc().shards.size());
  std::set<std::pair<int64_t, uint64_t>> asked_pages;  // (shard, page)
  char page[4096];
  int64_t asked = 0, cached = 0;
  std::mt19937_64 random(std::random_device{}());
  const auto uniform = [&random](int64_t lo, int64_t hi) {  // [lo, hi)
    return std::uniform_int_distribution<int64_t>(lo, hi - 1)(random);
  };
  // One page in each of `parts` equal parts of the selection.
  const int64_t parts = std::min(kSamples, rows);
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t first = i * rows / parts, end = (i + 1) * rows / parts;
    const int64_t row = uniform(first, std::max(end, first + 1));
    const int64_t token = uniform(0, per_row);
    absl::StatusOr<VectorLocation> at = layout.sel.Locate(r.desc(), row, token);
    if (!at.ok() || r.shard_fd(at->shard) < 0) continue;
    const uint64_t offset = at->offset / 4096 * 4096;
    if (!asked_pages.emplace(at->shard, offset).second) continue;
    Probe& probe = probes[static_cast<size_t>(at->shard)];
    if (probe.residency == nullptr && !probe.fd.valid()) {
      const int shard_fd = r.shard_fd(at->shard);
      struct stat st;
      if (::fstat(shard_fd, &st) == 0 && st.st_size > 0) {
        auto residency =
            PageResidency::Open(shard_fd, static_cast<uint64_t>(st.st_size),
                                r.shard_path(at->shard));
        if (residency.ok()) probe.residency = std::move(*residency);
      }
      if (probe.residency == nullptr) {
        auto opened =
            OpenFile(absl::StrCat("/proc/self/fd/", shard_fd), O_RDONLY);
        if (!opened.ok()) return -1;
        probe.fd = std::move(*opened);
        ::posix_fadvise(probe.fd.get(), 0, 0, POSIX_FADV_RANDOM);
      }
    }
    ++asked;
    if (probe.residency != nullptr) {
      cached += probe.residency->Cached(offset, 1);
      continue;
    }
    iovec iov{page, sizeof(page)};
    const ssize_t n = ::preadv2(probe.fd.get(), &iov, 1,
                                static_cast<off_t>(offset), RWF_NOWAIT);
    if (n < 0 && errno != EAGAIN) return -1;  // EOPNOTSUPP: cannot tell
    cached += n > 0;
  }
  return asked == 0 ? -1 : static_cast<double>(cached) / asked;
}

// Maps every shard file of `r` through the scan's descriptors `fds`.
absl::StatusOr<ShardMaps> MapShards(const DatasetReader& r,
                                    const std::vector<UniqueFd>& fds,
                                    bool sparse) {
  ShardMaps maps(fds.size());
  for (size_t s = 0; s < fds.size(); ++s) {
    if (!fds[s].valid()) continue;
    struct stat st;
    if (::fstat(fds[s].get(), &st) != 0) {
      return ErrnoToStatus(errno, r.shard_path(static_cast<int64_t>(s)));
    }
    ASSIGN_OR_RETURN(
        maps[s],
        MappedFile::Map(fds[s].get(), static_cast<uint64_t>(st.st_size),
                        r.shard_path(static_cast<int64_t>(s))));
    // Where the selection has gaps, a page that is not cached is read
    // alone rather than with its neighbours (another layer's bytes).
    if (sparse) maps[s]->AdviseRandom();
  }
  return maps;
}

}  // namespace

// ------------------------------------------------------------ ScanRegistry

absl::StatusOr<std::unique_ptr<ScanRegistry>> ScanRegistry::Start(
    Options options) {
  std::unique_ptr<ScanRegistry> r(
      new ScanRegistry(options.scans, std::move(options.on_sweep_scan)));
  ASSIGN_OR_RETURN(r->reservoir_, Reservoir::Create(options.reservoir));
  options.reads.register_buffers = options.scans.register_buffers;
  ASSIGN_OR_RETURN(r->engine_,
                   ReadEngine::Start(options.reads, r->reservoir_.get()));
  ReadEngine* engine = r->engine_.get();
  r->reservoir_->SetReleaseListener([engine] { engine->Wake(); });
  r->reservoir_->StartPrefault();
  r->gather_ = std::make_unique<GatherPool>(
      options.gather_helpers >= 0
          ? options.gather_helpers
          : GatherPool::DefaultHelpers(std::thread::hardware_concurrency()));
  return r;
}

ScanRegistry::~ScanRegistry() {
  // The prefault thread wakes the engine through the release listener.
  if (reservoir_ != nullptr) reservoir_->StopPrefault();
  engine_.reset();  // before the reservoir its reads land in
}

ScanRegistry::Subscription::~Subscription() {
  if (registry_ != nullptr) registry_->Leave(this);
}

absl::StatusOr<BlockLayout> ScanRegistry::Layout(const DatasetDesc& d,
                                                 const StreamSpec& spec) const {
  ASSIGN_OR_RETURN(Selection sel, Selection::Create(d, spec));
  return BlockLayout::Make(d, sel, reservoir_->slot_bytes());
}

absl::StatusOr<std::unique_ptr<ScanRegistry::Subscription>>
ScanRegistry::Subscribe(std::shared_ptr<const DatasetReader> reader,
                        const std::string& dataset, const StreamSpec& spec,
                        uint64_t seed, SubscriberSpec sub) {
  ASSIGN_OR_RETURN(BlockLayout layout, Layout(reader->desc(), spec));
  const int64_t slots = options_.window_blocks + options_.lag_blocks;
  RETURN_IF_ERROR(reservoir_->Reserve(
      slots, absl::StrCat("shuffle window ", options_.window_blocks,
                          " + lag bound ", options_.lag_blocks)));
  auto subscription = std::make_unique<Subscription>();
  const bool sweep = spec.sweep_shares > 1;
  if (sweep &&
      (spec.sweep_share < 0 || spec.sweep_share >= spec.sweep_shares)) {
    reservoir_->Unreserve(slots);
    return absl::InvalidArgumentError(
        absl::StrCat("sweep share ", spec.sweep_share, " is not in [0, ",
                     spec.sweep_shares, ")"));
  }
  const std::string key = absl::StrCat(
      reinterpret_cast<uintptr_t>(reader.get()), "|",
      spec.layer.has_value() ? absl::StrCat(*spec.layer) : "all", "|",
      static_cast<int>(spec.tokens),
      sweep ? absl::StrCat("|sweep ", spec.sweep_share, "/", spec.sweep_shares)
            : "");
  MutexLock lock(&mu_);
  auto it = scans_.find(key);
  if (it == scans_.end()) {
    // O_DIRECT needs every offset, length and buffer 4 KiB-aligned: true
    // when a vector is a multiple of 4 KiB and so is a slot.
    // Files of an external layout (safetensors) put their rows after a
    // header: aligned only where every tensor starts on a 4 KiB boundary.
    bool rows_aligned = true;
    if (reader->desc().external != nullptr) {
      for (uint64_t offset : reader->desc().external->tensor_offset) {
        rows_aligned = rows_aligned && offset % 4096 == 0;
      }
    }
    const bool aligned = rows_aligned && layout.vector_bytes % 4096 == 0 &&
                         reservoir_->slot_bytes() % 4096 == 0;
    const std::string unaligned =
        absl::StrCat("vectors of ", layout.vector_bytes, " bytes, blocks of ",
                     reservoir_->slot_bytes(),
                     " bytes or the files' first rows are not "
                     "at 4 KiB multiples");
    enum class How { kBuffered, kDirect, kMapped };
    How how = How::kBuffered;
    std::string why;
    switch (options_.read_mode) {
      case ScanReadMode::kBuffered:
        why = "--read-mode buffered";
        break;
      case ScanReadMode::kMapped:
        how = How::kMapped;
        why = "--read-mode mapped";
        break;
      case ScanReadMode::kDirect:
        how = aligned ? How::kDirect : How::kBuffered;
        if (!aligned) why = unaligned;
        break;
      case ScanReadMode::kAuto: {
        // Cached: serve it from the page cache in place. Cold (or cannot
        // tell): read it once, with O_DIRECT where the layout allows it.
        const double cached = CachedFraction(*reader, layout);
        how = cached >= 0.5 ? How::kMapped
              : aligned     ? How::kDirect
                            : How::kBuffered;
        why = cached < 0 ? "the page cache cannot be probed here"
                         : absl::StrFormat("%.0f%% of sampled pages cached",
                                           100 * cached);
        if (how == How::kBuffered) absl::StrAppend(&why, "; ", unaligned);
        break;
      }
    }
    // Read-ahead fills the gaps between selected ranges (another layer's
    // slices): where they are large, buffered reads get none.
    const bool sparse = layout.sel.Sparse(reader->desc());
    // The scan's own descriptors of the same inodes (via /proc/self/fd, so
    // a file replaced on disk since the catalog opened it is not picked up):
    // its hints and O_DIRECT do not touch the query path's descriptors.
    const DatasetReader& r = *reader;
    auto open_shards =
        [&r, sparse](bool o_direct) -> absl::StatusOr<std::vector<UniqueFd>> {
      std::vector<UniqueFd> fds;
      for (int64_t s = 0; s < static_cast<int64_t>(r.desc().shards.size());
           ++s) {
        if (r.shard_fd(s) < 0) {
          fds.emplace_back();
          continue;
        }
        auto fd = r.ReopenShard(s, o_direct ? O_DIRECT : 0);
        if (!fd.ok()) return fd.status();
        if (!o_direct) {
          ::posix_fadvise(fd->get(), 0, 0,
                          sparse ? POSIX_FADV_RANDOM : POSIX_FADV_SEQUENTIAL);
        }
        fds.push_back(std::move(*fd));
      }
      return fds;
    };
    absl::StatusOr<std::vector<UniqueFd>> fds =
        open_shards(how == How::kDirect);
    if (how == How::kDirect && !fds.ok() &&
        fds.status().code() == absl::StatusCode::kInvalidArgument) {
      // EINVAL: this filesystem does not do O_DIRECT (tmpfs, some FUSE).
      LogWarning("scan of ", dataset, ": O_DIRECT refused (",
                 fds.status().message(), "); reading through the page cache");
      how = How::kBuffered;
      fds = open_shards(false);
    }
    if (!fds.ok()) {
      reservoir_->Unreserve(slots);
      return fds.status();
    }
    std::shared_ptr<ShardMaps> maps;
    if (how == How::kMapped) {
      absl::StatusOr<ShardMaps> made = MapShards(r, *fds, sparse);
      if (made.ok()) {
        maps = std::make_shared<ShardMaps>(std::move(*made));
      } else {
        LogWarning("scan of ", dataset, ": cannot map the shards (",
                   made.status().message(),
                   "); reading through the page cache");
        how = How::kBuffered;
      }
    }
    ReadEngine* engine = engine_.get();
    auto scan = std::make_shared<SharedScan>(
        std::move(reader), dataset, std::move(layout), options_,
        reservoir_.get(), [engine] { engine->Wake(); }, std::move(*fds), seed,
        sub.epoch);
    scan->set_io(how == How::kDirect   ? "direct"
                 : how == How::kMapped ? "mapped"
                 : sparse              ? "buffered-random"
                                       : "buffered");
    scan->set_maps(std::move(maps));
    scan->set_pressure_listener([this] { ReclaimUnderPressure(); });
    if (sweep) scan->set_shares(spec.sweep_shares, spec.sweep_share);
    it = scans_.emplace(key, scan).first;
    engine_->Add(scan);
    if (sweep && on_sweep_scan_) on_sweep_scan_(scan, spec, seed);
    LogInfo("scan of ", dataset, " (", scan->selection_name(),
            ") started: ", scan->layout().num_blocks, " blocks of ",
            scan->layout().vectors_per_block, " vectors, ",
            how == How::kDirect   ? "O_DIRECT"
            : how == How::kMapped ? "served from the page cache in place"
            : sparse              ? "buffered, no read-ahead"
                                  : "buffered",
            why.empty() ? "" : absl::StrCat(" (", why, ")"));
  }
  subscription->registry_ = this;
  subscription->scan_ = it->second;
  subscription->id_ = it->second->Subscribe(std::move(sub));
  ReclaimOverflow(reservoir_->elastic_shortfall());
  return subscription;
}

void ScanRegistry::ReclaimOverflow(int64_t limit) {
  // Memory that laggards borrowed beyond their lag bounds, taken back when
  // reads (or a region's parking, after a new reservation) need it.
  int64_t excess = std::min(limit, reservoir_->overflow_excess());
  for (auto& [key, scan] : scans_) {
    if (excess <= 0) break;
    excess -= scan->ReclaimOverflow(excess);
  }
}

void ScanRegistry::ReclaimUnderPressure() {
  // On the read engine's thread, holding nothing. A few blocks at a time:
  // each is a laggard's block to read again later.
  MutexLock lock(&mu_);
  ReclaimOverflow(4);
}

absl::Status ScanRegistry::Reserve(int64_t slots, const std::string& what) {
  RETURN_IF_ERROR(reservoir_->Reserve(slots, what));
  MutexLock lock(&mu_);
  ReclaimOverflow(reservoir_->elastic_shortfall());
  return absl::OkStatus();
}

void ScanRegistry::Leave(Subscription* s) {
  {
    MutexLock lock(&mu_);
    s->scan_->Unsubscribe(s->id_);
    if (s->scan_->subscribers() == 0) {
      for (auto it = scans_.begin(); it != scans_.end(); ++it) {
        if (it->second == s->scan_) {
          engine_->Remove(it->second.get());
          LogInfo("scan of ", it->second->dataset(), " ended: no clients left");
          scans_.erase(it);
          break;
        }
      }
    }
  }
  reservoir_->Unreserve(options_.window_blocks + options_.lag_blocks);
}

std::vector<ScanStatus> ScanRegistry::Status() const {
  std::vector<std::shared_ptr<SharedScan>> scans;
  {
    MutexLock lock(&mu_);
    for (const auto& [key, scan] : scans_) scans.push_back(scan);
  }
  std::vector<ScanStatus> out;
  for (const auto& scan : scans) out.push_back(scan->Status());
  return out;
}

}  // namespace shardcast
