#include "loom/parallel/data_parallel.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>

#include "loom/error.h"
#include "loom/kernels/elementwise.h"
#include "loom/parallel/grad_buckets.h"

namespace loom::parallel {

namespace {

// Point-to-point tags of a checkpoint's moment gather (two per unit), clear of any other sender's.
constexpr uint64_t kMomentsTag = uint64_t{0x5A4} << 40;

// One rank: the whole model, nothing to reduce.
class Alone final : public DataParallel {
 public:
  explicit Alone(int64_t total) : DataParallel(total) {}
};

// DDP: every rank holds everything; gradient buckets are all-reduced as backward makes them final,
// once per step (during the last micro-batch's backward).
class Ddp final : public DataParallel {
 public:
  Ddp(comm::ProcessGroup& dp, const DataParallelSetup& s, profile::Tracer* tracer)
      : DataParallel(s.table->total_numel()), dp_(dp), table_(*s.table), bucket_bytes_(s.bucket_bytes),
        block_starts_(s.table->block_starts(s.n_layers)), tracer_(tracer), experts_split_(s.experts_split),
        expert_replicas_(s.expert_replicas) {}

  int size() const override { return dp_.size(); }
  int rank() const override { return dp_.rank(); }

  ArenaNeeds arena_needs() override {
    ArenaNeeds n;
    try {
      n.grads_memory = dp_.register_buffer(static_cast<size_t>(table_total_) * sizeof(float), MemCategory::Gradients);
    } catch (const CommError&) {
      // The group's arena is full (LOOM_COMM_ARENA_MB): plain memory works, with one staging copy more.
    }
    return n;
  }
  void attach(const ZeroArenas& a) override {
    DataParallel::attach(a);
    buckets_ = std::make_unique<GradBuckets>(table_, a.grads, dp_, bucket_bytes_, experts_split_, expert_replicas_);
  }
  void begin_micro_batch(bool training, bool last) override {
    reduce_ = training && last;
    if (reduce_) buckets_->begin();
  }
  void after_backward(int64_t unit) override {
    if (reduce_) buckets_->ready_from(unit >= 0 ? block_starts_[static_cast<size_t>(unit)] : 0);
  }
  void finish_gradients() override {
    const profile::ScopedSpanContext restore(profile::SpanContext::kNoUnit);
    comm::mark_wait(dp_);
    profile::Span span(tracer_, "dp_all_reduce_wait", profile::Category::Communication, 0,
                       static_cast<double>(total_) * 4);
    const auto w0 = std::chrono::steady_clock::now();
    buckets_->finish();
    wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    reduce_ = false;
  }
  // Under expert parallelism the replicas hold different experts: no whole state to compare.
  ReplicatedState replicated() const override {
    return experts_split_ ? ReplicatedState{} : ReplicatedState{true, false, true};
  }
  double wait_seconds() const override { return wait_; }
  double comm_cpu_seconds() const override { return dp_.stats().comm_cpu_seconds; }

 private:
  comm::ProcessGroup& dp_;
  spec::ParamTable table_;
  size_t bucket_bytes_;
  std::vector<int64_t> block_starts_;
  profile::Tracer* tracer_;
  bool experts_split_;
  comm::ProcessGroup* expert_replicas_;
  std::unique_ptr<GradBuckets> buckets_;
  bool reduce_ = false;
  double wait_ = 0;
};

spec::ParamTable flat_along_dp(spec::ParamTable t) {
  t.shard_flat_along(spec::MeshAxis::DP);
  return t;
}

// ZeRO 1-3 over the dp group: the optimizer state (1), the gradients (2) and the weights (3) are
// sharded unit by unit (every tensor Shard(flat) along dp; spec::zero_shard_plan); ZeroEngine moves
// the pieces. Under expert parallelism the routed experts' part of each unit is sharded by a second
// engine over the expert replicas (the ranks holding the same experts), the rest over every replica
// (spec::zero_shard_plans): each element still has exactly one owner among all the ranks.
class Zero final : public DataParallel {
 public:
  Zero(comm::ProcessGroup& dp, const DataParallelSetup& s, Allocator& alloc, profile::Tracer* tracer)
      : DataParallel(s.table->total_numel()), dp_(dp), table_(flat_along_dp(*s.table)), L_(s.n_layers),
        stage_(s.zero_stage), bf16_(s.bf16), bf16_only_(s.bf16_only), release_(s.release), alloc_(alloc), tracer_(tracer) {
    if (s.experts_split) {
      if (!s.expert_replicas) throw Error("internal: ZeRO under expert parallelism needs the expert replicas' group");
      auto plans = spec::zero_shard_plans(table_, s.n_layers, dp.size(), s.expert_replicas->size());
      parts_.push_back({&dp, std::move(plans.rest), nullptr});
      parts_.push_back({s.expert_replicas, std::move(plans.experts), nullptr});
    } else {
      parts_.push_back({&dp, spec::zero_shard_plan(table_, s.n_layers, dp.size()), nullptr});
    }
  }

  int size() const override { return dp_.size(); }
  int rank() const override { return dp_.rank(); }
  int stage() const override { return stage_; }

  // ZeRO-3 reserves the weight arenas and backs only this rank's pieces; ZeRO-2/3 likewise the gradients.
  // ZeRO-1/2 in bf16 mode shard the f32 masters too: replicas compute from the bf16 copies (and the few
  // elements read in f32), so only the optimizer's pieces need f32 masters.
  ArenaNeeds arena_needs() override {
    ArenaNeeds n;
    n.master_on_demand = !bf16_only_ && (stage_ == 3 || bf16_);  // bf16-only weights have no masters
    n.lowp_on_demand = stage_ == 3;
    n.grads_on_demand = stage_ >= 2;
    if (stage_ == 1) {
      try {
        n.grads_memory = dp_.register_buffer(static_cast<size_t>(table_total_) * sizeof(float), MemCategory::Gradients);
      } catch (const CommError&) {
      }
    }
    return n;
  }
  std::vector<spec::ArenaRange> optimizer_pieces() const override { return pieces(); }
  std::vector<spec::ArenaRange> weights_held() const override {
    return stage_ == 3 ? pieces() : std::vector<spec::ArenaRange>{};
  }
  void attach(const ZeroArenas& a) override {
    DataParallel::attach(a);
    // bf16-only weights: every kernel reads the bf16 values, so nothing travels in f32.
    std::vector<spec::ArenaRange> f32_read;
    for (const auto& p : table_.params())
      if (!p.gemm_only && !bf16_only_) f32_read.push_back({p.offset, p.offset + p.numel()});
    ZeroArenas arenas = a;
    arenas.release = release_;
    for (Part& p : parts_) {
      p.engine = std::make_unique<ZeroEngine>(p.plan, stage_, arenas, f32_read, *p.group, alloc_, tracer_);
      p.engine->drop_unowned_masters();  // ZeRO-1/2 in bf16: initialised whole, kept sharded
    }
  }

  int64_t begin_step() override {
    // ZeRO-2/3 keep no full gradient: only this rank's pieces accumulate across micro-batches.
    if (stage_ < 2) return DataParallel::begin_step();
    int64_t zeroed = 0;
    each([&](ZeroEngine& z) { zeroed += z.zero_owned_grads(); });
    return zeroed;
  }
  // ZeRO-1 reduces once, during the last micro-batch's backward; ZeRO-2/3 every micro-batch (they keep
  // no full gradient to accumulate into).
  void begin_micro_batch(bool training, bool last) override {
    training_ = training;
    reduce_ = training && (stage_ >= 2 || last);
  }

  void before_forward(int64_t unit) override {
    if (stage_ != 3) return;
    const size_t tail = plan_unit(L_);
    if (unit < 0) {
      // The embeddings and the head (tied or not) are used at both ends of the pass: gather them first,
      // with block 0 right behind.
      each([&](ZeroEngine& z) {
        z.require(plan_unit(-1));
        z.prefetch(tail);
        z.prefetch(plan_unit(0));
      });
    } else if (unit < L_) {
      each([&](ZeroEngine& z) {
        z.require(plan_unit(unit));
        if (unit + 1 < L_) z.prefetch(plan_unit(unit + 1));
      });
    } else {
      each([&](ZeroEngine& z) { z.require(tail); });
    }
  }
  void after_forward(int64_t unit) override {
    if (stage_ != 3) return;
    each([&](ZeroEngine& z) {
      // The last block is needed again at once by backward: keep it instead of gathering it twice.
      if (unit >= 0 && unit < L_ && !(training_ && unit == L_ - 1)) z.release(plan_unit(unit));
      if (unit == L_ && !training_) {
        z.release(plan_unit(-1));
        z.release(plan_unit(L_));
      }
    });
  }
  void before_backward(int64_t unit) override {
    each([&](ZeroEngine& z) {
      if (stage_ == 3) {
        if (unit == L_) {
          if (L_ > 0) z.prefetch(plan_unit(L_ - 1));
        } else if (unit >= 0) {
          z.require(plan_unit(unit));
          if (unit > 0) z.prefetch(plan_unit(unit - 1));
        }
      }
      if (stage_ >= 2) {
        // A tied head adds into the embedding gradient from the first unit of backward on.
        if (unit == L_) {
          z.zero_unit_grads(plan_unit(L_));
          z.zero_unit_grads(plan_unit(-1));
        } else if (unit >= 0) {
          z.zero_unit_grads(plan_unit(unit));
        }
      }
    });
  }
  void after_backward(int64_t unit) override {
    const size_t u = plan_unit(unit);
    if (reduce_) {
      each([&](ZeroEngine& z) { z.reduce_unit(u); });
      if (stage_ >= 2) {
        // One unit's reduction overlaps the next unit's backward; then its pages go back.
        if (reducing_) each([&](ZeroEngine& z) { z.finish_unit(*reducing_); });
        reducing_ = u;
        if (unit < 0) {
          each([](ZeroEngine& z) { z.finish_all(); });
          reducing_.reset();
        }
      }
    }
    if (stage_ == 3) {
      each([&](ZeroEngine& z) {
        if (unit >= 0 && unit < L_) z.release(u);
        if (unit < 0) {
          z.release(plan_unit(-1));
          z.release(plan_unit(L_));
        }
      });
    }
  }
  void finish_gradients() override {
    each([](ZeroEngine& z) { z.finish_all(); });
  }
  std::vector<spec::ArenaRange> gradient_pieces() const override { return pieces(); }
  bool gradients_sharded() const override { return true; }
  bool after_optimizer_step() override {
    // ZeRO-1/2: each rank updated its pieces of the weights; every replica needs all of them. (ZeRO-3
    // gathers each unit when the next forward reaches it.)
    if (stage_ == 3) return false;
    each([](ZeroEngine& z) { z.all_gather_masters(); });
    return !parts_.front().engine->masters_sharded();
  }

  void gather_full_state(const float* m, const float* v, Allocator& alloc) override {
    // Whole-model checkpoints gather onto one rank, which under expert parallelism holds only its own
    // experts: the run configuration allows only sharded checkpoints there.
    if (parts_.size() > 1) throw Error("internal: a whole-model checkpoint of an expert-parallel ZeRO run");
    const spec::ShardPlan& plan = parts_.front().plan;
    const int me = dp_.rank();
    std::vector<comm::Work> works;
    if (me == 0) {
      gathered_m_ = Tensor::empty({table_total_}, DType::F32, alloc, MemCategory::Optimizer);
      gathered_v_ = Tensor::empty({table_total_}, DType::F32, alloc, MemCategory::Optimizer);
    }
    // Point to point to dp rank 0, unit by unit: the other ranks need no memory for the save.
    for (size_t u = 0; u < plan.units(); ++u) {
      const uint64_t tag = kMomentsTag + 2 * u;
      if (me != 0) {
        const auto n = static_cast<size_t>(plan.piece(u, me).size());
        const int64_t local = plan.local_offset(u, me);
        if (n == 0) continue;
        works.push_back(dp_.send(m + local, n, DType::F32, 0, tag));
        works.push_back(dp_.send(v + local, n, DType::F32, 0, tag + 1));
        continue;
      }
      for (int r = 0; r < dp_.size(); ++r) {
        const auto p = plan.piece(u, r);
        if (p.size() == 0) continue;
        float* gm = gathered_m_.data<float>() + p.begin;
        float* gv = gathered_v_.data<float>() + p.begin;
        const auto n = static_cast<size_t>(p.size());
        if (r == 0) {
          std::memcpy(gm, m + plan.local_offset(u, 0), n * sizeof(float));
          std::memcpy(gv, v + plan.local_offset(u, 0), n * sizeof(float));
          continue;
        }
        works.push_back(dp_.recv(gm, n, DType::F32, r, tag));
        works.push_back(dp_.recv(gv, n, DType::F32, r, tag + 1));
      }
    }
    for (auto& w : works) w.wait();
    parts_.front().engine->gather_full_masters(0);  // where the masters are sharded (ZeRO-3; ZeRO-1/2 in bf16)
  }
  Moments full_moments(const float*, const float*) const override {
    if (!gathered_m_.numel()) throw Error("internal: a ZeRO checkpoint needs gather_full_state() on every rank first");
    return {gathered_m_.data<float>(), gathered_v_.data<float>()};
  }
  void release_full_state() override {
    gathered_m_ = gathered_v_ = Tensor();
    each([](ZeroEngine& z) { z.release_all(); });
  }
  void weights_changed() override {
    each([](ZeroEngine& z) {
      z.release_all();
      z.drop_unowned_masters();  // ZeRO-1/2 in bf16: loaded whole, kept sharded
    });
  }
  // ZeRO-3 replicates no state (every rank holds different pieces); under ZeRO-1/2 the moments are
  // pieces, different by design: only the weights must agree (the bf16 copies where the f32 masters
  // are sharded too). Under expert parallelism the replicas hold different experts: nothing to compare.
  ReplicatedState replicated() const override {
    if (stage_ == 3 || parts_.size() > 1) return {};
    return {true, parts_.front().engine->masters_sharded(), false};
  }
  double wait_seconds() const override {
    double s = 0;
    for (const Part& p : parts_) s += p.engine->wait_seconds();
    return s;
  }
  double comm_cpu_seconds() const override {
    double s = 0;
    for (const Part& p : parts_) s += p.group->stats().comm_cpu_seconds;
    return s;
  }

 private:
  // ShardPlan unit of a model unit: embeddings 0, block l l+1, final norm + head n_layers+1.
  size_t plan_unit(int64_t unit) const { return static_cast<size_t>(unit + 1); }
  template <class F>
  void each(F&& f) {
    for (Part& p : parts_) f(*p.engine);
  }
  // This rank's pieces of every part, in arena order (how the optimizer lays out its moments).
  std::vector<spec::ArenaRange> pieces() const {
    std::vector<spec::ArenaRange> out;
    for (const Part& p : parts_) {
      const auto mine = p.plan.pieces(p.group->rank());
      out.insert(out.end(), mine.begin(), mine.end());
    }
    if (parts_.size() > 1)
      std::stable_sort(out.begin(), out.end(),
                       [](const spec::ArenaRange& a, const spec::ArenaRange& b) { return a.begin < b.begin; });
    return out;
  }

  // One sharding: a plan over a group and the engine that moves its pieces.
  struct Part {
    comm::ProcessGroup* group;
    spec::ShardPlan plan;
    std::unique_ptr<ZeroEngine> engine;
  };

  comm::ProcessGroup& dp_;
  spec::ParamTable table_;
  int64_t L_;
  int stage_;
  bool bf16_, bf16_only_;
  PageReservation::Release release_;
  Allocator& alloc_;
  profile::Tracer* tracer_;
  std::vector<Part> parts_;  // every replica's; then, under expert parallelism, the experts'
  bool training_ = true, reduce_ = false;
  std::optional<size_t> reducing_;  // ZeRO-2/3: the unit whose reduction overlaps the current backward
  Tensor gathered_m_, gathered_v_;   // full moments on dp rank 0 while a checkpoint is saved
};

}  // namespace

int64_t DataParallel::begin_step() {
  if (!grads_ || total_ <= 0) return 0;
  kernels::fill_zero(grads_, total_);
  return total_;
}

std::unique_ptr<DataParallel> make_data_parallel(comm::ProcessGroup* dp, const DataParallelSetup& setup, Allocator& alloc,
                                                 profile::Tracer* tracer) {
  if (!dp || dp->size() <= 1) return std::make_unique<Alone>(setup.table->total_numel());
  if (setup.zero_stage >= 1) return std::make_unique<Zero>(*dp, setup, alloc, tracer);
  return std::make_unique<Ddp>(*dp, setup, tracer);
}

}  // namespace loom::parallel
