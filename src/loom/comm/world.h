// Joining a job: reads who this process is (JobEnv), finds the rendezvous store (the launcher's, or
// rank 0's under mpirun), learns which ranks share a node, and builds the world ProcessGroup on the
// right transport: shared memory on one node, hierarchical shared memory + MPI across nodes, MPI
// everywhere with `--comm mpi`.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/job_env.h"
#include "loom/comm/process_group.h"
#include "loom/comm/shm_transport.h"
#include "loom/comm/store.h"

namespace loom::comm {

struct CommOptions {
  std::string transport = "auto";  // LOOM_COMM / --comm: auto | shm | mpi
  ShmOptions shm;
  Tuning tuning;
  int ranks_per_node = 0;  // LOOM_RANKS_PER_NODE: node = rank / k (forces node boundaries); 0 = by host
};

// LOOM_COMM, LOOM_COMM_TIMEOUT (seconds), LOOM_COMM_DEBUG, LOOM_COMM_ALGO ("ring" or
// "all_reduce=direct,all_gather=ring"), LOOM_COMM_ONE_SHOT_KB, LOOM_COMM_ARENA_MB, LOOM_COMM_SPIN_US,
// LOOM_RANKS_PER_NODE.
// Throws ConfigError naming the variable and the valid values.
CommOptions comm_options_from_env(const std::map<std::string, std::string>& env);

// Shared by every group of a job.
struct GroupContext {
  JobEnv job;
  CommOptions options;
  Tuning tuning;
  std::shared_ptr<Store> store;
  std::vector<int> node_of;  // node index of each global rank
  bool use_mpi = false;      // every group runs on MPI (--comm mpi)
  std::shared_ptr<const PeerLiveness> liveness;  // which ranks of this node are still running
};

class World {
 public:
  // Collective over the whole job; throws CommError / CommTimeoutError / ConfigError.
  static std::unique_ptr<World> join(const JobEnv& job, const CommOptions& options, Allocator* accounting = nullptr);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  ProcessGroup& group() { return *group_; }
  int rank() const { return ctx_->job.rank; }
  int size() const { return ctx_->job.world_size; }
  int nodes() const;
  const GroupContext& context() const { return *ctx_; }

 private:
  World() = default;
  std::unique_ptr<StoreServer> server_;  // rank 0 under mpirun, or a one-process job
  std::shared_ptr<GroupContext> ctx_;
  std::unique_ptr<ProcessGroup> group_;
  bool owns_mpi_ = false;
};

// Builds the group for `global` ranks (this process is global[my_index]) after a split of `parent`.
std::unique_ptr<ProcessGroup> make_subgroup(const std::shared_ptr<GroupContext>& ctx, ProcessGroup& parent,
                                            Transport& parent_transport, int color, int key, std::vector<int> global,
                                            int my_index, std::string id, Allocator* accounting);

}  // namespace loom::comm
