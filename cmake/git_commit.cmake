# Run at every build (src/loom/CMakeLists.txt, target loom_git_commit): writes OUT, a header that
# defines LOOM_GIT_COMMIT as the source tree's commit (`git rev-parse --short HEAD`, "-dirty" when
# tracked files have changes, "unknown" outside a git checkout). Captured at configure time instead,
# the hash went stale with every later commit, and run manifests recorded a commit the binary was not
# built from. The file is rewritten only when the value changes, so an unchanged tree rebuilds nothing.
execute_process(COMMAND git rev-parse --short HEAD WORKING_DIRECTORY "${SRC}" OUTPUT_VARIABLE commit
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT commit)
  set(commit "unknown")
else()
  execute_process(COMMAND git status --porcelain --untracked-files=no WORKING_DIRECTORY "${SRC}"
                  OUTPUT_VARIABLE changes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(changes)
    string(APPEND commit "-dirty")
  endif()
endif()
set(content "// Generated at build time by cmake/git_commit.cmake: do not edit.\n#pragma once\n#define LOOM_GIT_COMMIT \"${commit}\"\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL content)
  file(WRITE "${OUT}" "${content}")
endif()
