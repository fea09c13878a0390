#include "server/engine/reservoir.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardcast {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

std::unique_ptr<Reservoir> MakeReservoir(uint64_t bytes, uint64_t slot_bytes,
                                         Prefault prefault = Prefault::kOff,
                                         bool start = true) {
  ReservoirOptions o;
  o.bytes = bytes;
  o.slot_bytes = slot_bytes;
  o.prefault = prefault;
  absl::StatusOr<std::unique_ptr<Reservoir>> r = Reservoir::Create(o);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return nullptr;
  if (start) (*r)->StartPrefault();
  return std::move(*r);
}

// Pages of [p, p + bytes) that are resident, per mincore(2).
size_t ResidentPages(const char* p, uint64_t bytes) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((bytes + page - 1) / page);
  EXPECT_EQ(::mincore(const_cast<char*>(p), bytes, vec.data()), 0);
  return static_cast<size_t>(std::count_if(
      vec.begin(), vec.end(), [](unsigned char c) { return (c & 1) != 0; }));
}

TEST(Reservoir, SlotsAreHandedOutLowestIndexFirst) {
  auto r = MakeReservoir(4 * 64 * kKiB, 64 * kKiB);
  ASSERT_NE(r, nullptr);
  ASSERT_EQ(r->num_slots(), 4);
  for (int32_t want = 0; want < 4; ++want) {
    std::optional<int32_t> slot = r->TryAcquire();
    ASSERT_TRUE(slot.has_value());
    EXPECT_EQ(*slot, want);
  }
  EXPECT_EQ(r->slots_in_use(), 4);
}

TEST(Reservoir, TryAcquireReturnsNothingWhenAllSlotsAreInUse) {
  auto r = MakeReservoir(3 * 4 * kKiB, 4 * kKiB);
  ASSERT_NE(r, nullptr);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(r->TryAcquire().has_value());
  EXPECT_FALSE(r->TryAcquire().has_value());
  EXPECT_FALSE(r->TryAcquire().has_value());  // and stays so
  EXPECT_EQ(r->slots_in_use(), 3);
}

TEST(Reservoir, ReleasedSlotsAreReusedLowestIndexFirst) {
  auto r = MakeReservoir(5 * 4 * kKiB, 4 * kKiB);
  ASSERT_NE(r, nullptr);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(r->TryAcquire().has_value());
  r->Release(3);
  r->Release(1);
  r->Release(4);
  EXPECT_EQ(r->slots_in_use(), 2);
  EXPECT_EQ(r->TryAcquire(), std::optional<int32_t>(1));
  EXPECT_EQ(r->TryAcquire(), std::optional<int32_t>(3));
  EXPECT_EQ(r->TryAcquire(), std::optional<int32_t>(4));
  EXPECT_FALSE(r->TryAcquire().has_value());
}

TEST(Reservoir, ASlotReleasedWhileLowerOnesAreFreeIsNotPreferred) {
  auto r = MakeReservoir(4 * 4 * kKiB, 4 * kKiB);
  ASSERT_NE(r, nullptr);
  ASSERT_EQ(r->TryAcquire(), std::optional<int32_t>(0));
  ASSERT_EQ(r->TryAcquire(), std::optional<int32_t>(1));
  r->Release(1);  // 1, 2, 3 free: the warm slot 1 comes first again
  EXPECT_EQ(r->TryAcquire(), std::optional<int32_t>(1));
  r->Release(0);
  EXPECT_EQ(r->TryAcquire(), std::optional<int32_t>(0));
  EXPECT_EQ(r->TryAcquire(), std::optional<int32_t>(2));
}

TEST(Reservoir, ReleaseCallsTheListenerAfterTheSlotIsBackWithoutLocksHeld) {
  auto r = MakeReservoir(4 * 4 * kKiB, 4 * kKiB);
  ASSERT_NE(r, nullptr);
  int calls = 0;
  std::vector<int64_t> in_use_seen;
  Reservoir* raw = r.get();
  // The listener queries the reservoir: this would deadlock if Release
  // still held its mutex, and shows the slot is already back.
  r->SetReleaseListener([&calls, &in_use_seen, raw] {
    ++calls;
    in_use_seen.push_back(raw->slots_in_use());
  });
  ASSERT_TRUE(r->TryAcquire().has_value());
  ASSERT_TRUE(r->TryAcquire().has_value());
  EXPECT_EQ(calls, 0);  // acquiring does not call it
  r->Release(0);
  r->Release(1);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(in_use_seen, (std::vector<int64_t>{1, 0}));
}

TEST(Reservoir, ReleaseWithoutAListenerIsFine) {
  auto r = MakeReservoir(2 * 4 * kKiB, 4 * kKiB);
  ASSERT_NE(r, nullptr);
  ASSERT_EQ(r->TryAcquire(), std::optional<int32_t>(0));
  r->Release(0);
  EXPECT_EQ(r->slots_in_use(), 0);
}

TEST(Reservoir, ReserveBeyondCapacityIsResourceExhaustedNamingFlagAndNumbers) {
  // 10 slots of 1 MiB.
  auto r = MakeReservoir(10 * kMiB, 1 * kMiB);
  ASSERT_NE(r, nullptr);
  ASSERT_EQ(r->num_slots(), 10);
  ASSERT_TRUE(r->Reserve(7, "first stream").ok());
  absl::Status st = r->Reserve(4, "shuffle window 3 + lag bound 1");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  const std::string msg(st.message());
  EXPECT_THAT(msg, HasSubstr("--reservoir-bytes"));
  EXPECT_THAT(msg, HasSubstr("needs 4 blocks of 1 MiB"));
  EXPECT_THAT(msg, HasSubstr("shuffle window 3 + lag bound 1"));
  EXPECT_THAT(msg, HasSubstr("only 3 of the reservoir's 10 (10 MiB"));
  // A refusal reserves nothing.
  EXPECT_EQ(r->slots_reserved(), 7);
  EXPECT_TRUE(r->Reserve(3, "fits exactly").ok());
  EXPECT_EQ(r->slots_reserved(), 10);
  EXPECT_EQ(r->Reserve(1, "one more").code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(Reservoir, ReserveMoreThanTheWholePoolIsRefusedEvenWhenEmpty) {
  auto r = MakeReservoir(4 * kMiB, 1 * kMiB);
  ASSERT_NE(r, nullptr);
  absl::Status st = r->Reserve(5, "a large window");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("needs 5 blocks"));
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("only 4 of the reservoir's 4"));
  EXPECT_EQ(r->slots_reserved(), 0);
}

TEST(Reservoir, UnreserveGivesRoomBack) {
  auto r = MakeReservoir(6 * kMiB, 1 * kMiB);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->Reserve(4, "a").ok());
  ASSERT_TRUE(r->Reserve(2, "b").ok());
  ASSERT_FALSE(r->Reserve(1, "c").ok());
  r->Unreserve(4);
  EXPECT_EQ(r->slots_reserved(), 2);
  EXPECT_TRUE(r->Reserve(4, "c").ok());
  EXPECT_EQ(r->slots_reserved(), 6);
  r->Unreserve(4);
  r->Unreserve(2);
  EXPECT_EQ(r->slots_reserved(), 0);
  EXPECT_TRUE(r->Reserve(6, "all").ok());
}

TEST(Reservoir, ReservationsAreIndependentOfSlotsInUse) {
  auto r = MakeReservoir(2 * kMiB, 1 * kMiB);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->TryAcquire().has_value());
  ASSERT_TRUE(r->TryAcquire().has_value());
  EXPECT_TRUE(r->Reserve(2, "a").ok());
  r->Unreserve(2);
  EXPECT_EQ(r->slots_in_use(), 2);
}

// The refusal must state the block size it counts in. With --block-bytes
// below 1 MiB (allowed: 64-byte multiples) "%.0f MiB" rounds it to 0.
TEST(Reservoir, ReserveRefusalNamesTheBlockSizeInReadableUnits) {
  auto r = MakeReservoir(16 * 256 * kKiB, 256 * kKiB);
  ASSERT_NE(r, nullptr);
  absl::Status st = r->Reserve(17, "shuffle window 16 + lag bound 1");
  ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("blocks of 256 KiB")) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("(4 MiB,")) << st;
}

TEST(Reservoir, FewerThanTwoSlotsIsInvalidArgumentNamingTheFlag) {
  for (uint64_t bytes : {uint64_t{0}, uint64_t{4096}, uint64_t{2 * 4096 - 1}}) {
    ReservoirOptions o;
    o.bytes = bytes;
    o.slot_bytes = 4096;
    absl::StatusOr<std::unique_ptr<Reservoir>> r = Reservoir::Create(o);
    ASSERT_FALSE(r.ok()) << bytes;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr("--reservoir-bytes"));
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("8192"));
  }
  auto two = MakeReservoir(2 * 4096, 4096);
  ASSERT_NE(two, nullptr);
  EXPECT_EQ(two->num_slots(), 2);
}

TEST(Reservoir, SlotBytesAreRoundedUpToSixtyFourAndBytesDownToWholeSlots) {
  struct Case {
    uint64_t bytes, slot_bytes;
    uint64_t want_slot_bytes;
    int64_t want_slots;
  };
  // want_* worked out by hand: slot = ceil(slot_bytes / 64) * 64 (at least
  // 64), slots = floor(bytes / slot).
  const Case cases[] = {
      {10000, 100, 128, 78},  // 78 * 128 = 9984 <= 10000 < 79 * 128
      {10000, 64, 64, 156},   // 156 * 64 = 9984
      {10000, 65, 128, 78},   //
      {1000, 1, 64, 15},      // 15 * 64 = 960
      {1000, 0, 64, 15},      //
      {1 << 20, 4096, 4096, 256}, {(1 << 20) + 4095, 4096, 4096, 256},
      {3 * 4160, 4097, 4160, 3},  // 4097 -> 65 * 64 = 4160
  };
  for (const Case& c : cases) {
    auto r = MakeReservoir(c.bytes, c.slot_bytes);
    ASSERT_NE(r, nullptr) << c.bytes << " / " << c.slot_bytes;
    EXPECT_EQ(r->slot_bytes(), c.want_slot_bytes)
        << c.bytes << " / " << c.slot_bytes;
    EXPECT_EQ(r->num_slots(), c.want_slots) << c.bytes << " / " << c.slot_bytes;
    EXPECT_EQ(r->bytes(), c.want_slot_bytes * c.want_slots);
  }
}

TEST(Reservoir, SlotDataIsDistinctInsideTheMappingAndWritableThroughout) {
  // 65 * 64 bytes: slots are cache-line but not page multiples.
  auto r = MakeReservoir(9 * 4160 + 100, 4097);
  ASSERT_NE(r, nullptr);
  const int64_t n = r->num_slots();
  ASSERT_EQ(n, 9);
  const uint64_t size = r->slot_bytes();
  const char* begin = r->base();
  const char* end = r->base() + r->bytes();
  std::vector<char*> ptrs;
  for (int32_t s = 0; s < n; ++s) {
    char* p = r->slot_data(s);
    ASSERT_GE(p, begin) << s;
    ASSERT_LE(p + size, end) << s;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << s;
    ptrs.push_back(p);
  }
  std::vector<char*> sorted = ptrs;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i) {
    ASSERT_GE(static_cast<uint64_t>(sorted[i] - sorted[i - 1]), size)
        << "slots overlap";
  }
  // Fill every slot completely with its own pattern, then check none was
  // overwritten by a neighbour.
  for (int32_t s = 0; s < n; ++s) {
    std::memset(ptrs[s], 'a' + s, size);
  }
  for (int32_t s = 0; s < n; ++s) {
    const char* p = ptrs[s];
    for (uint64_t i = 0; i < size; ++i) {
      if (p[i] != static_cast<char>('a' + s)) {
        FAIL() << "slot " << s << " byte " << i;
      }
    }
  }
}

TEST(Reservoir, PagesAreTouchedOnlyWhenUsedUnlessPrefaulted) {
  const uint64_t bytes = 8 * 64 * kKiB;
  auto lazy = MakeReservoir(bytes, 64 * kKiB);
  ASSERT_NE(lazy, nullptr);
  EXPECT_EQ(ResidentPages(lazy->base(), lazy->bytes()), 0u);
  std::memset(lazy->slot_data(0), 1, 4096);
  EXPECT_GE(ResidentPages(lazy->base(), lazy->bytes()), 1u);

  auto eager = MakeReservoir(bytes, 64 * kKiB, Prefault::kStart);
  ASSERT_NE(eager, nullptr);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(ResidentPages(eager->base(), eager->bytes()),
            eager->bytes() / page);
}

TEST(Reservoir, ParkedSlotsGiveTheirPagesBackAndAreNotHandedOut) {
  // 8 prefaulted slots of 64 KiB; a lease of 3 parks the 3 highest free.
  auto r = MakeReservoir(8 * 64 * kKiB, 64 * kKiB, Prefault::kStart);
  ASSERT_NE(r, nullptr);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t slot_pages = 64 * kKiB / page;
  ASSERT_TRUE(r->Reserve(3, "a lease").ok());
  r->Park(3);
  EXPECT_EQ(r->slots_parked(), 3);
  EXPECT_EQ(r->slots_in_use(), 0);
  EXPECT_EQ(ResidentPages(r->base(), r->bytes()), 5 * slot_pages);
  for (int32_t s = 5; s < 8; ++s) {
    EXPECT_EQ(ResidentPages(r->slot_data(s), 64 * kKiB), 0u) << s;
  }
  std::vector<int32_t> got;
  while (std::optional<int32_t> s = r->TryAcquire()) got.push_back(*s);
  EXPECT_EQ(got, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  for (int32_t s : got) r->Release(s);
  r->Unpark(3);
  r->Unreserve(3);
  EXPECT_EQ(r->slots_parked(), 0);
  got.clear();
  while (std::optional<int32_t> s = r->TryAcquire()) got.push_back(*s);
  EXPECT_EQ(got.size(), 8u);
  for (int32_t s : got) r->Release(s);
}

TEST(Reservoir, SlotsInUseWhenParkingAreParkedAsTheyAreReleased) {
  auto r = MakeReservoir(4 * 64 * kKiB, 64 * kKiB, Prefault::kStart);
  ASSERT_NE(r, nullptr);
  std::vector<int32_t> held;
  while (std::optional<int32_t> s = r->TryAcquire()) held.push_back(*s);
  ASSERT_EQ(held.size(), 4u);
  r->Park(2);  // nothing free: owed
  EXPECT_EQ(r->slots_parked(), 0);
  r->Release(held[0]);
  r->Release(held[1]);
  EXPECT_EQ(r->slots_parked(), 2);
  EXPECT_EQ(ResidentPages(r->slot_data(held[0]), 64 * kKiB), 0u);
  EXPECT_FALSE(r->TryAcquire().has_value());  // parked, not free
  r->Release(held[2]);
  EXPECT_EQ(r->TryAcquire(), std::optional<int32_t>(held[2]));
  // Unparking more than was parked cancels what is still owed first.
  r->Park(1);
  r->Unpark(3);
  EXPECT_EQ(r->slots_parked(), 0);
  r->Release(held[2]);
  r->Release(held[3]);
  EXPECT_EQ(r->slots_in_use(), 0);
}

TEST(Reservoir, ParkingASlotSmallerThanAPageLeavesItsNeighboursData) {
  // 2 KiB slots: two share each page. Parking one must not zero the other.
  auto r = MakeReservoir(8 * 2 * kKiB, 2 * kKiB);
  ASSERT_NE(r, nullptr);
  std::vector<int32_t> held;
  while (std::optional<int32_t> s = r->TryAcquire()) held.push_back(*s);
  for (int32_t s : held) std::memset(r->slot_data(s), 'a' + s, 2 * kKiB);
  r->Park(1);
  r->Release(held[6]);  // shares its page with slot 7
  EXPECT_EQ(r->slots_parked(), 1);
  for (uint64_t i = 0; i < 2 * kKiB; ++i) {
    ASSERT_EQ(r->slot_data(held[7])[i], 'a' + held[7]) << i;
  }
  // A slot of 6 KiB spans one whole page and parts of two others: only the
  // whole page is given back.
  auto wide = MakeReservoir(4 * 6 * kKiB, 6 * kKiB);
  ASSERT_NE(wide, nullptr);
  std::vector<int32_t> wide_held;
  while (std::optional<int32_t> s = wide->TryAcquire()) wide_held.push_back(*s);
  ASSERT_EQ(wide_held.size(), 4u);
  for (int32_t s : wide_held) {
    std::memset(wide->slot_data(s), 'a' + s, 6 * kKiB);
  }
  wide->Park(1);
  wide->Release(wide_held[1]);
  for (int32_t s : {wide_held[0], wide_held[2]}) {
    for (uint64_t i = 0; i < 6 * kKiB; ++i) {
      ASSERT_EQ(wide->slot_data(s)[i], 'a' + s) << s << " " << i;
    }
  }
  for (int32_t s : wide_held) {
    if (s != wide_held[1]) wide->Release(s);
  }
  for (int32_t s : held) {
    if (s != held[6]) r->Release(s);
  }
}

// Polls `done` for up to 20 s (the prefault thread runs at nice 19).
bool Eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 2000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

TEST(Reservoir, BackgroundPrefaultTouchesEveryFreeSlotAndCountsIt) {
  auto r = MakeReservoir(16 * 256 * kKiB, 256 * kKiB, Prefault::kBackground);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(Eventually([&] { return r->slots_touched() == 16; }))
      << r->slots_touched() << " of 16 slots touched";
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(ResidentPages(r->base(), r->bytes()), r->bytes() / page);
  EXPECT_EQ(r->slots_in_use(), 0);
  // Every slot came back to the pool, lowest first.
  std::vector<int32_t> got;
  while (std::optional<int32_t> s = r->TryAcquire()) got.push_back(*s);
  ASSERT_EQ(got.size(), 16u);
  for (int32_t i = 0; i < 16; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], i);
  for (int32_t s : got) r->Release(s);
}

TEST(Reservoir, SlotsHandedOutBeforeThePrefaultCountAsTouched) {
  auto r = MakeReservoir(4 * 64 * kKiB, 64 * kKiB);  // no prefault
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->slots_touched(), 0);
  std::optional<int32_t> a = r->TryAcquire();
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(r->slots_touched(), 1);
  r->Release(*a);
  EXPECT_EQ(r->slots_touched(), 1);
  auto eager = MakeReservoir(4 * 64 * kKiB, 64 * kKiB, Prefault::kStart);
  ASSERT_NE(eager, nullptr);
  EXPECT_EQ(eager->slots_touched(), 4);
}

TEST(Reservoir, PinnedSlotsStayTouchedWhenParked) {
  // Registered with io_uring: every page is in memory and stays there.
  auto r = MakeReservoir(4 * 64 * kKiB, 64 * kKiB);
  ASSERT_NE(r, nullptr);
  r->SetPinned();
  EXPECT_EQ(r->slots_touched(), 4);
  ASSERT_TRUE(r->Reserve(2, "a lease").ok());
  r->Park(2);
  EXPECT_EQ(r->slots_touched(), 4);
  r->Unpark(2);
  r->Unreserve(2);
}

TEST(Reservoir, BackgroundPrefaultLeavesParkedSlotsAloneUntilUnparked) {
  // The region's memory must not be taken back by the prefault. 64 slots of
  // 256 KiB, the top 8 parked; the reservation is dropped (the engine keeps
  // it while parked) so that the prefault runs meanwhile.
  // Parked before the prefault starts: a prefault thread that ran ahead of
  // this test (TSan, a loaded machine) made the outcome a race.
  auto r = MakeReservoir(64 * 256 * kKiB, 256 * kKiB, Prefault::kBackground,
                         /*start=*/false);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->Reserve(8, "a lease").ok());
  r->Park(8);
  r->Unreserve(8);
  r->StartPrefault();
  ASSERT_TRUE(Eventually([&] { return r->slots_touched() == 56; }))
      << r->slots_touched() << " of 56 slots touched";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(r->slots_touched(), 56);
  for (int32_t s = 56; s < 64; ++s) {
    EXPECT_EQ(ResidentPages(r->slot_data(s), 256 * kKiB), 0u) << s;
  }
  r->Unpark(8);
  ASSERT_TRUE(Eventually([&] { return r->slots_touched() == 64; }))
      << r->slots_touched() << " of 64 slots touched after unparking";
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(ResidentPages(r->slot_data(56), 8 * 256 * kKiB),
            8 * 256 * kKiB / page);
  // Parked again, touched slots give their pages back and stop counting.
  ASSERT_TRUE(r->Reserve(2, "another lease").ok());
  r->Park(2);
  EXPECT_EQ(r->slots_touched(), 62);
  r->Unpark(2);
  r->Unreserve(2);
}

TEST(Reservoir, BackgroundPrefaultPausesWhileAnythingIsReserved) {
  // 128 slots of 256 KiB: more than the thread touches before Reserve, and
  // little enough for a nice-19 thread on a loaded machine (CI runs tests
  // in parallel) to finish within Eventually's 20 s.
  // Reserved before the prefault starts: one that ran ahead of this test
  // (TSan, a loaded machine) had touched all 128 slots before Reserve, 1 run
  // in 10 under TSan.
  auto r = MakeReservoir(128 * 256 * kKiB, 256 * kKiB, Prefault::kBackground,
                         /*start=*/false);
  ASSERT_NE(r, nullptr);
  ASSERT_TRUE(r->Reserve(1, "a stream").ok());
  r->StartPrefault();
  const int64_t at_reserve = r->slots_touched();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // The slot being touched at Reserve may still be finished (one step).
  EXPECT_LE(r->slots_touched(), at_reserve + 1);
  EXPECT_LT(r->slots_touched(), 128);
  r->Unreserve(1);
  ASSERT_TRUE(Eventually([&] { return r->slots_touched() == 128; }))
      << r->slots_touched() << " of 128 slots touched after the stream";
}

TEST(Reservoir, DestroyingAReservoirStopsItsPrefaultAtOnce) {
  // 1 GiB: far more than the thread touches before the destructor runs.
  auto r = MakeReservoir(1ull << 30, 4 * kMiB, Prefault::kBackground);
  ASSERT_NE(r, nullptr);
  const auto start = std::chrono::steady_clock::now();
  r->StopPrefault();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  const int64_t touched = r->slots_touched();
  EXPECT_LT(touched, r->num_slots()) << "stopped only when done";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(r->slots_touched(), touched) << "still touching after the stop";
  r.reset();
}

void ConcurrentAcquireAndRelease(Prefault prefault);

TEST(Reservoir, ConcurrentAcquireAndReleaseNeverShareASlot) {
  for (Prefault prefault : {Prefault::kOff, Prefault::kBackground}) {
    SCOPED_TRACE(prefault == Prefault::kOff ? "no prefault" : "background");
    ConcurrentAcquireAndRelease(prefault);
  }
}

void ConcurrentAcquireAndRelease(Prefault prefault) {
  // With the prefault, 64 KiB slots: its thread takes slots out of the pool
  // while the others acquire them.
  // Before the reservoir: its prefault thread may call the listener until
  // the reservoir is destroyed.
  std::atomic<int> releases{0};
  auto r = prefault == Prefault::kOff
               ? MakeReservoir(8 * 4096, 4096)
               : MakeReservoir(8 * 64 * kKiB, 64 * kKiB, prefault,
                               /*start=*/false);
  ASSERT_NE(r, nullptr);
  r->SetReleaseListener([&releases] { releases++; });
  r->StartPrefault();  // after the listener, as the daemon does
  std::vector<std::atomic<int>> owners(8);
  for (auto& o : owners) o = 0;
  std::atomic<bool> shared{false};
  constexpr int kThreads = 4, kRounds = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        std::optional<int32_t> s = r->TryAcquire();
        if (!s.has_value()) continue;
        if (owners[static_cast<size_t>(*s)].fetch_add(1) != 0) shared = true;
        owners[static_cast<size_t>(*s)].fetch_sub(1);
        r->Release(*s);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(shared.load());
  EXPECT_EQ(r->slots_in_use(), 0);
  EXPECT_GT(releases.load(), 0);
}

}  // namespace
}  // namespace shardcast
