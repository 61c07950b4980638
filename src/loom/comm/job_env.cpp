// Reading who this process is from the launcher's variables. Every value is parsed strictly: a rank that
// reads "1x" as 1 would join the wrong job slot and hang the whole job instead of failing here.
#include "loom/comm/job_env.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cctype>
#include <charconv>
#include <cstdint>
#include <optional>
#include <vector>

#include "loom/core/keyed_hash.h"
#include "loom/error.h"

extern char** environ;

namespace loom::comm {
namespace {

using Env = std::map<std::string, std::string>;

std::optional<std::string> lookup(const Env& env, const std::string& name) {
  auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

int parse_int(const std::string& name, const std::string& text, int lo, int hi) {
  int v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size())
    throw ConfigError(fmt::format("{} = '{}' is not an integer", name, text));
  if (v < lo || v > hi) throw ConfigError(fmt::format("{} = {} is out of range ({}..{})", name, v, lo, hi));
  return v;
}

std::optional<int> int_var(const Env& env, const std::string& name, int lo, int hi) {
  auto text = lookup(env, name);
  if (!text) return std::nullopt;
  return parse_int(name, *text, lo, hi);
}

int required_int(const Env& env, const std::string& name, const std::string& because, int lo, int hi) {
  auto v = int_var(env, name, lo, hi);
  if (!v) throw ConfigError(fmt::format("{} is not set ({})", name, because));
  return *v;
}

constexpr int kMaxRanks = 1 << 20;

// Slurm's SLURM_TASKS_PER_NODE lists the tasks of each node compressed: "4(x2),3" means 4, 4, 3.
int slurm_tasks_on_node(const std::string& spec, int node) {
  const std::string name = "SLURM_TASKS_PER_NODE";
  std::vector<int> counts;
  size_t at = 0;
  while (at <= spec.size()) {
    size_t comma = spec.find(',', at);
    std::string item = spec.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    int repeat = 1;
    if (auto paren = item.find("(x"); paren != std::string::npos) {
      if (item.back() != ')') throw ConfigError(fmt::format("{} = '{}' is malformed", name, spec));
      repeat = parse_int(name, item.substr(paren + 2, item.size() - paren - 3), 1, kMaxRanks);
      item.resize(paren);
    }
    int count = parse_int(name, item, 1, kMaxRanks);
    for (int i = 0; i < repeat && counts.size() <= static_cast<size_t>(node); ++i) counts.push_back(count);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  if (static_cast<size_t>(node) >= counts.size())
    throw ConfigError(fmt::format("{} = '{}' has no entry for SLURM_NODEID {}", name, spec, node));
  return counts[node];
}

void validate_job_id(const std::string& id) {
  // It becomes part of shared-memory names (/dev/shm/loom-<id>-...): no slashes, nothing a shell mangles.
  bool ok = !id.empty() && id.size() <= 64;
  for (char ch : id) ok = ok && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.');
  if (!ok) throw ConfigError(fmt::format("LOOM_JOB_ID = '{}' must be 1..64 characters of A-Z a-z 0-9 . _ -", id));
}

}  // namespace

JobEnv read_job_env(const std::map<std::string, std::string>& env) {
  JobEnv job;
  const bool loom = env.contains("LOOM_RANK") || env.contains("LOOM_WORLD_SIZE");
  if (loom) {
    job.launcher = Launcher::kLoom;
    const std::string why = "both LOOM_RANK and LOOM_WORLD_SIZE are needed; `loom run` sets them";
    job.world_size = required_int(env, "LOOM_WORLD_SIZE", why, 1, kMaxRanks);
    job.rank = required_int(env, "LOOM_RANK", why, 0, kMaxRanks);
    job.local_world_size = int_var(env, "LOOM_LOCAL_WORLD_SIZE", 1, kMaxRanks).value_or(job.world_size);
    job.local_rank = int_var(env, "LOOM_LOCAL_RANK", 0, kMaxRanks).value_or(job.rank);
    job.restart_count = int_var(env, "LOOM_RESTART_COUNT", 0, 1 << 20).value_or(0);
  } else if (env.contains("OMPI_COMM_WORLD_RANK")) {
    job.launcher = Launcher::kMpi;
    const std::string why = "mpirun sets it with OMPI_COMM_WORLD_RANK";
    job.world_size = required_int(env, "OMPI_COMM_WORLD_SIZE", why, 1, kMaxRanks);
    job.rank = required_int(env, "OMPI_COMM_WORLD_RANK", why, 0, kMaxRanks);
    job.local_world_size = int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxRanks).value_or(job.world_size);
    job.local_rank = int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxRanks).value_or(job.rank);
  } else if (env.contains("SLURM_PROCID")) {
    job.launcher = Launcher::kSlurm;
    const std::string why = "srun sets it with SLURM_PROCID";
    job.world_size = required_int(env, "SLURM_NTASKS", why, 1, kMaxRanks);
    job.rank = required_int(env, "SLURM_PROCID", why, 0, kMaxRanks);
    job.local_rank = int_var(env, "SLURM_LOCALID", 0, kMaxRanks).value_or(job.rank);
    if (auto n = int_var(env, "SLURM_NTASKS_PER_NODE", 1, kMaxRanks))
      job.local_world_size = *n;
    else if (auto spec = lookup(env, "SLURM_TASKS_PER_NODE"))
      job.local_world_size = slurm_tasks_on_node(*spec, int_var(env, "SLURM_NODEID", 0, kMaxRanks).value_or(0));
    else
      job.local_world_size = job.world_size;
  }

  const char* rank_var = job.launcher == Launcher::kMpi     ? "OMPI_COMM_WORLD_RANK"
                         : job.launcher == Launcher::kSlurm ? "SLURM_PROCID"
                                                            : "LOOM_RANK";
  if (job.rank >= job.world_size)
    throw ConfigError(fmt::format("{} = {} must be below the world size {}", rank_var, job.rank, job.world_size));
  if (job.local_world_size > job.world_size)
    throw ConfigError(fmt::format("the local world size {} exceeds the world size {} ({})", job.local_world_size,
                                  job.world_size, launcher_name(job.launcher)));
  if (job.local_rank >= job.local_world_size)
    throw ConfigError(fmt::format("the local rank {} must be below the local world size {} ({})", job.local_rank,
                                  job.local_world_size, launcher_name(job.launcher)));

  if (auto addr = lookup(env, "LOOM_MASTER_ADDR")) {
    if (addr->empty()) throw ConfigError("LOOM_MASTER_ADDR is set but empty");
    job.master_addr = *addr;
  }
  job.master_port = int_var(env, "LOOM_MASTER_PORT", 0, 65535).value_or(0);
  job.secret = lookup(env, "LOOM_JOB_SECRET").value_or("");
  job.forced_node_id = int_var(env, "LOOM_NODE_ID", 0, kMaxRanks).value_or(-1);

  if (job.world_size > 1) {
    if (job.launcher == Launcher::kSlurm &&
        (!env.contains("LOOM_MASTER_ADDR") || job.master_port == 0 || job.secret.empty()))
      throw ConfigError(
          "a multi-rank Slurm job needs LOOM_MASTER_ADDR, LOOM_MASTER_PORT and LOOM_JOB_SECRET from the job script "
          "(e.g. export LOOM_MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) "
          "LOOM_MASTER_PORT=29500 LOOM_JOB_SECRET=$(head -c32 /dev/urandom | xxd -p -c64)), or start it with `loom run`");
    if (job.launcher == Launcher::kLoom && job.secret.empty())
      throw ConfigError(fmt::format("LOOM_JOB_SECRET is not set in a {}-rank job: start the job with `loom run`",
                                    job.world_size));
    if (job.launcher == Launcher::kLoom && job.master_port == 0)
      throw ConfigError(fmt::format("LOOM_MASTER_PORT is not set (or 0) in a {}-rank job: start the job with `loom run`",
                                    job.world_size));
  }

  // Under mpirun without LOOM_JOB_SECRET the id stays empty: rank 0 makes the secret and broadcasts it, and
  // the id is derived from it then.
  if (auto id = lookup(env, "LOOM_JOB_ID")) {
    validate_job_id(*id);
    job.job_id = *id;
  } else if (!job.secret.empty()) {
    job.job_id = job_id_from_secret(job.secret);
  } else if (job.world_size == 1) {
    job.job_id = fmt::format("pid{}", ::getpid());
  }
  return job;
}

JobEnv read_job_env() { return read_job_env(current_environment()); }

std::map<std::string, std::string> current_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view entry(*e);
    auto eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return env;
}

std::string job_id_from_secret(const std::string& secret) { return derived_id(secret, "job id"); }

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "single process";
    case Launcher::kLoom: return "loom run";
    case Launcher::kMpi: return "mpirun";
    case Launcher::kSlurm: return "srun";
  }
  return "unknown";
}

}  // namespace loom::comm
