// Direct algorithms: every rank exposes its buffer (registered memory is used in place; other memory
// is staged once into this rank's arena), publishes where it is in an exchange, and then reads what it
// needs straight from its peers' memory. all_reduce is reduce-scatter by owner + all-gather:
//
//   exchange {in, res}     all inputs are ready, everyone knows where everyone's buffers are
//   owner r of chunk r:    res[r] = in_0[r] op in_1[r] op ... op in_{n-1}[r]   (rank order)
//   exchange               every chunk is reduced
//   every rank:            out[j] = res_j[j] for j != r                       (plain copies)
//   exchange               nobody reads my buffers any more: the caller may reuse them
//
// Each chunk is reduced by exactly one rank and copied by the others, so results are bitwise identical
// everywhere. Per rank this moves (n + 1)·S/n reads and 2·S/n writes for reduce, plus (n-1)·S/n of
// each for gathering: about 5/4 of the ceiling's traffic at n = 2.
#include <cstring>
#include <optional>

#include "loom/comm/algorithms.h"
#include "loom/comm/reduce_kernels.h"
#include "loom/error.h"

namespace loom::comm {

namespace {

// A buffer peers can read: registered memory in place, or a staged copy in the arena (freed on exit).
class Exposed {
 public:
  // `private_copy`: stage even registered memory, because this rank overwrites it while peers read.
  Exposed(Transport& t, const void* p, size_t bytes, bool copy_in, bool private_copy = false) : t_(t) {
    if (auto off = private_copy ? std::nullopt : t.arena_offset(p, bytes)) {
      offset_ = *off;
      local_ = static_cast<std::byte*>(const_cast<void*>(p));
      ok_ = true;
      return;
    }
    auto block = t.arena_allocate(bytes);
    if (!block) return;
    staged_ = *block;
    local_ = staged_.data();
    offset_ = *t.arena_offset(local_, bytes);
    if (copy_in && bytes) std::memcpy(local_, p, bytes);
    ok_ = true;
  }
  ~Exposed() { t_.arena_free(staged_); }
  Exposed(const Exposed&) = delete;
  Exposed& operator=(const Exposed&) = delete;
  bool ok() const { return ok_; }
  uint64_t offset() const { return offset_; }
  std::byte* local() const { return local_; }
  bool staged() const { return staged_.data() != nullptr; }

 private:
  Transport& t_;
  std::span<std::byte> staged_;
  std::byte* local_ = nullptr;
  uint64_t offset_ = 0;
  bool ok_ = false;
};

struct Where {
  uint64_t in = 0;
  uint64_t res = 0;
  uint64_t ok = 1;  // 0: this rank could not expose its buffers (arena full)
};

// Publishes where this rank's buffers are. Returns nullopt on every rank if any rank could not expose
// them: the fallback to the ring must be taken by all ranks together, never by one alone.
std::optional<std::vector<Where>> publish(Transport& t, Where mine) {
  auto recs = t.exchange({reinterpret_cast<const std::byte*>(&mine), sizeof mine});
  std::vector<Where> all(recs.size());
  bool ok = true;
  for (size_t r = 0; r < recs.size(); ++r) {
    std::memcpy(&all[r], recs[r].data(), sizeof(Where));
    ok = ok && all[r].ok;
  }
  if (!ok) return std::nullopt;
  return all;
}

// A peer's bytes: mapped in place when the transport can, else copied into `hold`.
const std::byte* peer_bytes(Transport& t, int peer, uint64_t offset, size_t bytes, std::vector<std::byte>& hold) {
  if (bytes == 0) return nullptr;
  if (const std::byte* p = t.map_peer(peer, offset, bytes)) return p;
  hold.resize(bytes);
  t.read_peer(peer, offset, hold);
  return hold.data();
}

void copy_from_peer(Transport& t, int peer, uint64_t offset, std::byte* dst, size_t bytes) {
  if (bytes == 0) return;
  if (const std::byte* p = t.map_peer(peer, offset, bytes)) {
    std::memcpy(dst, p, bytes);
  } else {
    t.read_peer(peer, offset, {dst, bytes});
  }
}

// Reduces chunk [lo, hi) of every rank's exposed input (at offsets `in`) into `dst`.
void reduce_owned(Transport& t, const std::vector<Where>& where, size_t lo, size_t hi, size_t in_base,
                  void* dst, const CollArgs& a) {
  const size_t es = dtype_size(a.dtype);
  const int n = t.size();
  std::vector<std::vector<std::byte>> holds(n);
  std::vector<const void*> srcs(n);
  for (int j = 0; j < n; ++j)
    srcs[j] = peer_bytes(t, j, where[j].in + (in_base + lo) * es, (hi - lo) * es, holds[j]);
  if (hi > lo) reduce_sources(dst, srcs, hi - lo, a.dtype, a.reduce, n);
}

}  // namespace

bool all_reduce_direct(Transport& t, const CollArgs& a) {
  const int n = t.size(), r = t.rank();
  const size_t es = dtype_size(a.dtype), bytes = a.count * es;
  const bool in_place = a.in == a.out;
  Exposed in(t, a.in, bytes, true);
  // Where my reduced chunk goes: the output if peers can read it; else my exposed input's own chunk,
  // which only I read (peers read the other chunks of it), unless that is the caller's input.
  std::optional<Exposed> out_exposed;
  std::byte* res = nullptr;
  uint64_t res_off = 0;
  bool ok = in.ok();
  if (!ok) {
  } else if (auto off = t.arena_offset(a.out, bytes)) {
    res = static_cast<std::byte*>(a.out);
    res_off = *off;
  } else if (in.staged() || in_place) {
    res = in.local();
    res_off = in.offset();
  } else {
    out_exposed.emplace(t, a.out, bytes, false);
    ok = out_exposed->ok();
    if (ok) {
      res = out_exposed->local();
      res_off = out_exposed->offset();
    }
  }
  auto published = publish(t, {in.offset(), res_off, ok});
  if (!published) return false;
  const auto& where = *published;
  const size_t lo = chunk_begin(a.count, n, r), hi = chunk_begin(a.count, n, r + 1);
  reduce_owned(t, where, lo, hi, 0, res + lo * es, a);
  auto* out = static_cast<std::byte*>(a.out);
  if (res != out && hi > lo) std::memcpy(out + lo * es, res + lo * es, (hi - lo) * es);
  t.exchange({});
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    const size_t jlo = chunk_begin(a.count, n, j), jhi = chunk_begin(a.count, n, j + 1);
    copy_from_peer(t, j, where[j].res + jlo * es, out + jlo * es, (jhi - jlo) * es);
  }
  t.exchange({});
  return true;
}

bool reduce_scatter_direct(Transport& t, const CollArgs& a) {
  const size_t es = dtype_size(a.dtype);
  Exposed in(t, a.in, a.count * es * t.size(), true);
  auto where = publish(t, {in.offset(), 0, in.ok()});
  if (!where) return false;
  reduce_owned(t, *where, 0, a.count, a.count * t.rank(), a.out, a);
  t.exchange({});
  return true;
}

bool all_gather_v_direct(Transport& t, const CollArgs& a) {
  const size_t es = dtype_size(a.dtype);
  const auto off = prefix_offsets(a.counts);
  const int r = t.rank();
  Exposed in(t, a.in, a.counts[r] * es, true);
  auto where = publish(t, {in.offset(), 0, in.ok()});
  if (!where) return false;
  auto* out = static_cast<std::byte*>(a.out);
  for (int j = 0; j < t.size(); ++j) {
    if (j == r) {
      if (a.in != out + off[r] * es && a.counts[r]) std::memcpy(out + off[r] * es, a.in, a.counts[r] * es);
      continue;
    }
    copy_from_peer(t, j, (*where)[j].in, out + off[j] * es, a.counts[j] * es);
  }
  t.exchange({});
  return true;
}

bool broadcast_direct(Transport& t, const CollArgs& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  std::optional<Exposed> src;
  if (t.rank() == a.root) src.emplace(t, a.out, bytes, true);
  auto where = publish(t, {src ? src->offset() : 0, 0, src ? src->ok() : true});
  if (!where) return false;
  if (t.rank() != a.root) copy_from_peer(t, a.root, (*where)[a.root].in, static_cast<std::byte*>(a.out), bytes);
  t.exchange({});
  return true;
}

bool reduce_direct(Transport& t, const CollArgs& a) {
  const size_t bytes = a.count * dtype_size(a.dtype);
  Exposed in(t, a.in, bytes, true);
  auto where = publish(t, {in.offset(), 0, in.ok()});
  if (!where) return false;
  if (t.rank() == a.root) reduce_owned(t, *where, 0, a.count, 0, a.out, a);
  t.exchange({});
  return true;
}

bool all_to_all_v_direct(Transport& t, const CollArgs& a) {
  const int n = t.size(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  const auto send_off = prefix_offsets(a.counts);
  const auto recv_off = prefix_offsets(a.recv_counts);
  // In place, peers would read blocks this rank is already overwriting: they read a staged copy.
  const auto* in_lo = static_cast<const std::byte*>(a.in);
  const auto* out_lo = static_cast<const std::byte*>(a.out);
  const bool overlap = in_lo < out_lo + recv_off[n] * es && out_lo < in_lo + send_off[n] * es;
  Exposed in(t, a.in, send_off[n] * es, true, overlap);
  // Peers need my send offsets to find their block: publish them beside the buffer's offset.
  // Record: ok, offset, send offsets[n+1].
  std::vector<uint64_t> rec(n + 3);
  rec[0] = in.ok();
  rec[1] = in.offset();
  for (int j = 0; j <= n; ++j) rec[j + 2] = send_off[j];
  auto recs = t.exchange({reinterpret_cast<const std::byte*>(rec.data()), rec.size() * sizeof(uint64_t)});
  for (int j = 0; j < n; ++j) {
    uint64_t ok;
    std::memcpy(&ok, recs[j].data(), sizeof ok);
    if (!ok) return false;
  }
  auto* out = static_cast<std::byte*>(a.out);
  for (int j = 0; j < n; ++j) {
    uint64_t peer[3];
    std::memcpy(peer, recs[j].data() + sizeof(uint64_t), sizeof(uint64_t));
    std::memcpy(peer + 1, recs[j].data() + sizeof(uint64_t) * (r + 2), 2 * sizeof(uint64_t));
    if (peer[2] - peer[1] != a.recv_counts[j])
      throw CommError("all_to_all_v: group rank " + std::to_string(j) + " sends " + std::to_string(peer[2] - peer[1]) +
                      " elements to group rank " + std::to_string(r) + ", which expects " +
                      std::to_string(a.recv_counts[j]) + " (send and receive counts disagree)");
    copy_from_peer(t, j, peer[0] + peer[1] * es, out + recv_off[j] * es, a.recv_counts[j] * es);
  }
  t.exchange({});
  return true;
}

}  // namespace loom::comm
