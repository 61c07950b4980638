# Sourced by the training benchmarks (dp_vs_threads.sh, tp_vs_dp.sh, pp_bubble.sh) with their arguments
# "[rounds] [steps] [build-dir]": sets rounds, steps, loom (the binary), moves to the repository root,
# prepares the fortunes corpus once, and makes $tmp (removed on exit); median reads numbers on stdin.
set -euo pipefail
rounds=${1:-3}
steps=${2:-10}
build=${3:-build}
loom="$(cd "$build" && pwd)/loom"
[ -x "$loom" ] || { echo "no $loom: build first" >&2; exit 1; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d data/fortunes ] || "$loom" prepare --input /usr/share/games/fortunes --out data/fortunes >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
