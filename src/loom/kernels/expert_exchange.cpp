#include "loom/kernels/expert_exchange.h"

#include <cstring>

namespace loom::kernels {

void ExpertExchange::exchange_rows(const void* send, std::span<const int64_t> send_rows, void* recv,
                                   std::span<const int64_t> recv_rows, int64_t row_bytes, const char* /*name*/) {
  // One rank: the rows stay where they are.
  if (send != recv) std::memcpy(recv, send, static_cast<size_t>(send_rows[0] * row_bytes));
  (void)recv_rows;
}

}  // namespace loom::kernels
