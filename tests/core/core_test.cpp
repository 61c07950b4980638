#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <random>

#include "loom/core/allocator.h"
#include "loom/core/bf16.h"
#include "loom/core/page_pool.h"
#include "loom/core/page_reservation.h"
#include "loom/core/philox.h"
#include "loom/core/slot_mapping.h"
#include "loom/core/tensor.h"
#include "loom/error.h"

using namespace loom;

TEST(Philox, MatchesThePublishedKnownAnswer) {
  // Random123's kat_vectors: philox4x32_10 with counter 0 and key 0.
  auto r = Philox::block(0, 0, 0);
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
}

TEST(Philox, ValueIsAPureFunctionOfSeedStreamAndIndex) {
  EXPECT_EQ(Philox::u32(7, 3, 1000), Philox::u32(7, 3, 1000));
  EXPECT_NE(Philox::u32(7, 3, 1000), Philox::u32(7, 3, 1001));
  EXPECT_NE(Philox::u32(7, 3, 1000), Philox::u32(8, 3, 1000));
  EXPECT_NE(Philox::u32(7, 3, 1000), Philox::u32(7, 4, 1000));
}

TEST(Philox, NormalHasUnitVarianceAndZeroMean) {
  double s = 0, s2 = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double x = Philox::normal(42, stream_of("w"), i);
    s += x;
    s2 += x * x;
  }
  EXPECT_NEAR(s / n, 0.0, 0.01);
  EXPECT_NEAR(s2 / n, 1.0, 0.01);
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is exactly half way between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);
  // 1 + 3 * 2^-8 is half way between 1 + 2^-7 and 1 + 2^-6: ties go to even (1 + 2^-6).
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(INFINITY))));
}

TEST(Bf16, StochasticRoundingIsUnbiased) {
  const float x = 1.0f + std::ldexp(1.0f, -9);  // a quarter of the way from 1 to the next bf16
  double mean = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) mean += bf16_to_f32(f32_to_bf16_stochastic(x, Philox::u32(1, 2, i) & 0xffff));
  EXPECT_NEAR(mean / n, x, 2e-5);
}

TEST(Allocator, TracksLiveAndPeakBytesPerCategory) {
  Allocator a;
  {
    Buffer p(a, 1000, MemCategory::Parameters);
    Buffer w(a, 500, MemCategory::Workspace);
    EXPECT_EQ(a.stats(MemCategory::Parameters).live, 1000u);
    EXPECT_EQ(a.total().live, 1500u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.data()) % Allocator::kAlignment, 0u);
  }
  EXPECT_EQ(a.total().live, 0u);
  EXPECT_EQ(a.total().peak, 1500u);
  EXPECT_EQ(a.stats(MemCategory::Workspace).peak, 500u);
  a.reset_peaks();
  EXPECT_EQ(a.total().peak, 0u);
}

// ZeRO-3's arenas: reserved address space that is backed only where written, and whose pages can be
// given back without moving any view into it.
TEST(PageReservation, BacksPagesOnWriteAndGivesBackOnlyWholePagesInsideARange) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE)), n = 64 * page;
  PageReservation r(n);
  EXPECT_EQ(r.resident_bytes(), 0u) << "nothing is backed before it is written";
  auto* f = static_cast<float*>(r.data());
  for (size_t i = 0; i < n / sizeof(float); ++i) f[i] = 1.0f + static_cast<float>(i);
  EXPECT_EQ(r.resident_bytes(), n);
  // [1.5 pages, 10.5 pages): pages 2..9 lie wholly inside; pages 1 and 10 straddle the ends.
  EXPECT_EQ(r.release(page + page / 2, 9 * page), 8 * page);
  EXPECT_EQ(r.resident_bytes(), n - 8 * page);
  const size_t per_page = page / sizeof(float);
  EXPECT_EQ(f[2 * per_page], 0.0f) << "a given-back page reads as zero";
  EXPECT_EQ(f[9 * per_page + 5], 0.0f);
  EXPECT_EQ(f[page / sizeof(float) + 1], 1.0f + static_cast<float>(per_page + 1)) << "straddling pages keep their data";
  EXPECT_EQ(f[10 * per_page + 1], 1.0f + static_cast<float>(10 * per_page + 1));
  EXPECT_EQ(r.release(page + 10, 100), 0u) << "less than a page inside: nothing to give back";
  EXPECT_THROW(r.release(n - page, 2 * page), Error);
  // Lazily given-back pages stay usable: the next write simply keeps them.
  EXPECT_EQ(r.release(20 * page, 4 * page, PageReservation::Release::Lazy), 4 * page);
  f[20 * per_page] = 7.0f;
  EXPECT_EQ(f[20 * per_page], 7.0f);
  PageReservation moved = std::move(r);
  EXPECT_EQ(moved.data(), static_cast<void*>(f));
  EXPECT_EQ(r.data(), nullptr);
}

// Moving pages hands their contents over without copying or faulting; the source stays addressable.
TEST(PageReservation, MovesPagesWithTheirContentsAndLeavesTheSourceReserved) {
  const size_t page = PageReservation::page_size(), n = 32 * page, per_page = page / sizeof(float);
  PageReservation r(n);
  auto* f = static_cast<float*>(r.data());
  for (size_t i = 0; i < 8 * per_page; ++i) f[i] = static_cast<float>(i);
  EXPECT_EQ(r.move_pages(0, 16 * page, 8 * page), 8 * page);
  EXPECT_EQ(r.resident_bytes(), 8 * page) << "pages moved, not copied";
  EXPECT_EQ(f[16 * per_page + 3], 3.0f);
  EXPECT_EQ(f[23 * per_page + 1], static_cast<float>(7 * per_page + 1));
  EXPECT_EQ(f[5], 0.0f) << "the source reads as fresh reserved memory";
  f[5] = 1.0f;  // and is writable
  // A range earlier moves cut into several mappings still moves (in pieces).
  EXPECT_EQ(r.move_pages(4 * page, 20 * page, 1 * page), 0u + page) << "from the moved block: a reserved page";
  EXPECT_EQ(r.move_pages(16 * page, 0, 8 * page), 8 * page);
  EXPECT_EQ(f[3], 3.0f);
  EXPECT_THROW(r.move_pages(1, 0, page), Error);
  EXPECT_THROW(r.move_pages(0, page, 2 * page), Error) << "overlapping ranges";
}

// ZeRO-3 hands one unit's given-back pages to the next unit: bounded by the capacity, in place when a
// unit is needed again, and given back whole on drain.
TEST(PagePool, HandsPagesOverUpToItsCapacityAndGivesTheRestBack) {
  const size_t page = PageReservation::page_size(), n = 64 * page;
  PageReservation r(n);
  auto* bytes = static_cast<unsigned char*>(r.data());
  std::memset(bytes, 1, 24 * page);  // three "units" of 8 pages at 0, 8 and 16 pages
  PagePool pool(r, 10 * page + 100, PageReservation::Release::Eager);
  EXPECT_EQ(pool.capacity(), 10 * page) << "whole pages only";
  EXPECT_EQ(pool.give(0, 8 * page), 8 * page);
  EXPECT_EQ(pool.give(8 * page + 10, 8 * page), 2 * page) << "7 whole pages inside, 2 fit, 5 go back";
  EXPECT_EQ(pool.pooled_bytes(), 10 * page);
  EXPECT_EQ(r.resident_bytes(), 24 * page - 5 * page);
  // A unit written at 32..40 pages gets pooled pages: nothing new is backed.
  EXPECT_EQ(pool.take(32 * page, 8 * page), 8 * page);
  EXPECT_EQ(r.resident_bytes(), 24 * page - 5 * page);
  std::memset(bytes + 32 * page, 2, 8 * page);
  EXPECT_EQ(r.resident_bytes(), 24 * page - 5 * page) << "the write landed on moved pages";
  EXPECT_EQ(pool.pooled_bytes(), 2 * page);
  // Given back and needed again at once: the pages stay where they are.
  EXPECT_EQ(pool.give(32 * page, 8 * page), 8 * page);
  EXPECT_EQ(pool.take(32 * page, 8 * page), 8 * page);
  EXPECT_EQ(bytes[32 * page + 7], 2) << "taken in place: nothing moved";
  EXPECT_EQ(pool.drain(), 2 * page);
  EXPECT_EQ(pool.pooled_bytes(), 0u);
  EXPECT_EQ(r.resident_bytes(), 24 * page - 5 * page - 2 * page);
  PagePool none(r, 0, PageReservation::Release::Eager);
  EXPECT_EQ(none.give(16 * page, 8 * page), 0u);
  EXPECT_EQ(r.resident_bytes(), 24 * page - 5 * page - 2 * page - 8 * page) << "capacity 0 passes everything back";
}

// Blocks that take turns share physical memory: parts mapped to one slot alias each other, parts in
// different slots do not, and nothing else of the reservation changes.
TEST(SlotMapping, PartsInOneSlotShareMemoryAndOtherSlotsDoNot) {
  const size_t page = PageReservation::page_size(), n = 32 * page;
  PageReservation r(n);
  auto* b = static_cast<unsigned char*>(r.data());
  b[0] = 7;  // outside any slot: private as before
  EXPECT_EQ(PageReservation::whole_pages(page + 1, 3 * page), (std::pair<size_t, size_t>{2 * page, 2 * page}));
  EXPECT_EQ(PageReservation::whole_pages(page + 1, page).second, 0u);
  SlotMapping slots(r, 2, 4 * page - 100);
  EXPECT_EQ(slots.slot_bytes(), 4 * page) << "whole pages";
  // "Block 1" = pages 4..6 + 10, "block 3" = pages 16..18 + 22 in slot 0; "block 2" = pages 24..28 in slot 1.
  EXPECT_EQ(slots.map(0, {{4 * page, 3 * page}, {10 * page, page}}), 4 * page);
  EXPECT_EQ(slots.map(0, {{16 * page, 3 * page}, {22 * page, page}}), 4 * page);
  EXPECT_EQ(slots.map(1, {{24 * page, 4 * page}}), 4 * page);
  b[4 * page + 5] = 1;
  b[10 * page + 9] = 2;
  b[24 * page + 5] = 3;
  EXPECT_EQ(b[16 * page + 5], 1) << "the same slot offset: one page of memory";
  EXPECT_EQ(b[22 * page + 9], 2);
  EXPECT_EQ(b[4 * page + 5 + 0], 1);
  b[16 * page + 5] = 9;
  EXPECT_EQ(b[4 * page + 5], 9);
  EXPECT_EQ(b[24 * page + 5], 3) << "another slot is other memory";
  EXPECT_EQ(b[0], 7);
  EXPECT_THROW(slots.map(1, {{0, 5 * page}}), Error) << "more than a slot";
  EXPECT_THROW(slots.map(2, {{0, page}}), Error);
}

TEST(Tensor, ViewsShareStorageAndCheckBounds) {
  Allocator a;
  Tensor t = Tensor::zeros({4, 3}, DType::F32, a, MemCategory::Activations);
  Tensor rows = t.slice(1, 3);
  rows.data<float>()[0] = 5.0f;
  EXPECT_EQ(t.data<float>()[3], 5.0f);
  EXPECT_EQ(rows.shape(), Shape({2, 3}));
  EXPECT_THROW(t.slice(2, 5), ShapeError);
  EXPECT_THROW(t.reshape({5, 2}), ShapeError);
  EXPECT_EQ(t.reshape({12}).numel(), 12);
  EXPECT_EQ(a.stats(MemCategory::Activations).live, 48u);
}
