#!/usr/bin/env bash
# What the always-on collective check costs (issue 21: below 2% of a 4 KiB all-reduce). `loom bench comm
# --check-cost N` times each size N rounds with the op stamps off and on, alternating inside one run, so the
# comparison shares ranks, buffers and core placement (two launches of the same run differ on this VM by
# more than a 4 KiB all-reduce takes). Runs the one-shot/direct path and the ring path.
#   bash bench/comm_check_cost.sh [rounds] [ranks] [build-dir]
set -euo pipefail
rounds=${1:-15}
ranks=${2:-2}
build=${3:-build}
loom="$(cd "$build" && pwd)/loom"
[ -x "$loom" ] || { echo "no $loom: build first" >&2; exit 1; }
for algo in auto ring; do
  echo "# LOOM_COMM_ALGO=$algo"
  LOOM_COMM_ALGO=$algo "$loom" run -n "$ranks" -- "$loom" bench comm --ops all_reduce -b 4K -e 4M -f 32 --batches 9 \
    --no-ceiling --check-cost "$rounds" | grep -E "all_reduce|op check"
done
