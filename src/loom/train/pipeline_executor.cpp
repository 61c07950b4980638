#include "loom/train/pipeline_executor.h"

#include <chrono>
#include <span>

#include "loom/error.h"

namespace loom::train {

namespace {
// Point-to-point tags of pipeline transfers, clear of any other sender's.
constexpr uint64_t kPipelineTag = uint64_t{0x5B0} << 40;
}  // namespace

PipelineExecutor::PipelineExecutor(model::Transformer& model, kernels::Backend& backend, comm::ProcessGroup& pp,
                                   const spec::PipelineStages& stages, spec::PipelineSchedule kind, int64_t micro_batch,
                                   int64_t seq, bool bf16_wire, profile::Tracer* tracer)
    : model_(model), backend_(backend), pp_(pp), stages_(stages), kind_(kind), micro_batch_(micro_batch), seq_(seq),
      tracer_(tracer), rank_(pp.rank()), size_(pp.size()), bf16_wire_(bf16_wire) {
  const int K = stages_.chunks();
  for (int c = 0; c < stages_.v; ++c) {
    const int g = c * size_ + rank_;
    const int64_t first = stages_.first_layer(g);
    chunks_.push_back({first, first + stages_.layers[static_cast<size_t>(g)], g == 0, g == K - 1});
  }
  slots_.resize(chunks_.size());
}

uint64_t PipelineExecutor::tag(int micro_batch, int global_chunk, bool backward) const {
  return kPipelineTag + ((static_cast<uint64_t>(micro_batch) * static_cast<uint64_t>(stages_.chunks()) +
                          static_cast<uint64_t>(global_chunk)) << 1) + (backward ? 1 : 0);
}

model::ActivationContext& PipelineExecutor::context(int chunk, int micro_batch, bool acquire) {
  auto& slots = slots_[static_cast<size_t>(chunk)];
  for (auto& s : slots)
    if (s.micro_batch == micro_batch) return s.ctx;
  if (!acquire)
    throw Error("internal: pipeline micro-batch " + std::to_string(micro_batch) + " of chunk " + std::to_string(chunk) +
                " has no activations (the schedule runs its backward before its forward)");
  for (auto& s : slots)
    if (s.micro_batch < 0) {
      s.micro_batch = micro_batch;
      return s.ctx;
    }
  slots.push_back({model_.make_context(micro_batch_, seq_, chunks_[static_cast<size_t>(chunk)],
                                      kind_ == spec::PipelineSchedule::ZeroBubbleH1),
                   micro_batch});
  return slots.back().ctx;
}

void PipelineExecutor::release(int chunk, int micro_batch) {
  for (auto& s : slots_[static_cast<size_t>(chunk)])
    if (s.micro_batch == micro_batch) s.micro_batch = -1;
}

// The weight-gradient pass of a split backward exchanges nothing; the input-gradient pass does what a
// whole backward does.
bool PipelineExecutor::receives(const spec::PipelineAction& a) const {
  const auto& ch = chunks_[static_cast<size_t>(a.chunk)];
  if (a.pass == spec::Pass::BackwardWeight) return false;
  return a.pass == spec::Pass::Forward ? !ch.embeddings : !ch.head;
}

bool PipelineExecutor::sends(const spec::PipelineAction& a) const {
  const auto& ch = chunks_[static_cast<size_t>(a.chunk)];
  if (a.pass == spec::Pass::BackwardWeight) return false;
  return a.pass == spec::Pass::Forward ? !ch.head : !ch.embeddings;
}

Tensor PipelineExecutor::wire(Tensor& buffer, const Tensor& t) {
  if (!bf16_wire_) return t;
  if (!buffer.defined() || buffer.numel() < t.numel())
    buffer = Tensor::empty({t.numel()}, DType::BF16, backend_.allocator(), MemCategory::Activations);
  return buffer.view(0, t.shape());
}

comm::ProcessGroup::PeerOp PipelineExecutor::receive_of(const spec::PipelineAction& a) {
  const int g = a.chunk * size_ + rank_;
  const auto& ch = chunks_[static_cast<size_t>(a.chunk)];
  // Forward: the previous chunk's output, into this chunk's input row of the residual stream; backward:
  // the gradient of this chunk's output.
  const bool forward = a.pass == spec::Pass::Forward;
  auto& c = context(a.chunk, a.micro_batch, forward);
  const Tensor& target = forward ? c.residual[static_cast<size_t>(ch.first)] : c.d_res;
  const Tensor in = wire(wire_in_, target);
  if (bf16_wire_) arriving_ = target;
  return {false, in.raw(), static_cast<size_t>(in.numel()), in.dtype(), stages_.rank_of(forward ? g - 1 : g + 1),
          tag(a.micro_batch, g, !forward)};
}

comm::ProcessGroup::PeerOp PipelineExecutor::send_of(const spec::PipelineAction& a) {
  const int g = a.chunk * size_ + rank_;
  const auto& ch = chunks_[static_cast<size_t>(a.chunk)];
  auto& c = context(a.chunk, a.micro_batch, false);
  const bool forward = a.pass == spec::Pass::Forward;
  const Tensor& source = forward ? c.residual[static_cast<size_t>(ch.last)] : c.d_res;
  const Tensor out = wire(wire_out_, source);
  if (bf16_wire_) backend_.cast(out, source);
  return {true, out.raw(), static_cast<size_t>(out.numel()), out.dtype(), stages_.rank_of(forward ? g + 1 : g - 1),
          tag(a.micro_batch, forward ? g + 1 : g - 1, !forward)};
}

double PipelineExecutor::run(const std::vector<spec::PipelineAction>& actions, const Tensor& tokens,
                             const Tensor& targets, const Fill& fill, float grad_scale) {
  double loss = 0;
  comm::Work pending;  // the previous action's send with this action's receive
  // Both halves count as waiting: a small exchange runs inline, inside send_recv_many, when nothing is
  // queued ahead of it (comm::ProcessGroup::submit), a large one on the progress thread until wait().
  auto timed = [&](const char* name, double bytes, auto&& body) {
    profile::Span span(tracer_, name, profile::Category::Communication, 0, bytes);
    const auto t0 = std::chrono::steady_clock::now();
    body();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto post = [&](std::span<const comm::ProcessGroup::PeerOp> ops) {
    double bytes = 0;  // sent and received, as the span's traffic
    for (const auto& op : ops) bytes += static_cast<double>(op.count * dtype_size(op.dtype));
    // The spans name the exchange's group and first peer (comm::mark_wait), restored after them.
    const profile::ScopedSpanContext restore(profile::SpanContext::kNoUnit);
    timed("pp_transfer_post", bytes, [&] {
      pending = pp_.send_recv_many(ops);
      comm::mark_wait(pending);
    });
  };
  auto wait = [&] {
    {
      const profile::ScopedSpanContext restore(profile::SpanContext::kNoUnit);
      comm::mark_wait(pending);
      timed("pp_transfer_wait", 0, [&] { pending.wait(); });
    }
    pending = comm::Work();
    // A bf16 receive lands in the wire buffer: into the residual stream (or its gradient) before use.
    if (arriving_.defined()) {
      backend_.cast(arriving_, wire_in_.view(0, arriving_.shape()));
      arriving_ = Tensor();
    }
  };
  if (!actions.empty() && receives(actions.front())) {
    const auto r = receive_of(actions.front());
    post({&r, 1});
  }
  for (size_t i = 0; i < actions.size(); ++i) {
    const auto& a = actions[i];
    profile::ScopedSpanContext where(profile::SpanContext::kNoUnit, nullptr, a.micro_batch);
    wait();  // this action's input (and the previous action's send) are done
    const auto& ch = chunks_[static_cast<size_t>(a.chunk)];
    auto& c = context(a.chunk, a.micro_batch, a.pass == spec::Pass::Forward);
    if (a.pass == spec::Pass::Forward) {
      if (ch.embeddings || ch.head) fill(a.micro_batch);
      const double l = model_.forward_chunk(c, ch, &tokens, &targets, grad_scale);
      if (ch.head) loss += l;
    } else if (a.pass == spec::Pass::Backward) {
      model_.backward_chunk(c, ch);
    } else if (a.pass == spec::Pass::BackwardInput) {
      model_.backward_chunk_input(c, ch);
    } else {
      model_.backward_chunk_weight(c, ch);
    }
    // This action's send goes out with the next action's receive. A context whose backward is done (its
    // whole or its weight pass), or an evaluation forward's, is free once its send has gone.
    std::vector<comm::ProcessGroup::PeerOp> ops;
    if (sends(a)) ops.push_back(send_of(a));
    if (i + 1 < actions.size() && receives(actions[i + 1])) ops.push_back(receive_of(actions[i + 1]));
    if (!ops.empty()) post(ops);
    if (a.pass == spec::Pass::Backward || a.pass == spec::Pass::BackwardWeight || grad_scale <= 0) {
      wait();
      release(a.chunk, a.micro_batch);
    }
  }
  wait();
  return loss;
}

double PipelineExecutor::train(int micro_batches, const Tensor& tokens, const Tensor& targets, const Fill& fill,
                               float grad_scale) {
  const auto plan = spec::build_pipeline_schedule(kind_, size_, stages_.v, micro_batches);
  return run(plan.ranks[static_cast<size_t>(rank_)], tokens, targets, fill, grad_scale);
}

double PipelineExecutor::theoretical_bubble(int micro_batches) const {
  return spec::theoretical_bubble(spec::build_pipeline_schedule(kind_, size_, stages_.v, micro_batches));
}

double PipelineExecutor::evaluate(int micro_batches, const Tensor& tokens, const Tensor& targets, const Fill& fill) {
  return run(spec::evaluation_order(stages_.v, micro_batches), tokens, targets, fill, 0.0f);
}

}  // namespace loom::train
