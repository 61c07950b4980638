#!/usr/bin/env bash
# Sets up a fresh machine, builds Loom and runs the whole test suite (the README's second command).
# The unit tests of core and kernels also run under AddressSanitizer + UBSan in a separate build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs=$(nproc)

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$jobs"
# Each rank of the suite uses two threads at most, so tests can share the machine.
export OMP_NUM_THREADS=2
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 600

if [ "${LOOM_SKIP_SANITIZERS:-0}" != "1" ]; then
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DLOOM_SANITIZE=ON
  cmake --build build-asan -j"$jobs" --target core_test safetensors_test elementwise_test attention_test gemm_test
  ctest --test-dir build-asan --output-on-failure -j"$jobs" --timeout 600 -R '^(Philox|Bf16|Allocator|Tensor|Safetensors|Elementwise|Attention|Gemm)' -L unit
fi
