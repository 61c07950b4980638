#!/usr/bin/env bash
# Mixture of experts (issue 19 item 5): `moe-mini` (llama-mini's attention, 8 SwiGLU experts of width
# 512, top-2: the same MLP FLOPs per token as llama-mini's dense width 1024, 2.4x the parameters)
# against llama-mini itself on one rank of 2 threads, and at ep = 2 and 4 (dp = ep ranks of one thread;
# ep = 4 puts 4 ranks on a 2-core machine), at ep = 2 under ZeRO-3 (the experts' state sharded over their
# own group: here one rank, the rest over both) and at tp = 2 with sequence parallelism (every expert
# split by width), bf16, batch 8 x 256, the runs alternated for `rounds` rounds.
# Each row: median tokens/s and MFU; the GEMM rate of the experts' grouped GEMMs and of the dense GEMMs
# in the same run (rank 0's span table, GFLOP/s: forward, backward data, backward weight); the share of
# rank 0's step in the MoE routing kernels and in the expert-parallel exchanges (ep_*: all-to-alls and
# the counts' all-gather, all exposed); rank 0's peak memory beside `loom plan --engine loom`'s for the
# same layout; the planner's tokens/s for the run's layout with a machine file calibrated now, with both
# models' layer GEMMs timed (the experts' at the rows each sees; `loom profile report --machine`: each
# rank 1/ranks of the machine).
#   bash bench/moe.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"
"$loom" calibrate --out "$tmp/machine.toml" --model configs/llama-mini.toml --model configs/moe-mini.toml | tail -1

# run PRESET DP EP TP ZERO: "tokens/s mfu peak_bytes grouped_fwd grouped_bwd_data grouped_bwd_weight fwd bwd_data
# bwd_weight moe_share% ep_share%"
run() {
  rm -rf "$tmp/out"
  "$loom" run -n $(($2 * $4)) -- "$loom" train --config configs/llama-mini.toml --set model.preset="$1" --set precision=bf16 \
    --set parallel.dp="$2" --set parallel.ep="$3" --set parallel.tp="$4" --set parallel.sequence_parallel=$([ "$4" -gt 1 ] && echo true || echo false) \
    --set parallel.zero="$5" \
    --set train.steps="$steps" --set train.eval_every=0 --set checkpoint.save_every=0 \
    --set train.out_dir="$tmp/out" --set trace.file="$tmp/out/trace.json" --json >"$tmp/log" 2>&1
  # The planner's step for this run's layout, each rank 1/ranks of the calibrated machine.
  "$loom" profile report "$tmp/out" --machine "$tmp/machine.toml" --json >"$tmp/report" 2>/dev/null || echo '{}' >"$tmp/report"
  python3 - "$tmp/log" "$tmp/report" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
planner = json.load(open(sys.argv[2])).get("planner", {})
step = [c["predicted_s"] for c in planner.get("classes", []) if c["class"] == "step"]
plan_tps = round(2048 / step[0]) if step else "nan"
run = json.loads(text.strip().splitlines()[-1])
def rate(name):
    m = re.search(r"^%s\s+\d+\s+[\d.]+\s+[\d.]+%%\s+([\d.]+)" % name, text, re.M)
    return m.group(1) if m else "nan"
share = lambda prefix: round(sum(float(m.group(1)) for m in re.finditer(
    r"^%s\w+\s+\d+\s+[\d.]+\s+([\d.]+)%%" % prefix, text, re.M)), 1)
print(round(run["tokens_per_s"]), round(100 * run["mfu"], 1), run["peak_bytes"],
      *[rate(n) for n in ("gemm_grouped_fwd", "gemm_grouped_bwd_data", "gemm_grouped_bwd_weight",
                          "gemm_fwd", "gemm_bwd_data", "gemm_bwd_weight")], share("moe_"), share("ep_"), plan_tps)
EOF
}

# planned PRESET DP EP TP ZERO: the planner's bytes for rank 0 of that layout (Loom's engine memory)
planned() {
  "$loom" plan --model "$1" --cluster "$tmp/machine.toml:$(($2 * $4))" --seq 256 --global-batch 8 --engine loom \
    --fix dp="$2" ep="$3" tp="$4" sp=$(($4 > 1)) mb=$((8 / $2)) recompute=none zero="$5" --json | python3 -c '
import json, sys
print(int(round(json.load(sys.stdin)["layouts"][0]["memory_GiB"]["total"] * 2**30)))'
}

runs=("llama-mini 1 1 1 0" "moe-mini 1 1 1 0" "moe-mini 2 2 1 0" "moe-mini 4 4 1 0" "moe-mini 2 2 1 3"
      "moe-mini 1 1 2 0")
declare -A rows=()
for ((r = 1; r <= rounds; r++)); do
  for p in "${runs[@]}"; do rows[$p]+="$(run $p)"$'\n'; done
done
echo "bf16, batch 8 x 256, $steps steps per run, median of $rounds; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
printf '%-22s %8s %6s %17s %28s %28s %7s %7s %11s\n' layout tok/s MFU% "peak MiB (plan)" \
  "grouped GEMM GF/s f/bd/bw" "dense GEMM GF/s f/bd/bw" "moe %" "ep %" "plan tok/s"
for p in "${runs[@]}"; do
  col() {
    local v
    v=$(echo -n "${rows[$p]}" | awk -v c="$1" '{print $c}')
    if [ "$(echo "$v" | head -1)" = nan ]; then echo -; else echo "$v" | median; fi
  }
  plan_bytes=$(planned $p)
  read -r preset dp ep tp zero <<<"$p"
  printf '%-22s %8s %6s %17s %28s %28s %7s %7s %11s\n' "$preset ep$ep tp$tp z$zero" "$(col 1)" "$(col 2)" \
    "$(( $(col 3 | cut -d. -f1) / 1048576 )) ($(( plan_bytes / 1048576 )))" \
    "$(col 4)/$(col 5)/$(col 6)" "$(col 7)/$(col 8)/$(col 9)" "$(col 10)" "$(col 11)" "$(col 12)"
done
