// Who this process is in a job: rank, world size, local rank, rendezvous address and secret, read from
// the variables of whichever launcher started it (`loom run`, OpenMPI's mpirun, Slurm's srun).
#pragma once

#include <map>
#include <string>

namespace loom::comm {

enum class Launcher { kNone, kLoom, kMpi, kSlurm };

struct JobEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // Rendezvous store (LOOM_MASTER_ADDR / LOOM_MASTER_PORT). Port 0 under mpirun: rank 0 starts the
  // store on a free port and broadcasts it (with the secret) over MPI.
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // LOOM_JOB_SECRET: without it a process cannot join the store. Empty only for a single process.
  std::string secret;
  // Unique per job (LOOM_JOB_ID, else derived from the secret): prefixes shared-memory names.
  std::string job_id;
  // LOOM_NODE_ID forces node boundaries (so the hierarchical path runs on one machine); -1 = unset.
  int forced_node_id = -1;
  // LOOM_RESTART_COUNT: which start of the job this is (`loom run --max-restarts`; 0: the first).
  int restart_count = 0;
};

// Reads the job from `env` (normally the process environment). Precedence: LOOM_* (set by `loom
// run`), then OMPI_COMM_WORLD_*, then SLURM_*. A process with none of them is a one-rank job.
// Throws ConfigError naming the variable when a value is malformed or inconsistent
// (rank >= world size, missing secret in a multi-rank job that is not under mpirun, ...).
JobEnv read_job_env(const std::map<std::string, std::string>& env);
JobEnv read_job_env();  // from the process environment

// The process environment as a map (for read_job_env and for the launcher's children).
std::map<std::string, std::string> current_environment();

const char* launcher_name(Launcher launcher);

// The job id a secret gives (12 hex digits of a keyed hash): what names the job's shared memory, which
// every local user can list, so it tells nothing about the secret. Any byte string is a valid secret.
std::string job_id_from_secret(const std::string& secret);

}  // namespace loom::comm
