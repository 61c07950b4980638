#!/usr/bin/env bash
# Pipeline parallelism on one machine (issue 13's benchmark): `mini` (bf16, 6 blocks) at pp=2 under
# gpipe, 1f1b, interleaved-1f1b (v=2) and zb-h1, with m = 2, 4 and 8 micro-batches of 2 sequences per step.
# Each row prints the median tokens/s (steps 3..N), each stage's measured idle fraction of the schedule
# (median over steps: its waits on transfers over the schedule's wall time, from the run's own
# pp_idle metrics) and the schedule's theoretical bubble. Then, at m = 4, tokens/s of pp=2 (1f1b) beside
# dp=2 (two ranks of one thread) and one rank of two threads, alternated for `rounds` rounds.
#   bash bench/pp_bubble.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"

# run NAME RANKS ARGS...: prints "tokens/s idle0 idle1 theory" of one run (idle and theory 0 without pp)
run() {
  local ranks=$2
  shift 2
  rm -rf "$tmp/ck" "$tmp/out"
  "$loom" run -n "$ranks" -- "$loom" train --config configs/mini.toml --set train.steps="$steps" \
    --set train.eval_every=0 --set checkpoint.save_every=0 --set train.out_dir="$tmp/out" --save-dir "$tmp/ck" \
    --quiet --json "$@" | tail -1 |
    python3 -c 'import json,sys; j=json.load(sys.stdin); p=j.get("pipeline", {}); i=p.get("idle_by_stage", [0, 0])
print(round(j["tokens_per_s"]), "%.3f %.3f %.3f" % (i[0], i[1], p.get("bubble_theory", 0)))'
}

echo "mini (bf16), pp=2, micro-batch 2 x 256 tokens, $steps steps per run, $rounds rounds (medians)"
printf "%-18s %3s %8s %9s %9s %9s %10s\n" schedule m tok/s "idle s0" "idle s1" theory "s0-theory"
for sched in gpipe 1f1b interleaved-1f1b zb-h1; do
  v=1
  [ "$sched" = interleaved-1f1b ] && v=2
  for m in 2 4 8; do
    tps="" i0="" i1="" th=0
    for ((r = 1; r <= rounds; r++)); do
      set -- $(run "$sched" 2 --set parallel.pp=2 --set parallel.pipeline.schedule="$sched" \
        --set parallel.pipeline.virtual_stages=$v --set train.micro_batch_size=2 --set train.batch_size=$((2 * m)))
      tps+="$1 " i0+="$2 " i1+="$3 " th=$4
    done
    a=$(echo "$i0" | median) b=$(echo "$i1" | median)
    printf "%-18s %3s %8s %8.1f%% %8.1f%% %8.1f%% %+9.1f pt\n" "$sched" "$m" "$(echo "$tps" | median)" \
      "$(awk -v x="$a" 'BEGIN {print 100 * x}')" "$(awk -v x="$b" 'BEGIN {print 100 * x}')" \
      "$(awk -v x="$th" 'BEGIN {print 100 * x}')" "$(awk -v x="$a" -v t="$th" 'BEGIN {print 100 * (x - t)}')"
  done
done
echo

echo "mini (bf16), batch 8 = m 4 x micro-batch 2, $steps steps per run, $rounds rounds alternated"
declare -A results
layouts=("one-rank-2-threads 1 --set train.threads=2 --set train.micro_batch_size=2"
         "dp2 2 --set parallel.dp=2 --set train.micro_batch_size=2"
         "pp2-1f1b 2 --set parallel.pp=2 --set train.micro_batch_size=2")
for ((r = 1; r <= rounds; r++)); do
  for l in "${layouts[@]}"; do
    set -- $l
    name=$1
    shift
    line=$(run "$name" "$@")
    results[$name]+="${line%% *} "
  done
done
base=$(echo "${results[one-rank-2-threads]}" | median)
printf "%-20s %8s %7s   (runs)\n" layout tok/s "vs 1"
for l in "${layouts[@]}"; do
  name=${l%% *}
  m=$(echo "${results[$name]}" | median)
  printf "%-20s %8s %6.2fx   (%s)\n" "$name" "$m" "$(awk -v a="$m" -v b="$base" 'BEGIN {print a / b}')" "${results[$name]}"
done
