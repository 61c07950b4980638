#!/usr/bin/python3
"""PyTorch eager-mode training throughput: the baseline Loom's training benchmark compares against.

Why: Loom's tokens/s only means something next to what stock PyTorch does on the same machine,
model, batch and thread count.  This script trains the reference models of
tests/parity/torch_model.py (the same Hugging Face-style GPT-2 / Llama used for parity) in plain
eager mode, as a typical user would, and prints one JSON line:

    {"framework": "pytorch", "preset": ..., "dtype": ..., "threads": ..., "tokens_per_s": ...,
     "step_s_median": ..., "steps": N, ...}

tokens_per_s is the median over the timed steps of batch*seq / step time (so one slow step, e.g. a
page-fault storm, does not move it); step_s_median is the median step time.  Warm-up steps (first
allocations, oneDNN primitive creation) are run but not timed.

A step = zero_grad, forward + cross-entropy loss (inside torch.autocast('cpu', bfloat16) for
--dtype bf16; parameters and optimizer state stay fp32, as in the usual mixed-precision recipe),
backward, AdamW(lr 3e-4) step.  Tokens are random (fixed seed), a fresh batch each step.

Usage:
    /usr/bin/python3 bench/pytorch_train.py --preset mini --dtype bf16 --steps 20 --warmup 3 \
        --threads 2 --batch 8 --seq 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
from torch_model import ModelConfig, build_model, count_params  # noqa: E402

# The presets Loom's own benchmark uses (configs of the same names); keep them in step.
PRESETS = {
    "mini": dict(arch="gpt2", vocab_size=8192, max_seq=256, d_model=384, n_layers=6, n_heads=6,
                 n_kv_heads=6, d_ff=1536, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True),
    "gpt2-124m": dict(arch="gpt2", vocab_size=50257, max_seq=1024, d_model=768, n_layers=12, n_heads=12,
                      n_kv_heads=12, d_ff=3072, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True),
    "llama-mini": dict(arch="llama", vocab_size=8192, max_seq=256, d_model=384, n_layers=6, n_heads=6,
                       n_kv_heads=2, d_ff=1024, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False),
}


def loaded_blas() -> str:
    """Path of the BLAS library this process mapped, or "" if none / not Linux.

    Why: Debian's torch does fp32 matmul through whatever libblas.so.3 the system's alternatives
    point at.  Netlib's reference BLAS (/usr/lib/x86_64-linux-gnu/blas/) is ~100x slower than
    OpenBLAS, so an fp32 result is meaningless without knowing which one ran.
    """
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({ln.split()[-1] for ln in f if "blas" in ln.rsplit("/", 1)[-1]})
    except OSError:
        return ""
    return ",".join(libs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="PyTorch eager CPU training throughput (one JSON line)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mini")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    cfg = ModelConfig.from_dict(PRESETS[args.preset])
    if args.seq > cfg.max_seq:
        ap.error(f"--seq {args.seq} exceeds the preset's max_seq {cfg.max_seq}")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(cfg, dtype=torch.float32, init_seed=args.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(args.seed + 1)
    autocast = args.dtype == "bf16"

    def step() -> float:
        data = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        tokens, targets = data[:, :-1], data[:, 1:]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, targets)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(args.warmup):
        step()
    times = []
    loss = float("nan")
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()  # .item() inside synchronises nothing on CPU but keeps the loss honest
        times.append(time.perf_counter() - t0)

    tokens_per_step = args.batch * args.seq
    result = {
        "framework": "pytorch",
        "preset": args.preset,
        "dtype": args.dtype,
        "threads": args.threads,
        "tokens_per_s": round(statistics.median(tokens_per_step / t for t in times), 1),
        "step_s_median": round(statistics.median(times), 4),
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": args.batch,
        "seq": args.seq,
        "params": count_params(model),
        "final_loss": round(loss, 4),
        "torch": torch.__version__,
        "blas": loaded_blas(),
    }
    if "/blas/libblas" in result["blas"]:
        print("pytorch_train: warning: fp32 matmul runs on netlib's reference BLAS "
              f"({result['blas']}); install OpenBLAS for a fair fp32 baseline", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
