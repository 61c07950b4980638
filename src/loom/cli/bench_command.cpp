// `loom bench comm`: the collectives benchmark, in the style of nccl-tests. Run one copy per rank
// (`loom run -n 2 -- loom bench comm`, or under mpirun for `--vs mpi`). For every op and size it prints
// time, algbw and busbw (nccl-tests' definitions), the number of wrong result elements, the CPU time the
// communication used, the ceiling measured in the same run (one process, one thread per rank, moving the
// bytes the op must move at least) and, with --vs mpi, OpenMPI's own collective on the same buffers.
#include <fmt/format.h>
#include <mpi.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "loom/cli/commands.h"
#include "loom/comm/reduce_kernels.h"
#include "loom/kernels/cpu_backend.h"
#include "loom/kernels/gemm.h"
#include "loom/comm/world.h"
#include "loom/error.h"

namespace loom::cli {

namespace {

using Clock = std::chrono::steady_clock;
using comm::OpKind;
using comm::ProcessGroup;
using comm::ReduceOp;

struct BenchArgs {
  std::vector<std::string> ops{"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"};
  std::string dtype = "f32";
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  int factor = 4;
  double batch_seconds = 0.1;  // each timed batch runs about this long
  int batches = 5;             // the median batch is reported
  bool plain = false;          // plain (unregistered) buffers
  bool inplace = false;
  bool vs_mpi = false;
  bool ceiling = true;
  bool json = false;      // one JSON object per row instead of the table
  int check_cost = 0;     // rounds of alternating the always-on op check off and on (0: not measured)
  std::string transport;  // --comm: overrides LOOM_COMM
  // > 0: each op is issued alone and waited for after this many milliseconds of GEMMs on the rank's
  // threads, as a training step issues its blocking collectives; the time is the rank-average wait.
  double busy_ms = 0;
};

size_t parse_bytes(const std::string& s) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  std::string unit = s.substr(pos);
  double mul = unit.empty() || unit == "B" ? 1
               : unit == "K" || unit == "KiB" ? 1024.0
               : unit == "M" || unit == "MiB" ? 1024.0 * 1024
               : unit == "G" || unit == "GiB" ? 1024.0 * 1024 * 1024
                                              : -1;
  if (pos == 0 || mul < 0 || !(v >= 0) || v * mul > 1e15)
    throw ConfigError(fmt::format("bench comm: size '{}' is not a byte count: write e.g. 8, 4K, 64M or 1G", s));
  return static_cast<size_t>(v * mul);
}

OpKind parse_op(const std::string& s) {
  for (OpKind k : {OpKind::kAllReduce, OpKind::kReduceScatter, OpKind::kAllGather, OpKind::kBroadcast, OpKind::kReduce,
                   OpKind::kAllToAll})
    if (s == comm::op_name(k)) return k;
  throw ConfigError(fmt::format(
      "bench comm: unknown op '{}': use all_reduce, reduce_scatter, all_gather, broadcast, reduce or all_to_all", s));
}

// nccl-tests' conventions: `size` is the all_reduce / broadcast / reduce buffer, the reduce_scatter
// input, the all_gather output and the all_to_all buffer; busbw = algbw * factor.
struct Shape {
  size_t count = 0;  // per-rank element count the op is called with
  size_t in_elems = 0, out_elems = 0;
  double bus_factor = 1;
};

Shape shape_of(OpKind k, size_t bytes, size_t elem, int n) {
  Shape s;
  const size_t total = bytes / elem;
  switch (k) {
    case OpKind::kAllReduce:
      s = {total, total, total, 2.0 * (n - 1) / n};
      break;
    case OpKind::kReduceScatter:
      s = {total / n, total / n * n, total / n, double(n - 1) / n};
      break;
    case OpKind::kAllGather:
      s = {total / n, total / n, total / n * n, double(n - 1) / n};
      break;
    case OpKind::kAllToAll:
      s = {total / n, total / n * n, total / n * n, double(n - 1) / n};
      break;
    default:  // broadcast, reduce
      s = {total, total, total, 1.0};
  }
  return s;
}

double input_value(int rank, size_t j) { return (rank + 1) * 3.0 + static_cast<double>(j % 5); }

// Element i of this rank's result, from the inputs' formula (small integers: exact in every dtype).
double expected(OpKind k, size_t i, size_t count, int rank, int n) {
  auto sum_over_ranks = [n](size_t j) {
    double s = 0;
    for (int r = 0; r < n; ++r) s += input_value(r, j);
    return s;
  };
  switch (k) {
    case OpKind::kAllReduce:
    case OpKind::kReduce: return sum_over_ranks(i);
    case OpKind::kReduceScatter: return sum_over_ranks(rank * count + i);
    case OpKind::kAllGather: return input_value(static_cast<int>(i / count), i % count);
    case OpKind::kAllToAll: return input_value(static_cast<int>(i / count), rank * count + i % count);
    default: return input_value(0, i);  // broadcast from rank 0
  }
}

// Inputs are small integers, exact in every dtype; sums of many ranks may not be in bf16 (above 256).
double representable_in(DType t, double v) {
  alignas(8) std::byte tmp[8];
  store_element(tmp, 0, t, v);
  return load_element(tmp, 0, t);
}

// A buffer in the group's shared arena (registered) or in ordinary memory.
struct Buffer {
  comm::RegisteredBuffer reg;
  std::vector<std::byte> plain;
  std::byte* data() { return reg.size() ? reg.data() : plain.data(); }
};

Buffer make_buffer(ProcessGroup& pg, size_t bytes, bool registered) {
  Buffer b;
  if (registered && bytes > 0) {
    try {
      b.reg = pg.register_buffer(bytes);
      return b;
    } catch (const CommError& e) {
      // MPI arenas stop at 256 MiB whatever LOOM_COMM_ARENA_MB says: measure plain memory instead.
      static bool told = false;
      if (!told && pg.rank() == 0) fmt::print("# {}: using plain buffers from here on\n", e.what());
      told = true;
    }
  }
  b.plain.resize(std::max<size_t>(bytes, 64));
  return b;
}

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;  // bf16: MPI has no such type
  }
}

// A fixed amount of GEMM work that takes about `ms` milliseconds on this rank's threads when measured:
// fixed work, not a fixed time, so that ranks slowed by the machine's noise arrive late at the next
// collective, as they do in a training step.
class BusyWork {
 public:
  explicit BusyWork(double ms) : backend_(alloc_, nullptr, resolve_threads(0)) {
    if (ms <= 0) return;
    run_once();  // creates the primitive
    std::vector<double> t;
    for (int i = 0; i < 3; ++i) {
      const auto t0 = Clock::now();
      run_once();
      t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    reps_ = std::max(1, static_cast<int>(std::lround(ms * 1e-3 / std::max(t[1], 1e-7))));
  }
  void run() {
    for (int i = 0; i < reps_; ++i) run_once();
  }

 private:
  static constexpr int64_t kDim = 256;
  void run_once() {
    kernels::gemm({.M = kDim, .N = kDim, .K = kDim}, a_.data(), b_.data(), c_.data(), nullptr, alloc_);
  }
  Allocator alloc_;
  kernels::CpuBackend backend_;  // sets this rank's thread count for the GEMMs
  std::vector<float> a_ = std::vector<float>(kDim * kDim, 0.5f), b_ = std::vector<float>(kDim * kDim, 0.25f),
                     c_ = std::vector<float>(kDim * kDim);
  int reps_ = 0;
};

// The least work an op needs, done by one process with one thread per rank over n private buffers.
class Ceiling {
 public:
  explicit Ceiling(int n) : n_(n), sync_(n + 1) {
    for (int t = 0; t < n; ++t)
      threads_.emplace_back([this, t] {
        for (;;) {
          sync_.arrive_and_wait();
          if (stop_) return;
          job_(t);
          sync_.arrive_and_wait();
        }
      });
  }
  ~Ceiling() {
    stop_ = true;
    sync_.arrive_and_wait();
    for (auto& t : threads_) t.join();
  }

  // Seconds per op (median of `batches`).
  double measure(OpKind k, const Shape& s, DType dtype, double batch_seconds, int batches) {
    const size_t e = dtype_size(dtype);
    std::vector<std::vector<std::byte>> in(n_), out(n_);
    for (int r = 0; r < n_; ++r) {
      in[r].assign(std::max<size_t>(s.in_elems * e, 64), std::byte{1});
      out[r].assign(std::max<size_t>(s.out_elems * e, 64), std::byte{0});
    }
    job_ = [&](int t) { work(k, s, dtype, in, out, t); };
    auto run = [&] {
      sync_.arrive_and_wait();
      sync_.arrive_and_wait();
    };
    run();
    auto t0 = Clock::now();
    run();
    const double one = std::chrono::duration<double>(Clock::now() - t0).count();
    const int iters = std::clamp(static_cast<int>(batch_seconds / std::max(one, 1e-7)), 1, 1000);
    std::vector<double> times;
    for (int b = 0; b < batches; ++b) {
      t0 = Clock::now();
      for (int i = 0; i < iters; ++i) run();
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

 private:
  // Thread t's share. Blocks of 16 KiB elements keep a reduced block in cache while it is copied out.
  void work(OpKind k, const Shape& s, DType dtype, std::vector<std::vector<std::byte>>& in,
            std::vector<std::vector<std::byte>>& out, int t) {
    const size_t e = dtype_size(dtype);
    auto range = [&](size_t total) { return std::pair{total * t / n_, total * (t + 1) / n_}; };
    std::vector<const void*> srcs(n_);
    auto reduce_into = [&](std::byte* dst, size_t in_offset, size_t len) {
      for (int r = 0; r < n_; ++r) srcs[r] = in[r].data() + in_offset * e;
      comm::reduce_sources(dst, srcs, len, dtype, ReduceOp::kSum, n_);
    };
    constexpr size_t kBlock = 16384;
    switch (k) {
      case OpKind::kAllReduce: {
        auto [lo, hi] = range(s.count);
        for (size_t b = lo; b < hi; b += kBlock) {
          const size_t len = std::min(kBlock, hi - b);
          reduce_into(out[0].data() + b * e, b, len);
          for (int r = 1; r < n_; ++r) std::memcpy(out[r].data() + b * e, out[0].data() + b * e, len * e);
        }
        break;
      }
      case OpKind::kReduce: {
        auto [lo, hi] = range(s.count);
        if (hi > lo) reduce_into(out[0].data() + lo * e, lo, hi - lo);
        break;
      }
      case OpKind::kReduceScatter: {
        auto [lo, hi] = range(s.count * n_);  // over (destination rank, element)
        for (size_t j = lo; j < hi;) {
          const size_t r = j / s.count, i = j % s.count, len = std::min(hi - j, s.count - i);
          reduce_into(out[r].data() + i * e, r * s.count + i, len);
          j += len;
        }
        break;
      }
      case OpKind::kBroadcast: {
        auto [lo, hi] = range(s.count);
        for (int r = 1; r < n_; ++r) std::memcpy(out[r].data() + lo * e, in[0].data() + lo * e, (hi - lo) * e);
        break;
      }
      case OpKind::kAllGather:
      case OpKind::kAllToAll: {
        // Block (d, b): rank d's output block b comes from rank b's input (block 0 or block d).
        auto [lo, hi] = range(size_t(n_) * n_ * s.count);
        for (size_t j = lo; j < hi;) {
          const size_t blk = j / s.count, i = j % s.count, len = std::min(hi - j, s.count - i);
          const size_t d = blk / n_, b = blk % n_;
          const size_t src_block = k == OpKind::kAllGather ? 0 : d;
          std::memcpy(out[d].data() + (b * s.count + i) * e, in[b].data() + (src_block * s.count + i) * e, len * e);
          j += len;
        }
        break;
      }
      default: break;
    }
  }

  int n_;
  std::barrier<> sync_;
  std::vector<std::thread> threads_;
  std::function<void(int)> job_;
  bool stop_ = false;
};

struct Row {
  double seconds = 0, cpu_seconds = 0, mpi_seconds = 0, ceiling_seconds = 0;
  double checked_seconds = 0, unchecked_seconds = 0;  // --check-cost: medians with the op stamps on / off
  uint64_t wrong = 0;
  std::string algo;
};

class CommBench {
 public:
  CommBench(const BenchArgs& a, comm::World& world) : a_(a), world_(world), pg_(world.group()), busy_(a.busy_ms) {
    dtype_ = parse_dtype(a.dtype);
    if (a.vs_mpi) {
      int init = 0;
      MPI_Initialized(&init);
      int size = 0;
      if (init) MPI_Comm_size(MPI_COMM_WORLD, &size);
      if (!init || size != pg_.size())
        throw ConfigError(
            "bench comm --vs mpi needs the ranks to be MPI processes: start it with mpirun, e.g. mpirun -np 2 loom bench "
            "comm --vs mpi (as root add --allow-run-as-root --oversubscribe)");
      if (mpi_type(dtype_) == MPI_DATATYPE_NULL)
        throw ConfigError(fmt::format("bench comm --vs mpi: MPI has no {} type; use f32, f64, i32 or i64", a.dtype));
    }
    if (a.ceiling && pg_.rank() == 0) ceiling_ = std::make_unique<Ceiling>(pg_.size());
  }

  void run() {
    const int n = pg_.size();
    const size_t lo = std::max<size_t>(parse_bytes(a_.min_bytes), dtype_size(dtype_));
    const size_t hi = parse_bytes(a_.max_bytes);
    // A size below one element is rounded up to one: say so rather than compare the sizes as given.
    if (hi < dtype_size(dtype_))
      throw ConfigError(fmt::format("bench comm: --max-bytes {} is less than one {} element ({} bytes)", a_.max_bytes,
                                    a_.dtype, dtype_size(dtype_)));
    if (hi < lo) throw ConfigError(fmt::format("bench comm: --max-bytes {} is below --min-bytes {}", a_.max_bytes, a_.min_bytes));
    if (a_.factor < 2) throw ConfigError("bench comm: --step-factor must be at least 2");
    if (pg_.rank() == 0 && !a_.json) {
      fmt::print("# loom bench comm: {} ranks on {} node(s), transport {}, {}, {} buffers, {}\n", n, world_.nodes(),
                 pg_.transport_name(), a_.dtype, a_.plain ? "plain" : "registered",
                 a_.inplace ? "in place" : "out of place");
      fmt::print("# time: median of {} batches, the slowest rank's; busbw = algbw x factor (nccl-tests); cpu: comm-thread "
                 "CPU per op, average rank\n",
                 a_.batches);
      fmt::print("{:>15} {:>10} {:>11} {:>8} {:>10} {:>9} {:>9} {:>7} {:>8} {:>9} {:>6} {:>9} {:>6}\n", "op", "size(B)",
                 "count", "algo", "time(us)", "algbw", "busbw", "#wrong", "cpu(us)", "ceil-bus", "%ceil", "mpi-bus",
                 "vs-mpi");
    }
    for (const auto& name : a_.ops) {
      const OpKind k = parse_op(name);
      for (size_t bytes = lo; bytes <= hi; bytes *= a_.factor) {
        const Shape s = shape_of(k, bytes, dtype_size(dtype_), n);
        if (s.count == 0) continue;
        Row row = measure(k, s);
        if (pg_.rank() == 0) print(k, s, row);
        if (bytes > hi / a_.factor) break;
      }
    }
  }

 private:
  Row measure(OpKind k, const Shape& s) {
    const size_t e = dtype_size(dtype_);
    const int n = pg_.size(), me = pg_.rank();
    const bool in_place = a_.inplace || k == OpKind::kBroadcast;
    // In place, one buffer of the larger size: all_gather's input is our block of the output,
    // reduce_scatter's output is our block of the input (nccl-tests' convention), the others share it.
    Buffer out = make_buffer(pg_, (in_place ? std::max(s.in_elems, s.out_elems) : s.out_elems) * e, !a_.plain);
    Buffer in_buf = in_place ? Buffer{} : make_buffer(pg_, s.in_elems * e, !a_.plain);
    std::byte* in = in_place ? (k == OpKind::kAllGather ? out.data() + me * s.count * e : out.data()) : in_buf.data();
    std::byte* out_ptr = in_place && k == OpKind::kReduceScatter ? out.data() + me * s.count * e : out.data();
    auto fill = [&] {
      const size_t elems = k == OpKind::kAllGather ? s.count : s.in_elems;
      for (size_t j = 0; j < elems; ++j) store_element(in, j, dtype_, input_value(me, j));
    };
    std::vector<std::byte> saved;  // in-place ops overwrite their input: restore before each op
    fill();
    if (in_place && k != OpKind::kAllGather && k != OpKind::kBroadcast)
      saved.assign(in, in + s.in_elems * e);
    auto issue = [&]() -> comm::Work {
      switch (k) {
        case OpKind::kAllReduce: return pg_.all_reduce(in, out_ptr, s.count, dtype_);
        case OpKind::kReduceScatter: return pg_.reduce_scatter(in, out_ptr, s.count, dtype_);
        case OpKind::kAllGather: return pg_.all_gather(in, out_ptr, s.count, dtype_);
        case OpKind::kBroadcast: return pg_.broadcast(out_ptr, s.count, dtype_, 0);
        case OpKind::kReduce: return pg_.reduce(in, out_ptr, s.count, dtype_, ReduceOp::kSum, 0);
        default: return pg_.all_to_all(in, out_ptr, s.count, dtype_);
      }
    };
    Row row;
    auto representable = [&](double v) { return representable_in(dtype_, v); };
    // Correctness first, on a fresh input.
    {
      auto w = issue();
      w.wait();
      row.algo = comm::algo_name(w.algorithm());
      const bool has_result = k != OpKind::kReduce || me == 0;
      const size_t out_elems = k == OpKind::kReduceScatter ? s.count : s.out_elems;
      if (has_result)
        for (size_t i = 0; i < out_elems; ++i)
          if (load_element(out_ptr, i, dtype_) != representable(expected(k, i, s.count, me, n))) ++row.wrong;
    }
    // Timing: the values no longer matter (in-place ops accumulate), only the bytes moved.
    const uint64_t wrong_here = row.wrong;
    row.seconds = a_.busy_ms > 0 ? time_between_work([&] { return issue(); })
                                 : time_batches([&] { return issue(); }, &row.cpu_seconds);
    row.wrong = static_cast<uint64_t>(reduce_max(static_cast<double>(wrong_here)));
    if (a_.vs_mpi) row.mpi_seconds = time_mpi(k, s, in, out_ptr);
    if (a_.check_cost > 0) {
      // The same ranks, buffers and placement, the check flipped between batches: the difference is the
      // check's, not the noise between two launches (which on this VM is larger than the op itself).
      std::vector<double> on, off;
      const bool was = pg_.tuning().check;
      for (int r = 0; r < a_.check_cost; ++r) {
        pg_.tuning().check = false;
        off.push_back(time_batches([&] { return issue(); }, nullptr));
        pg_.tuning().check = true;
        on.push_back(time_batches([&] { return issue(); }, nullptr));
      }
      pg_.tuning().check = was;
      std::sort(on.begin(), on.end());
      std::sort(off.begin(), off.end());
      row.checked_seconds = on[on.size() / 2];
      row.unchecked_seconds = off[off.size() / 2];
    }
    if (!saved.empty()) std::memcpy(in, saved.data(), saved.size());
    pg_.barrier().wait();
    // Below ~256 KiB the in-process "ceiling" measures its own thread barrier, not memory: not shown.
    const size_t moved = std::max(s.in_elems, s.out_elems) * e;
    if (ceiling_ && moved >= (size_t{256} << 10))
      row.ceiling_seconds = ceiling_->measure(k, s, dtype_, a_.batch_seconds, a_.batches);
    pg_.barrier().wait();
    return row;
  }

  double reduce_max(double v) {
    pg_.all_reduce(&v, &v, 1, DType::F64, ReduceOp::kMax).wait();
    return v;
  }

  // Seconds per op: batches of back-to-back ops, the slowest rank's time per batch, median batch.
  template <class Issue>
  double time_batches(Issue&& issue, double* cpu_per_op) {
    issue().wait();
    pg_.barrier().wait();
    auto t0 = Clock::now();
    issue().wait();
    const double one = reduce_max(std::chrono::duration<double>(Clock::now() - t0).count());
    const int iters = std::clamp(static_cast<int>(a_.batch_seconds / std::max(one, 1e-7)), 1, 2000);
    std::vector<double> times;
    const double cpu0 = pg_.stats().comm_cpu_seconds;
    std::vector<comm::Work> works(iters);
    for (int b = 0; b < a_.batches; ++b) {
      pg_.barrier().wait();
      t0 = Clock::now();
      for (int i = 0; i < iters; ++i) works[i] = issue();
      for (auto& w : works) w.wait();
      times.push_back(reduce_max(std::chrono::duration<double>(Clock::now() - t0).count() / iters));
    }
    if (cpu_per_op) {
      // Rank-average CPU of the timed ops (the barriers and reductions between batches are excluded
      // only approximately: they are a few microseconds each).
      double cpu = (pg_.stats().comm_cpu_seconds - cpu0) / (double(iters) * a_.batches);
      pg_.all_reduce(&cpu, &cpu, 1, DType::F64, ReduceOp::kAvg).wait();
      *cpu_per_op = cpu;
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

  // Seconds per op as a step sees it (--busy-ms): each op issued after the busy work and waited for
  // alone; per batch the rank-average wait (each rank's exposed time, including waiting for a late
  // peer), median batch.
  template <class Issue>
  double time_between_work(Issue&& issue) {
    issue().wait();
    const double per_iter = a_.busy_ms * 1e-3;
    const int iters = std::clamp(static_cast<int>(a_.batch_seconds / per_iter), 3, 2000);
    std::vector<double> times;
    for (int b = 0; b < a_.batches; ++b) {
      pg_.barrier().wait();
      double waited = 0;
      for (int i = 0; i < iters; ++i) {
        busy_.run();
        const auto t0 = Clock::now();
        issue().wait();
        waited += std::chrono::duration<double>(Clock::now() - t0).count();
      }
      double mean = waited / iters;
      pg_.all_reduce(&mean, &mean, 1, DType::F64, ReduceOp::kAvg).wait();
      times.push_back(mean);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

  double time_mpi(OpKind k, const Shape& s, const void* in, void* out) {
    const MPI_Datatype t = mpi_type(dtype_);
    const int c = static_cast<int>(s.count);
    const void* src = in == out ? MPI_IN_PLACE : in;
    auto op = [&] {
      switch (k) {
        case OpKind::kAllReduce: MPI_Allreduce(src, out, c, t, MPI_SUM, MPI_COMM_WORLD); break;
        case OpKind::kReduceScatter:
          // In place, MPI leaves the result at the buffer's start rather than in our block: same traffic.
          if (in == static_cast<const std::byte*>(out) - pg_.rank() * s.count * dtype_size(dtype_))
            MPI_Reduce_scatter_block(MPI_IN_PLACE, const_cast<void*>(in), c, t, MPI_SUM, MPI_COMM_WORLD);
          else
            MPI_Reduce_scatter_block(in, out, c, t, MPI_SUM, MPI_COMM_WORLD);
          break;
        case OpKind::kAllGather:
          MPI_Allgather(in == static_cast<std::byte*>(out) + pg_.rank() * s.count * dtype_size(dtype_) ? MPI_IN_PLACE : in,
                        c, t, out, c, t, MPI_COMM_WORLD);
          break;
        case OpKind::kBroadcast: MPI_Bcast(out, c, t, 0, MPI_COMM_WORLD); break;
        case OpKind::kReduce:
          MPI_Reduce(in == out && pg_.rank() == 0 ? MPI_IN_PLACE : in, out, c, t, MPI_SUM, 0, MPI_COMM_WORLD);
          break;
        default: MPI_Alltoall(src, c, t, out, c, t, MPI_COMM_WORLD); break;
      }
    };
    op();
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = Clock::now();
    op();
    const double one = reduce_max(std::chrono::duration<double>(Clock::now() - t0).count());
    const int iters = std::clamp(static_cast<int>(a_.batch_seconds / std::max(one, 1e-7)), 1, 2000);
    std::vector<double> times;
    for (int b = 0; b < a_.batches; ++b) {
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = Clock::now();
      for (int i = 0; i < iters; ++i) op();
      times.push_back(reduce_max(std::chrono::duration<double>(Clock::now() - t0).count() / iters));
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  }

  void print(OpKind k, const Shape& s, const Row& r) {
    // nccl-tests' size: the all_gather output, otherwise the input.
    const size_t size = (k == OpKind::kAllGather ? s.out_elems : s.in_elems) * dtype_size(dtype_);
    auto busbw = [&](double t) { return t > 0 ? size / t * s.bus_factor * 1e-9 : 0.0; };
    auto opt = [](bool have, double v, const char* f) { return have ? fmt::format(fmt::runtime(f), v) : std::string("-"); };
    if (a_.json) {
      nlohmann::json j{{"op", comm::op_name(k)}, {"ranks", pg_.size()},       {"bytes", size},
                       {"count", s.count},       {"algo", r.algo},            {"time_us", r.seconds * 1e6},
                       {"algbw_GBps", size / r.seconds * 1e-9}, {"busbw_GBps", busbw(r.seconds)},
                       {"wrong", r.wrong},       {"cpu_us", r.cpu_seconds * 1e6}};
      if (r.ceiling_seconds > 0) j["ceiling_busbw_GBps"] = busbw(r.ceiling_seconds);
      if (r.mpi_seconds > 0) j["mpi_busbw_GBps"] = busbw(r.mpi_seconds);
      if (r.checked_seconds > 0) {
        j["checked_time_us"] = r.checked_seconds * 1e6;
        j["unchecked_time_us"] = r.unchecked_seconds * 1e6;
      }
      fmt::print("{}\n", j.dump());
      std::fflush(stdout);
      return;
    }
    fmt::print("{:>15} {:>10} {:>11} {:>8} {:>10.1f} {:>9.2f} {:>9.2f} {:>7} {:>8.1f} {:>9} {:>6} {:>9} {:>6}\n",
               comm::op_name(k), size, s.count, r.algo, r.seconds * 1e6, size / r.seconds * 1e-9, busbw(r.seconds),
               r.wrong, r.cpu_seconds * 1e6, opt(r.ceiling_seconds > 0, busbw(r.ceiling_seconds), "{:.2f}"),
               opt(r.ceiling_seconds > 0, 100.0 * r.ceiling_seconds / r.seconds, "{:.0f}%"),
               opt(r.mpi_seconds > 0, busbw(r.mpi_seconds), "{:.2f}"),
               opt(r.mpi_seconds > 0, r.mpi_seconds / r.seconds, "{:.2f}x"));
    if (r.checked_seconds > 0)
      fmt::print("{:>15}   op check: {:.3f} us on, {:.3f} us off ({:+.1f}%, median of {} alternating rounds)\n", "",
                 r.checked_seconds * 1e6, r.unchecked_seconds * 1e6,
                 100.0 * (r.checked_seconds / r.unchecked_seconds - 1.0), a_.check_cost);
    std::fflush(stdout);
  }

  const BenchArgs& a_;
  comm::World& world_;
  ProcessGroup& pg_;
  DType dtype_;
  std::unique_ptr<Ceiling> ceiling_;
  BusyWork busy_;
};

int bench_comm(const BenchArgs& a) {
  auto env = comm::current_environment();
  comm::CommOptions options = comm::comm_options_from_env(env);
  if (!a.transport.empty()) options.transport = a.transport;
  // Room for the largest in + out buffers (all_gather / all_to_all outputs are the whole size).
  const size_t need_mb = (2 * parse_bytes(a.max_bytes) >> 20) + 64;
  if (!env.contains("LOOM_COMM_ARENA_MB")) options.shm.arena_bytes = std::max(options.shm.arena_bytes, need_mb << 20);
  Allocator accounting;
  auto world = comm::World::join(comm::read_job_env(env), options, &accounting);
  CommBench bench(a, *world);
  bench.run();
  return 0;
}

}  // namespace

void register_bench(CLI::App& app, Action& action) {
  auto* bench = app.add_subcommand("bench", "Benchmarks of Loom's own subsystems");
  bench->require_subcommand(1);
  auto* cmd = bench->add_subcommand(
      "comm", "Collectives benchmark (nccl-tests style); run one copy per rank: loom run -n 2 -- loom bench comm");
  auto a = std::make_shared<BenchArgs>();
  cmd->add_option("--ops", a->ops, "ops to run (all_reduce reduce_scatter all_gather broadcast reduce all_to_all)")
      ->delimiter(',');
  cmd->add_option("--comm", a->transport, "transport: auto (shared memory on one node), shm or mpi (default: LOOM_COMM)")
      ->check(CLI::IsMember({"auto", "shm", "mpi"}));
  cmd->add_option("--dtype", a->dtype, "element type: f32, bf16, f64, i32, i64 (default f32)");
  cmd->add_option("-b,--min-bytes", a->min_bytes, "smallest size, e.g. 8, 4K (default 8)");
  cmd->add_option("-e,--max-bytes", a->max_bytes, "largest size, e.g. 64M, 1G (default 64M)");
  cmd->add_option("-f,--step-factor", a->factor, "size multiplier between rows (default 4)")->check(finite_range(2, 1 << 20));
  cmd->add_option("--batch-seconds", a->batch_seconds, "length of one timed batch (default 0.1)")->check(finite_range(1e-4, 3600));
  cmd->add_option("--batches", a->batches, "timed batches per row; the median is reported (default 5)")
      ->check(finite_range(1, 100000));
  cmd->add_flag("--plain", a->plain, "ordinary buffers instead of registered (shared-arena) ones");
  cmd->add_flag("--inplace", a->inplace, "in-place ops (output buffer is the input)");
  auto vs = std::make_shared<std::string>();
  cmd->add_option("--vs", *vs, "baseline to time on the same buffers: mpi (OpenMPI's collectives; run under mpirun)")
      ->check(CLI::IsMember({"mpi"}));
  cmd->add_flag("!--no-ceiling", a->ceiling, "skip the in-process ceiling measurement");
  cmd->add_flag("--json", a->json, "one JSON object per row (op, ranks, bytes, time_us, algbw/busbw GB/s, ...)");
  cmd->add_option("--busy-ms", a->busy_ms,
                  "issue each op alone after this many milliseconds of GEMMs on the rank's threads, as a training "
                  "step does, and report the rank-average wait (late peers included); 0: back-to-back batches")
      ->check(finite_range(0, 10000));
  cmd->add_option("--check-cost", a->check_cost,
                  "also time each row N rounds with the always-on op check off and on, alternating in the same run "
                  "(LOOM_COMM_CHECK)")
      ->check(finite_range(0, 1000));
  cmd->callback([&action, a, vs] {
    a->vs_mpi = *vs == "mpi";
    if (a->batches < 1) throw CLI::ValidationError("--batches", "must be at least 1");
    action = [a] { return bench_comm(*a); };
  });
  register_bench_gemm(*bench, action);
}

}  // namespace loom::cli
