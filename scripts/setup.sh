#!/usr/bin/env bash
# Installs every Debian package Loom needs to build, test and benchmark. Idempotent: safe to re-run.
set -euo pipefail

packages=(
  cmake ninja-build g++ pkg-config git
  libdnnl-dev                      # oneDNN 2.x: GEMMs (AMX / AVX-512 / AVX2 chosen at run time)
  libgtest-dev libgmock-dev        # unit tests
  libbenchmark-dev                 # micro-benchmarks under bench/
  libcli11-dev                     # command-line parsing
  libtomlplusplus-dev              # TOML configs
  nlohmann-json3-dev               # JSON metrics, manifests, safetensors headers
  libfmt-dev                       # GCC 12's libstdc++ has no <format>
  libssl-dev                       # HMAC-SHA256: job ids and fingerprints derived from the job secret
  clang libclang-rt-14-dev         # libFuzzer targets under fuzz/ (ASan/UBSan runtimes)
  libomp-14-dev                    # OpenMP for clang: the fuzz build configures the whole project
  libopenmpi-dev openmpi-bin      # MPI transport between nodes; the baseline of `loom bench comm`
  libsentencepiece-dev             # BPE tokenizer training and encoding (loom prepare)
  fortunes                         # the default training corpus (text files under /usr/share/games/fortunes)
  python3-torch python3-numpy      # PyTorch parity references and benchmark baselines (/usr/bin/python3)
  libopenblas0-pthread             # without it Debian's torch falls back to netlib BLAS (~2 GFLOP/s)
  chromium python3-pil             # the profiler's HTML report is rendered headless in a test and checked
)

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
echo "setup: all ${#packages[@]} packages present"
