#!/usr/bin/env bash
# What the always-on collective check costs (issue 21: below 2% of a 4 KiB all-reduce): `loom bench comm`
# all_reduce at each size with the op stamps on (default) and off (LOOM_COMM_CHECK=0), alternating the two
# for `rounds` rounds; prints each side's median time per op and the ratio on/off.
#   bash bench/comm_check_cost.sh [rounds] [ranks] [sizes] [build-dir]
set -euo pipefail
rounds=${1:-7}
ranks=${2:-2}
sizes=${3:-"4K 64K 4M"}
build=${4:-build}
loom="$(cd "$build" && pwd)/loom"
[ -x "$loom" ] || { echo "no $loom: build first" >&2; exit 1; }
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
echo "size  check-on(us)  check-off(us)  on/off   ($ranks ranks, $rounds alternating rounds, median of each)"
for size in $sizes; do
  on="" off=""
  for ((r = 1; r <= rounds; r++)); do
    for check in 1 0; do
      t=$(LOOM_COMM_CHECK=$check "$loom" run -n "$ranks" -- "$loom" bench comm --ops all_reduce -b "$size" -e "$size" \
            --batches 9 --no-ceiling --json | tail -1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["time_us"])')
      if [ "$check" = 1 ]; then on+="$t "; else off+="$t "; fi
    done
  done
  m_on=$(echo "$on" | median) m_off=$(echo "$off" | median)
  printf "%-5s %12.2f  %13.2f  %6.3f\n" "$size" "$m_on" "$m_off" "$(echo "$m_on / $m_off" | bc -l)"
done
