#!/usr/bin/env bash
# Data parallelism on one machine (issue 5's target): `mini`, dp=2 ranks of 1 thread against one rank of
# 2 threads, with gradient buckets overlapped with backward, with one all-reduce after backward, and each
# ZeRO stage (ZeRO-3 also with pages given back eagerly). Alternates the runs for `rounds` rounds and prints each run's median tokens/s (steps 3..N)
# and rank 0's peak model-state memory (weights + gradients + optimizer, MiB).
#   bash bench/dp_vs_threads.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"
declare -A results state
runs=("dp1 1 4096 0 lazy" "dp2-buckets 2 4096 0 lazy" "dp2-after-backward 2 0 0 lazy" "dp2-zero1 2 4096 1 lazy"
      "dp2-zero2 2 4096 2 lazy" "dp2-zero3 2 4096 3 lazy" "dp2-zero3-eager 2 4096 3 eager")
for ((r = 1; r <= rounds; r++)); do
  for run in "${runs[@]}"; do
    set -- $run
    rm -rf "$tmp/ck"
    read -r tps mib < <("$loom" run -n "$2" -- "$loom" train --config configs/mini.toml --set parallel.dp="$2" \
      --set parallel.bucket_kb="$3" --set parallel.zero="$4" --set parallel.zero_release="$5" \
      --set train.steps="$steps" --set train.eval_every=0 --set checkpoint.save_every=0 \
      --set train.out_dir="$tmp/out" --save-dir "$tmp/ck" --quiet --json | tail -1 |
      python3 -c 'import json,sys; j=json.load(sys.stdin); p=j["peak_bytes_by_category"]
print(round(j["tokens_per_s"]), round((p["parameters"]+p["gradients"]+p["optimizer"])/2**20, 1))')
    results[$1]+="$tps "
    state[$1]=$mib
  done
done
base=$(echo "${results[dp1]}" | median)
printf "%-22s %10s %8s %12s   (runs: tokens/s)\n" run "median" "vs dp1" "state MiB"
for run in "${runs[@]}"; do
  k=${run%% *}
  m=$(echo "${results[$k]}" | median)
  printf "%-22s %10s %7.2fx %12s   (%s)\n" "$k" "$m" "$(awk -v a="$m" -v b="$base" 'BEGIN {print a / b}')" "${state[$k]}" \
    "${results[$k]}"
done
