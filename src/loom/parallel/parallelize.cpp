#include "loom/parallel/parallelize.h"


namespace loom::parallel {

double Parallelism::tp_wait_seconds() const {
  auto* t = dynamic_cast<const TensorParallelOps*>(ops.get());
  return t ? t->wait_seconds() : 0.0;
}

double Parallelism::tp_in_flight_seconds() const {
  auto* t = dynamic_cast<const TensorParallelOps*>(ops.get());
  return t ? t->in_flight_seconds() : 0.0;
}

Parallelism parallelize(const Mesh* mesh, kernels::Backend& backend, TensorParallelOptions tp) {
  Parallelism p;
  if (mesh) {
    p.dp = mesh->group(spec::MeshAxis::DP);
    p.tp = mesh->group(spec::MeshAxis::TP);
    p.world = mesh->shape().world();
  }
  if (p.tp) {
    p.shard = {p.tp->rank(), p.tp->size()};
    p.ops = std::make_unique<TensorParallelOps>(backend, *p.tp, tp);
  } else {
    p.ops = std::make_unique<kernels::LayerOps>(backend);
  }
  return p;
}

}  // namespace loom::parallel
