// One rank of a multi-rank collectives test, started by `loom run` or `mpirun` from collectives_test.cpp.
// Exits 0 when every check passed; otherwise prints what failed (with the seed) and exits non-zero.
//   comm_worker matrix      every op x dtype x size x in-place x algorithm, against a float64 reference,
//                           and every rank's results hashed and compared (bitwise-identical results)
//   comm_worker subgroups   two sub-groups (even / odd ranks) running at once, plus a split by halves
//   comm_worker async       many ops in flight, completed in issue order
//   comm_worker hier        all_reduce / reduce_scatter / all_gather across forced nodes; MPI must carry bytes
//   comm_worker never_join  rank 1 never joins; the others must fail with the watchdog message
//   comm_worker mismatch    rank 1 calls all_gather where the others call all_reduce (LOOM_COMM_DEBUG=1)
//   comm_worker count_mismatch_small|count_mismatch_large   rank 1 all-reduces 16 elements more
//   comm_worker crash       rank 1 dies by SIGKILL while the others wait in an all_reduce
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "loom/comm/world.h"
#include "loom/core/bf16.h"
#include "loom/error.h"

using namespace loom;
using namespace loom::comm;

namespace {

uint64_t seed = 20261202;
int failures = 0;

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Input element i of `rank` for op number `op`, as a double exactly representable in the dtype.
double value(DType t, uint64_t op, int rank, size_t i) {
  uint64_t h = mix(seed ^ mix(op * 1315423911ull + rank * 2654435761ull + i));
  switch (t) {
    case DType::I32:
    case DType::I64: return static_cast<double>(static_cast<int64_t>(h % 2001) - 1000);
    case DType::BF16: return round_to_bf16(static_cast<float>((h >> 11) * 0x1.0p-53 * 2 - 1));
    case DType::F32: return static_cast<float>((h >> 11) * 0x1.0p-53 * 2 - 1);
    default: return (h >> 11) * 0x1.0p-53 * 2 - 1;
  }
}


double tolerance(DType t, double magnitude, int n) {
  switch (t) {
    case DType::F32: return 4e-7 * n * (magnitude + 1);
    case DType::BF16: return 8e-3 * (magnitude + 1);
    case DType::F64: return 1e-14 * n * (magnitude + 1);
    default: return 0;
  }
}

uint64_t hash_bytes(const void* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

double reduce_ref(ReduceOp op, DType t, uint64_t opno, int n, size_t i) {
  double acc = value(t, opno, 0, i);
  for (int r = 1; r < n; ++r) {
    double v = value(t, opno, r, i);
    if (op == ReduceOp::kMax) acc = std::max(acc, v);
    else if (op == ReduceOp::kMin) acc = std::min(acc, v);
    else acc += v;
  }
  return op == ReduceOp::kAvg ? acc / n : acc;
}

struct Checker {
  std::string what;
  DType t;
  int n;
  int bad = 0;
  // Large buffers are checked at a stride (plus the ends); the cross-rank hash still covers every byte.
  bool checked(size_t i, size_t count) const { return count < 4096 || i % 61 == 0 || i + 8 > count || i < 8; }
  void expect(size_t i, double got, double want) {
    if (std::fabs(got - want) <= tolerance(t, std::fabs(want), n)) return;
    if (bad++ < 3) std::fprintf(stderr, "FAIL %s: element %zu is %.9g, expected %.9g (seed %llu)\n", what.c_str(), i, got,
                                want, static_cast<unsigned long long>(seed));
    ++failures;
  }
};

// Runs each collective once with the given algorithm forced; returns hashes of the results that
// must be identical on every rank.
void run_matrix(ProcessGroup& pg, std::vector<uint64_t>& hashes, int& checks) {
  const int n = pg.size(), r = pg.rank();
  const DType dtypes[] = {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64};
  const Algo algos[] = {Algo::kAuto, Algo::kOneShot, Algo::kDirect, Algo::kRing};
  uint64_t opno = 0;
  for (Algo algo : algos) {
    for (auto& f : pg.tuning().forced) f = algo;
    for (DType t : dtypes) {
      const size_t es = dtype_size(t);
      std::vector<size_t> sizes = {0, 1, 7, static_cast<size_t>(n) * 5 + 1};
      if (algo == Algo::kAuto || algo == Algo::kRing) sizes.push_back((size_t{4} << 20) / es / (t == DType::F32 ? 1 : 4));
      for (size_t count : sizes) {
        for (int in_place = 0; in_place < 2; ++in_place) {
          const ReduceOp rop = (t == DType::I32 || t == DType::I64) ? ReduceOp(opno % 3 == 1 ? 0 : opno % 3 + 1 == 3 ? 3 : 2)
                                                                    : ReduceOp(opno % 4);
          const std::string tag = fmt::format("{} {} n={} count={} in_place={}", algo_name(algo), dtype_name(t), n, count,
                                              in_place);
          // all_reduce
          {
            ++opno;
            std::vector<std::byte> in(count * es + 1), out(count * es + 1);
            for (size_t i = 0; i < count; ++i) store_element(in.data(), i, t, value(t, opno, r, i));
            void* dst = in_place ? in.data() : out.data();
            pg.all_reduce(in.data(), dst, count, t, rop).wait();
            Checker c{fmt::format("all_reduce({}) {}", reduce_op_name(rop), tag), t, n};
            for (size_t i = 0; i < count; ++i)
              if (c.checked(i, count)) c.expect(i, load_element(dst, i, t), reduce_ref(rop, t, opno, n, i)), ++checks;
            hashes.push_back(hash_bytes(dst, count * es));
          }
          // reduce_scatter: count elements per rank
          {
            ++opno;
            const size_t per = count / n + (count % 2);
            std::vector<std::byte> in(per * n * es + 1), out(per * es + 1);
            for (size_t i = 0; i < per * n; ++i) store_element(in.data(), i, t, value(t, opno, r, i));
            void* dst = in_place ? in.data() + r * per * es : out.data();
            if (in_place) {  // reduce_scatter in place means the output overlaps this rank's input block: copy first
              std::vector<std::byte> copy(in);
              pg.reduce_scatter(copy.data(), dst, per, t, rop).wait();
            } else {
              pg.reduce_scatter(in.data(), dst, per, t, rop).wait();
            }
            Checker c{fmt::format("reduce_scatter {}", tag), t, n};
            for (size_t i = 0; i < per; ++i)
              if (c.checked(i, per)) c.expect(i, load_element(dst, i, t), reduce_ref(rop, t, opno, n, r * per + i)), ++checks;
          }
          // all_gather
          {
            ++opno;
            const size_t per = count / n + 1;
            std::vector<std::byte> in(per * es + 1), out(per * n * es + 1);
            for (size_t i = 0; i < per; ++i) store_element(in.data(), i, t, value(t, opno, r, i));
            const void* src = in.data();
            if (in_place) {
              std::memcpy(out.data() + r * per * es, in.data(), per * es);
              src = out.data() + r * per * es;
            }
            pg.all_gather(src, out.data(), per, t).wait();
            Checker c{fmt::format("all_gather {}", tag), t, n};
            for (int j = 0; j < n; ++j)
              for (size_t i = 0; i < per; ++i)
                if (c.checked(i, per)) c.expect(j * per + i, load_element(out.data(), j * per + i, t), value(t, opno, j, i)), ++checks;
            hashes.push_back(hash_bytes(out.data(), per * n * es));
          }
          // all_gather_v: rank j contributes (count + j) % 5 + j elements
          {
            ++opno;
            std::vector<size_t> counts(n);
            for (int j = 0; j < n; ++j) counts[j] = (count + j) % 5 + j + (count > 1000 ? count / n : 0);
            size_t total = 0;
            for (auto c : counts) total += c;
            std::vector<std::byte> in(counts[r] * es + 1), out(total * es + 1);
            for (size_t i = 0; i < counts[r]; ++i) store_element(in.data(), i, t, value(t, opno, r, i));
            pg.all_gather_v(in.data(), out.data(), counts, t).wait();
            Checker c{fmt::format("all_gather_v {}", tag), t, n};
            size_t at = 0;
            for (int j = 0; j < n; ++j)
              for (size_t i = 0; i < counts[j]; ++i, ++at)
                if (c.checked(i, counts[j])) c.expect(at, load_element(out.data(), at, t), value(t, opno, j, i)), ++checks;
          }
          // broadcast from root = opno % n
          {
            ++opno;
            const int root = static_cast<int>(opno % n);
            std::vector<std::byte> buf(count * es + 1);
            for (size_t i = 0; i < count; ++i) store_element(buf.data(), i, t, value(t, opno, r, i));
            pg.broadcast(buf.data(), count, t, root).wait();
            Checker c{fmt::format("broadcast root {} {}", root, tag), t, n};
            for (size_t i = 0; i < count; ++i)
              if (c.checked(i, count)) c.expect(i, load_element(buf.data(), i, t), value(t, opno, root, i)), ++checks;
            hashes.push_back(hash_bytes(buf.data(), count * es));
          }
          // reduce to root
          {
            ++opno;
            const int root = static_cast<int>((opno + 1) % n);
            std::vector<std::byte> in(count * es + 1), out(count * es + 1);
            for (size_t i = 0; i < count; ++i) store_element(in.data(), i, t, value(t, opno, r, i));
            void* dst = in_place ? in.data() : out.data();
            pg.reduce(in.data(), dst, count, t, rop, root).wait();
            if (r == root) {
              Checker c{fmt::format("reduce root {} {}", root, tag), t, n};
              for (size_t i = 0; i < count; ++i)
                if (c.checked(i, count)) c.expect(i, load_element(dst, i, t), reduce_ref(rop, t, opno, n, i)), ++checks;
            }
          }
          // all_to_all and all_to_all_v (block from j to k has (j + 2k + count) % 4 elements, plus a share of count)
          {
            ++opno;
            const size_t per = count / n + 1;
            std::vector<std::byte> in(per * n * es + 1), out(per * n * es + 1);
            for (size_t i = 0; i < per * n; ++i) store_element(in.data(), i, t, value(t, opno, r, i));
            pg.all_to_all(in.data(), out.data(), per, t).wait();
            Checker c{fmt::format("all_to_all {}", tag), t, n};
            for (int j = 0; j < n; ++j)
              for (size_t i = 0; i < per; ++i)
                if (c.checked(i, per)) c.expect(j * per + i, load_element(out.data(), j * per + i, t), value(t, opno, j, r * per + i)), ++checks;
          }
          {
            ++opno;
            auto blk = [&](int from, int to) { return static_cast<size_t>((from + 2 * to + count) % 4) + count / (n * n); };
            std::vector<size_t> sc(n), rc(n);
            size_t st = 0, rt = 0;
            for (int j = 0; j < n; ++j) st += sc[j] = blk(r, j), rt += rc[j] = blk(j, r);
            std::vector<std::byte> in(st * es + 1), out(rt * es + 1);
            for (size_t i = 0; i < st; ++i) store_element(in.data(), i, t, value(t, opno, r, i));
            pg.all_to_all_v(in.data(), out.data(), sc, rc, t).wait();
            Checker c{fmt::format("all_to_all_v {}", tag), t, n};
            size_t at = 0;
            for (int j = 0; j < n; ++j) {
              size_t off = 0;  // where rank j's block for me starts in j's input
              for (int k = 0; k < r; ++k) off += blk(j, k);
              for (size_t i = 0; i < rc[j]; ++i, ++at)
                if (c.checked(i, rc[j])) c.expect(at, load_element(out.data(), at, t), value(t, opno, j, off + i)), ++checks;
            }
          }
        }
      }
    }
  }
  for (auto& f : pg.tuning().forced) f = Algo::kAuto;
  // tagged send/recv around a ring: every rank sends to r+1 and receives from r-1
  if (n > 1) {
    for (size_t count : {size_t{0}, size_t{3}, size_t{1} << 20}) {
      std::vector<float> out(count), in(count);
      for (size_t i = 0; i < count; ++i) out[i] = static_cast<float>(value(DType::F32, 999, r, i));
      // A large send completes only once received (ops run in issue order), so even ranks send first.
      Work s, rv;
      if (r % 2 == 0) {
        s = pg.send(out.data(), count, DType::F32, (r + 1) % n, 42 + count);
        rv = pg.recv(in.data(), count, DType::F32, (r + n - 1) % n, 42 + count);
      } else {
        rv = pg.recv(in.data(), count, DType::F32, (r + n - 1) % n, 42 + count);
        s = pg.send(out.data(), count, DType::F32, (r + 1) % n, 42 + count);
      }
      rv.wait();
      s.wait();
      Checker c{fmt::format("send/recv {} elements", count), DType::F32, 1};
      for (size_t i = 0; i < count; ++i) c.expect(i, in[i], value(DType::F32, 999, (r + n - 1) % n, i)), ++checks;
    }
  }
  // grouped send/recv: every rank sends to both neighbours and receives from both, all ranks listing the
  // ops in the same order; with plain send/recv in issue order a message larger than the channel would
  // deadlock here. Two messages to one peer (n = 2: both neighbours are the same rank) keep list order.
  if (n > 1) {
    for (size_t count : {size_t{0}, size_t{5}, size_t{1} << 20}) {
      const int right = (r + 1) % n, left = (r + n - 1) % n;
      std::vector<float> to_right(count), to_left(count), from_left(count), from_right(count);
      for (size_t i = 0; i < count; ++i) {
        to_right[i] = static_cast<float>(value(DType::F32, 501, r, i));
        to_left[i] = static_cast<float>(value(DType::F32, 502, r, i));
      }
      using PeerOp = ProcessGroup::PeerOp;
      const PeerOp ops[] = {{true, to_right.data(), count, DType::F32, right, 7000 + count},
                            {true, to_left.data(), count, DType::F32, left, 8000 + count},
                            {false, from_left.data(), count, DType::F32, left, 7000 + count},
                            {false, from_right.data(), count, DType::F32, right, 8000 + count}};
      pg.send_recv_many(ops).wait();
      Checker c{fmt::format("send_recv_many {} elements", count), DType::F32, 1};
      for (size_t i = 0; i < count; ++i) {
        c.expect(i, from_left[i], value(DType::F32, 501, left, i)), ++checks;
        c.expect(i, from_right[i], value(DType::F32, 502, right, i)), ++checks;
      }
    }
  }
  pg.barrier().wait();
}

int matrix(World& world) {
  ProcessGroup& pg = world.group();
  std::vector<uint64_t> hashes;
  int checks = 0;
  run_matrix(pg, hashes, checks);
  // Bitwise identical everywhere: every rank's result hashes equal rank 0's.
  std::vector<uint64_t> all(hashes.size() * pg.size());
  pg.all_gather(hashes.data(), all.data(), hashes.size(), DType::I64).wait();
  for (int j = 1; j < pg.size(); ++j)
    for (size_t i = 0; i < hashes.size(); ++i)
      if (all[j * hashes.size() + i] != all[i]) {
        std::fprintf(stderr, "FAIL: result %zu differs between rank 0 and rank %d (not bitwise identical)\n", i, j);
        ++failures;
        break;
      }
  std::printf("rank %d: matrix %s on %s: %d checks, %zu hashes, %d failures\n", world.rank(),
              failures ? "FAILED" : "ok", pg.transport_name(), checks, hashes.size(), failures);
  return failures ? 1 : 0;
}

int subgroups(World& world) {
  ProcessGroup& pg = world.group();
  const int r = pg.rank(), n = pg.size();
  auto parity = pg.split(r % 2, r);
  auto halves = pg.split(r < n / 2 ? 0 : 1, -r);  // reversed order inside each half
  auto none = pg.split(r == 0 ? 0 : -1, 0);
  if ((r == 0) != (none != nullptr)) ++failures;
  // Both groups at once: ops issued on each, then waited together.
  const size_t count = 100000;
  std::vector<double> a(count, r + 1.0), b(count, 10.0 * (r + 1));
  auto wa = parity->all_reduce(a.data(), a.data(), count, DType::F64);
  auto wb = halves->all_reduce(b.data(), b.data(), count, DType::F64);
  wa.wait();
  wb.wait();
  double want_a = 0, want_b = 0;
  for (int j = 0; j < n; ++j) {
    if (j % 2 == r % 2) want_a += j + 1.0;
    if ((j < n / 2) == (r < n / 2)) want_b += 10.0 * (j + 1);
  }
  if (a[0] != want_a || a[count - 1] != want_a || b[0] != want_b || b[count - 1] != want_b) {
    std::fprintf(stderr, "FAIL subgroups: got %g %g, expected %g %g\n", a[0], b[0], want_a, want_b);
    ++failures;
  }
  // Group ranks follow (key, rank): the halves were keyed by -rank.
  if (halves->ranks().front() < halves->ranks().back() && halves->size() > 1) {
    std::fprintf(stderr, "FAIL subgroups: split keys not honoured\n");
    ++failures;
  }
  std::printf("rank %d: subgroups %s\n", world.rank(), failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

int async_order(World& world) {
  ProcessGroup& pg = world.group();
  const int n = pg.size();
  // Each op doubles the buffer it gets from the previous one: the answer depends on issue order.
  const int ops = 40;
  std::vector<float> buf(300000, 1.0f);
  std::vector<Work> works;
  for (int k = 0; k < ops; ++k)
    works.push_back(pg.all_reduce(buf.data(), buf.data(), buf.size(), DType::F32, k % 2 ? ReduceOp::kAvg : ReduceOp::kSum));
  for (auto& w : works) w.wait();
  double want = 1;
  for (int k = 0; k < ops; ++k) want = k % 2 ? want : want * n;
  if (buf[0] != static_cast<float>(want) || buf.back() != static_cast<float>(want)) {
    std::fprintf(stderr, "FAIL async: got %g, expected %g\n", buf[0], want);
    ++failures;
  }
  std::printf("rank %d: async %s\n", world.rank(), failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}

int hier(World& world) {
  ProcessGroup& pg = world.group();
  std::vector<uint64_t> hashes;
  int checks = 0;
  const int n = pg.size(), r = pg.rank();
  const size_t count = (size_t{1} << 20) + 3;
  std::vector<float> in(count), out(count);
  for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>(value(DType::F32, 7, r, i));
  pg.all_reduce(in.data(), out.data(), count, DType::F32).wait();
  Checker c{"hierarchical all_reduce", DType::F32, n};
  for (size_t i = 0; i < count; i += 97) c.expect(i, out[i], reduce_ref(ReduceOp::kSum, DType::F32, 7, n, i)), ++checks;
  std::vector<float> rs(count / n);
  std::vector<float> rsin(rs.size() * n);
  for (size_t i = 0; i < rsin.size(); ++i) rsin[i] = static_cast<float>(value(DType::F32, 8, r, i));
  pg.reduce_scatter(rsin.data(), rs.data(), rs.size(), DType::F32).wait();
  Checker c2{"hierarchical reduce_scatter", DType::F32, n};
  for (size_t i = 0; i < rs.size(); i += 89)
    c2.expect(i, rs[i], reduce_ref(ReduceOp::kSum, DType::F32, 8, n, r * rs.size() + i)), ++checks;
  std::vector<float> ag(rs.size() * n);
  pg.all_gather(rs.data(), ag.data(), rs.size(), DType::F32).wait();
  Checker c3{"hierarchical all_gather", DType::F32, n};
  for (size_t i = 0; i < ag.size(); i += 101)
    c3.expect(i, ag[i], reduce_ref(ReduceOp::kSum, DType::F32, 8, n, i)), ++checks;
  run_matrix(pg, hashes, checks);
  const auto st = pg.stats();
  std::printf("rank %d: hier %s on %s over %d nodes: %d checks, inter-node bytes %llu\n", world.rank(),
              failures ? "FAILED" : "ok", pg.transport_name(), world.nodes(), checks,
              static_cast<unsigned long long>(st.inter_node_bytes));
  if (world.nodes() > 1 && st.inter_node_bytes == 0) {
    std::fprintf(stderr, "FAIL: no bytes went through the inter-node transport\n");
    return 1;
  }
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: comm_worker matrix|subgroups|async|hier|never_join|mismatch|count_mismatch_small|"
                 "count_mismatch_large|crash\n");
    return 2;
  }
  const std::string what = argv[1];
  if (const char* s = std::getenv("LOOM_TEST_SEED")) seed = std::strtoull(s, nullptr, 10);
  try {
    auto job = read_job_env();
    if (what == "never_join" && job.rank == 1) {
      pause();  // never joins; the launcher ends it when the others fail
      return 0;
    }
    auto world = World::join(job, comm_options_from_env(current_environment()));
    if (what == "matrix") return matrix(*world);
    if (what == "subgroups") return subgroups(*world);
    if (what == "async") return async_order(*world);
    if (what == "hier") return hier(*world);
    if (what == "never_join") {
      std::printf("rank %d joined although rank 1 never did\n", job.rank);
      return 1;
    }
    if (what == "mismatch") {
      std::vector<float> buf(64 * world->size(), 1.0f);
      if (job.rank == 1) world->group().all_gather(buf.data(), buf.data(), 64, DType::F32).wait();
      else world->group().all_reduce(buf.data(), buf.data(), 64, DType::F32).wait();
      return 1;
    }
    if (what == "count_mismatch_small" || what == "count_mismatch_large") {
      // Rank 1 reduces a few more elements than the others: one-shot (small) or ring/direct (large).
      const size_t n = what == "count_mismatch_small" ? 64 : size_t{1} << 20;
      std::vector<float> buf(n + 16, 1.0f);
      world->group().all_reduce(buf.data(), buf.data(), job.rank == 1 ? n + 16 : n, DType::F32).wait();
      return 1;
    }
    if (what == "crash") {
      std::vector<float> buf(1 << 20, 1.0f);
      if (job.rank == 1) {
        std::fflush(stdout);
        kill(getpid(), SIGKILL);
      }
      world->group().all_reduce(buf.data(), buf.data(), buf.size(), DType::F32).wait();
      return 1;
    }
    std::fprintf(stderr, "unknown scenario %s\n", what.c_str());
    return 2;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "comm_worker: error: %s\n", e.what());
    return 3;
  }
}
