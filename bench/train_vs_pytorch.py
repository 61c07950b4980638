#!/usr/bin/python3
"""Training throughput of Loom against eager PyTorch on the same model, batch and thread count.

Why: a tokens/s figure only means something next to a baseline measured on the same machine in the
same minutes. This runs `loom train` and bench/pytorch_train.py alternately (Loom, PyTorch, Loom,
PyTorch, ...) so that drift in machine load hits both, for fp32 and bf16, and prints the median
tokens/s of each, their ratio, and Loom's MFU.

Usage (from the repository root, after building):
    /usr/bin/python3 bench/train_vs_pytorch.py [--preset mini] [--rounds 3] [--steps 12] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(cmd: list[str], env: dict) -> dict:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="mini", choices=["mini", "llama-mini"])
    ap.add_argument("--rounds", type=int, default=3, help="alternations of Loom and PyTorch per precision")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run (first 2 untimed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "loom"))
    ap.add_argument("--precisions", default="fp32,bf16")
    args = ap.parse_args()

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), LOOM_THREADS=str(args.threads))
    # Some machines pin OpenBLAS to an older core type (OPENBLAS_CORETYPE) to dodge bugs in old
    # builds; Debian's 0.3.21 runs correctly without it and faster, so the baseline gets its best.
    torch_env = {k: v for k, v in env.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    print(f"preset {args.preset}, batch 8 x 256, {args.threads} threads, {args.rounds} alternating rounds, "
          f"{args.steps} steps per run (medians)")
    print(f"{'precision':<10}{'loom tok/s':>12}{'torch tok/s':>13}{'ratio':>8}{'loom MFU':>10}  torch BLAS")
    for prec in args.precisions.split(","):
        loom, torch, mfu, blas = [], [], [], ""
        for _ in range(args.rounds):
            l = run_json([args.loom, "train", "--set", f"model.preset={args.preset}", "--set", f"precision={prec}",
                          "--set", f"train.steps={args.steps}", "--set", "train.batch_size=8", "--set",
                          "train.eval_every=0", "--set", "train.out_dir=/tmp/loom-bench", "--set",
                          "trace.summary=false", "--quiet", "--json"], env)
            loom.append(l["tokens_per_s"])
            mfu.append(l["mfu"])
            t = run_json(["/usr/bin/python3", os.path.join(ROOT, "bench", "pytorch_train.py"), "--preset", args.preset,
                          "--dtype", prec, "--steps", str(args.steps - 2), "--warmup", "2", "--threads",
                          str(args.threads), "--batch", "8", "--seq", "256"], torch_env)
            torch.append(t["tokens_per_s"])
            blas = os.path.basename(str(t.get("blas", "")))
        lm, tm = statistics.median(loom), statistics.median(torch)
        print(f"{prec:<10}{lm:>12.0f}{tm:>13.0f}{lm / tm:>7.2f}x{100 * statistics.median(mfu):>9.1f}%  {blas}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
