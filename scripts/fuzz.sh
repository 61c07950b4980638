#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang, ASan + UBSan) in build-fuzz/, replays every regression
# input and seed, then fuzzes each target for SECONDS (default 30), two at a time. Exits non-zero on
# any crash, leak, sanitizer report or hang; the inputs that caused them are kept in build-fuzz/crashes/.
# docs/fuzzing.md says how to run longer and how to keep a crash as a regression input.
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      LOOM_FUZZ_TARGETS="safetensors hardware" picks targets
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
jobs=${LOOM_FUZZ_JOBS:-2}

# name:max_len:dictionary -- max_len is the longest input a target is given: room for the largest seed
# (the files of a real tiny checkpoint) and some growth; longer inputs only slow the fuzzer down. The
# dictionary (fuzz/dicts/) holds the syntax, key names and edge values of the format.
all_targets=(safetensors:16384:json checkpoint_manifest:16384:json shard_header:4096: shard_set:8192:json
             run_config:4096:toml hardware:4096:toml validation:8192:toml store_wire:1024: store_server:4096:)
if [ -n "${LOOM_FUZZ_TARGETS:-}" ]; then
  picked=()
  for t in "${all_targets[@]}"; do [[ " $LOOM_FUZZ_TARGETS " == *" ${t%%:*} "* ]] && picked+=("$t"); done
  all_targets=("${picked[@]}")
fi

cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DLOOM_FUZZ=ON -DLOOM_BUILD_TESTS=OFF >/dev/null
mkdir -p build-fuzz/crashes build-fuzz/logs
if ! nice -n 10 cmake --build build-fuzz -j"$jobs" --target fuzz >build-fuzz/logs/build.log 2>&1; then
  grep -E -A5 'error|FAILED' build-fuzz/logs/build.log | head -40
  echo "fuzz: the build failed (build-fuzz/logs/build.log)"
  exit 1
fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=0:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}

# One target: replay fuzz/regressions/<name> and the seeds, then fuzz. New inputs go to
# build-fuzz/corpus/<name> (the committed seeds are only read).
run_target() {
  local name max_len dict
  IFS=: read -r name max_len dict <<<"$1"
  local bin=build-fuzz/fuzz/${name}_fuzz log=build-fuzz/logs/$name.log
  local seeds=(fuzz/corpus/"$name")
  [ -d fuzz/regressions/"$name" ] && seeds+=(fuzz/regressions/"$name")
  mkdir -p build-fuzz/corpus/"$name"
  local common=(-max_len="$max_len" -timeout=10 -rss_limit_mb=2048 -artifact_prefix=build-fuzz/crashes/"$name"-)
  [ -n "$dict" ] && common+=(-dict=fuzz/dicts/"$dict".dict)
  if ! "$bin" "${common[@]}" -runs=0 "${seeds[@]}" >"$log" 2>&1; then
    echo "fuzz: $name: a regression input or seed fails (log: $log)"
    grep -m1 -E 'ERROR: |runtime error|^fuzz: ' "$log" | sed 's/^/  /' || true
    return 1
  fi
  if ! nice -n 10 "$bin" "${common[@]}" -max_total_time="$seconds" -print_final_stats=1 \
      build-fuzz/corpus/"$name" "${seeds[@]}" >>"$log" 2>&1; then
    echo "fuzz: $name: CRASH after $(grep -c '' "$log") log lines (log: $log; input: build-fuzz/crashes/$name-*)"
    grep -m1 -E 'ERROR: |runtime error|^fuzz: ' "$log" | sed 's/^/  /' || true
    return 1
  fi
  local runs cov
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1)
  echo "fuzz: $name: ${runs:-?} inputs in ${seconds} s, $cov, no crash"
}
export -f run_target
export seconds

start=$(date +%s)
status=0
printf '%s\n' "${all_targets[@]}" | xargs -P "$jobs" -I{} bash -c 'run_target {}' || status=1
if [ $status -ne 0 ]; then
  echo "fuzz: FAILED (crash inputs in build-fuzz/crashes/, logs in build-fuzz/logs/; docs/fuzzing.md)"
  exit 1
fi
echo "fuzz: ${#all_targets[@]} targets clean after $(( $(date +%s) - start )) s of fuzzing, ${seconds} s each"
