// Ring and pipeline algorithms over send_recv: they need nothing but ordered messages, so they run on
// every transport (MPI between nodes, shared memory when the arena cannot stage a buffer).
//
// Reduce-scatter ring, n ranks, chunk c finally owned by rank c: at step s (0..n-2) rank r sends its
// partial of chunk r-1-s to rank r+1 and receives rank r-1's partial of chunk r-2-s, to which it adds
// its own contribution. After n-1 steps the chunk received last is r itself, complete. Partials travel
// in the accumulator type (f32 for bf16), so bf16 is rounded once, at the owner.
// All-gather ring: at step s rank r sends chunk r-s (complete) and receives chunk r-s-1.
// Each chunk is reduced once and then only copied: every rank ends with the same bits.
#include <algorithm>
#include <cstring>

#include "loom/comm/algorithms.h"
#include "loom/comm/reduce_kernels.h"

namespace loom::comm {

namespace {
int wrap(int k, int n) { return ((k % n) + n) % n; }

std::span<const std::byte> cbytes(const void* p, size_t n) { return {static_cast<const std::byte*>(p), n}; }
std::span<std::byte> mbytes(void* p, size_t n) { return {static_cast<std::byte*>(p), n}; }

// Reduce-scatter over chunks given by `begin(c)` (element offsets into `in`, n+1 entries); the owned
// chunk ends in `out`.
void ring_reduce_scatter(Transport& t, const void* in, void* out, const std::vector<size_t>& begin, const CollArgs& a) {
  const int n = t.size(), r = t.rank();
  const size_t es = dtype_size(a.dtype), as = dtype_size(accumulator_type(a.dtype));
  const auto* src = static_cast<const std::byte*>(in);
  size_t max_chunk = 0;
  for (int c = 0; c < n; ++c) max_chunk = std::max(max_chunk, begin[c + 1] - begin[c]);
  std::vector<std::byte> send_buf(max_chunk * as), recv_buf(max_chunk * as);
  const int right = wrap(r + 1, n), left = wrap(r - 1, n);
  // Step 0 sends my own contribution of chunk r-1, converted to the accumulator type.
  int c_send = wrap(r - 1, n);
  reduce_hop(send_buf.data(), nullptr, src + begin[c_send] * es, begin[c_send + 1] - begin[c_send], a.dtype, a.reduce,
             false, n);
  for (int s = 0; s < n - 1; ++s) {
    const int c_recv = wrap(r - 2 - s, n);
    const size_t send_n = begin[c_send + 1] - begin[c_send], recv_n = begin[c_recv + 1] - begin[c_recv];
    t.send_recv(right, cbytes(send_buf.data(), send_n * as), left, mbytes(recv_buf.data(), recv_n * as));
    const bool last = s == n - 2;
    reduce_hop(last ? out : send_buf.data(), recv_buf.data(), src + begin[c_recv] * es, recv_n, a.dtype, a.reduce,
               last, n);
    c_send = c_recv;
  }
}

// All-gather over blocks at element offsets `begin` of `out`; this rank's block must already be there.
void ring_all_gather(Transport& t, void* out, const std::vector<size_t>& begin, size_t es) {
  const int n = t.size(), r = t.rank();
  auto* o = static_cast<std::byte*>(out);
  for (int s = 0; s < n - 1; ++s) {
    const int c_send = wrap(r - s, n), c_recv = wrap(r - s - 1, n);
    t.send_recv(wrap(r + 1, n), cbytes(o + begin[c_send] * es, (begin[c_send + 1] - begin[c_send]) * es),
                wrap(r - 1, n), mbytes(o + begin[c_recv] * es, (begin[c_recv + 1] - begin[c_recv]) * es));
  }
}

std::vector<size_t> balanced(size_t count, int n) {
  std::vector<size_t> b(n + 1);
  for (int j = 0; j <= n; ++j) b[j] = chunk_begin(count, n, j);
  return b;
}
}  // namespace

void all_reduce_ring(Transport& t, const CollArgs& a) {
  const int n = t.size();
  const size_t es = dtype_size(a.dtype);
  if (n == 1) {
    reduce_hop(a.out, nullptr, a.in, a.count, a.dtype, a.reduce, true, 1);
    return;
  }
  const auto begin = balanced(a.count, n);
  auto* out = static_cast<std::byte*>(a.out);
  ring_reduce_scatter(t, a.in, out + begin[t.rank()] * es, begin, a);
  ring_all_gather(t, a.out, begin, es);
}

void reduce_scatter_ring(Transport& t, const CollArgs& a) {
  const int n = t.size();
  std::vector<size_t> begin(n + 1);
  for (int j = 0; j <= n; ++j) begin[j] = a.count * j;
  if (n == 1) {
    reduce_hop(a.out, nullptr, a.in, a.count, a.dtype, a.reduce, true, 1);
    return;
  }
  ring_reduce_scatter(t, a.in, a.out, begin, a);
}

void all_gather_v_ring(Transport& t, const CollArgs& a) {
  const size_t es = dtype_size(a.dtype);
  const auto begin = prefix_offsets(a.counts);
  auto* out = static_cast<std::byte*>(a.out);
  const size_t mine = a.counts[t.rank()] * es;
  if (a.in != out + begin[t.rank()] * es && mine) std::memcpy(out + begin[t.rank()] * es, a.in, mine);
  ring_all_gather(t, a.out, begin, es);
}

// Pipelined chain root -> root+1 -> ... in pieces, so every link is busy at once for large buffers.
void broadcast_chain(Transport& t, const CollArgs& a) {
  const int n = t.size();
  if (n == 1) return;
  const size_t bytes = a.count * dtype_size(a.dtype);
  const size_t piece = size_t{1} << 20;
  const int pos = wrap(t.rank() - a.root, n);
  auto* buf = static_cast<std::byte*>(a.out);
  for (size_t off = 0; off < bytes || off == 0; off += piece) {
    const size_t len = std::min(piece, bytes - off);
    if (pos > 0) t.recv(wrap(t.rank() - 1, n), off, mbytes(buf + off, len));
    if (pos < n - 1) t.send(wrap(t.rank() + 1, n), off, cbytes(buf + off, len));
    if (bytes == 0) break;
  }
}

// Reduce-scatter ring, then the owners send their chunks to the root.
void reduce_ring(Transport& t, const CollArgs& a) {
  const int n = t.size(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  if (n == 1) {
    reduce_hop(a.out, nullptr, a.in, a.count, a.dtype, a.reduce, true, 1);
    return;
  }
  const auto begin = balanced(a.count, n);
  std::vector<std::byte> mine((begin[r + 1] - begin[r]) * es);
  ring_reduce_scatter(t, a.in, mine.data(), begin, a);
  if (r != a.root) {
    t.send(a.root, 0, mine);
    return;
  }
  auto* out = static_cast<std::byte*>(a.out);
  if (!mine.empty()) std::memcpy(out + begin[r] * es, mine.data(), mine.size());
  for (int j = 0; j < n; ++j)
    if (j != r) t.recv(j, 0, mbytes(out + begin[j] * es, (begin[j + 1] - begin[j]) * es));
}

// n-1 rounds; in round s every rank sends to r+s and receives from r-s, so each round is a permutation.
void all_to_all_v_pairwise(Transport& t, const CollArgs& a) {
  const int n = t.size(), r = t.rank();
  const size_t es = dtype_size(a.dtype);
  const auto send_off = prefix_offsets(a.counts);
  const auto recv_off = prefix_offsets(a.recv_counts);
  const auto* in = static_cast<const std::byte*>(a.in);
  auto* out = static_cast<std::byte*>(a.out);
  if (a.counts[r]) std::memcpy(out + recv_off[r] * es, in + send_off[r] * es, a.counts[r] * es);
  for (int s = 1; s < n; ++s) {
    const int to = wrap(r + s, n), from = wrap(r - s, n);
    t.send_recv(to, cbytes(in + send_off[to] * es, a.counts[to] * es), from,
                mbytes(out + recv_off[from] * es, a.recv_counts[from] * es));
  }
}

}  // namespace loom::comm
