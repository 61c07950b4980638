#include "loom/parallel/parallelize.h"

#include "loom/parallel/context_parallel_attention.h"
#include "loom/parallel/expert_parallel_exchange.h"


namespace loom::parallel {

double Parallelism::tp_wait_seconds() const {
  auto* t = dynamic_cast<const TensorParallelOps*>(ops.get());
  return t ? t->wait_seconds() : 0.0;
}

double Parallelism::tp_in_flight_seconds() const {
  auto* t = dynamic_cast<const TensorParallelOps*>(ops.get());
  return t ? t->in_flight_seconds() : 0.0;
}

double Parallelism::cp_wait_seconds() const {
  auto* c = dynamic_cast<const ContextParallelAttention*>(attention.get());
  return c ? c->wait_seconds() : 0.0;
}

double Parallelism::cp_in_flight_seconds() const {
  auto* c = dynamic_cast<const ContextParallelAttention*>(attention.get());
  return c ? c->in_flight_seconds() : 0.0;
}

Parallelism parallelize(const Mesh* mesh, kernels::Backend& backend, TensorParallelOptions tp,
                        const spec::PipelineStages* stages, spec::CpMode cp_mode, int ep) {
  Parallelism p;
  if (mesh) {
    p.dp = mesh->replica_group();
    p.cp = mesh->group(spec::MeshAxis::CP);
    p.tp = mesh->group(spec::MeshAxis::TP);
    p.pp = mesh->group(spec::MeshAxis::PP);
    p.world = mesh->shape().world();
  }
  if (stages) p.stages = *stages;
  if (p.pp) {
    if (!stages || stages->pp != p.pp->size())
      throw Error("internal: a pipeline of " + std::to_string(p.pp->size()) + " ranks needs its stages");
    p.shard = stages->shard_of(p.pp->rank());
  }
  if (p.tp) {
    p.shard.tp_rank = p.tp->rank(), p.shard.tp_size = p.tp->size();
    p.ops = std::make_unique<TensorParallelOps>(backend, *p.tp, tp);
  } else {
    p.ops = std::make_unique<kernels::LayerOps>(backend);
  }
  if (p.cp)
    p.attention = std::make_unique<ContextParallelAttention>(backend, *p.cp, cp_mode);
  else
    p.attention = std::make_unique<kernels::AttentionOps>(backend);
  if (ep > 1) {
    const int replicas = p.dp_size();
    if (!p.dp || replicas % ep != 0)
      throw Error("internal: expert parallelism over " + std::to_string(ep) + " ranks needs replicas it divides, not " +
                  std::to_string(replicas));
    // ep groups: consecutive replicas; the expert replicas: the same place in every ep group. Both
    // splits are collective over the replicas.
    const int r = p.dp->rank();
    if (ep == replicas) {
      p.ep = p.dp;
    } else {
      p.owned_ep = p.dp->split(r / ep, r % ep);
      p.ep = p.owned_ep.get();
    }
    p.owned_expert_replicas = p.dp->split(r % ep, r / ep);  // of one rank when ep = replicas
    p.expert_replicas = p.owned_expert_replicas.get();
    p.shard.ep_rank = p.ep->rank(), p.shard.ep_size = ep;
    p.experts = std::make_unique<ExpertParallelExchange>(backend, *p.ep);
  }
  return p;
}

}  // namespace loom::parallel
