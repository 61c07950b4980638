// Runs the `loom` binary as a user would (a shell command line, environment prefixes allowed) and
// captures its exit code, stdout and stderr. Shared by the CLI tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

namespace loom::test {

struct CliResult {
  int rc = -1;
  std::string out, err;
};

// Runs a bash command line (no single quotes in it) and captures its exit code, stdout and stderr.
inline CliResult run_shell(const std::string& command_line) {
  namespace fs = std::filesystem;
  static int counter = 0;
  fs::path err = fs::temp_directory_path() / ("loom-cli-err-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::string cmd = "bash -c '{ " + command_line + "\n} 2>" + err.string() + "'";
  CliResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int status = ::pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream e(err);
  r.err.assign(std::istreambuf_iterator<char>(e), {});
  fs::remove(err);
  return r;
}

// `prefix` goes before the binary (e.g. "LOOM_FAULT_INJECT=manifest" or "ulimit -f 100;").
inline CliResult run_loom(const std::string& args, const std::string& prefix = "") {
  return run_shell(prefix + " exec " + LOOM_BINARY + " " + args);
}

// A fresh, empty scratch folder unique to this process.
inline std::filesystem::path scratch_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("loom-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// Trains `ranks` ranks of the tiny config with `sets` (quietly); returns the run folder (metrics in out/,
// checkpoints in ck/). Fails the calling test if the run does.
inline std::filesystem::path train_tiny(const std::string& name, int ranks, const std::string& sets) {
  auto dir = scratch_dir(name);
  auto r = run_loom("run -n " + std::to_string(ranks) + " -- loom train --config " LOOM_SOURCE_DIR
                    "/configs/tiny.toml --quiet " + sets + " --set train.out_dir=" + (dir / "out").string() +
                    " --save-dir " + (dir / "ck").string());
  if (r.rc != 0) ADD_FAILURE() << r.err;
  return dir;
}

// Copies the checkpoints in `from`/ck and resumes them with `ranks` ranks of the tiny config and `args`
// (quietly); returns the run folder (metrics in out/). Fails the calling test if the run does.
inline std::filesystem::path resume_copy(const std::string& name, const std::filesystem::path& from, int ranks,
                                         const std::string& args) {
  auto dir = scratch_dir(name);
  std::filesystem::copy(from / "ck", dir / "ck", std::filesystem::copy_options::recursive);
  auto r = run_loom("run -n " + std::to_string(ranks) + " -- loom train --config " LOOM_SOURCE_DIR
                    "/configs/tiny.toml --quiet " + args + " --set train.out_dir=" + (dir / "out").string() +
                    " --save-dir " + (dir / "ck").string() + " --resume");
  if (r.rc != 0) ADD_FAILURE() << r.err;
  return dir;
}

}  // namespace loom::test
