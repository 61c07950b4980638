#!/usr/bin/env bash
# Sets up a fresh machine, builds Loom and trains the default model (the README's first command).
# Extra arguments go to `loom train`, e.g. scripts/train.sh --set train.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)" --target loom
# The default corpus (Debian's fortunes, installed by setup.sh) is tokenized once into data/fortunes.
if [[ ! -f data/fortunes/manifest.json ]]; then
  ./build/loom prepare --input /usr/share/games/fortunes --out data/fortunes
fi
# A second run continues the first from its latest checkpoint (a finished run stays finished).
resume=()
[[ -f checkpoints/mini/latest ]] && resume=(--resume)
exec ./build/loom train --config configs/mini.toml "${resume[@]}" "$@"
