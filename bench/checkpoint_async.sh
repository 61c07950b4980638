#!/usr/bin/env bash
# Asynchronous checkpoints (issue 18 item 3): `mini` (bf16) for `steps` steps with a save every 4 steps,
# synchronous (checkpoint.async = false) against asynchronous, beside the same run without saves,
# alternated for `rounds` rounds, in two settings: dp=2 (both cores train: the background write can
# only take time from training) and one rank of one thread (a core is free for the write). Prints the
# median wall time of each run, what each save cost it, (wall - wall without saves) / saves, and the
# median stall of a periodic save at its step boundary (the trace's checkpoint_save span, or
# checkpoint_snapshot's when asynchronous; rank 0). The last save is synchronous in both modes (a run
# waits for its final checkpoint), and the disk's write-back makes the wall times noisy. Under dp=2 a
# fourth mode, "whole", is the synchronous save in checkpoint.format = "whole" (gathered and written by
# rank 0) against the default sharded format (each rank writes its half).
#   bash bench/checkpoint_async.sh [rounds] [steps] [build-dir]
source "$(dirname "$0")/training_run_setup.sh"

# run RANKS SAVE_EVERY ASYNC ARGS...: prints the run's wall seconds, and writes the median periodic-save
# stall (ms) to $tmp/stall
run() {
  local ranks=$1 every=$2 async=$3
  shift 3
  rm -rf "$tmp/ck" "$tmp/out"
  local t0 t1
  t0=$(date +%s.%N)
  "$loom" run -n "$ranks" -- "$loom" train --config configs/mini.toml --set train.steps="$steps" \
    --set train.eval_every=0 --set checkpoint.save_every="$every" --set checkpoint.async="$async" \
    --set train.out_dir="$tmp/out" --save-dir "$tmp/ck" --set trace.file="$tmp/out/trace.json" --quiet "$@" >/dev/null
  t1=$(date +%s.%N)
  python3 -c '
import json, statistics, sys
t = json.load(open(sys.argv[1])); ev = t["traceEvents"] if isinstance(t, dict) else t
d = [e["dur"] / 1e3 for e in ev if e.get("name") in ("checkpoint_save", "checkpoint_snapshot") and e.get("pid", 0) in (0, None)]
print("%.0f" % statistics.median(d[:-1]) if len(d) > 1 else "-")' "$tmp/out/trace.json" >"$tmp/stall"
  if [ "$every" -gt 0 ]; then du -sh "$(ls -d "$tmp"/ck/step-* | tail -1)" | cut -f1 >"$tmp/size"; fi
  awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f\n", b - a}'
}

saves=$((steps / 4))
for setting in "dp2 2 --set parallel.dp=2" "1rank-1thread 1 --set train.threads=1"; do
  set -- $setting
  name=$1 ranks=$2
  shift 2
  modes="none sync async"
  [ "$ranks" -gt 1 ] && modes="none whole sync async"
  declare -A wall=() stall=()
  for ((r = 1; r <= rounds; r++)); do
    for k in $modes; do
      every=4 async=false format=sharded
      [ $k = none ] && every=0
      [ $k = async ] && async=true
      [ $k = whole ] && format=whole
      wall[$k]+="$(run "$ranks" $every $async "$@" --set checkpoint.format=$format) "
      stall[$k]+="$(cat "$tmp/stall") "
    done
  done
  base=$(echo "${wall[none]}" | median)
  echo "mini (bf16), $name, $steps steps, a save every 4 ($saves saves of $(cat "$tmp/size")), $rounds rounds (medians)"
  printf "%-8s %9s %14s %18s   (runs)\n" saves "wall s" "per save s" "stall per save ms"
  for k in $modes; do
    m=$(echo "${wall[$k]}" | median)
    st=-
    [ $k != none ] && st=$(echo "${stall[$k]}" | median)
    printf "%-8s %9s %14s %18s   (%s)\n" "$k" "$m" \
      "$([ $k = none ] && echo - || awk -v m="$m" -v b="$base" -v n="$saves" 'BEGIN {printf "%.3f", (m - b) / n}')" \
      "$st" "${wall[$k]}"
  done
  echo
  unset wall stall
done
