#include "loom/parallel/expert_parallel_exchange.h"

#include <chrono>
#include <vector>

#include "loom/error.h"

namespace loom::parallel {

void ExpertParallelExchange::gather_counts(std::span<const int64_t> mine, std::span<int64_t> all) {
  if (all.size() != mine.size() * static_cast<size_t>(ep_.size()))
    throw Error("internal: expert counts gather needs ep x experts slots");
  const auto t0 = std::chrono::steady_clock::now();
  comm::issue_and_wait(be_.tracer(), "ep_counts_all_gather", static_cast<double>(all.size_bytes()), [&] {
    return ep_.all_gather(mine.data(), all.data(), mine.size(), DType::I64);
  });
  wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void ExpertParallelExchange::exchange_rows(const void* send, std::span<const int64_t> send_rows, void* recv,
                                           std::span<const int64_t> recv_rows, int64_t row_bytes, const char* name) {
  // Moved as opaque words (rows of bf16 or f32 values alike): 4-byte ones where the row allows.
  const DType unit = row_bytes % 4 == 0 ? DType::F32 : DType::BF16;
  const int64_t per_row = row_bytes / static_cast<int64_t>(dtype_size(unit));
  if (row_bytes % 2 != 0) throw Error("internal: expert rows must be whole 2-byte words");
  std::vector<size_t> sc(send_rows.size()), rc(recv_rows.size());
  double bytes = 0;
  for (size_t j = 0; j < sc.size(); ++j)
    sc[j] = static_cast<size_t>(send_rows[j] * per_row), bytes += static_cast<double>(send_rows[j] * row_bytes);
  for (size_t j = 0; j < rc.size(); ++j) rc[j] = static_cast<size_t>(recv_rows[j] * per_row);
  const auto t0 = std::chrono::steady_clock::now();
  comm::issue_and_wait(be_.tracer(), name, bytes, [&] { return ep_.all_to_all_v(send, recv, sc, rc, unit); });
  wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace loom::parallel
