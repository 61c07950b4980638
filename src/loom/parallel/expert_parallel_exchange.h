// Expert parallelism's transport: the ep group's all-gather of per-expert row counts and the
// all-to-all_v of rows to their expert's rank and back (kernels/expert_exchange.h), each traced as a
// communication span and timed as exposed communication.
#pragma once

#include "loom/comm/process_group.h"
#include "loom/kernels/backend.h"
#include "loom/kernels/expert_exchange.h"

namespace loom::parallel {

class ExpertParallelExchange final : public kernels::ExpertExchange {
 public:
  ExpertParallelExchange(kernels::Backend& backend, comm::ProcessGroup& ep) : be_(backend), ep_(ep) {}
  int size() const override { return ep_.size(); }
  int rank() const override { return ep_.rank(); }
  void gather_counts(std::span<const int64_t> mine, std::span<int64_t> all) override;
  void exchange_rows(const void* send, std::span<const int64_t> send_rows, void* recv,
                     std::span<const int64_t> recv_rows, int64_t row_bytes, const char* name) override;
  // Wall seconds this thread waited on the exchanges (all of it exposed: nothing overlaps them yet).
  double wait_seconds() const { return wait_; }
  const comm::ProcessGroup& group() const { return ep_; }

 private:
  kernels::Backend& be_;
  comm::ProcessGroup& ep_;
  double wait_ = 0;
};

}  // namespace loom::parallel
