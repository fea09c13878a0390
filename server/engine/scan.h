// The shared scan: one disk pass over a dataset selection that feeds every
// shuffled stream of that selection at once (docs/architecture.md).
//
// Layout. The selected vectors are numbered in disk order, g = row * k + j
// (a row is one layer of one example, k the selected tokens of a row). The
// numbering is cut into blocks of `vectors_per_block` consecutive vectors,
// one reservoir slot each; a block is read with a few large reads (one per
// row it touches, merged when rows are adjacent on disk).
//
// Scan order. The scan visits blocks in a seeded permutation per cycle; a
// block is read when at least one subscriber still needs it in the epoch it
// is being fed, and goes to every subscriber that needs it. Each subscriber
// (a client stream) keeps a bitmap of the blocks it still needs, so a late
// joiner simply needs everything and gets what it missed on the next cycle.
// When a subscriber has been handed every block of its epoch it immediately
// needs all of them again for its next epoch, so clients that run together
// stay together across epochs.
//
// Memory and lag. Delivered blocks wait in a subscriber's queue (FIFO, in
// scan order) until the client moves them into its shuffle window. Every
// stream reserves window + lag_blocks slots in the reservoir, so slots never
// run out: a queue may always hold `lag_blocks`, and more while the
// reservoir can lend (overflow): slots nobody reserved, and beyond them
// slots that are free now (reservations count every stream's worst case,
// but the streams of a scan share its blocks). Overflow is charged per
// block, not per queue: a block held beyond their lag bounds by several
// subscribers (trainers lagging together) occupies one slot and costs one
// unit. What was lent beyond the reservations is taken back, newest blocks
// first, when a read finds no free slot (ScanRegistry). A subscriber whose
// queue is full and can get no overflow while another one is starving (blocked,
// waiting for a block not read yet) is skipped for that block and gets it on
// a later cycle; otherwise the scan waits for it. So clients that keep up
// with each other (within the lag bound plus spare memory) never cost a
// second read, and a slow client holds back the others by at most that.
//
// Clients launched together (trainers of one job, ranks of one node) reach
// the daemon some milliseconds apart; a new scan hands out no block for
// `start_delay`, so that they all join it before any block is consumed. It
// reads from the start: a client joining meanwhile is queued every block
// read so far (ClaimResident), and the disk does not idle while the scan
// waits.
//
// Determinism. A client alone on a scan gets blocks in the order of the
// permutation of (its seed, its epoch) (the scan takes the first client's
// seed and epoch as its own), and it draws only when its window is full, so
// its batches do not depend on timing.
//
// Threads: NextRead/ReadDone run on the read engine's thread; Take and the
// other subscriber calls on the clients' worker threads. One mutex guards
// the scan; wakers are called with it held (they only schedule work). The
// scan tells the engine that it may have a read through a plain function, so
// tests can drive NextRead/ReadDone by hand (scan_test.cc).
#ifndef SHARDCAST_SERVER_ENGINE_SCAN_H_
#define SHARDCAST_SERVER_ENGINE_SCAN_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/base/mutex.h"
#include "common/format/reader.h"
#include "server/engine/engine_status.h"
#include "server/engine/gather_pool.h"
#include "server/engine/index_set.h"
#include "server/engine/read_engine.h"
#include "server/engine/reservoir.h"
#include "server/engine/selection.h"
#include "server/io/mapped_file.h"

namespace shardcast {

/// The selection cut into blocks of consecutive vectors.
struct BlockLayout {
  Selection sel;
  uint64_t vector_bytes = 0;
  int64_t vectors_per_block = 0;
  int64_t num_blocks = 0;

  /// INVALID_ARGUMENT when one vector does not fit in a block.
  static absl::StatusOr<BlockLayout> Make(const DatasetDesc& d,
                                          const Selection& sel,
                                          uint64_t block_bytes);
  int64_t first_vector(int64_t b) const { return b * vectors_per_block; }
  int64_t vectors(int64_t b) const {
    return std::min(vectors_per_block, sel.num_vectors() - first_vector(b));
  }
  /// Index within block b of its first vector of rank `rank` of
  /// `world_size` (vector g is rank g mod world_size's); the rank's others
  /// follow every world_size-th. At least vectors(b) when it has none.
  int64_t first_of_rank(int64_t b, int64_t rank, int64_t world_size) const {
    return ((rank - first_vector(b)) % world_size + world_size) % world_size;
  }
  /// How many vectors of block b are rank `rank`'s.
  int64_t vectors_of_rank(int64_t b, int64_t rank, int64_t world_size) const {
    const int64_t at = first_of_rank(b, rank, world_size);
    return at < vectors(b) ? (vectors(b) - at - 1) / world_size + 1 : 0;
  }
};

/// The shard files of a scan that serves cached data from memory maps
/// (ScanReadMode::kMapped), by shard index (null: a shard with no examples).
using ShardMaps = std::vector<std::unique_ptr<MappedFile>>;

/// A block: immutable once read. Its vectors are either in a reservoir slot
/// (read there) or, in a mapped scan, in the shard maps themselves; either
/// way it holds a slot, which bounds what clients may pin, and returns it
/// when the last reference goes.
struct Block {
  int64_t id = -1;
  int64_t first_vector = 0;
  int64_t vectors = 0;
  uint64_t vector_bytes = 0;
  char* data = nullptr;  // in the slot: vectors * vector_bytes, in order
  /// Mapped: the row pieces holding the vectors, in order (a row is one
  /// layer of one example; its selected tokens are adjacent in the file).
  /// Vector i is vector (i + row_skip) % row_vectors of piece
  /// (i + row_skip) / row_vectors.
  struct Piece {
    const MappedFile* file;
    uint64_t offset;
    uint64_t length;
    const char* at;  // file->data() + offset
  };
  std::vector<Piece> pieces;
  int64_t row_skip = 0;
  int64_t row_vectors = 0;
  std::shared_ptr<const ShardMaps> maps;  // keeps `pieces` mapped
  /// Content-token labels of examples [first_example, ...), when present.
  int64_t first_example = 0;
  std::string labels;
  Reservoir* reservoir = nullptr;
  int32_t slot = -1;
  ~Block();

  const char* vector(int64_t i) const {
    if (pieces.empty()) return data + static_cast<size_t>(i) * vector_bytes;
    const int64_t at = i + row_skip;
    return pieces[static_cast<size_t>(at / row_vectors)].at +
           static_cast<size_t>(at % row_vectors) * vector_bytes;
  }
  /// Sum of the faults of the maps the pieces are in (MappedFile::faults):
  /// above 0, a page of the file reads zeros in the map for good.
  uint64_t MapFaults() const;
  /// OK when every byte a copy from the pieces read is still in its file:
  /// no fault ever repaired in their maps, and no file now ends before a
  /// piece does (a file that shrank within a page reads zeros silently).
  /// DATA_LOSS naming the file otherwise. `sizes` (optional) keeps the file
  /// sizes read for a pass over several blocks (one batch's), so that each
  /// file is asked once per pass, not once per block.
  using FileSizes = std::vector<std::pair<const MappedFile*, uint64_t>>;
  absl::Status CheckMapped(FileSizes* sizes = nullptr) const;
  /// labels.bin value of content token `content` of `example` (an example
  /// the block's vectors belong to; needs labels).
  uint8_t Label(int64_t example, int64_t content,
                int64_t content_tokens) const {
    return static_cast<uint8_t>(labels[static_cast<size_t>(
        (example - first_example) * content_tokens + content)]);
  }
};
using BlockRef = std::shared_ptr<const Block>;

/// How a shared scan reads its shards.
enum class ScanReadMode {
  /// O_DIRECT when the layout allows it (vectors and blocks 4 KiB multiples)
  /// and the selection is not in the page cache (a sample of its pages,
  /// probed without reading them): cold data is read once, without the
  /// kernel's read-ahead fetching the unselected bytes between ranges.
  /// Mapped (below) when most of the sample is cached; buffered otherwise
  /// (or when the page cache cannot be probed).
  kAuto,
  kDirect,    // O_DIRECT whenever the layout allows it
  kBuffered,  // through the page cache
  /// Served from memory maps of the shards: blocks are views of the page
  /// cache and clients' batches are gathered from it directly (one copy
  /// instead of two). Auto's choice for cached data. Data that is not
  /// cached is read into the page cache synchronously, page by page when
  /// the selection is sparse: slow for cold data.
  kMapped,
};

/// "auto", "direct", "buffered", "mapped"; INVALID_ARGUMENT otherwise.
absl::StatusOr<ScanReadMode> ParseScanReadMode(absl::string_view name);

struct ScanOptions {
  int64_t window_blocks = 16;  // a client's shuffle window
  int64_t lag_blocks = 32;     // a client's queue bound
  ScanReadMode read_mode = ScanReadMode::kAuto;
  /// Register the reservoir's slots with io_uring (fixed buffers): pins and
  /// touches the whole reservoir at start, and needs RLIMIT_MEMLOCK.
  bool register_buffers = false;
  /// A new scan waits this long before its first read, so that clients
  /// launched together all join before any block is consumed.
  std::chrono::milliseconds start_delay{0};
  /// A stream copies a batch in parts of at least this many bytes, on its
  /// thread and the registry's gather helpers (gather_pool.h).
  uint64_t gather_part_bytes = 4 << 20;
};

/// What a subscriber asks of its scan.
struct SubscriberSpec {
  std::string peer;    // for status and logs
  std::string client;  // the transport's id of the stream ("s7")
  int64_t rank = 0, world_size = 1;
  int64_t node_rank = 0, node_count = 1;  // StreamSpec's node group
  int64_t epoch = 0;                      // first epoch fed
  int64_t epochs = 0;                     // 0 = endless
  /// Blocks still needed in `epoch` (a resume token's); empty = all.
  std::optional<IndexSet> needed;
  /// May hold blocks beyond its lag bound in spare reservoir memory. A
  /// peer's share feed may not: its backpressure is the network's, and an
  /// endless feed that borrowed would have the scan read cycles ahead.
  bool borrow = true;
};

/// What a client gets when it asks its subscription for the next block.
struct Take {
  enum Kind {
    kBlock,      // `block` is the next block of the epoch
    kWait,       // the next block is not read yet: the waker will be called
    kDelivered,  // every block of the epoch has been handed over
  };
  Kind kind = kWait;
  BlockRef block;
};

/// What becomes of a block a peer delivers (SharedScan::Deliver).
enum class Delivery {
  kTaken,     // handed to the subscribers that need it
  kUnneeded,  // nobody needs it now: dropped (a later cycle brings it)
  kFull,      // no room now: deliver it again after the waker, or shortly
};

/// One shared scan. Created and owned by ScanRegistry; thread-safe.
class SharedScan final : public BlockSource,
                         public std::enable_shared_from_this<SharedScan> {
 public:
  /// A scan of `layout` reading `reader`'s shards through `fds` (its own
  /// descriptors, index = shard) into `reservoir` slots. `wake_reads` is
  /// called (any thread, possibly with the scan's lock held) whenever the
  /// scan may have a read to hand out: ReadEngine::Wake in the daemon. The
  /// first cycle's permutation is a function of (`seed`, `first_cycle`).
  SharedScan(std::shared_ptr<const DatasetReader> reader, std::string dataset,
             BlockLayout layout, ScanOptions options, Reservoir* reservoir,
             std::function<void()> wake_reads, std::vector<UniqueFd> fds,
             uint64_t seed, int64_t first_cycle);
  ~SharedScan() override;

  const BlockLayout& layout() const { return layout_; }
  const DatasetReader& reader() const { return *reader_; }
  const std::string& dataset() const { return dataset_; }
  /// "layer 12, content tokens", for status pages and logs.
  const std::string& selection_name() const { return selection_name_; }
  /// How it reads ("direct", "buffered", "buffered-random"), for status.
  /// Set once, before the scan is shared.
  void set_io(std::string io) { io_ = std::move(io); }
  /// Called (without the scan's lock) when a read finds no free slot while
  /// elastic overflow is lent (Reservoir::overflow_excess): the registry
  /// takes some back. Set once, before the scan is shared.
  void set_pressure_listener(std::function<void()> listener) {
    on_pressure_ = std::move(listener);
  }
  /// Serves blocks from these maps of the shards instead of reading them
  /// (ScanReadMode::kMapped). Set once, before the scan is shared.
  void set_maps(std::shared_ptr<const ShardMaps> maps) {
    maps_ = std::move(maps);
  }

  /// Sweeps (docs/sweeps.md): the blocks are dealt in `count` shares
  /// (block b is share b mod count, as node groups split them) and this
  /// scan reads only share `own` from disk; the others' blocks come from
  /// the peers that read them, through Deliver. Set once, before the scan is
  /// shared. Default: one share, read here.
  void set_shares(int64_t count, int64_t own);
  int64_t share_count() const { return share_count_; }
  /// From now on this scan reads share `share` itself (its peer is lost):
  /// what its subscribers still need of it is read here, the rest of the
  /// pass included. Logged; status counts the shares read here.
  void ReadShare(int64_t share) ABSL_LOCKS_EXCLUDED(mu_);
  bool ReadsShare(int64_t share) const ABSL_LOCKS_EXCLUDED(mu_);
  /// How many block needs of share `share` the subscribers have open now: a
  /// feed asks its peer for more only while this is above 0, so that a
  /// peer's scan reads no further ahead than this one's subscribers need.
  /// When 0, `waker` (if any) is called once a subscriber needs a block of
  /// the share (it replaces the share's earlier waker).
  int64_t ShareNeed(int64_t share, std::function<void()> waker = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Block `block` of a share a peer reads, as its `vectors` (the block's
  /// vectors in order, vectors(block) x vector_bytes) and, for a dataset
  /// with labels, read here: copied into a slot and queued for the
  /// subscribers that need it, like a block read here. INVALID_ARGUMENT for
  /// a block out of range, of a share read here, or of the wrong size (the
  /// peer is to be dropped). On kFull, `waker` is called (with the scan's
  /// lock held) when a subscriber takes a block; the reservoir may free a
  /// slot without it, so deliver again after a short wait too. A needer a
  /// full lag bound behind is waited for (kFull: dropping the block would
  /// have its owner read it again) unless `skip_laggards`, which the feed
  /// sets once it has waited long: then, while another subscriber starves,
  /// the laggard gets the block on a later pass.
  absl::StatusOr<Delivery> Deliver(int64_t block, absl::string_view vectors,
                                   std::function<void()> waker,
                                   bool skip_laggards = false)
      ABSL_LOCKS_EXCLUDED(mu_);

  /// Adds a subscriber; returns its id.
  uint64_t Subscribe(SubscriberSpec spec) ABSL_LOCKS_EXCLUDED(mu_);
  /// Removes a subscriber and lets go of its queued blocks. Once it returns,
  /// its waker is never called again.
  void Unsubscribe(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  /// Number of subscribers.
  int64_t subscribers() const ABSL_LOCKS_EXCLUDED(mu_);
  /// Whether a subscriber other than `id` waits for a block that has not
  /// come (its client blocked in TakeBlock): what a peer's pass that takes
  /// nothing holds back.
  bool OthersStarving(uint64_t id) const ABSL_LOCKS_EXCLUDED(mu_);

  /// The next block of `epoch` for subscriber `id`, in scan order. On kWait,
  /// `waker` is kept and called once (with the scan's lock held) when that
  /// may have changed. A read error of a block the subscriber was waiting
  /// for is returned (DATA_LOSS naming the file).
  absl::StatusOr<Take> TakeBlock(uint64_t id, int64_t epoch,
                                 std::function<void()> waker)
      ABSL_LOCKS_EXCLUDED(mu_);
  /// Blocks of `epoch` not yet taken by `id` (still needed or queued).
  IndexSet Untaken(uint64_t id, int64_t epoch) const ABSL_LOCKS_EXCLUDED(mu_);
  /// Gives back up to `n` reservoir overflow units by dropping the newest
  /// queued blocks beyond subscribers' lag bounds (they become needed again,
  /// as if deferred). Returns how many were given back.
  int64_t ReclaimOverflow(int64_t n) ABSL_LOCKS_EXCLUDED(mu_);
  /// Adds to the subscriber's delivered-bytes figure.
  void AddDelivered(uint64_t id, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  ScanStatus Status() const ABSL_LOCKS_EXCLUDED(mu_);

  // BlockSource (read engine thread). The engine asks for reads again at
  // ReadyAt() when it has none: that call ends the start delay.
  Clock::time_point ReadyAt() const override { return start_at_; }
  std::unique_ptr<BlockRead> NextRead() override ABSL_LOCKS_EXCLUDED(mu_);
  void ReadDone(std::unique_ptr<BlockRead> read, absl::Status status) override
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Queued {
    uint64_t read_id;
    int64_t block;
    int64_t epoch;
    BlockRef data;      // set when read
    bool over = false;  // held beyond the lag bound (charged as overflow)
  };
  struct Subscriber {
    SubscriberSpec spec;
    IndexSet base;    // blocks with vectors of its partition
    IndexSet needed;  // for deliver_epoch
    int64_t deliver_epoch = 0;
    std::deque<Queued> queue;
    std::function<void()> waker;
    absl::Status error;
    int64_t overflow = 0;  // queue entries marked `over`
    uint64_t delivered = 0, skipped = 0, bytes = 0;
  };
  void NewCycle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NextRead; *pressed when it found no free slot with elastic overflow lent.
  std::unique_ptr<BlockRead> NextReadOrPressure(bool* pressed)
      ABSL_LOCKS_EXCLUDED(mu_);
  IndexSet BaseSet(const SubscriberSpec& spec) const;
  /// Makes `s` need `blocks` (replacing what it needed).
  void Need(Subscriber& s, IndexSet blocks) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Feeds `s` its next epoch, if it has one.
  void Arm(Subscriber& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Adds or removes one block of what `s` needs.
  void Need(Subscriber& s, int64_t block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unneed(Subscriber& s, int64_t block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Hands `s` the block of read `read_id` (data null while it is being
  /// read) if its queue has room or it can borrow overflow: it no longer
  /// needs the block and moves to its next epoch when that was the last.
  /// False (nothing changed) otherwise.
  /// `resident`: a block read before `s` joined (ClaimResident), which even
  /// a subscriber that may not borrow takes beyond its lag bound with
  /// spare memory: dropping it would read it again.
  bool Enqueue(Subscriber& s, uint64_t read_id, int64_t block, BlockRef data,
               bool resident = false) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropNeeds(Subscriber& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Ends `s` with `error` (its first error stays): it needs nothing more,
  /// lets go of its queue and is woken to see it.
  void Fail(Subscriber& s, const absl::Status& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Ends every subscriber that needs block `b` with `error` (a block that
  /// cannot be read).
  void FailNeeders(int64_t b, const absl::Status& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Starving(const Subscriber& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Whether block `b` is read here (its share is), not delivered.
  bool ReadHere(int64_t b) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return read_here_[static_cast<size_t>(b % share_count_)];
  }
  /// Whether every needer of `b` has queue room or overflow can take it;
  /// *full_feed: a needer that may not borrow (a peer's share feed) is a
  /// full lag bound behind.
  bool RoomFor(int64_t b, bool* any_room, bool* full_feed) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// What to do with block `b` now (read or delivered). kIssue: issue it
  /// (needers a full lag bound behind get it on a later cycle); kWait: a
  /// needer is a lag bound behind and is waited for; kSkip: no needer has
  /// room, so it is left to a later cycle (counted as skipped). A laggard
  /// is left behind only when `may_skip` and another subscriber starves,
  /// and a peer's feed never.
  enum class Admit { kIssue, kWait, kSkip };
  Admit AdmitBlock(int64_t b, bool may_skip) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// A block `b` in slot `slot` (data not set) and, for a dataset with
  /// labels, its label range sized: the file offset of its labels.
  std::shared_ptr<Block> NewBlock(int64_t b, int32_t slot,
                                  uint64_t* labels_offset) const;
  /// Registers a block that is read now (`block` being read, or delivered
  /// with its data) and queues it for its needers; its read id.
  uint64_t Issue(int64_t b, std::shared_ptr<Block> block, bool ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Unmarks the entries of `s` that are within its lag bound again (its
  /// queue shrank), returning the overflow units nobody else holds.
  void Settle(Subscriber& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Marks `q` (being queued for `s` beyond its lag bound) as overflow: the
  /// first such holder of its read takes a reservoir unit. False when none
  /// is left (nothing changed).
  bool HoldOver(Subscriber& s, Queued& q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Unmarks `q`; true when that returned its read's unit (last holder).
  bool ReleaseOver(Subscriber& s, Queued& q) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Empties the queue of `s`, returning what its entries held.
  void ClearQueue(Subscriber& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Queues for `s` the resident blocks it needs, in issue order.
  void ClaimResident(Subscriber& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Wake(Subscriber& s);
  /// Calls share `share`'s ShareNeed waker if the share is needed now.
  void WakeShare(int64_t share) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Whether blocks may be handed out (the start delay is over). The call
  /// that finds the delay over wakes the subscribers waiting for it.
  bool DeliveringLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::unique_ptr<BlockRead>> MakeRead(
      int64_t block, int32_t slot, std::shared_ptr<Block>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::shared_ptr<const DatasetReader> reader_;
  const std::string dataset_;
  const BlockLayout layout_;
  const ScanOptions options_;
  Reservoir* const reservoir_;
  const std::function<void()> wake_reads_;
  const std::vector<UniqueFd> fds_;  // the scan's own shard descriptors
  const uint64_t seed_;
  const std::string selection_name_;
  std::string io_;
  std::shared_ptr<const ShardMaps> maps_;
  std::function<void()> on_pressure_;
  /// Per read: how many subscribers hold it beyond their lag bound (one
  /// reservoir overflow unit while > 0).
  std::unordered_map<uint64_t, int32_t> over_holders_ ABSL_GUARDED_BY(mu_);
  const std::string labels_path_;
  const Clock::time_point start_at_;  // no block handed out before

  mutable Mutex mu_;
  std::map<uint64_t, Subscriber> subs_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool delivering_ ABSL_GUARDED_BY(mu_) = false;  // start_at_ has passed
  std::vector<int32_t> need_count_ ABSL_GUARDED_BY(mu_);  // per block
  int64_t total_need_ ABSL_GUARDED_BY(mu_) = 0;
  // Sweeps: shares, and which are read here; the needs of blocks read here.
  int64_t share_count_ = 1;
  std::vector<bool> read_here_ ABSL_GUARDED_BY(mu_) = {true};
  int64_t disk_need_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> share_need_ ABSL_GUARDED_BY(mu_) = {0};
  // By share: who waits for share_need_ to leave 0 (ShareNeed).
  std::vector<std::function<void()>> share_wakers_ ABSL_GUARDED_BY(mu_) = {
      nullptr};
  uint64_t blocks_delivered_ ABSL_GUARDED_BY(mu_) = 0;  // by peers
  uint64_t bytes_delivered_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> deliver_waker_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> order_ ABSL_GUARDED_BY(mu_);  // this cycle's permutation
  int64_t cycle_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t position_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_read_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::shared_ptr<Block>> pending_ ABSL_GUARDED_BY(mu_);
  /// Blocks read (or being read) that someone may still hold, by read id
  /// (= issue order): a joining subscriber takes these first, for free.
  struct Resident {
    int64_t block;
    std::weak_ptr<Block> data;
  };
  std::map<uint64_t, Resident> resident_ ABSL_GUARDED_BY(mu_);
  uint64_t blocks_read_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_read_ ABSL_GUARDED_BY(mu_) = 0;
  /// Bytes a mapped scan populated since it last dropped its maps' pages
  /// from the page tables (MakeRead).
  uint64_t populated_since_trim_ ABSL_GUARDED_BY(mu_) = 0;
};

/// Told of each sweep scan that starts (StreamSpec::sweep_shares > 1): the
/// scan (its dataset() is the id), the spec of the stream that started it
/// (selection and shares) and its seed.
using SweepScanHook = std::function<void(const std::shared_ptr<SharedScan>&,
                                         const StreamSpec&, uint64_t seed)>;

/// All shared scans of a daemon, keyed by (dataset, selection). Subscribing
/// joins the scan of that selection or starts one; the last subscriber to
/// leave ends it. Thread-safe.
class ScanRegistry {
 public:
  struct Options {
    ReservoirOptions reservoir;
    ReadEngineOptions reads;
    ScanOptions scans;
    /// Threads helping streams copy their batches (gather_pool.h); -1:
    /// GatherPool::DefaultHelpers of this machine's cores.
    int gather_helpers = -1;
    /// Called when a sweep scan (StreamSpec::sweep_shares > 1) starts, with
    /// the registry's lock held: it must only schedule work (the feeds that
    /// Deliver the peers' shares into it). The scan ends when its last
    /// subscriber leaves; hold it weakly.
    SweepScanHook on_sweep_scan;
  };
  /// Makes the reservoir and starts the read engine the scans share (woken
  /// whenever a slot is released). Errors of Reservoir::Create and
  /// ReadEngine::Start. `options.reads.register_buffers` follows
  /// `options.scans.register_buffers`.
  static absl::StatusOr<std::unique_ptr<ScanRegistry>> Start(Options options);
  /// Every subscription must be gone. Stops the engine (reads in flight
  /// complete first), then frees the reservoir.
  ~ScanRegistry();

  /// A subscription: the scan and the subscriber id. Leaving (destruction)
  /// unsubscribes and returns the reservation.
  class Subscription {
   public:
    ~Subscription();
    SharedScan* scan() const { return scan_.get(); }
    uint64_t id() const { return id_; }
    /// The registry's helpers for copying batches, and its options.
    GatherPool* gather() const { return registry_->gather_.get(); }
    const ScanOptions& options() const { return registry_->options_; }

   private:
    friend class ScanRegistry;
    ScanRegistry* registry_ = nullptr;
    std::shared_ptr<SharedScan> scan_;
    uint64_t id_ = 0;
  };

  /// Joins (or starts) the scan of `spec`'s selection. `seed` and
  /// `sub.epoch` set a new scan's permutation. RESOURCE_EXHAUSTED when the
  /// reservoir cannot reserve window + lag blocks; INVALID_ARGUMENT for a
  /// bad selection; errno codes when a shard cannot be reopened.
  absl::StatusOr<std::unique_ptr<Subscription>> Subscribe(
      std::shared_ptr<const DatasetReader> reader, const std::string& dataset,
      const StreamSpec& spec, uint64_t seed, SubscriberSpec sub)
      ABSL_LOCKS_EXCLUDED(mu_);

  /// The layout a stream of `spec` gets (for validating resume tokens
  /// before subscribing).
  absl::StatusOr<BlockLayout> Layout(const DatasetDesc& d,
                                     const StreamSpec& spec) const;

  /// Reserves `slots` reservoir slots for memory held outside the scans
  /// (a transport's buffers), taking back what laggards borrowed where the
  /// reservation needs it. RESOURCE_EXHAUSTED as Reservoir::Reserve; give
  /// them back with reservoir()->Unreserve.
  absl::Status Reserve(int64_t slots, const std::string& what)
      ABSL_LOCKS_EXCLUDED(mu_);

  const ScanOptions& options() const { return options_; }
  Reservoir* reservoir() const { return reservoir_.get(); }
  ReadEngine* engine() const { return engine_.get(); }
  const GatherPool& gather() const { return *gather_; }
  std::vector<ScanStatus> Status() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  ScanRegistry(ScanOptions options, SweepScanHook on_sweep)
      : options_(options), on_sweep_scan_(std::move(on_sweep)) {}
  void Leave(Subscription* s) ABSL_LOCKS_EXCLUDED(mu_);
  /// Takes back up to `limit` units of overflow lent beyond the
  /// reservations.
  void ReclaimOverflow(int64_t limit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// A scan's read found no free slot while overflow was lent elastically.
  void ReclaimUnderPressure() ABSL_LOCKS_EXCLUDED(mu_);

  // The engine stops before the reservoir its reads land in goes away.
  std::unique_ptr<Reservoir> reservoir_;
  std::unique_ptr<ReadEngine> engine_;
  std::unique_ptr<GatherPool> gather_;
  const ScanOptions options_;
  const SweepScanHook on_sweep_scan_;
  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<SharedScan>> scans_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace shardcast

#endif  // SHARDCAST_SERVER_ENGINE_SCAN_H_
