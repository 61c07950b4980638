// Data parallelism behind one interface, whatever the strategy: alone (nothing to do), DDP (gradient
// buckets all-reduced under backward, parallel::GradBuckets) or ZeRO 1-3 (each rank owns spec::ShardPlan
// pieces of the arena, parallel::ZeroEngine). The Trainer drives a step through these calls and never
// asks which strategy runs; parallel::make_data_parallel picks it from the dp group and the ZeRO stage.
//
// Life cycle: make_data_parallel -> arena_needs() (how the parameter store must back its arenas, before
// it exists) -> attach(arenas) -> per step: begin_step, per micro-batch begin_micro_batch and the unit
// calls around forward and backward, finish_gradients, (optimizer) after_optimizer_step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/core/tensor.h"
#include "loom/parallel/zero_engine.h"
#include "loom/spec/param_table.h"

namespace loom::parallel {

struct DataParallelSetup {
  const spec::ParamTable* table = nullptr;  // this rank's (tp shard of the) parameter table; copied
  int64_t n_layers = 0;
  bool bf16 = false;                         // bf16 compute copies beside the f32 masters
  bool bf16_only = false;                    // bf16-pure: the bf16 arena is the weights, no f32 masters
  int zero_stage = 0;                        // 0 (DDP) .. 3; alone every stage is the plain run
  size_t bucket_bytes = 4 << 20;             // DDP: gradient bytes per all-reduce (0: one after backward)
  PageReservation::Release release = PageReservation::Release::Lazy;  // ZeRO-2/3 page give-back
  // Expert parallelism: the routed experts' weights (spec::expert_ranges) are reduced over (and under
  // ZeRO sharded over) the ranks holding the same experts instead of every replica (a group of one
  // where no other rank holds them).
  bool experts_split = false;
  comm::ProcessGroup* expert_replicas = nullptr;
};

// How the parameter store must back its arenas (reserved address space backed on demand, or whole),
// and memory for the gradient arena that collectives read in place (the dp group's registered memory;
// empty when there is none or the group's arena is full). The caller keeps `grads_memory` alive for as
// long as the store.
struct ArenaNeeds {
  bool master_on_demand = false, lowp_on_demand = false, grads_on_demand = false;
  comm::RegisteredBuffer grads_memory;
};

// Which of this rank's state its replicas hold alike (what --check-replicas may compare).
struct ReplicatedState {
  bool weights = false;         // the f32 masters (or, when only their pieces are kept, the bf16 copies)
  bool weights_as_lowp = false; // compare the bf16 copies instead of the masters
  bool moments = false;         // the AdamW moments
};

class DataParallel {
 public:
  virtual ~DataParallel() = default;

  // The dp group's size and this rank's place in it (1 and 0 alone).
  virtual int size() const { return 1; }
  virtual int rank() const { return 0; }
  // ZeRO stage in effect (0: DDP or alone).
  virtual int stage() const { return 0; }

  virtual ArenaNeeds arena_needs() { return {}; }
  // The arena ranges whose optimizer state this rank owns, and whose weights it holds at rest (empty:
  // all of it).
  virtual std::vector<spec::ArenaRange> optimizer_pieces() const { return {}; }
  virtual std::vector<spec::ArenaRange> weights_held() const { return {}; }
  // The store's arenas, once built (and initialised).
  virtual void attach(const ZeroArenas& arenas) { grads_ = arenas.grads, total_ = table_total_; }

  // ---- a step ----
  // Clears the gradients that accumulate over the step's micro-batches (all, or this rank's pieces);
  // returns how many floats it zeroed.
  virtual int64_t begin_step();
  // Before each forward. training: a backward follows; last: the step's last micro-batch.
  virtual void begin_micro_batch(bool /*training*/, bool /*last*/) {}
  // Around each unit (model::LayerHooks' units: -1 embeddings, 0..L-1 blocks, L final norm + head).
  virtual void before_forward(int64_t /*unit*/) {}
  virtual void after_forward(int64_t /*unit*/) {}
  virtual void before_backward(int64_t /*unit*/) {}
  virtual void after_backward(int64_t /*unit*/) {}
  // After the last backward: every reduction has landed.
  virtual void finish_gradients() {}
  // The arena ranges where this rank holds the group-summed gradient (the whole arena, or its pieces),
  // and whether a sum over them must be summed over the group to cover the model.
  virtual std::vector<spec::ArenaRange> gradient_pieces() const { return {{0, total_}}; }
  virtual bool gradients_sharded() const { return false; }
  // After the optimizer updated this rank's pieces: every replica gets all the weights. Returns true
  // when the bf16 copies must then be refreshed from the masters.
  virtual bool after_optimizer_step() { return false; }

  // ---- checkpoints and replicas ----
  // Collective over the group: the full moments (and, where masters are sharded, the full masters) on
  // dp rank 0, from this rank's m and v (laid out as optimizer_pieces()).
  virtual void gather_full_state(const float* /*m*/, const float* /*v*/, Allocator& /*alloc*/) {}
  // The full moments gather_full_state assembled on rank 0, or m and v themselves where nothing is sharded.
  struct Moments {
    const float* m;
    const float* v;
  };
  virtual Moments full_moments(const float* m, const float* v) const { return {m, v}; }
  virtual void release_full_state() {}
  // After weights were written from outside (a checkpoint, an import): drops what is not this rank's.
  virtual void weights_changed() {}
  virtual ReplicatedState replicated() const { return {}; }

  // Wall seconds this thread spent waiting for the group's collectives (cumulative), and the CPU time
  // the group's communication used (0 alone).
  virtual double wait_seconds() const { return 0; }
  virtual double comm_cpu_seconds() const { return 0; }

 protected:
  explicit DataParallel(int64_t table_total) : table_total_(table_total) {}
  float* grads_ = nullptr;
  int64_t total_ = 0, table_total_ = 0;
};

// dp: the data-parallel group (nullptr or size 1: alone). Not owned; outlives the result.
std::unique_ptr<DataParallel> make_data_parallel(comm::ProcessGroup* dp, const DataParallelSetup& setup, Allocator& alloc,
                                                 profile::Tracer* tracer);

}  // namespace loom::parallel
