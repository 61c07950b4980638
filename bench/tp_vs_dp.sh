#!/usr/bin/env bash
# Tensor parallelism on one machine (issue 12's benchmark): `mini` and `llama-mini` (bf16) as one rank
# of 2 threads, dp=2 (two ranks of one thread), and tp=2 (two ranks of one thread) with and without
# sequence parallelism and with and without the TP overlap. The runs are alternated for `rounds`
# rounds; each row prints the median tokens/s (steps 3..N) against one rank, rank 0's peak memory by
# category (MiB: parameters + optimizer, gradients, activations), and rank 0's traced time per step
# (median run): GEMMs, other kernels, communication waited for (exposed) and the part of the
# asynchronous collectives' flight that compute hid (overlapped).
#   bash bench/tp_vs_dp.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"
declare -A results rows
# name ranks dp tp sp overlap
runs=("one-rank 1 1 1 false true" "dp2 2 2 1 false true" "tp2 2 1 2 false true" "tp2-sp 2 1 2 true true"
      "tp2-no-overlap 2 1 2 false false" "tp2-sp-no-overlap 2 1 2 true false")
for config in mini llama-mini; do
  for ((r = 1; r <= rounds; r++)); do
    for run in "${runs[@]}"; do
      set -- $run
      rm -rf "$tmp/ck"
      line=$("$loom" run -n "$2" -- "$loom" train --config "configs/$config.toml" --set parallel.dp="$3" \
        --set parallel.tp="$4" --set parallel.sequence_parallel="$5" --set parallel.tp_overlap="$6" \
        --set train.steps="$steps" --set train.eval_every=0 --set checkpoint.save_every=0 \
        --set train.out_dir="$tmp/out" --save-dir "$tmp/ck" --quiet --json | tail -1 |
        python3 -c 'import json,sys; j=json.load(sys.stdin); p=j["peak_bytes_by_category"]; t=j.get("step_split_ms", {})
mib=lambda b: b/2**20
print(round(j["tokens_per_s"]), "%.1f %.1f %.1f" % (mib(p["parameters"]+p["optimizer"]), mib(p["gradients"]), mib(p["activations"])),
      "%.0f %.0f %.0f %.0f %.0f" % (t.get("wall",0), t.get("gemm",0), t.get("other_kernels",0), t.get("comm_exposed",0), t.get("comm_hidden",0)))')
      set -- $line
      results[$config/${run%% *}]+="$1 "
      rows[$config/${run%% *}/$1]="${*:2}"
    done
  done
  base=$(echo "${results[$config/one-rank]}" | median)
  base_state=$(echo "${rows[$config/one-rank/$(echo "${results[$config/one-rank]}" | tr ' ' '\n' | grep . | sort -n | sed -n "$(( (rounds + 1) / 2 ))p")]}" | cut -d' ' -f1)
  echo "$config (bf16), $steps steps per run, $rounds rounds"
  printf "%-18s %8s %7s %10s %7s %7s %7s | %6s %6s %6s %8s %8s   (runs: tokens/s)\n" run tok/s "vs 1" "param+opt" "ratio" grads act \
    "step" gemm other exposed overlap
  for run in "${runs[@]}"; do
    k=${run%% *}
    m=$(echo "${results[$config/$k]}" | median)
    pick=$(echo "${results[$config/$k]}" | tr ' ' '\n' | grep . | sort -n | sed -n "$(( (rounds + 1) / 2 ))p")
    set -- ${rows[$config/$k/$pick]}
    printf "%-18s %8s %6.2fx %10s %6.2fx %7s %7s | %6s %6s %6s %8s %8s   (%s)\n" "$k" "$m" \
      "$(awk -v a="$m" -v b="$base" 'BEGIN {print a / b}')" "$1" "$(awk -v a="$1" -v b="$base_state" 'BEGIN {print a / b}')" \
      "$2" "$3" "$4" "$5" "$6" "$7" "$8" "${results[$config/$k]}"
  done
  echo
done
