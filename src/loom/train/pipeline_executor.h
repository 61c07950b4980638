// Runs one step's pipeline schedule (spec::PipelinePlan) on this rank: for every (micro-batch, chunk,
// pass) of its list, the chunk's forward or backward (model::Transformer::forward_chunk /
// backward_chunk), the activations to the next chunk's rank and the gradients to the previous one.
// Each action's send goes out together with the next action's receive as one grouped send/recv
// (comm::ProcessGroup::send_recv_many), so neighbours exchanging in both directions never wait on each
// other; tags name (micro-batch, chunk, direction), so a mismatched pair is an error, not wrong data.
// One activation context per micro-batch in flight per chunk, reused: the schedule's promise on memory
// (1F1B: at most pp - r micro-batches on rank r) is what the allocator sees.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/model/transformer.h"
#include "loom/spec/pipeline_schedule.h"
#include "loom/spec/pipeline_stages.h"

namespace loom::train {

class PipelineExecutor {
 public:
  // fill(micro_batch, tokens, targets): the micro-batch's samples (the chunks with the embeddings and
  // with the head each read the data themselves: it is a function of the sample index).
  using Fill = std::function<void(int64_t micro_batch)>;
  // bf16_wire: activations and their gradients cross stages as bf16 (cast from and to the f32 residual
  // stream through one send and one receive buffer: at most one grouped exchange is in flight).
  PipelineExecutor(model::Transformer& model, kernels::Backend& backend, comm::ProcessGroup& pp,
                   const spec::PipelineStages& stages, spec::PipelineSchedule kind, int64_t micro_batch, int64_t seq,
                   bool bf16_wire, profile::Tracer* tracer);

  // One training step over `micro_batches` micro-batches: returns the sum of their mean losses on the
  // rank with the head (0 elsewhere). grad_scale as for Transformer::forward.
  double train(int micro_batches, const Tensor& tokens, const Tensor& targets, const Fill& fill, float grad_scale);
  // Forwards only (evaluation): the same sum.
  double evaluate(int micro_batches, const Tensor& tokens, const Tensor& targets, const Fill& fill);

  // Seconds this thread waited on pipeline transfers (cumulative): the bubble plus exposed transfers.
  double wait_seconds() const { return wait_seconds_; }
  // Activation contexts allocated so far, per local chunk (they are kept and reused step after step):
  // spec::contexts_held of the schedules run.
  std::vector<int> contexts_allocated() const {
    std::vector<int> n;
    for (const auto& s : slots_) n.push_back(static_cast<int>(s.size()));
    return n;
  }
  // The schedule's textbook bubble fraction at this many micro-batches (spec::theoretical_bubble).
  double theoretical_bubble(int micro_batches) const;

 private:
  double run(const std::vector<spec::PipelineAction>& actions, const Tensor& tokens, const Tensor& targets,
             const Fill& fill, float grad_scale);
  model::ActivationContext& context(int chunk, int micro_batch, bool acquire);
  void release(int chunk, int micro_batch);
  // What action `a` receives before it runs, and what it sends after (nullptr / empty when nothing).
  comm::ProcessGroup::PeerOp receive_of(const spec::PipelineAction& a);
  comm::ProcessGroup::PeerOp send_of(const spec::PipelineAction& a);
  bool receives(const spec::PipelineAction& a) const;
  bool sends(const spec::PipelineAction& a) const;
  uint64_t tag(int micro_batch, int global_chunk, bool backward) const;

  // The buffer a transfer of `t` goes through: `t` itself in f32, else this direction's bf16 wire buffer.
  Tensor wire(Tensor& buffer, const Tensor& t);

  model::Transformer& model_;
  kernels::Backend& backend_;
  comm::ProcessGroup& pp_;
  spec::PipelineStages stages_;
  spec::PipelineSchedule kind_;
  int64_t micro_batch_, seq_;
  profile::Tracer* tracer_;
  int rank_, size_;
  std::vector<model::Transformer::Chunk> chunks_;  // this rank's, by local chunk
  struct Slot {
    model::ActivationContext ctx;
    int micro_batch = -1;  // the micro-batch using it, or -1 when free
  };
  std::vector<std::vector<Slot>> slots_;  // per local chunk
  double wait_seconds_ = 0;
  bool bf16_wire_;
  Tensor wire_in_, wire_out_;  // bf16 wire: the receive and send buffers
  Tensor arriving_;            // bf16 wire: where the receive in flight goes once it has landed
};

}  // namespace loom::train
