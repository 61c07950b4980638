#!/usr/bin/env bash
# Activation recompute (issue 16 item 3): `mini` (6 blocks, 8 x 256 tokens) and `gpt2-124m` (12 blocks,
# 2 x 1024 tokens), bf16, one rank, under train.recompute = none, selective and full, alternated for
# `rounds` rounds. Each row: the median tokens/s and step time (traced runs; `loom profile report`),
# the planner's step time for the same model and layout (--engine loom, on the report's roofline), the
# measured peak activation bytes (the allocator's category) and the planner's (`loom plan --engine
# loom`), and both against none.
#   bash bench/recompute.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"

# run MODEL POLICY ARGS...: prints "tokens/s measured_step_ms planned_step_ms activations_bytes"
run() {
  local model=$1 policy=$2
  shift 2
  rm -rf "$tmp/out"
  local json
  json=$("$loom" train --config configs/mini.toml --set model.preset="$model" --set data.source=synthetic \
    --set train.steps="$steps" --set train.eval_every=0 --set checkpoint.save_every=0 --set trace.summary=false \
    --set train.recompute="$policy" --set train.out_dir="$tmp/out" --set trace.file="$tmp/out/trace.json" \
    --quiet --json "$@" | tail -1)
  "$loom" profile report "$tmp/out" --json | python3 -c '
import json, sys
run = json.loads(sys.argv[1]); rep = json.load(sys.stdin)
step = {c["class"]: c for c in rep["planner"]["classes"]}["step"]
print(round(run["tokens_per_s"]), "%.1f %.1f %d" % (1e3 * step["measured_s"], 1e3 * step["predicted_s"],
      run["peak_bytes_by_category"]["activations"]))' "$json"
}

# planned_activations MODEL SEQ BATCH POLICY: the planner's activation bytes for one rank
planned_activations() {
  "$loom" plan --model "$1" --cluster a100:1 --seq "$2" --global-batch "$3" --engine loom \
    --fix dp=1 mb="$3" recompute="$4" --json | python3 -c '
import json, sys; print(int(round(json.load(sys.stdin)["layouts"][0]["memory_GiB"]["activations"] * 2**30)))'
}

for spec in "mini 256 8" "gpt2-124m 1024 2"; do
  set -- $spec
  model=$1 seq=$2 batch=$3
  declare -A tps=() meas=() plan=() act=()
  for ((r = 1; r <= rounds; r++)); do
    for policy in none selective full; do
      set -- $(run "$model" "$policy" --set train.seq_len="$seq" --set train.batch_size="$batch")
      tps[$policy]+="$1 " meas[$policy]+="$2 " plan[$policy]=$3 act[$policy]=$4
    done
  done
  echo "$model (bf16, one rank, $batch x $seq tokens per step), $steps steps per run, $rounds rounds (medians)"
  printf "%-10s %8s %6s %10s %10s %7s %12s %12s %7s %9s\n" recompute tok/s "vs none" "step ms" "planner" error \
    "act. MiB" "planner MiB" exact "vs none"
  base_tps=$(echo "${tps[none]}" | median)
  for policy in none selective full; do
    t=$(echo "${tps[$policy]}" | median) m=$(echo "${meas[$policy]}" | median) p=${plan[$policy]}
    a=${act[$policy]} pa=$(planned_activations "$model" "$seq" "$batch" "$policy")
    printf "%-10s %8s %6.2fx %10s %10s %+6.0f%% %12.1f %12.1f %7s %8.0f%%\n" "$policy" "$t" \
      "$(awk -v a="$t" -v b="$base_tps" 'BEGIN {print a / b}')" "$m" "$p" \
      "$(awk -v m="$m" -v p="$p" 'BEGIN {print 100 * (p - m) / m}')" \
      "$(awk -v a="$a" 'BEGIN {print a / 1048576}')" "$(awk -v a="$pa" 'BEGIN {print a / 1048576}')" \
      "$([ "$a" = "$pa" ] && echo yes || echo "$((pa - a)) B")" \
      "$(awk -v a="$a" -v b="${act[none]}" 'BEGIN {print 100 * a / b}')"
  done
  echo
  unset tps meas plan act
done
