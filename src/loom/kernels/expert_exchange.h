// The op interface between a mixture-of-experts block and an expert-parallel group whose `size` ranks
// each hold experts / size of them (parallel::ExpertParallelExchange): rows travel to their expert's rank
// and back by all-to-all, so the model stays free of communication. Without expert parallelism the
// block takes no exchange (model::MoeLayer::set_exchange(nullptr)) and runs every expert here.
#pragma once

#include <cstdint>
#include <span>

namespace loom::kernels {

class ExpertExchange {
 public:
  virtual ~ExpertExchange() = default;
  // The expert-parallel group: its size and this rank's place. Rank r holds experts
  // [r, r + 1) x experts / size.
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // Every rank's per-expert row counts: `mine` [E] in, `all` [size x E] out (rank-major).
  virtual void gather_counts(std::span<const int64_t> mine, std::span<int64_t> all) = 0;
  // Rows of `row_bytes` each: send_rows[j] consecutive rows of `send` go to rank j, recv_rows[i] rows from
  // rank i land consecutively in `recv` (rank-major). `name` names the transfer in the trace.
  virtual void exchange_rows(const void* send, std::span<const int64_t> send_rows, void* recv,
                             std::span<const int64_t> recv_rows, int64_t row_bytes, const char* name) = 0;
};

}  // namespace loom::kernels
