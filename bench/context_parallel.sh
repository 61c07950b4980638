#!/usr/bin/env bash
# Context parallelism on long sequences (issue 20 item 5): a narrow Llama (d_model 128, 8 blocks, 4 heads,
# 2 KV heads, vocabulary 512; bf16) trained on one sample of T = 8192 and T = 16384 tokens per step, as
# one rank of 2 threads (cp = 1) and as two ranks of one thread splitting every sample (cp = 2, ring
# and all-to-all). The runs are alternated for `rounds` rounds. Each row: the median tokens/s against
# cp = 1, rank 0's peak activation bytes (the allocator's category) against cp = 1 and against `loom plan
# --engine loom` for the same layout (exact: "yes"), the step's traced time (median run: attention,
# other compute, communication waited for) and, for the asynchronous collectives, how much of their
# time in flight compute hid (all of them, then per collective from the trace summary).
#   bash bench/context_parallel.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"
model=(--set model.preset=tiny-llama --set model.d_model=128 --set model.n_layers=8 --set model.n_heads=4
       --set model.n_kv_heads=2 --set model.d_ff=384 --set model.max_seq=16384)
cat >"$tmp/model.toml" <<'EOF'
[model]
preset = "tiny-llama"
d_model = 128
n_layers = 8
n_heads = 4
n_kv_heads = 2
d_ff = 384
max_seq = 16384
EOF

# run T CP MODE: prints "tokens/s activations_bytes step_ms attention_ms other_ms exposed_ms hidden% per-collective"
run() {
  local T=$1 cp=$2 mode=$3
  rm -rf "$tmp/out"
  "$loom" run -n "$cp" -- "$loom" train --config configs/tiny.toml "${model[@]}" --set precision=bf16 \
    --set train.seq_len="$T" --set train.batch_size=1 --set train.micro_batch_size=1 --set train.steps="$steps" \
    --set train.eval_every=0 --set checkpoint.save_every=0 --set parallel.cp="$cp" --set parallel.cp_mode="$mode" \
    --set train.out_dir="$tmp/out" --set trace.file="$tmp/out/trace.json" --json >"$tmp/log" 2>&1
  python3 - "$tmp/log" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
run = json.loads(text.strip().splitlines()[-1])
split = run["step_split_ms"]
# step_split_ms is per step (after the warm-up); the span table's shares of the traced wall give attention's
att = split["wall"] * sum(float(m.group(1)) / 100
                          for m in re.finditer(r"^attention\w*\s+\d+\s+[\d.]+\s+([\d.]+)%", text, re.M))
per = ",".join("%s:%s%%" % (m.group(1), m.group(2))
               for m in re.finditer(r"^\s+(cp_\w+)\s+[\d.]+ ms in flight, ([\d.]+)% hidden", text, re.M)) or "-"
hidden = 100 * split["comm_hidden"] / split["comm_in_flight"] if split.get("comm_in_flight") else 0
print(round(run["tokens_per_s"]), run["peak_bytes_by_category"]["activations"],
      "%.0f %.0f %.0f %.1f %.0f" % (split["wall"], att, split["gemm"] + split["other_kernels"] - att,
                                    split["comm_exposed"], hidden), per)
EOF
}

# planned T CP MODE: the planner's activation bytes for one rank of that layout
planned() {
  "$loom" plan --model "$tmp/model.toml" --cluster a100:"$2" --seq "$1" --global-batch 1 --engine loom \
    --fix dp=1 cp="$2" mb=1 recompute=none cp_mode="$3" --json | python3 -c '
import json, sys; print(int(round(json.load(sys.stdin)["layouts"][0]["memory_GiB"]["activations"] * 2**30)))'
}

runs=("cp1 1 ring" "cp2-ring 2 ring" "cp2-all-to-all 2 all-to-all")
for T in 8192 16384; do
  declare -A tps=() rows=()
  for ((r = 1; r <= rounds; r++)); do
    for spec in "${runs[@]}"; do
      set -- $spec
      line=$(run "$T" "$2" "$3")
      set -- $line
      tps[${spec%% *}]+="$1 " rows[${spec%% *}/$1]="$line"
    done
  done
  echo "T = $T tokens (bf16, batch 1), $steps steps per run, $rounds rounds (medians; cp1: one rank of 2 threads, cp2: two of one)"
  printf "%-15s %8s %6s %9s %6s %11s %6s | %7s %9s %7s %8s %7s  %s\n" run tok/s "vs 1" "act. MiB" "vs 1" "planner MiB" \
    exact "step ms" attention other exposed hidden "per collective (hidden)"
  base=$(echo "${tps[cp1]}" | median)
  base_act=
  for spec in "${runs[@]}"; do
    set -- $spec
    k=$1 cp=$2 mode=$3
    t=$(echo "${tps[$k]}" | median)
    pick=$(echo "${tps[$k]}" | tr ' ' '\n' | grep . | sort -n | sed -n "$(( (rounds + 1) / 2 ))p")
    set -- ${rows[$k/$pick]}
    act=$2 pa=$(planned "$T" "$cp" "$mode")
    base_act=${base_act:-$act}
    printf "%-15s %8s %5.2fx %9.1f %5.0f%% %11.1f %6s | %7s %9s %7s %8s %6s%%  %s\n" "$k" "$t" \
      "$(awk -v a="$t" -v b="$base" 'BEGIN {print a / b}')" "$(awk -v a="$act" 'BEGIN {print a / 1048576}')" \
      "$(awk -v a="$act" -v b="$base_act" 'BEGIN {print 100 * a / b}')" "$(awk -v a="$pa" 'BEGIN {print a / 1048576}')" \
      "$([ "$act" = "$pa" ] && echo yes || echo "$((pa - act)) B")" "$3" "$4" "$5" "$6" "$7" "$8"
  done
  echo
  unset tps rows
done
