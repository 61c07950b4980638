// The `loom` binary: one file per subcommand; this file only dispatches and reports errors.
#include <csignal>
#include <cstdio>
#include <exception>
#include <string>

#include "loom/cli/commands.h"
#include "loom/error.h"
#include "loom_git_commit.h"  // generated at build time (cmake/git_commit.cmake)

int main(int argc, char** argv) {
  // A file-size limit must surface as a write error (EFBIG) Loom can report, not a silent kill.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"Loom: a distributed training engine for transformer language models"};
  app.set_version_flag("--version", std::string("loom ") + LOOM_VERSION + " (" + LOOM_GIT_COMMIT + ")");
  app.require_subcommand(1);
  loom::cli::Action action;
  loom::cli::register_train(app, action);
  loom::cli::register_info(app, action);
  loom::cli::register_generate(app, action);
  loom::cli::register_interchange(app, action);
  loom::cli::register_plan(app, action);
  loom::cli::register_prepare(app, action);
  loom::cli::register_calibrate(app, action);
  loom::cli::register_run(app, action);
  loom::cli::register_bench(app, action);
  loom::cli::register_verify(app, action);
  loom::cli::register_profile(app, action);
  loom::cli::register_ckpt(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" that succeed; a real one reads like every other Loom error:
    // one line, exit status 1 (CLI11's own form was two lines and a status of 100-odd).
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "loom: error: %s (see `loom %s--help`)\n", e.what(),
                 argc > 1 && argv[1][0] != '-' ? (std::string(argv[1]) + " ").c_str() : "");
    return 1;
  }
  try {
    return action ? action() : 0;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: internal error: %s\n", e.what());
    return 2;
  }
}
