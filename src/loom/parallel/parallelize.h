// The one step that turns a device mesh into what a run needs, for every axis: the groups each part
// of the engine talks over, this rank's shard of the parameter table, the model's layer ops
// (tensor-parallel where tp > 1), where attention runs (across the cp group where cp > 1), and the
// data-parallel strategy (alone, DDP or ZeRO, over the replicas: dp x cp ranks holding the same weights)
// for the arenas of that shard. Expert parallelism adds its pieces here.
#pragma once

#include <memory>

#include "loom/comm/process_group.h"
#include "loom/kernels/attention_ops.h"
#include "loom/kernels/expert_exchange.h"
#include "loom/kernels/layer_ops.h"
#include "loom/parallel/data_parallel.h"
#include "loom/parallel/mesh.h"
#include "loom/parallel/tensor_parallel_ops.h"
#include "loom/spec/context_parallel.h"
#include "loom/spec/param_table.h"
#include "loom/spec/pipeline_stages.h"

namespace loom::parallel {

struct Parallelism {
  // The replicas: every rank holding this rank's weights, dp x cp of them (context-parallel ranks
  // hold one model too and see other tokens of the same samples), ordered by (dp, cp). Gradients are
  // reduced and ZeRO shards over it; nullptr when dp x cp = 1.
  comm::ProcessGroup* dp = nullptr;
  comm::ProcessGroup* cp = nullptr;  // the context-parallel group; nullptr when cp = 1
  comm::ProcessGroup* tp = nullptr;  // the tensor-parallel group; nullptr when tp = 1
  comm::ProcessGroup* pp = nullptr;  // the pipeline group; nullptr when pp = 1
  spec::PipelineStages stages;       // the model's chunks (one chunk, all blocks, without pp)
  spec::TableShard shard;            // this rank's tensor-parallel shard of every weight
  std::unique_ptr<kernels::LayerOps> ops;  // how the model's linears, embedding and loss run here
  std::unique_ptr<kernels::AttentionOps> attention;  // where the attention core runs (cp group or here)
  // Expert parallelism: ep consecutive replicas split every MoE block's experts (`ep`, nullptr when
  // ep = 1); `expert_replicas` are the ranks holding the same experts, one per ep group, over which the
  // experts' gradients are reduced and ZeRO shards their state (a group of one when ep = dp).
  // `experts`: how rows reach their expert.
  comm::ProcessGroup* ep = nullptr;
  comm::ProcessGroup* expert_replicas = nullptr;
  std::unique_ptr<comm::ProcessGroup> owned_ep, owned_expert_replicas;
  std::unique_ptr<kernels::ExpertExchange> experts;
  int ep_size() const { return ep ? ep->size() : 1; }
  int world = 1;                     // ranks in the job (the peak MFU is measured against)
  int dp_size() const { return dp ? dp->size() : 1; }  // replicas (dp x cp)
  int dp_rank() const { return dp ? dp->rank() : 0; }
  int cp_size() const { return cp ? cp->size() : 1; }
  int cp_rank() const { return cp ? cp->rank() : 0; }
  int pp_size() const { return pp ? pp->size() : 1; }
  int pp_rank() const { return pp ? pp->rank() : 0; }
  // The data-parallel strategy over this rank's dp group, for the arenas `setup.table` lays out (built
  // once per trainer, before its parameter store: the strategy says how the arenas must be backed).
  std::unique_ptr<DataParallel> data_parallel(const DataParallelSetup& setup, Allocator& alloc,
                                              profile::Tracer* tracer) const {
    DataParallelSetup s = setup;
    s.expert_replicas = expert_replicas, s.experts_split = ep_size() > 1;
    return make_data_parallel(dp, s, alloc, tracer);
  }
  // Seconds this rank waited on tensor-parallel collectives so far (exposed), and seconds they were in
  // flight (0 without tp).
  double tp_wait_seconds() const;
  double tp_in_flight_seconds() const;
  // The same for the context-parallel exchanges (ring send/recv, all-to-all).
  double cp_wait_seconds() const;
  double cp_in_flight_seconds() const;
};

// mesh: nullptr for a single-rank run (everything local). tp: how tensor parallelism runs where tp > 1.
// stages: the model's cut into pipeline chunks (spec::cut_pipeline), needed where pp > 1: this rank's
// shard then holds the blocks of its chunks, the embeddings on pipeline rank 0 and the head on the
// rank of the last chunk. cp_mode: how attention crosses the cp group where cp > 1.
// ep: expert-parallel degree, drawn from the replicas (it must divide them; collective over them when > 1).
Parallelism parallelize(const Mesh* mesh, kernels::Backend& backend, TensorParallelOptions tp = {},
                        const spec::PipelineStages* stages = nullptr, spec::CpMode cp_mode = spec::CpMode::Ring,
                        int ep = 1);

}  // namespace loom::parallel
