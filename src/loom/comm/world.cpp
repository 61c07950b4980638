#include "loom/comm/world.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include "loom/comm/mpi_transport.h"
#include "loom/comm/rendezvous.h"
#include "loom/error.h"

namespace loom::comm {

namespace {

int parse_int_var(const std::map<std::string, std::string>& env, const std::string& name, int fallback, int lo,
                  int hi) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return fallback;
  size_t used = 0;
  long v = 0;
  try {
    v = std::stol(it->second, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != it->second.size() || v < lo || v > hi)
    throw ConfigError(fmt::format("{}={} is not an integer in [{}, {}]", name, it->second, lo, hi));
  return static_cast<int>(v);
}

// The MPI transport's arena is an MPI window (MPI_Get serves read_peer). OpenMPI 4.1's shared-memory
// BTL fails at teardown (CMA reads returning EFAULT, then a hang) once a job's windows pass about
// 512 MiB per rank, so MPI arenas stay at 256 MiB at most: MPI copies anyway, registered memory buys it
// nothing beyond room for the buffers.
size_t mpi_arena_bytes(const CommOptions& o) { return std::min(o.shm.arena_bytes, size_t{256} << 20); }

std::string host_name() {
  char buf[256] = {};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

OpKind parse_op_kind(const std::string& s) {
  for (int k = 0; k <= static_cast<int>(OpKind::kBarrier); ++k)
    if (s == op_name(static_cast<OpKind>(k))) return static_cast<OpKind>(k);
  throw ConfigError("LOOM_COMM_ALGO: unknown op '" + s +
                    "': use all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all (or their _v forms)");
}

std::string shm_prefix(const GroupContext& ctx, const std::string& id) {
  return "/loom-" + ctx.job.job_id + "-" + id;
}

// The transport(s) for a group of `global` ranks; `mpi` is this group's MPI communicator when MPI is
// in use (may be null on one node).
std::unique_ptr<ProcessGroup> build_group(const std::shared_ptr<GroupContext>& ctx, const std::vector<int>& global,
                                          int my_index, const std::string& id, Allocator* accounting,
                                          std::unique_ptr<MpiTransport> mpi) {
  const auto deadline = Clock::now() + ctx->tuning.timeout;
  const int node = ctx->node_of[global[my_index]];
  const bool one_node = std::all_of(global.begin(), global.end(), [&](int g) { return ctx->node_of[g] == node; });
  if (ctx->use_mpi) return std::make_unique<ProcessGroup>(ctx, global, my_index, std::move(mpi), id, accounting);
  if (one_node) {
    ShmOptions o = ctx->options.shm;
    o.ranks_on_node = std::max<int>(o.ranks_on_node, ctx->job.local_world_size);
    auto t = ShmTransport::create(*ctx->store, "loom/g/" + id, shm_prefix(*ctx, id), my_index, global, o, deadline,
                                  ctx->liveness);
    return std::make_unique<ProcessGroup>(ctx, global, my_index, std::move(t), id, accounting);
  }
  if (!mpi)
    throw CommError(fmt::format(
        "group {} spans {} nodes, which needs the MPI transport: start multi-node jobs with mpirun (mpirun -np N "
        "loom ...), or force everything onto one node (unset LOOM_NODE_ID / LOOM_RANKS_PER_NODE)",
        id, 1 + *std::max_element(ctx->node_of.begin(), ctx->node_of.end())));
  // Hierarchical when the ranks are node-major with the same count on every node.
  std::vector<int> nodes_in_order;
  for (int g : global)
    if (nodes_in_order.empty() || nodes_in_order.back() != ctx->node_of[g]) nodes_in_order.push_back(ctx->node_of[g]);
  const int N = static_cast<int>(nodes_in_order.size());
  const int L = static_cast<int>(global.size()) / N;
  bool node_major = static_cast<int>(global.size()) == N * L;
  for (size_t i = 0; node_major && i < global.size(); ++i)
    node_major = ctx->node_of[global[i]] == nodes_in_order[i / L];
  std::sort(nodes_in_order.begin(), nodes_in_order.end());
  node_major = node_major && std::adjacent_find(nodes_in_order.begin(), nodes_in_order.end()) == nodes_in_order.end();
  auto* flat_mpi = mpi.get();
  auto pg = std::make_unique<ProcessGroup>(ctx, global, my_index, std::move(mpi), id, accounting);
  if (!node_major || L == 1) return pg;
  const int local_index = my_index % L, node_index = my_index / L;
  std::vector<int> local_globals(global.begin() + node_index * L, global.begin() + (node_index + 1) * L);
  ShmOptions o = ctx->options.shm;
  o.ranks_on_node = std::max<int>(o.ranks_on_node, ctx->job.local_world_size);
  const std::string local_id = fmt::format("{}.node{}", id, node);
  auto local = ShmTransport::create(*ctx->store, "loom/g/" + local_id, shm_prefix(*ctx, local_id), local_index,
                                    local_globals, o, deadline, ctx->liveness);
  auto cross = flat_mpi->split(local_index, node_index, size_t{64} << 20);
  pg->set_hierarchy(std::move(local), std::move(cross));
  return pg;
}

}  // namespace

CommOptions comm_options_from_env(const std::map<std::string, std::string>& env) {
  CommOptions o;
  if (auto it = env.find("LOOM_COMM"); it != env.end() && !it->second.empty()) o.transport = it->second;
  if (o.transport != "auto" && o.transport != "shm" && o.transport != "mpi")
    throw ConfigError("LOOM_COMM=" + o.transport + " is not a transport: use auto, shm or mpi");
  o.tuning.timeout = std::chrono::seconds(parse_int_var(env, "LOOM_COMM_TIMEOUT", 300, 1, 86400 * 7));
  o.tuning.debug = parse_int_var(env, "LOOM_COMM_DEBUG", 0, 0, 1) == 1;
  o.tuning.check = parse_int_var(env, "LOOM_COMM_CHECK", 1, 0, 1) == 1;
  o.tuning.one_shot_max_bytes = static_cast<size_t>(parse_int_var(env, "LOOM_COMM_ONE_SHOT_KB", 16, 0, 128)) << 10;
  o.shm.arena_bytes = static_cast<size_t>(parse_int_var(env, "LOOM_COMM_ARENA_MB", 512, 1, 1 << 20)) << 20;
  o.shm.spin_us = parse_int_var(env, "LOOM_COMM_SPIN_US", 50, 0, 1'000'000);
  o.ranks_per_node = parse_int_var(env, "LOOM_RANKS_PER_NODE", 0, 0, 1 << 20);
  if (auto it = env.find("LOOM_COMM_ALGO"); it != env.end() && !it->second.empty()) {
    const std::string& spec = it->second;
    size_t start = 0;
    while (start <= spec.size()) {
      size_t end = spec.find(',', start);
      if (end == std::string::npos) end = spec.size();
      std::string item = spec.substr(start, end - start);
      if (auto eq = item.find('='); eq != std::string::npos) {
        o.tuning.forced[static_cast<int>(parse_op_kind(item.substr(0, eq)))] = parse_algo(item.substr(eq + 1));
      } else if (!item.empty()) {
        for (auto& f : o.tuning.forced) f = parse_algo(item);
      }
      start = end + 1;
    }
  }
  return o;
}

std::unique_ptr<World> World::join(const JobEnv& job, const CommOptions& options, Allocator* accounting) {
  std::unique_ptr<World> w(new World());
  auto ctx = std::make_shared<GroupContext>();
  ctx->job = job;
  ctx->options = options;
  ctx->tuning = options.tuning;
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(options.tuning.timeout);
  const auto deadline = Clock::now() + options.tuning.timeout;

  if (job.launcher == Launcher::kMpi) {
    ensure_mpi_initialized();
    w->owns_mpi_ = true;
    int size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != job.world_size)
      throw CommError(fmt::format("MPI reports {} ranks but the environment says {}", size, job.world_size));
  } else if (options.transport == "mpi") {
    throw ConfigError("--comm mpi needs the job to run under mpirun (mpirun -np N loom ...), not `loom run`");
  }
  ctx->use_mpi = options.transport == "mpi";

  std::string addr = job.master_addr, secret = job.secret;
  int port = job.master_port;
  if (job.world_size == 1 && port == 0) {
    // A one-process job still gets a (private) store, so every group is built the same way.
    secret = make_job_secret();
    w->server_ = std::make_unique<StoreServer>("127.0.0.1", 0, secret);
    addr = "127.0.0.1";
    port = w->server_->port();
  } else if (job.launcher == Launcher::kMpi && port == 0) {
    // Under mpirun, rank 0 hosts the store and hands its address and a fresh secret to the others
    // over MPI: nobody outside the MPI job learns the secret.
    struct Rendezvous {
      int port;
      int secret_bytes;
      char addr[256];
    } rv{};
    std::string my_host = host_name();
    std::vector<char> hosts(static_cast<size_t>(job.world_size) * 256);
    char mine[256] = {};
    std::strncpy(mine, my_host.c_str(), 255);
    MPI_Allgather(mine, 256, MPI_CHAR, hosts.data(), 256, MPI_CHAR, MPI_COMM_WORLD);
    bool one_host = true;
    for (int r = 0; r < job.world_size; ++r) one_host = one_host && my_host == std::string(&hosts[r * 256]);
    if (job.rank == 0) {
      std::string s = secret.empty() ? make_job_secret() : secret;
      w->server_ = std::make_unique<StoreServer>(one_host ? "127.0.0.1" : "0.0.0.0", 0, s);
      rv.port = w->server_->port();
      std::strncpy(rv.addr, one_host ? "127.0.0.1" : my_host.c_str(), sizeof rv.addr - 1);
      rv.secret_bytes = static_cast<int>(s.size());
      secret = s;
    }
    MPI_Bcast(&rv, sizeof rv, MPI_BYTE, 0, MPI_COMM_WORLD);
    // The secret goes by its length: any byte string of any length is a valid LOOM_JOB_SECRET.
    secret.resize(static_cast<size_t>(rv.secret_bytes));
    MPI_Bcast(secret.data(), rv.secret_bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
    addr = rv.addr;
    port = rv.port;
  }
  if (ctx->job.job_id.empty() || ctx->job.job_id.rfind("pid", 0) == 0) ctx->job.job_id = job_id_from_secret(secret);
  ctx->store = std::make_shared<Store>(addr, port, secret, timeout);

  std::vector<int> all(job.world_size);
  for (int r = 0; r < job.world_size; ++r) all[r] = r;
  std::string where = job.forced_node_id >= 0 ? fmt::format("id:{}", job.forced_node_id)
                      : options.ranks_per_node > 0 ? fmt::format("id:{}", job.rank / options.ranks_per_node)
                                                   : "host:" + host_name();
  auto places = store_all_gather(*ctx->store, "loom/nodes", job.rank, all, where, deadline);
  std::vector<std::string> distinct;
  for (const auto& p : places) {
    auto it = std::find(distinct.begin(), distinct.end(), p);
    ctx->node_of.push_back(static_cast<int>(it - distinct.begin()));
    if (it == distinct.end()) distinct.push_back(p);
  }

  if (job.world_size > 1) {
    std::vector<int> here;
    for (int r = 0; r < job.world_size; ++r)
      if (ctx->node_of[r] == ctx->node_of[job.rank]) here.push_back(r);
    if (here.size() > 1)
      ctx->liveness = PeerLiveness::create(*ctx->store, fmt::format("loom/live/{}", ctx->node_of[job.rank]),
                                           shm_prefix(*ctx, fmt::format("node{}", ctx->node_of[job.rank])), job.rank,
                                           here, deadline);
  }

  std::unique_ptr<MpiTransport> mpi;
  if (w->owns_mpi_ && (ctx->use_mpi || distinct.size() > 1)) {
    MPI_Comm dup;
    MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    mpi = std::make_unique<MpiTransport>(dup, mpi_arena_bytes(options));
  }
  w->group_ = build_group(ctx, all, job.rank, "world", accounting, std::move(mpi));
  w->ctx_ = ctx;
  return w;
}

World::~World() {
  group_.reset();
  if (owns_mpi_ && mpi_is_initialized()) {
    // Rank 0 hosts the store: keep it until every rank is past its last use of it.
    if (std::uncaught_exceptions() == 0) MPI_Barrier(MPI_COMM_WORLD);
    if (ctx_) ctx_->store.reset();
    server_.reset();
    finalize_mpi();
  }
}

int World::nodes() const { return 1 + *std::max_element(ctx_->node_of.begin(), ctx_->node_of.end()); }

std::unique_ptr<ProcessGroup> make_subgroup(const std::shared_ptr<GroupContext>& ctx, ProcessGroup& /*parent*/,
                                            Transport& parent_transport, int color, int key, std::vector<int> global,
                                            int my_index, std::string id, Allocator* accounting) {
  std::unique_ptr<MpiTransport> mpi;
  // MPI splits are collective over the parent communicator: every parent rank calls, members or not.
  if (auto* m = dynamic_cast<MpiTransport*>(&parent_transport)) mpi = m->split(color, key, mpi_arena_bytes(ctx->options));
  if (color < 0) return nullptr;
  return build_group(ctx, global, my_index, id, accounting, std::move(mpi));
}

}  // namespace loom::comm
