// `loom run`: the launcher. Starts N ranks of a command on this node with torchrun-style variables,
// hosts the rendezvous store (node 0), and watches the ranks: one failure stops the job, and the
// launcher says which rank failed and how. With --max-restarts K it then starts the job again, at most
// K times (LOOM_RESTART_COUNT tells the ranks which attempt they are; `loom train` continues from its
// latest complete checkpoint).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "loom/cli/commands.h"
#include "loom/comm/job_env.h"
#include "loom/comm/store.h"
#include "loom/error.h"

namespace loom::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct RunArgs {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  bool master_addr_given = false;
  int master_port = 0;  // 0 on one node: pick a free port
  double kill_grace_s = 3.0;
  double stop_timeout_s = 60.0;
  int max_restarts = 0;
  std::vector<std::string> command;
};

struct Rank {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
};

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* abbrev = sigabbrev_np(sig);
    return fmt::format("was killed by signal {} (SIG{}{})", sig, abbrev ? abbrev : "?",
                       WCOREDUMP(status) ? ", core dumped" : "");
  }
  return fmt::format("ended with wait status {}", status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// A rank that stopped because it was asked to: `loom train` saves and exits 128 + the signal (143 for
// SIGTERM) when preempted, so a job signalled behind the launcher's back is stopped, not failed.
bool stopped_on_request(int status) {
  if (!WIFEXITED(status)) return false;
  const int code = WEXITSTATUS(status);
  return code == 128 + SIGTERM || code == 128 + SIGINT || code == 128 + SIGHUP;
}

// `loom` as the command means this very binary, so `loom run -- loom train` works without loom on PATH.
std::string resolve_program(const std::string& program) {
  if (program != "loom") return program;
  const std::string self = self_executable();
  return self.empty() ? program : self;
}

// Shared-memory segments of this job that a killed rank could not unlink (ranks unlink them as soon as
// all have mapped them, so only a crash during set-up leaves any).
int remove_leftover_segments(const std::string& job_id) {
  int removed = 0;
  std::error_code ec;
  const std::string prefix = "loom-" + job_id + "-";
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0 && std::filesystem::remove(entry.path(), ec)) ++removed;
  }
  return removed;
}

void validate(const RunArgs& a) {
  if (a.command.empty())
    throw ConfigError("loom run: no command to launch: write it after `--`, e.g. loom run -n 2 -- loom train");
  if (a.nproc < 1 || a.nproc > 1024) throw ConfigError(fmt::format("loom run: -n {} must be 1..1024 ranks per node", a.nproc));
  if (a.nnodes < 1) throw ConfigError(fmt::format("loom run: --nnodes {} must be at least 1", a.nnodes));
  if (a.node_rank < 0 || a.node_rank >= a.nnodes)
    throw ConfigError(fmt::format("loom run: --node-rank {} must be 0..{} (--nnodes {})", a.node_rank, a.nnodes - 1, a.nnodes));
  if (a.master_port < 0 || a.master_port > 65535)
    throw ConfigError(fmt::format("loom run: --master-port {} is not a TCP port (1..65535)", a.master_port));
  if (a.nnodes > 1 && a.node_rank > 0 && !a.master_addr_given)
    throw ConfigError("loom run: nodes other than 0 need --master-addr (node 0's address), e.g. --master-addr node0");
  if (a.kill_grace_s < 0 || a.stop_timeout_s < 0)
    throw ConfigError("loom run: --kill-grace and --stop-timeout must not be negative");
  if (a.max_restarts < 0 || a.max_restarts > 10000)
    throw ConfigError(fmt::format("loom run: --max-restarts {} must be 0..10000", a.max_restarts));
  if (a.max_restarts > 0 && a.nnodes > 1)
    throw ConfigError(
        "loom run: --max-restarts needs a one-node job (--nnodes 1): restarting a multi-node job needs every "
        "node's launcher to agree on each restart, which this launcher does not do yet");
}

// The signals the launcher takes synchronously in its watch loop. SIGHUP only when it is not ignored
// already: under `nohup` the job must survive the terminal hanging up.
sigset_t watched_signals(bool watch_hup) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGCHLD);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  if (watch_hup) sigaddset(&set, SIGHUP);
  return set;
}

bool ignored(int sig) {
  struct sigaction old {};
  ::sigaction(sig, nullptr, &old);
  return old.sa_handler == SIG_IGN;
}

// Everything a child needs, built before fork: between fork and exec only system calls are safe (the
// store's thread may hold the allocator's or stdio's locks).
struct ChildImage {
  std::string program;
  std::vector<std::string> env;
  std::vector<char*> argv, envp;
  std::string exec_error;
};

[[noreturn]] void exec_rank(ChildImage& c, pid_t launcher, pid_t group, const sigset_t& old_mask) {
  // One process group for the job, so the launcher can signal ranks and whatever they start.
  ::setpgid(0, group == 0 ? 0 : group);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the launcher died: nobody would watch or stop us
  if (::getppid() != launcher) ::_exit(127);
  // Ranks run in a background process group: one reading the terminal would stop on SIGTTIN.
  const int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
  // A shell starts background jobs with SIGINT ignored; ranks must still stop when the launcher asks.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  ::sigaction(SIGINT, &dfl, nullptr);
  ::sigaction(SIGTERM, &dfl, nullptr);
  ::sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  ::execvpe(c.program.c_str(), c.argv.data(), c.envp.data());
  const std::string& msg = c.exec_error;  // prepared by the parent; strerror is not async-signal-safe
  [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, msg.data(), msg.size());
  const char* why = errno == ENOENT ? "no such file or command\n" : errno == EACCES ? "permission denied\n" : "exec failed\n";
  w = ::write(STDERR_FILENO, why, std::strlen(why));
  ::_exit(127);
}

std::string random_suffix() {
  return comm::make_job_secret().substr(0, 6);
}

// How one start of the job's ranks ended.
struct Attempt {
  std::optional<std::string> failure;  // the failed rank and how (a rank that died first, when one did)
  int stop_signal = 0;                 // SIGINT/SIGTERM/SIGHUP the launcher received
  int exit_code = 0;                   // what `loom run` returns for it
};

// The launcher's state across attempts: signals, the job's secret and base environment.
struct Launcher {
  const RunArgs& a;
  std::map<std::string, std::string> base_env;
  std::string secret;
  sigset_t handled{}, old_mask{};

  // One start of every rank on this node, watched until all have ended.
  Attempt run(int restart);
};

Attempt Launcher::run(int restart) {
  // Names shared memory on this node only, so each launch (and each restart) gets its own suffix: two
  // jobs started from one shell with the same exported secret (or a nested `loom run`) must not share
  // segments. The id is public (it names files under /dev/shm): a keyed hash of the secret, never a
  // piece of it.
  const std::string job_id =
      (base_env.contains("LOOM_JOB_ID") ? base_env["LOOM_JOB_ID"] : comm::job_id_from_secret(secret)) + "-" +
      random_suffix();
  // Node 0 hosts the store for the attempt's lifetime (a restart gets a fresh one: no key of the failed
  // attempt survives); loopback only unless other nodes must reach it.
  std::unique_ptr<comm::StoreServer> server;
  int port = a.master_port;
  if (a.node_rank == 0) {
    server = std::make_unique<comm::StoreServer>(a.nnodes > 1 ? "0.0.0.0" : "127.0.0.1", a.master_port, secret);
    port = server->port();
  }

  const int world = a.nproc * a.nnodes;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool user_threads = base_env.contains("LOOM_THREADS");
  std::vector<ChildImage> images(a.nproc);
  for (int local = 0; local < a.nproc; ++local) {
    ChildImage& c = images[local];
    auto env_map = base_env;
    const int rank = a.node_rank * a.nproc + local;
    env_map["LOOM_RANK"] = std::to_string(rank);
    env_map["LOOM_LOCAL_RANK"] = std::to_string(local);
    env_map["LOOM_WORLD_SIZE"] = std::to_string(world);
    env_map["LOOM_LOCAL_WORLD_SIZE"] = std::to_string(a.nproc);
    env_map["LOOM_NODE_RANK"] = std::to_string(a.node_rank);
    env_map["LOOM_MASTER_ADDR"] = a.master_addr;
    env_map["LOOM_MASTER_PORT"] = std::to_string(port);
    env_map["LOOM_JOB_SECRET"] = secret;
    env_map["LOOM_JOB_ID"] = job_id;
    env_map["LOOM_RESTART_COUNT"] = std::to_string(restart);  // torchrun: TORCHELASTIC_RESTART_COUNT
    env_map["LOOM_MAX_RESTARTS"] = std::to_string(a.max_restarts);
    // Ranks share the cores: N ranks each taking every core would thrash.
    if (!user_threads) env_map["LOOM_THREADS"] = std::to_string(std::max(1u, cores / static_cast<unsigned>(a.nproc)));
    for (const auto& [k, v] : env_map) c.env.push_back(k + "=" + v);
    c.program = resolve_program(a.command[0]);
    c.argv.push_back(c.program.data());
    for (size_t i = 1; i < a.command.size(); ++i) c.argv.push_back(const_cast<char*>(a.command[i].c_str()));
    c.argv.push_back(nullptr);
    for (auto& e : c.env) c.envp.push_back(e.data());
    c.envp.push_back(nullptr);
    c.exec_error = fmt::format("loom run: rank {} cannot start '{}': ", rank, c.program);
  }

  std::vector<Rank> ranks(a.nproc);
  const pid_t self = ::getpid();
  pid_t group = 0;
  Attempt out;
  std::optional<std::string> died;  // the first rank killed by a signal the launcher did not send
  std::vector<int> sent;            // signals the launcher sent to the job
  int rank_stop_status = 0;         // 128 + signal of a rank that stopped when asked
  Clock::time_point kill_at = Clock::time_point::max();  // SIGKILL whatever still runs then
  int running = 0;
  // The job's process group: every rank and whatever it started, each signalled exactly once (a rank
  // that is training treats a second SIGINT as "stop now, skip the checkpoint").
  auto signal_all = [&](int sig) {
    if (group != 0) ::kill(-group, sig);
    sent.push_back(sig);
  };
  auto deadline_in = [](double seconds) {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  };
  auto record_failure = [&](std::string what) {
    if (out.failure || out.stop_signal != 0) return;
    out.failure = std::move(what);
    std::fprintf(stderr, "loom run: %s; stopping the other %d rank(s)\n", out.failure->c_str(), running);
    if (running > 0) signal_all(SIGTERM);
    kill_at = std::min(kill_at, deadline_in(a.kill_grace_s));
  };

  for (int local = 0; local < a.nproc; ++local) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      record_failure(fmt::format("cannot start rank {}: fork failed: {}", a.node_rank * a.nproc + local, std::strerror(errno)));
      break;
    }
    if (pid == 0) exec_rank(images[local], self, group, old_mask);
    if (group == 0) group = pid;
    ::setpgid(pid, group);  // also from the parent, so no signal can race the child's own call
    ranks[local] = Rank{a.node_rank * a.nproc + local, pid, true, 0};
    ++running;
  }

  while (running > 0) {
    timespec tick{0, 100'000'000};
    siginfo_t info;
    const int sig = ::sigtimedwait(&handled, &info, &tick);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      if (out.stop_signal != 0 || out.failure) {  // asked twice, or already stopping a failed job: stop now
        std::fprintf(stderr, "loom run: stopping all ranks now (SIGKILL)\n");
        signal_all(SIGKILL);
        if (out.stop_signal == 0) out.stop_signal = sig;
      } else {
        out.stop_signal = sig;
        std::fprintf(stderr, "loom run: received SIG%s: asking %d rank(s) to stop (again to kill them now)\n",
                     sigabbrev_np(sig), running);
        signal_all(sig == SIGHUP ? SIGTERM : sig);  // ranks save a checkpoint on SIGINT/SIGTERM when training
        kill_at = std::min(kill_at, deadline_in(a.stop_timeout_s));
      }
    }
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG | WUNTRACED);
      if (pid < 0 && errno == ECHILD) {  // nothing left to wait for, whatever the bookkeeping says
        for (auto& r : ranks) r.running = false;
        running = 0;
      }
      if (pid <= 0) break;
      for (auto& r : ranks) {
        if (r.pid != pid || !r.running) continue;
        if (WIFSTOPPED(status) && WSTOPSIG(status) != SIGTTIN && WSTOPSIG(status) != SIGTTOU) continue;  // SIGSTOP: the user's
        if (WIFSTOPPED(status)) {
          record_failure(fmt::format("rank {} (pid {}) was stopped by signal {} (SIG{}): ranks cannot use the "
                                     "terminal (stdin is /dev/null; `stty tostop` stops writers)",
                                     r.rank, r.pid, WSTOPSIG(status), sigabbrev_np(WSTOPSIG(status))));
          ::kill(r.pid, SIGKILL);
          continue;
        }
        r.running = false;
        r.status = status;
        --running;
        // A rank that died of a signal nobody here sent is the cause, even when a peer that noticed its
        // death was reaped first.
        if (WIFSIGNALED(status) && !died && std::find(sent.begin(), sent.end(), WTERMSIG(status)) == sent.end())
          died = fmt::format("rank {} (pid {}) {}", r.rank, r.pid, describe_exit(status));
        if (stopped_on_request(status))
          rank_stop_status = WEXITSTATUS(status);
        else if (failed(status))
          record_failure(fmt::format("rank {} (pid {}) {}", r.rank, r.pid, describe_exit(status)));
      }
    }
    if (Clock::now() >= kill_at && running > 0) {
      std::fprintf(stderr, "loom run: %d rank(s) still running after the grace period: killing them\n", running);
      signal_all(SIGKILL);
      kill_at = Clock::time_point::max();
    }
  }

  const int removed = remove_leftover_segments(job_id);
  if (removed > 0) std::fprintf(stderr, "loom run: removed %d shared-memory segment(s) left by failed ranks\n", removed);
  if (out.failure && died) out.failure = died;
  if (out.failure)
    out.exit_code = 1;
  else if (out.stop_signal != 0)
    out.exit_code = 128 + out.stop_signal;
  else {
    out.exit_code = rank_stop_status;
    for (const auto& r : ranks)
      if (failed(r.status) && !stopped_on_request(r.status)) out.exit_code = 1;
  }
  return out;
}

int launch(const RunArgs& a) {
  validate(a);
  Launcher l{a, comm::current_environment(), "", {}, {}};
  l.secret = l.base_env.contains("LOOM_JOB_SECRET") ? l.base_env["LOOM_JOB_SECRET"] : "";
  if (a.nnodes > 1 && l.secret.empty())
    throw ConfigError(
        "loom run: a multi-node job needs the same LOOM_JOB_SECRET on every node: export "
        "LOOM_JOB_SECRET=$(head -c32 /dev/urandom | xxd -p -c64) and pass it to every node's `loom run`");
  if (a.nnodes > 1 && a.master_port == 0)
    throw ConfigError("loom run: a multi-node job needs --master-port (the same on every node), e.g. --master-port 29500");
  if (l.secret.empty()) l.secret = comm::make_job_secret();
  l.base_env.erase("OMPI_COMM_WORLD_RANK");  // a loom-run job is not an mpirun job, even when nested in one
  l.base_env.erase("SLURM_PROCID");

  // Signals are blocked before any thread exists (threads inherit the mask): otherwise the store's
  // thread could take a SIGINT meant for the watch loop and die of it, taking the launcher along.
  const bool watch_hup = !ignored(SIGHUP);
  l.handled = watched_signals(watch_hup);
  ::sigprocmask(SIG_BLOCK, &l.handled, &l.old_mask);
  // An ignored SIGINT (a shell's background job) must still reach the loop; an ignored SIGCHLD would
  // make the kernel reap the ranks before we could see how they ended.
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  std::signal(SIGCHLD, SIG_DFL);
  auto restore_mask = [&] {
    // Drain what arrived meanwhile, so an unblocked pending SIGINT cannot kill us after the report.
    timespec zero{0, 0};
    while (::sigtimedwait(&l.handled, nullptr, &zero) > 0) {
    }
    ::sigprocmask(SIG_SETMASK, &l.old_mask, nullptr);
  };

  Attempt last;
  int restarts = 0;
  try {
    for (int restart = 0;; ++restart) {
      restarts = restart;
      last = l.run(restart);
      if (!last.failure || last.stop_signal != 0 || restart >= a.max_restarts) break;
      // A stop asked for between attempts wins over the restart.
      timespec zero{0, 0};
      siginfo_t info;
      const int sig = ::sigtimedwait(&l.handled, &info, &zero);
      if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
        // Stopped, as a stop during an attempt is: 128 + the signal, not a failure.
        std::fprintf(stderr, "loom run: received SIG%s: not restarting after %s\n", sigabbrev_np(sig),
                     last.failure->c_str());
        restore_mask();
        return 128 + sig;
      }
      std::fprintf(stderr,
                   "loom run: restarting the job (restart %d of %d) after %s; `loom train` continues from its "
                   "latest complete checkpoint\n",
                   restart + 1, a.max_restarts, last.failure->c_str());
    }
  } catch (...) {
    restore_mask();
    throw;
  }
  restore_mask();
  if (last.failure) {
    std::fprintf(stderr, "loom run: job failed%s: %s\n",
                 restarts > 0 ? fmt::format(" after {} restart(s)", restarts).c_str() : "",
                 last.failure->c_str());
    return 1;
  }
  return last.exit_code;
}

}  // namespace

void register_run(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("run", "Launch a multi-rank job: loom run -n N -- loom train ...");
  auto args = std::make_shared<RunArgs>();
  cmd->add_option("-n,--nproc-per-node", args->nproc, "ranks on this node")->required();
  cmd->add_option("--nnodes", args->nnodes, "nodes in the job (start one `loom run` per node)")->check(finite_range(1, 65536));
  cmd->add_option("--node-rank", args->node_rank, "this node's index, 0..nnodes-1 (node 0 hosts the rendezvous)");
  auto* addr = cmd->add_option("--master-addr", args->master_addr, "address of node 0, where the rendezvous store listens");
  cmd->add_option("--master-port", args->master_port, "rendezvous port (default: a free port on one node)");
  cmd->add_option("--kill-grace", args->kill_grace_s,
                  "seconds the other ranks get to exit after one fails, before SIGKILL (default 3)")
      ->check(finite_range(0, 3600));
  cmd->add_option("--stop-timeout", args->stop_timeout_s,
                  "seconds ranks get to finish (e.g. save a checkpoint) after Ctrl-C, before SIGKILL (default 60)")
      ->check(finite_range(0, 86400));
  cmd->add_option("--max-restarts", args->max_restarts,
                  "when a rank fails or dies (or the hang watchdog fires), stop the job and start it again, at most "
                  "K times (one node; `loom train` continues from its latest complete checkpoint); default 0")
      ->check(finite_range(0, 10000));
  cmd->add_option("command", args->command, "the command each rank runs (after --); `loom` means this binary")
      ->required();
  cmd->positionals_at_end();
  cmd->callback([&action, args, addr] {
    args->master_addr_given = addr->count() > 0;
    action = [args] { return launch(*args); };
  });
}

}  // namespace loom::cli
