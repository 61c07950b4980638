#!/usr/bin/env python3
"""Random layouts against one rank: small models of random shape (GPT-2 or Llama, GQA, odd head widths and
sequence lengths, odd vocabularies, sometimes a mixture of experts), each trained for a few steps under one
rank and under three random parallel layouts by `loom verify`, which compares the loss curves.

The test suite checks the layouts on fixed shapes; this sweeps the shapes it does not name. Each trial ends
as one of:
  PASS     every layout reproduced the one-rank losses (verify's tolerance: fp32 1e-5, bf16 1e-2)
  REFUSED  loom refused the combination before training, with an error message (printed)
  FAIL     a layout trained but its losses differ from one rank's (verify's table printed)
  CRASH    anything else: a signal, a timeout, an exit without an error message
Exit status 1 if any trial FAILed or CRASHed.

  python3 scripts/layout_sweep.py [--seed N] [--trials N] [--loom build/loom] [--steps N]
A trial takes a few seconds on 2 cores; the seed makes a sweep repeatable.
"""
import argparse
import random
import subprocess
import sys

LAYOUTS = ["dp=2", "dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3", "tp=2", "tp=2,sp=1", "tp=2,sp=1,overlap=0",
           "pp=2", "pp=2,schedule=gpipe", "pp=2,schedule=zb-h1", "pp=2,recompute=full", "tp=2,pp=2",
           "cp=2", "cp=2,cp_mode=all-to-all", "dp=1,recompute=selective", "dp=1,recompute=full"]
MOE_LAYOUTS = ["dp=2,ep=2", "dp=2,ep=2,zero=1"]


def random_model(rng):
    arch = rng.choice(["gpt2", "llama"])
    heads = rng.choice([2, 4, 6])
    head_dim = rng.choice([8, 16, 24, 32])
    kv = rng.choice([k for k in (1, 2, 3, 6) if heads % k == 0]) if arch == "llama" else heads
    d_model = head_dim * heads
    seq = rng.choice([16, 24, 40, 64, 72])
    sets = {
        "model.preset": "tiny", "model.arch": arch, "model.d_model": d_model, "model.n_heads": heads,
        "model.n_kv_heads": kv, "model.n_layers": rng.choice([2, 3, 4]), "model.max_seq": seq,
        "model.vocab_size": rng.choice([97, 128, 301]), "model.d_ff": rng.choice([2, 3, 4]) * d_model,
        "precision": rng.choice(["fp32", "bf16"]), "train.batch_size": rng.choice([4, 8]), "train.seq_len": seq,
        "train.eval_every": 0, "train.warmup_steps": 1, "train.lr": 3e-3,
    }
    moe = arch == "llama" and rng.random() < 0.3
    if moe:
        sets.update({"model.moe.experts": 4, "model.moe.top_k": 2})
    return sets, moe


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--loom", default="build/loom")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    counts = {"PASS": 0, "REFUSED": 0, "FAIL": 0, "CRASH": 0}
    for trial in range(args.trials):
        sets, moe = random_model(rng)
        layouts = rng.sample(LAYOUTS + (MOE_LAYOUTS if moe else []), 3)
        cmd = [args.loom, "verify", "--steps", str(args.steps), "--layouts", "dp=1;" + ";".join(layouts)]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            out = (r.stdout + r.stderr).strip()
            if r.returncode == 0:
                outcome = "PASS"
            elif r.returncode == 1 and "loom: error:" in out and "FAIL" not in r.stdout:
                outcome = "REFUSED"
            elif r.returncode == 1 and "FAIL" in r.stdout:
                outcome = "FAIL"
            else:
                outcome = "CRASH"
        except subprocess.TimeoutExpired:
            outcome, out = "CRASH", "timed out after 600 s"
        counts[outcome] += 1
        shape = " ".join(f"{k.split('.')[-1]}={v}" for k, v in sets.items() if k.startswith("model.") and k != "model.preset")
        print(f"{trial:3d} {outcome:<8} {sets['precision']:<5} {shape} | {' ; '.join(layouts)}", flush=True)
        if outcome != "PASS":
            lines = out.splitlines()
            shown = [l for l in lines if "error" in l] if outcome == "REFUSED" else lines[-12:]
            for line in shown[-12:]:
                print("      " + line, flush=True)
            if outcome != "REFUSED":
                print("      reproduce: " + " ".join(f"'{c}'" if (";" in c or " " in c) else c for c in cmd), flush=True)
    print(", ".join(f"{k} {v}" for k, v in counts.items()))
    return 1 if counts["FAIL"] or counts["CRASH"] else 0


if __name__ == "__main__":
    sys.exit(main())
