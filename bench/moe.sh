#!/usr/bin/env bash
# Mixture of experts on one rank (issue 19 item 5, ep = 1): `moe-mini` (llama-mini's attention, 8 SwiGLU
# experts of width 512, top-2: the same MLP FLOPs per token as llama-mini's dense width 1024, 2.4x the
# parameters) against llama-mini itself, bf16, batch 8 x 256, the runs alternated for `rounds` rounds.
# Each row: median tokens/s and MFU; the GEMM rate of the experts' grouped GEMMs and of the dense
# GEMMs in the same run (the span table's GFLOP/s: forward, backward data, backward weight); the MoE
# routing kernels' share of the step; the measured peak memory beside `loom plan --engine loom`'s
# prediction for the same layout; the planner's tokens/s with a machine file calibrated now.
#   bash bench/moe.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"
"$loom" calibrate --out "$tmp/machine.toml" --model configs/llama-mini.toml | tail -1

# run PRESET: "tokens/s mfu peak_bytes grouped_fwd grouped_bwd_data grouped_bwd_weight fwd bwd_data bwd_weight moe_share%"
run() {
  rm -rf "$tmp/out"
  "$loom" train --config configs/llama-mini.toml --set model.preset="$1" --set precision=bf16 \
    --set train.steps="$steps" --set train.eval_every=0 --set checkpoint.save_every=0 \
    --set train.out_dir="$tmp/out" --set trace.file="$tmp/out/trace.json" --json >"$tmp/log" 2>&1
  python3 - "$tmp/log" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
run = json.loads(text.strip().splitlines()[-1])
def rate(name):
    m = re.search(r"^%s\s+\d+\s+[\d.]+\s+[\d.]+%%\s+([\d.]+)" % name, text, re.M)
    return m.group(1) if m else "nan"
share = sum(float(m.group(1)) for m in re.finditer(r"^moe_\w+\s+\d+\s+[\d.]+\s+([\d.]+)%", text, re.M))
print(round(run["tokens_per_s"]), round(100 * run["mfu"], 1), run["peak_bytes"],
      *[rate(n) for n in ("gemm_grouped_fwd", "gemm_grouped_bwd_data", "gemm_grouped_bwd_weight",
                          "gemm_fwd", "gemm_bwd_data", "gemm_bwd_weight")], round(share, 1))
EOF
}

planned() {
  "$loom" plan --model "$1" --cluster "$tmp/machine.toml:1" --seq 256 --global-batch 8 --engine loom \
    --fix dp=1 mb=8 recompute=none --json | python3 -c '
import json, sys
l = json.load(sys.stdin)["layouts"][0]
print(round(l["tokens_per_s"]), int(round(l["memory_GiB"]["total"] * 2**30)))'
}

presets=(llama-mini moe-mini)
declare -A rows=()
for ((r = 1; r <= rounds; r++)); do
  for p in "${presets[@]}"; do rows[$p]+="$(run "$p")"$'\n'; done
done
echo "bf16, batch 8 x 256, $steps steps per run, median of $rounds; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
printf '%-11s %8s %6s %17s %28s %28s %8s %13s\n' model tok/s MFU% "peak MiB (plan)" \
  "grouped GEMM GF/s f/bd/bw" "dense GEMM GF/s f/bd/bw" "moe %" "plan tok/s"
for p in "${presets[@]}"; do
  col() {
    local v
    v=$(echo -n "${rows[$p]}" | awk -v c="$1" '{print $c}')
    if [ "$(echo "$v" | head -1)" = nan ]; then echo -; else echo "$v" | median; fi
  }
  read -r plan_tps plan_bytes <<<"$(planned "$p")"
  printf '%-11s %8s %6s %17s %28s %28s %8s %13s\n' "$p" "$(col 1)" "$(col 2)" \
    "$(( $(col 3 | cut -d. -f1) / 1048576 )) ($(( plan_bytes / 1048576 )))" \
    "$(col 4)/$(col 5)/$(col 6)" "$(col 7)/$(col 8)/$(col 9)" "$(col 10)" "$plan_tps"
done
