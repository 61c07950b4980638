#!/usr/bin/env bash
# Tracing overhead on `mini` (bf16, one rank of 2 threads): tracing off, the per-kernel summary
# (trace.summary), and the full Chrome trace with each span's unit, micro-batch and pass (trace.file),
# alternated for `rounds` rounds; median tokens/s of each against off.
#   bash bench/trace_overhead.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"
declare -A results
modes=("off --set trace.summary=false" "summary --set trace.summary=true" "full --set trace.summary=true --set trace.file=$tmp/trace.json")
for ((r = 1; r <= rounds; r++)); do
  for m in "${modes[@]}"; do
    set -- $m
    name=$1
    shift
    rm -rf "$tmp/ck"
    tps=$("$loom" train --config configs/mini.toml --set train.steps="$steps" --set train.eval_every=0 \
      --set checkpoint.save_every=0 --set train.out_dir="$tmp/out" --save-dir "$tmp/ck" --quiet --json "$@" |
      tail -1 | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["tokens_per_s"]))')
    results[$name]+="$tps "
  done
done
base=$(echo "${results[off]}" | median)
echo "mini (bf16), one rank, $steps steps per run, $rounds rounds alternated (median tokens/s)"
for m in "${modes[@]}"; do
  name=${m%% *}
  v=$(echo "${results[$name]}" | median)
  printf "%-8s %8s %+7.1f%%   (%s)\n" "$name" "$v" "$(awk -v a="$v" -v b="$base" 'BEGIN {print 100 * (a / b - 1)}')" "${results[$name]}"
done
