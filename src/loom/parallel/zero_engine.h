// ZeRO's communication over the parameter arena, unit by unit (see spec::ShardPlan): reduce-scattering
// each unit's gradients into the ranks that own them, gathering the updated weights after the step
// (ZeRO-1/2), and under ZeRO-3 gathering each unit's weights just before use and giving the pages back
// after. It works on the arenas' raw addresses, which stay fixed for the run (sharded arenas are
// reserved address space, backed only where written), and charges the Allocator exactly what it keeps
// resident, so the memory report shows the sharding.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/core/allocator.h"
#include "loom/core/bf16.h"
#include "loom/core/page_pool.h"
#include "loom/core/page_reservation.h"
#include "loom/core/slot_mapping.h"
#include "loom/spec/shard_plan.h"
#include "loom/profile/tracer.h"

namespace loom::parallel {

using spec::ArenaRange;
using spec::ShardPlan;

struct ZeroArenas {
  float* master = nullptr;  // f32 [total]
  bf16* lowp = nullptr;     // bf16 [total] in bf16 mode, else nullptr
  float* grads = nullptr;   // f32 [total]
  // Reservations of the on-demand arenas (ZeRO-3: master and lowp; ZeRO-1/2 in bf16 mode: master;
  // ZeRO-2/3: grads); nullptr otherwise.
  PageReservation* master_pages = nullptr;
  PageReservation* lowp_pages = nullptr;
  PageReservation* grad_pages = nullptr;
  // How pages are given back (parallel.zero_release).
  PageReservation::Release release = PageReservation::Release::Lazy;
};

class ZeroEngine {
 public:
  // stage: 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters). f32_read: the arena ranges
  // (ascending) the model reads in f32 even in bf16 mode (norm gains, biases, embeddings): weight
  // gathers move those exactly beside the bf16 copies, so every layout computes with the same values.
  ZeroEngine(ShardPlan plan, int stage, ZeroArenas arenas, std::vector<ArenaRange> f32_read, comm::ProcessGroup& dp,
             Allocator& alloc, profile::Tracer* tracer = nullptr);
  ~ZeroEngine();
  ZeroEngine(const ZeroEngine&) = delete;
  ZeroEngine& operator=(const ZeroEngine&) = delete;

  const ShardPlan& plan() const { return plan_; }
  int stage() const { return stage_; }
  std::vector<ArenaRange> owned() const { return plan_.pieces(rank_); }

  // ---- ZeRO-3 weights ----
  // Issues the all-gather of unit u's weights (bf16 copies in bf16 mode) unless gathered or under way.
  void prefetch(size_t u);
  // Unit u's weights are readable on return (gathered; in bf16 mode the f32-read elements unpacked).
  void require(size_t u);
  // Gives back unit u's gathered pages; this rank's piece stays.
  void release(size_t u);
  void release_all();
  // Where the masters are sharded: every unit's exact f32 masters on dp rank `root` (a checkpoint is
  // being written; the other ranks only send their pieces, so they need no memory for it);
  // release_all() afterwards on every rank.
  void gather_full_masters(int root);

  // ---- gradients ----
  // ZeRO-2/3, before unit u's gradients are first written in a micro-batch: clears the elements other
  // ranks own (this rank's piece keeps accumulating across micro-batches).
  void zero_unit_grads(size_t u);
  // Issues the sum of unit u's gradients over the dp group into the owners' pieces.
  void reduce_unit(size_t u);
  // Waits for unit u's reduction; ZeRO-2/3 give the pages other ranks own back.
  void finish_unit(size_t u);
  // finish_unit for every unit reduced and not yet finished.
  void finish_all();
  // Clears this rank's gradient pieces (the accumulator), at the start of a step; returns the floats
  // zeroed.
  int64_t zero_owned_grads();

  // ---- ZeRO-1/2 after the optimizer step ----
  // Every rank updated its pieces of the weights; all of them need all of it: the f32 masters, or, when
  // the masters are sharded (bf16 mode), the bf16 copies and the f32-read elements.
  void all_gather_masters();
  // ZeRO-1/2 with sharded masters, after the masters were written whole (initialisation, a checkpoint
  // load): gives back the pages of other ranks' masters that the model never reads in f32.
  void drop_unowned_masters();
  bool masters_sharded() const { return a_.master_pages != nullptr; }

  // Wall seconds the calling thread spent waiting for this engine's collectives (cumulative).
  double wait_seconds() const { return wait_seconds_; }

 private:
  enum class Held { Sharded, InFlight, Gathered };
  // Shared by ZeRO-3's gathers and ZeRO-1/2's sharded-master gather (no accounting here).
  void issue_gather(size_t u);     // starts unit u's gather
  void complete_gather(size_t u);  // waits for it and unpacks the f32-read elements
  // Scratch for a collective: the group's registered memory when it has room (read in place by the
  // collective, its pages backed once and reused), else the allocator's.
  struct Scratch {
    comm::RegisteredBuffer registered;
    Buffer plain;
    void* data() const { return registered.size() ? static_cast<void*>(registered.data()) : plain.data(); }
  };
  Scratch scratch(size_t bytes);
  // Bytes charged for unit u's gradient scratch while it is resident (its slot's pages aside).
  int64_t grad_scratch_bytes(size_t u) const;
  // The parts of unit u this rank does not own (before and after its piece).
  std::pair<ArenaRange, ArenaRange> others(size_t u) const;
  // Elements of `r` the model reads in f32.
  int64_t f32_within(const ArenaRange& r) const;
  void charge(MemCategory c, int64_t bytes);
  // Lazy release: the pages one unit gives back go to the next unit that needs them (PagePool) --
  // ZeRO-3's gathered weights (bf16 copies, or f32 masters in f32 mode), in bf16 mode also the f32-read
  // masters the gathers unpack, and ZeRO-2/3's gradient scratch. What a pool holds is charged to its
  // category.
  // Lazy release, blocks: the non-owned pages of block u live in slot u mod 2 for good (SlotMapping),
  // for ZeRO-3's bf16 copies and ZeRO-2/3's gradient scratch; the pools below then serve only the other
  // units (embeddings, head) and the f32 arenas.
  struct Aliased {
    std::unique_ptr<SlotMapping> slots;
    std::vector<int> slot_of;             // per unit: its slot, or -1 (not aliased)
    std::vector<int64_t> aliased_bytes;   // per unit: bytes that live in its slot
    std::vector<int> holder;              // per slot: the unit live in it now, or -1
    bool has(size_t u) const { return slots && slot_of[u] >= 0; }
  };
  void make_alias(Aliased& a, PageReservation* pages, size_t element, MemCategory c);
  // Marks unit u live in its slot; throws if another unit sharing it is still live (`live(v)`).
  template <class Live>
  void claim_slot(Aliased& a, size_t u, Live&& live, const char* what);
  void free_slot(Aliased& a, size_t u);  // unit u no longer uses its slot
  struct Pooled {
    const Aliased* alias = nullptr;  // units it aliases are not pooled
    std::unique_ptr<PagePool> pool;
    size_t element = 0;      // bytes per element of its arena
    bool f32_only = false;   // serves only the elements read in f32 (the masters in bf16 mode)
    MemCategory category = MemCategory::Parameters;
  };
  // The element ranges of unit u a pool serves: the non-owned parts, or the f32-read elements in them.
  std::vector<ArenaRange> pooled_ranges(const Pooled& p, size_t u) const;
  void make_pool(Pooled& p, PageReservation* pages, size_t element, bool f32_only, MemCategory c);
  void give_pages(Pooled& p, size_t u);
  void take_pages(Pooled& p, size_t u);
  void drain(Pooled& p);
  // Gives back the pages of the masters in `r` (non-owned) outside the f32-read elements: outside their
  // whole pages when `keep_whole_pages_only` (ZeRO-3 in bf16: those pages are the master pool's), else
  // outside every page they touch (ZeRO-1/2 keep reading them).
  void release_masters_outside_f32(const ArenaRange& r, bool keep_whole_pages_only);
  // Waits for w; the time is exposed communication (a span named `what` in the trace).
  void wait(comm::Work& w, const char* what);

  ShardPlan plan_;
  int stage_;
  ZeroArenas a_;
  std::vector<ArenaRange> f32_;
  comm::ProcessGroup& dp_;
  Allocator& alloc_;
  profile::Tracer* tracer_;
  int rank_;
  int64_t own_param_bytes_ = 0, own_grad_bytes_ = 0;  // charged for this rank's pieces
  std::vector<Held> held_;
  std::vector<int64_t> charged_;                      // bytes charged for unit u's gathered weights
  std::vector<comm::Work> gather_, gather_f32_;
  // bf16 mode: the f32-read elements of a unit in flight, this rank's packed and everyone's gathered.
  std::vector<Scratch> f32_send_, f32_recv_;
  std::vector<std::vector<comm::Work>> reducing_;  // per unit, empty when finished
  std::vector<bool> grad_scratch_;                  // ZeRO-2/3: unit's non-owned gradients resident
  std::vector<size_t> reduce_order_;                // units reduced and not finished, oldest first
  bool full_masters_ = false;                       // gather_full_masters() ran here; lowp not gathered
  // Pools (empty `pool` under eager release: pages then follow the sharding exactly).
  Aliased lowp_alias_, grad_alias_;
  std::vector<std::pair<MemCategory, int64_t>> slot_charge_;  // charged for the slots, for good
  Pooled weight_pool_, master_pool_, grad_pool_;
  double wait_seconds_ = 0;
};

}  // namespace loom::parallel
