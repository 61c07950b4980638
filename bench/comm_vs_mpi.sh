#!/usr/bin/env bash
# Loom's collectives vs OpenMPI in the same run (issue 4's targets): 2 ranks at 4 KiB and 64 MiB with
# registered buffers, then 8 ranks (oversubscribed on a 2-core machine) at 64 MiB. Run on an idle machine.
#   bash bench/comm_vs_mpi.sh [build-dir]
set -euo pipefail
build=${1:-build}
loom="$build/loom"
[ -x "$loom" ] || { echo "no $loom: build first (cmake --build $build)" >&2; exit 1; }
mpirun=(mpirun --oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && mpirun+=(--allow-run-as-root)
echo "## 2 ranks, f32, registered buffers"
"${mpirun[@]}" -np 2 "$loom" bench comm --vs mpi -b 4K -e 64M -f 16384
echo "## 8 ranks (oversubscribed), f32, registered buffers"
"${mpirun[@]}" -np 8 "$loom" bench comm --vs mpi -b 64M -e 64M --batch-seconds 0.05 --batches 3
