#!/usr/bin/python3
"""Training throughput of Loom against eager PyTorch on the same model, batch and thread count.

Why: a tokens/s figure only means something next to a baseline measured on the same machine in the
same minutes. This runs `loom train` and bench/pytorch_train.py alternately (Loom, PyTorch, Loom,
PyTorch, ...) so that drift in machine load hits both, for fp32 and bf16, and prints the median
tokens/s of each, their ratio, Loom's MFU (against the GEMM peak `loom info` measures at the start of each
precision's rounds), and each process's peak resident memory (the kernel's
maximum RSS of the child: weights, optimizer state, activations, code and libraries alike for both;
Loom's own tracked peak beside it).

Usage (from the repository root, after building):
    /usr/bin/python3 bench/train_vs_pytorch.py [--preset mini] [--rounds 3] [--steps 12] [--threads 2]
    /usr/bin/python3 bench/train_vs_pytorch.py --preset gpt2-124m --batch 4 --seq 1024 --steps 5 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(cmd: list[str], env: dict) -> tuple[dict, float]:
    """The command's last stdout line as JSON, and the child's peak resident memory in bytes."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if p.returncode != 0:
        sys.exit(f"benchmark command failed ({p.returncode}): {' '.join(cmd)}\n{stderr[-2000:]}")
    return json.loads(stdout.strip().splitlines()[-1]), usage.ru_maxrss * 1024.0  # Linux: KiB


def measured_peaks(loom: str, env: dict) -> dict:
    """This machine's GEMM peak per precision, measured now (`loom info` with an empty probe cache).

    Why: MFU is tokens/s against the peak, and on a shared VM the peak itself drifts by 5-10% over an
    hour; a peak cached earlier in the day would move every MFU figure by as much.
    """
    with tempfile.TemporaryDirectory() as cache:
        p = subprocess.run([loom, "info"], capture_output=True, text=True, env=dict(env, LOOM_CACHE_DIR=cache),
                           cwd=ROOT)
    peaks = {}
    for line in p.stdout.splitlines():  # "peak BF16 GEMM: 726.6 GFLOP/s (measured)"
        if line.startswith("peak ") and "GFLOP/s" in line:
            dtype = line.split()[1].lower()
            peaks["fp32" if dtype == "f32" else dtype] = float(line.split(":")[1].split()[0]) * 1e9
    if not peaks:
        sys.exit(f"could not read the GEMM peaks from `loom info`:\n{p.stdout}{p.stderr}")
    return peaks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="mini", choices=["mini", "llama-mini", "gpt2-124m"])
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of Loom and PyTorch per precision")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run (first 2 untimed)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loom", default=os.path.join(ROOT, "build", "loom"))
    ap.add_argument("--precisions", default="fp32,bf16")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error("--steps must be at least 3 (2 warm-up steps are not timed)")

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), LOOM_THREADS=str(args.threads))
    # Some machines pin OpenBLAS to an older core type (OPENBLAS_CORETYPE) to dodge bugs in old
    # builds; Debian's 0.3.21 runs correctly without it and faster, so the baseline gets its best.
    torch_env = {k: v for k, v in env.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    print(f"preset {args.preset}, batch {args.batch} x {args.seq}, {args.threads} threads, {args.rounds} alternating "
          f"rounds, {args.steps} steps per run (medians; peak RSS in MiB, Loom's tracked peak in brackets)")
    print(f"{'precision':<10}{'loom tok/s':>12}{'torch tok/s':>13}{'ratio':>8}{'loom MFU':>10}"
          f"{'loom RSS':>16}{'torch RSS':>11}  torch BLAS")
    for prec in args.precisions.split(","):
        loom, torch, mfu, loom_rss, loom_tracked, torch_rss, blas = [], [], [], [], [], [], ""
        peak = measured_peaks(args.loom, env)[prec]
        loom_env = dict(env, LOOM_PEAK_FLOPS=str(peak))  # MFU against the peak measured just now
        for _ in range(args.rounds):
            l, rss = run_json([args.loom, "train", "--set", f"model.preset={args.preset}", "--set", f"precision={prec}",
                               "--set", f"train.steps={args.steps}", "--set", f"train.batch_size={args.batch}",
                               "--set", f"train.seq_len={args.seq}", "--set", "train.eval_every=0", "--set",
                               "checkpoint.save_every=0", "--set", "train.out_dir=/tmp/loom-bench", "--set",
                               "trace.summary=false", "--quiet", "--json"], loom_env)
            loom.append(l["tokens_per_s"])
            mfu.append(l["mfu"])
            loom_rss.append(rss)
            loom_tracked.append(l["peak_bytes"])
            t, rss = run_json(["/usr/bin/python3", os.path.join(ROOT, "bench", "pytorch_train.py"), "--preset",
                               args.preset, "--dtype", prec, "--steps", str(args.steps - 2), "--warmup", "2",
                               "--threads", str(args.threads), "--batch", str(args.batch), "--seq", str(args.seq)],
                              torch_env)
            torch.append(t["tokens_per_s"])
            torch_rss.append(rss)
            blas = os.path.basename(str(t.get("blas", "")))
        lm, tm = statistics.median(loom), statistics.median(torch)
        mib = 1 / (1 << 20)
        loom_mem = f"{statistics.median(loom_rss) * mib:.0f} ({statistics.median(loom_tracked) * mib:.0f})"
        print(f"{prec:<10}{lm:>12.0f}{tm:>13.0f}{lm / tm:>7.2f}x{100 * statistics.median(mfu):>9.1f}%"
              f"{loom_mem:>16}{statistics.median(torch_rss) * mib:>11.0f}  {blas}; peak {peak / 1e9:.0f} GFLOP/s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
