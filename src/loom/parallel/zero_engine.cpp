#include "loom/parallel/zero_engine.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>
#include <string>

#include "loom/error.h"
#include "loom/kernels/elementwise.h"

namespace loom::parallel {

namespace {
// Point-to-point tags of a checkpoint's weight gather (one per unit), clear of any other sender's.
constexpr uint64_t kFullMastersTag = uint64_t{0x5A3} << 40;

// Calls f(overlap) for every range of `ranges` (ascending) overlapping `r`, in order.
template <class F>
void for_each_overlap(const std::vector<ArenaRange>& ranges, const ArenaRange& r, F&& f) {
  auto it = std::lower_bound(ranges.begin(), ranges.end(), r.begin,
                             [](const ArenaRange& x, int64_t at) { return x.end <= at; });
  for (; it != ranges.end() && it->begin < r.end; ++it) {
    const ArenaRange o{std::max(it->begin, r.begin), std::min(it->end, r.end)};
    if (o.size() > 0) f(o);
  }
}
}  // namespace

ZeroEngine::ZeroEngine(ShardPlan plan, int stage, ZeroArenas arenas, std::vector<ArenaRange> f32_read,
                       comm::ProcessGroup& dp, Allocator& alloc, profile::Tracer* tracer)
    : plan_(std::move(plan)),
      stage_(stage),
      a_(arenas),
      f32_(std::move(f32_read)),
      dp_(dp),
      alloc_(alloc),
      tracer_(tracer),
      rank_(dp.rank()) {
  if (stage_ < 1 || stage_ > 3) throw ConfigError("ZeRO stage " + std::to_string(stage_) + " is not 1, 2 or 3");
  if (plan_.dp() != dp.size())
    throw Error("internal: ZeRO plan for " + std::to_string(plan_.dp()) + " ranks on a group of " +
                std::to_string(dp.size()));
  // Which arenas are on demand: ZeRO-3 the weights (masters and bf16 copies); ZeRO-1/2 in bf16 mode the
  // f32 masters only (replicas read the bf16 copies); ZeRO-2/3 the gradients.
  // bf16-only weights (no masters): the bf16 arena is the weights, on demand under ZeRO-3 alone.
  const bool weights_ok = !a_.master ? a_.lowp && !a_.master_pages && (stage_ == 3) == (a_.lowp_pages != nullptr)
                          : stage_ == 3 ? a_.master_pages && (!a_.lowp || a_.lowp_pages)
                                        : !a_.lowp_pages && (!a_.master_pages || a_.lowp);
  if (!weights_ok || (stage_ >= 2) != (a_.grad_pages != nullptr))
    throw Error("internal: ZeRO-" + std::to_string(stage_) + " needs on-demand arenas exactly for what it shards");
  const size_t n = plan_.units();
  held_.assign(n, stage_ == 3 ? Held::Sharded : Held::Gathered);
  charged_.assign(n, 0);
  gather_.resize(n);
  gather_f32_.resize(n);
  f32_send_.resize(n);
  f32_recv_.resize(n);
  reducing_.resize(n);
  grad_scratch_.assign(n, false);
  const int64_t own = plan_.local_size(rank_);
  if (stage_ == 3) {
    own_param_bytes_ = own * static_cast<int64_t>((a_.master ? sizeof(float) : 0) + (a_.lowp ? sizeof(bf16) : 0));
  } else if (a_.master_pages) {
    // The bf16 copies are allocated whole (charged by their owner); of the masters this rank keeps its
    // pieces and every element the model reads in f32.
    int64_t f32_others = 0;
    for (size_t u = 0; u < n; ++u) f32_others += f32_within(plan_.unit(u)) - f32_within(plan_.piece(u, rank_));
    own_param_bytes_ = (own + f32_others) * static_cast<int64_t>(sizeof(float));
  }
  if (a_.grad_pages) own_grad_bytes_ = own * static_cast<int64_t>(sizeof(float));
  if (a_.release == PageReservation::Release::Lazy) {
    if (stage_ == 3 && a_.lowp) make_alias(lowp_alias_, a_.lowp_pages, sizeof(bf16), MemCategory::Parameters);
    if (stage_ >= 2) make_alias(grad_alias_, a_.grad_pages, sizeof(float), MemCategory::Gradients);
    weight_pool_.alias = &lowp_alias_;
    grad_pool_.alias = &grad_alias_;
    if (stage_ == 3 && a_.lowp) {
      make_pool(weight_pool_, a_.lowp_pages, sizeof(bf16), false, MemCategory::Parameters);
      if (a_.master_pages) make_pool(master_pool_, a_.master_pages, sizeof(float), true, MemCategory::Parameters);
    } else if (stage_ == 3) {
      make_pool(weight_pool_, a_.master_pages, sizeof(float), false, MemCategory::Parameters);
    }
    if (stage_ >= 2) make_pool(grad_pool_, a_.grad_pages, sizeof(float), false, MemCategory::Gradients);
  }
  charge(MemCategory::Parameters, own_param_bytes_);
  charge(MemCategory::Gradients, own_grad_bytes_);
}

void ZeroEngine::make_alias(Aliased& a, PageReservation* pages, size_t element, MemCategory c) {
  const size_t n = plan_.units();
  if (n < 5) return;  // fewer than three blocks: two slots would save nothing
  a.slot_of.assign(n, -1);
  a.aliased_bytes.assign(n, 0);
  std::vector<std::vector<std::pair<size_t, size_t>>> ranges(n);
  size_t most = 0;
  for (size_t u = 1; u + 1 < n; ++u) {
    const auto [before, after] = others(u);
    size_t bytes = 0;
    for (const ArenaRange& r : {before, after}) {
      ranges[u].push_back(PageReservation::whole_pages(static_cast<size_t>(r.begin) * element, static_cast<size_t>(r.size()) * element));
      bytes += ranges[u].back().second;
    }
    a.aliased_bytes[u] = static_cast<int64_t>(bytes);
    most = std::max(most, bytes);
  }
  if (most == 0) return;
  a.slots = std::make_unique<SlotMapping>(*pages, 2, most);
  a.holder.assign(2, -1);
  for (size_t u = 1; u + 1 < n; ++u) {
    a.slot_of[u] = static_cast<int>((u - 1) % 2);
    a.slots->map(a.slot_of[u], ranges[u]);
  }
  // The slots are resident from their first use on: charged for good, and left out of the units' own
  // charges.
  slot_charge_.push_back({c, static_cast<int64_t>(2 * a.slots->slot_bytes())});
  charge(c, slot_charge_.back().second);
}

template <class Live>
void ZeroEngine::claim_slot(Aliased& a, size_t u, Live&& live, const char* what) {
  int& holder = a.holder[static_cast<size_t>(a.slot_of[u])];
  if (holder >= 0 && holder != static_cast<int>(u) && live(static_cast<size_t>(holder)))
    throw Error("internal: ZeRO " + std::string(what) + " of units " + std::to_string(holder) + " and " +
                std::to_string(u) + " share memory and would be live at once");
  holder = static_cast<int>(u);
}

void ZeroEngine::free_slot(Aliased& a, size_t u) {
  if (!a.has(u)) return;
  int& holder = a.holder[static_cast<size_t>(a.slot_of[u])];
  if (holder == static_cast<int>(u)) holder = -1;
}

void ZeroEngine::release_masters_outside_f32(const ArenaRange& r, bool keep_whole_pages_only) {
  if (r.size() == 0) return;
  size_t at = static_cast<size_t>(r.begin) * sizeof(float);
  auto upto = [&](size_t end) {
    if (end > at) a_.master_pages->release(at, end - at, a_.release);
  };
  for_each_overlap(f32_, r, [&](const ArenaRange& o) {
    std::pair<size_t, size_t> kept{static_cast<size_t>(o.begin) * sizeof(float), static_cast<size_t>(o.size()) * sizeof(float)};
    if (keep_whole_pages_only) kept = PageReservation::whole_pages(kept.first, kept.second);
    if (kept.second == 0) return;  // no whole page: released with what surrounds it
    upto(kept.first);
    at = kept.first + kept.second;
  });
  upto(static_cast<size_t>(r.end) * sizeof(float));
}

std::vector<ArenaRange> ZeroEngine::pooled_ranges(const Pooled& p, size_t u) const {
  if (p.alias && p.alias->has(u)) return {};
  const auto [before, after] = others(u);
  std::vector<ArenaRange> out;
  for (const ArenaRange& r : {before, after}) {
    if (r.size() == 0) continue;
    if (p.f32_only)
      for_each_overlap(f32_, r, [&](const ArenaRange& o) { out.push_back(o); });
    else
      out.push_back(r);
  }
  return out;
}

void ZeroEngine::make_pool(Pooled& p, PageReservation* pages, size_t element, bool f32_only, MemCategory c) {
  p.element = element, p.f32_only = f32_only, p.category = c;
  const bool weights = c == MemCategory::Parameters;
  // Capacity: what a step holds at its peak anyway, so pooling never raises it. Weights: the embeddings
  // and head units (gathered for the whole pass) and two blocks (the one in use, the next prefetched);
  // gradients: two units' scratch (one reducing, one being written).
  const size_t n = plan_.units(), page = PageReservation::page_size();
  std::vector<size_t> bytes(n);
  for (size_t u = 0; u < n; ++u)
    for (const ArenaRange& r : pooled_ranges(p, u)) bytes[u] += static_cast<size_t>(r.size()) * element + page;
  size_t capacity = 0;
  if (weights) {
    const size_t block = n > 2 ? *std::max_element(bytes.begin() + 1, bytes.end() - 1) : 0;
    capacity = bytes.front() + (n > 1 ? bytes.back() : 0) + 2 * block;
  } else {
    std::vector<size_t> sorted = bytes;
    std::sort(sorted.rbegin(), sorted.rend());
    capacity = sorted[0] + (n > 1 ? sorted[1] : 0);
  }
  p.pool = std::make_unique<PagePool>(*pages, capacity, a_.release);
}

void ZeroEngine::give_pages(Pooled& p, size_t u) {
  profile::Span span(tracer_, "zero_pages_give", profile::Category::Host);
  for (const ArenaRange& r : pooled_ranges(p, u))
    charge(p.category, static_cast<int64_t>(p.pool->give(static_cast<size_t>(r.begin) * p.element,
                                                         static_cast<size_t>(r.size()) * p.element)));
}

void ZeroEngine::take_pages(Pooled& p, size_t u) {
  profile::Span span(tracer_, "zero_pages_take", profile::Category::Host);
  for (const ArenaRange& r : pooled_ranges(p, u))
    charge(p.category, -static_cast<int64_t>(p.pool->take(static_cast<size_t>(r.begin) * p.element,
                                                          static_cast<size_t>(r.size()) * p.element)));
}

void ZeroEngine::drain(Pooled& p) {
  if (p.pool) charge(p.category, -static_cast<int64_t>(p.pool->drain()));
}

ZeroEngine::~ZeroEngine() {
  // Collectives still under way write into the arenas and buffers: let them land before memory goes.
  try {
    for (auto& w : gather_) w.wait();
    for (auto& w : gather_f32_) w.wait();
    for (auto& ws : reducing_)
      for (auto& w : ws) w.wait();
  } catch (...) {  // the group reported the failure already; nothing to add while unwinding
  }
  for (size_t u = 0; u < plan_.units(); ++u) {
    charge(MemCategory::Parameters, -charged_[u]);
    if (grad_scratch_[u]) charge(MemCategory::Gradients, -grad_scratch_bytes(u));
  }
  charge(MemCategory::Parameters, -own_param_bytes_);
  charge(MemCategory::Gradients, -own_grad_bytes_);
  for (Pooled* p : {&weight_pool_, &master_pool_, &grad_pool_})
    if (p->pool) charge(p->category, -static_cast<int64_t>(p->pool->pooled_bytes()));
  for (const auto& [category, bytes] : slot_charge_) charge(category, -bytes);
}

int64_t ZeroEngine::grad_scratch_bytes(size_t u) const {
  const auto [before, after] = others(u);
  const int64_t all = (before.size() + after.size()) * static_cast<int64_t>(sizeof(float));
  return grad_alias_.has(u) ? all - grad_alias_.aliased_bytes[u] : all;  // the slot is charged on its own
}

std::pair<ArenaRange, ArenaRange> ZeroEngine::others(size_t u) const {
  const ArenaRange unit = plan_.unit(u), mine = plan_.piece(u, rank_);
  return {{unit.begin, mine.begin}, {mine.end, unit.end}};
}

int64_t ZeroEngine::f32_within(const ArenaRange& r) const {
  int64_t n = 0;
  for_each_overlap(f32_, r, [&](const ArenaRange& o) { n += o.size(); });
  return n;
}

ZeroEngine::Scratch ZeroEngine::scratch(size_t bytes) {
  Scratch s;
  try {
    s.registered = dp_.register_buffer(bytes);
  } catch (const CommError&) {  // the group's arena is full: plain memory works, with a staging copy
    s.plain = Buffer(alloc_, bytes, MemCategory::Communication);
  }
  return s;
}

void ZeroEngine::charge(MemCategory c, int64_t bytes) {
  if (bytes != 0) alloc_.note_external(c, static_cast<ptrdiff_t>(bytes));
}

void ZeroEngine::wait(comm::Work& w, const char* what) {
  if (w.test()) {  // finished already (or never issued): nothing exposed
    w.wait();      // rethrows a failure
    return;
  }
  const profile::ScopedSpanContext restore(profile::SpanContext::kNoUnit);
  comm::mark_wait(w);
  profile::Span span(tracer_, what, profile::Category::Communication);
  const auto t0 = std::chrono::steady_clock::now();
  w.wait();
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void ZeroEngine::prefetch(size_t u) {
  if (stage_ < 3 || held_[u] != Held::Sharded) return;
  if (full_masters_) throw Error("internal: ZeRO-3 weights gathered for a checkpoint were not released");
  const ArenaRange unit = plan_.unit(u), mine = plan_.piece(u, rank_);
  if (unit.size() == 0) {
    held_[u] = Held::Gathered;
    return;
  }
  if (lowp_alias_.has(u)) claim_slot(lowp_alias_, u, [&](size_t v) { return held_[v] != Held::Sharded; }, "weight gathers");
  for (Pooled* p : {&weight_pool_, &master_pool_})
    if (p->pool) take_pages(*p, u);
  const int64_t others_n = unit.size() - mine.size();
  const int64_t f32_others = a_.lowp ? f32_within(unit) - f32_within(mine) : 0;
  charged_[u] = a_.lowp ? others_n * static_cast<int64_t>(sizeof(bf16)) + f32_others * static_cast<int64_t>(sizeof(float))
                        : others_n * static_cast<int64_t>(sizeof(float));
  if (lowp_alias_.has(u)) charged_[u] -= lowp_alias_.aliased_bytes[u];  // the slot is charged on its own
  charge(MemCategory::Parameters, charged_[u]);
  issue_gather(u);
}

void ZeroEngine::issue_gather(size_t u) {
  const ArenaRange unit = plan_.unit(u), mine = plan_.piece(u, rank_);
  held_[u] = Held::InFlight;
  const auto counts = plan_.counts(u);
  if (!a_.lowp) {
    gather_[u] = dp_.all_gather_v(a_.master + mine.begin, a_.master + unit.begin, counts, DType::F32);
    return;
  }
  // bf16 mode: the bf16 copies GEMMs read travel (half the bytes of the masters); the few elements read
  // in f32 (norms, biases, embeddings) travel exactly, packed, beside them.
  std::vector<size_t> f32_counts(counts.size());
  for (int r = 0; r < plan_.dp(); ++r) f32_counts[static_cast<size_t>(r)] = static_cast<size_t>(f32_within(plan_.piece(u, r)));
  const int64_t f32_all = f32_within(unit), f32_mine = static_cast<int64_t>(f32_counts[static_cast<size_t>(rank_)]);
  gather_[u] = dp_.all_gather_v(a_.lowp + mine.begin, a_.lowp + unit.begin, counts, DType::BF16);
  if (f32_all == 0) return;
  f32_send_[u] = scratch(static_cast<size_t>(std::max<int64_t>(f32_mine, 1)) * sizeof(float));
  f32_recv_[u] = scratch(static_cast<size_t>(f32_all) * sizeof(float));
  auto* send = static_cast<float*>(f32_send_[u].data());
  for_each_overlap(f32_, mine, [&](const ArenaRange& o) {
    std::memcpy(send, a_.master + o.begin, static_cast<size_t>(o.size()) * sizeof(float));
    send += o.size();
  });
  gather_f32_[u] = dp_.all_gather_v(f32_send_[u].data(), f32_recv_[u].data(), f32_counts, DType::F32);
}

void ZeroEngine::require(size_t u) {
  if (stage_ < 3) return;
  prefetch(u);
  complete_gather(u);
}

void ZeroEngine::complete_gather(size_t u) {
  if (held_[u] != Held::InFlight) return;
  wait(gather_[u], "zero_gather_wait");
  wait(gather_f32_[u], "zero_gather_wait");
  if (f32_recv_[u].data() != nullptr) {
    // Ranks' packed f32 elements arrive in rank order, i.e. in arena order: unpack them in place.
    const auto* recv = static_cast<const float*>(f32_recv_[u].data());
    for_each_overlap(f32_, plan_.unit(u), [&](const ArenaRange& o) {
      std::memcpy(a_.master + o.begin, recv, static_cast<size_t>(o.size()) * sizeof(float));
      recv += o.size();
    });
    f32_send_[u] = Scratch();
    f32_recv_[u] = Scratch();
  }
  held_[u] = Held::Gathered;
}

void ZeroEngine::release(size_t u) {
  if (stage_ < 3 || held_[u] == Held::Sharded) return;
  if (held_[u] == Held::InFlight) {  // never drop pages or buffers a collective is writing
    wait(gather_[u], "zero_gather_wait");
    wait(gather_f32_[u], "zero_gather_wait");
  }
  f32_send_[u] = Scratch();
  f32_recv_[u] = Scratch();
  const auto [before, after] = others(u);
  charge(MemCategory::Parameters, -charged_[u]);
  if (weight_pool_.pool) {
    give_pages(weight_pool_, u);
    if (master_pool_.pool) {
      // bf16 mode: the pool takes the whole pages of the f32-read masters; every other page of the
      // non-owned masters goes back (small f32 ranges between them, and on the rank that gathered
      // whole masters for a checkpoint, all the rest).
      give_pages(master_pool_, u);
      for (const ArenaRange& r : {before, after}) release_masters_outside_f32(r, true);
    }
  } else {
    for (const ArenaRange& r : {before, after}) {
      if (a_.master_pages)
        a_.master_pages->release(static_cast<size_t>(r.begin) * sizeof(float),
                                 static_cast<size_t>(r.size()) * sizeof(float), a_.release);
      if (a_.lowp_pages)
        a_.lowp_pages->release(static_cast<size_t>(r.begin) * sizeof(bf16), static_cast<size_t>(r.size()) * sizeof(bf16),
                               a_.release);
    }
  }
  charged_[u] = 0;
  held_[u] = Held::Sharded;
  free_slot(lowp_alias_, u);
}

void ZeroEngine::release_all() {
  for (size_t u = 0; u < plan_.units(); ++u) release(u);
  drain(weight_pool_);
  drain(master_pool_);
  if (stage_ < 3 && full_masters_) {  // ZeRO-1/2 after a checkpoint gather on this rank
    drop_unowned_masters();
    for (auto& c : charged_) charge(MemCategory::Parameters, -std::exchange(c, 0));
  }
  full_masters_ = false;
}

void ZeroEngine::drop_unowned_masters() {
  if (stage_ == 3 || !a_.master_pages) return;
  // The masters of other ranks' pieces that the model reads only as bf16 copies: nobody reads them.
  for (size_t u = 0; u < plan_.units(); ++u) {
    const auto [before, after] = others(u);
    for (const ArenaRange& r : {before, after}) release_masters_outside_f32(r, false);
  }
}

void ZeroEngine::gather_full_masters(int root) {
  if (!a_.master) throw Error("internal: bf16-only weights have no f32 masters to gather (sharded checkpoints only)");
  if (!a_.master_pages) return;  // the masters are whole on every rank
  release_all();
  std::vector<comm::Work> works;
  for (size_t u = 0; u < plan_.units(); ++u) {
    const uint64_t tag = kFullMastersTag + u;
    if (rank_ != root) {
      const ArenaRange mine = plan_.piece(u, rank_);
      if (mine.size() > 0)
        works.push_back(dp_.send(a_.master + mine.begin, static_cast<size_t>(mine.size()), DType::F32, root, tag));
      continue;
    }
    for (int r = 0; r < plan_.dp(); ++r) {
      const ArenaRange p = plan_.piece(u, r);
      if (r == root || p.size() == 0) continue;
      // ZeRO-1/2 keep the f32-read elements of every piece already.
      charged_[u] += (p.size() - (stage_ < 3 ? f32_within(p) : 0)) * static_cast<int64_t>(sizeof(float));
      works.push_back(dp_.recv(a_.master + p.begin, static_cast<size_t>(p.size()), DType::F32, r, tag));
    }
  }
  charge(MemCategory::Parameters, std::accumulate(charged_.begin(), charged_.end(), int64_t{0}));
  for (auto& w : works) wait(w, "zero_checkpoint_gather");
  if (rank_ == root) {
    std::fill(held_.begin(), held_.end(), Held::Gathered);
    full_masters_ = true;  // the bf16 copies of other ranks' pieces were not gathered
  }
}

void ZeroEngine::zero_unit_grads(size_t u) {
  if (stage_ < 2) return;
  if (!reducing_[u].empty()) finish_unit(u);  // the previous micro-batch's reduction reads these
  if (grad_alias_.has(u) && !grad_scratch_[u]) {
    // The unit that used this slot last must be done: its reduction landed (waited for here if it is
    // still under way) -- the hooks' order guarantees it; a different order is refused, not corrupted.
    const int v = grad_alias_.holder[static_cast<size_t>(grad_alias_.slot_of[u])];
    if (v >= 0 && v != static_cast<int>(u) && grad_scratch_[static_cast<size_t>(v)] && !reducing_[static_cast<size_t>(v)].empty())
      finish_unit(static_cast<size_t>(v));
    claim_slot(grad_alias_, u, [&](size_t w) { return static_cast<bool>(grad_scratch_[w]); }, "gradient scratch");
  }
  if (grad_pool_.pool && !grad_scratch_[u]) take_pages(grad_pool_, u);
  profile::Span span(tracer_, "zero_grad_clear", profile::Category::Kernel);
  const auto [before, after] = others(u);
  for (const ArenaRange& r : {before, after})
    if (r.size() > 0) std::memset(a_.grads + r.begin, 0, static_cast<size_t>(r.size()) * sizeof(float));
  if (!grad_scratch_[u]) charge(MemCategory::Gradients, grad_scratch_bytes(u));
  grad_scratch_[u] = true;
}

void ZeroEngine::reduce_unit(size_t u) {
  if (!reducing_[u].empty()) throw Error("internal: ZeRO unit " + std::to_string(u) + " reduced twice");
  const ArenaRange unit = plan_.unit(u), rest = plan_.remainder(u);
  const int64_t chunk = plan_.chunk(u);
  float* g = a_.grads;
  // Rank r's chunk of the sum lands in place, on its own piece of the arena.
  if (chunk > 0)
    reducing_[u].push_back(dp_.reduce_scatter(g + unit.begin, g + unit.begin + rank_ * chunk, static_cast<size_t>(chunk),
                                              DType::F32, comm::ReduceOp::kSum));
  if (rest.size() > 0)
    reducing_[u].push_back(dp_.all_reduce(g + rest.begin, g + rest.begin, static_cast<size_t>(rest.size()), DType::F32,
                                          comm::ReduceOp::kSum));
  if (!reducing_[u].empty()) reduce_order_.push_back(u);
}

void ZeroEngine::finish_unit(size_t u) {
  for (auto& w : reducing_[u]) wait(w, "zero_reduce_wait");
  reducing_[u].clear();
  reduce_order_.erase(std::remove(reduce_order_.begin(), reduce_order_.end(), u), reduce_order_.end());
  if (stage_ >= 2 && grad_scratch_[u]) {
    const auto [before, after] = others(u);
    charge(MemCategory::Gradients, -grad_scratch_bytes(u));
    free_slot(grad_alias_, u);
    if (grad_pool_.pool) {
      give_pages(grad_pool_, u);
    } else {
      for (const ArenaRange& r : {before, after})
        a_.grad_pages->release(static_cast<size_t>(r.begin) * sizeof(float), static_cast<size_t>(r.size()) * sizeof(float),
                               a_.release);
    }
    grad_scratch_[u] = false;
  }
}

void ZeroEngine::finish_all() {
  const auto pending = reduce_order_;
  for (size_t u : pending) finish_unit(u);
  // Units whose reduction had nothing to send (empty) may still hold scratch pages.
  for (size_t u = 0; u < plan_.units(); ++u)
    if (grad_scratch_[u]) finish_unit(u);
}

int64_t ZeroEngine::zero_owned_grads() {
  int64_t zeroed = 0;
  for (const ArenaRange& r : owned())
    if (r.size() > 0) kernels::fill_zero(a_.grads + r.begin, r.size()), zeroed += r.size();
  return zeroed;
}

void ZeroEngine::all_gather_masters() {
  if (stage_ >= 3) return;
  // ZeRO-3's gathers, all units issued at once: f32 masters, or with sharded masters (bf16 mode) the
  // bf16 copies plus the f32-read elements exactly.
  for (size_t u = 0; u < plan_.units(); ++u)
    if (plan_.unit(u).size() > 0) issue_gather(u);
  for (size_t u = 0; u < plan_.units(); ++u) complete_gather(u);
}

}  // namespace loom::parallel
