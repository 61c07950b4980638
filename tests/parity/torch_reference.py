#!/usr/bin/python3
"""PyTorch float64 reference for Loom's parity test: loss, every gradient, and a few AdamW steps.

Why: Loom's loss and *every* gradient are checked against an independent implementation
(llm.c's practice).  The reference runs in float64 so that its own rounding is negligible
next to the tolerances applied to Loom's fp32 results.

Usage:
    /usr/bin/python3 tests/parity/torch_reference.py --dir DIR
    /usr/bin/python3 tests/parity/torch_reference.py --self-test   # checks this reference itself

Input (written by Loom's side of the test):
    DIR/input.json          {"config": {arch, vocab_size, max_seq, d_model, n_layers, n_heads,
                                        n_kv_heads, d_ff, norm_eps, rope_theta, tie_embeddings},
                             "tokens": [[...]], "targets": [[...]],  (B x T ints; target -1 = ignored)
                             "steps": 3,
                             "adamw": {"lr", "beta1", "beta2", "eps", "weight_decay",
                                       "clip": max grad norm, 0 = none,
                                       "decay": [names of parameters that get weight decay]}}
    DIR/weights.safetensors every parameter (F32) by its Hugging Face name (see torch_model.py)

Output:
    DIR/torch_out.safetensors (F64)
        loss          [steps+1]  loss before each step, and after the last one
        grad_norm     [steps]    global L2 norm of the gradient before each step (before clipping)
        grad.<name>              gradient of the loss at the initial weights
        final.<name>             parameter after `steps` AdamW steps
        step<k>.<name>           parameter after k AdamW steps, k = 1..steps

Each step: zero grads, loss = mean cross-entropy on the same batch, backward, clip the global
gradient norm to `clip` if clip > 0 (torch.nn.utils.clip_grad_norm_), then torch.optim.AdamW
with two parameter groups (names in "decay" get weight_decay, the rest 0).

Any mismatch between the weight file and the model (a missing, unexpected or misshapen tensor),
an unknown config field, or a bad token exits non-zero with a one-line message.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_io import SafetensorsError, read_safetensors, write_safetensors  # noqa: E402
from torch_model import ModelConfig, build_model, moe_aux_loss  # noqa: E402


class ReferenceError(Exception):
    """Bad input; printed as one line and turned into a non-zero exit."""


def load_weights_strict(model: torch.nn.Module, weights: Dict[str, torch.Tensor], path: str) -> None:
    """Copy `weights` into `model` by name, refusing any difference in names or shapes."""
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if unexpected:
        problems.append(f"unexpected {unexpected}")
    for name in sorted(set(expected) & set(weights)):
        w, p = weights[name], expected[name]
        if tuple(w.shape) != tuple(p.shape):
            problems.append(f"{name}: shape {list(w.shape)} in file, model wants {list(p.shape)}")
        elif not w.is_floating_point():
            problems.append(f"{name}: dtype {w.dtype} is not floating point")
    if problems:
        raise ReferenceError(f"{path} does not match the model: " + "; ".join(problems))
    # load_state_dict(strict=True) is the belt to the braces above (and the API the brief names).
    model.load_state_dict({k: v.to(torch.float64) for k, v in weights.items()}, strict=True)


def _int_batch(x, name: str) -> torch.Tensor:
    t = torch.tensor(x, dtype=torch.int64)
    if t.dim() != 2:
        raise ReferenceError(f"input.json: {name} must be a B x T list of lists, got shape {list(t.shape)}")
    return t


def run_reference(d: str) -> Dict[str, torch.Tensor]:
    """Run the reference on DIR and write DIR/torch_out.safetensors; returns what it wrote."""
    with open(os.path.join(d, "input.json")) as f:
        spec = json.load(f)
    for key in ("config", "tokens", "targets", "adamw"):
        if key not in spec:
            raise ReferenceError(f"input.json: missing {key!r}")
    cfg = ModelConfig.from_dict(spec["config"])
    # The load-balancing loss's weight in the gradient (Loom: aux_loss_coef x the batch's tokens x its
    # gradient scale); the reported loss is the language-model loss alone, as Loom reports it.
    aux_weight = float(spec.get("moe_aux_weight", 0.0))
    steps = int(spec.get("steps", 0))
    tokens, targets = _int_batch(spec["tokens"], "tokens"), _int_batch(spec["targets"], "targets")
    if tokens.shape != targets.shape:
        raise ReferenceError(f"input.json: tokens {list(tokens.shape)} and targets {list(targets.shape)} differ")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ReferenceError(f"input.json: tokens outside [0, {cfg.vocab_size})")
    if targets.min() < -1 or targets.max() >= cfg.vocab_size:
        raise ReferenceError(f"input.json: targets outside [-1, {cfg.vocab_size})")
    if tokens.shape[1] > cfg.max_seq:
        raise ReferenceError(f"input.json: T = {tokens.shape[1]} exceeds max_seq {cfg.max_seq}")
    if not (targets >= 0).any():
        raise ReferenceError("input.json: every target is -1; the mean loss is undefined")

    model = build_model(cfg, dtype=torch.float64, init_seed=None)
    # Optional "weights": {"file": ..., "layout": "hf"} reads a Hugging Face export: GPT-2 stores its
    # attention and MLP projections as Conv1D, i.e. [in, out], the transpose of nn.Linear's weight.
    wspec = spec.get("weights", {})
    wpath = os.path.join(d, wspec.get("file", "weights.safetensors"))
    weights, _ = read_safetensors(wpath)
    if wspec.get("layout") == "hf" and cfg.arch == "gpt2":
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        weights = {k: (v.t().contiguous() if k.endswith(conv1d) else v) for k, v in weights.items()}
    load_weights_strict(model, weights, wpath)

    opt_spec = spec["adamw"]
    try:
        lr, beta1, beta2 = float(opt_spec["lr"]), float(opt_spec["beta1"]), float(opt_spec["beta2"])
        eps, wd = float(opt_spec["eps"]), float(opt_spec["weight_decay"])
    except KeyError as e:
        raise ReferenceError(f"input.json: adamw needs {e.args[0]!r}") from None
    clip = float(opt_spec.get("clip", 0.0) or 0.0)
    decay_names = set(opt_spec.get("decay", []))
    params = dict(model.named_parameters())
    unknown = sorted(decay_names - set(params))
    if unknown:
        raise ReferenceError(f"input.json: adamw.decay names unknown parameters {unknown}")
    groups = [
        {"params": [p for n, p in params.items() if n in decay_names], "weight_decay": wd},
        {"params": [p for n, p in params.items() if n not in decay_names], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=0.0)

    out: Dict[str, torch.Tensor] = {}
    losses: List[float] = []
    norms: List[float] = []
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=False)
        if step == steps:  # loss after the last update: no backward needed
            with torch.no_grad():
                losses.append(model(tokens, targets).item())
            break
        loss = model(tokens, targets)
        losses.append(loss.item())
        (loss + aux_weight * moe_aux_loss(model)).backward()
        if step == 0:
            for n, p in params.items():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                out[f"grad.{n}"] = g.detach().clone()
        total = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params.values() if p.grad is not None))
        norms.append(total.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
        for n, p in params.items():
            out[f"step{step + 1}.{n}"] = p.detach().clone()
    if steps == 0:  # still report the gradient at the initial weights
        model.zero_grad(set_to_none=False)
        (model(tokens, targets) + aux_weight * moe_aux_loss(model)).backward()
        for n, p in params.items():
            out[f"grad.{n}"] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()

    for n, p in params.items():
        out[f"final.{n}"] = p.detach().clone()
    out["loss"] = torch.tensor(losses, dtype=torch.float64)
    out["grad_norm"] = torch.tensor(norms, dtype=torch.float64)
    out = {k: v.to(torch.float64) for k, v in out.items()}
    write_safetensors(
        os.path.join(d, "torch_out.safetensors"),
        out,
        metadata={"producer": "tests/parity/torch_reference.py", "torch": torch.__version__},
    )
    return out


# ----------------------------------------------------------------------------- self-test
#
# Checks the reference itself, three independent ways, on tiny GPT-2 and Llama models:
#  1. the forward loss against a plain numpy implementation written from the model definitions
#     with explicit per-head / per-position loops (catches a wrong model, e.g. head split or rope);
#  2. gradients against central finite differences of the float64 loss (catches autograd misuse,
#     e.g. a detached tensor or a tied weight counted once);
#  3. the first AdamW step against the textbook update written out by hand (catches a wrong
#     optimizer setup: decay groups, clipping, bias correction).


def _tiny_config(arch: str) -> dict:
    if arch == "gpt2":
        return dict(arch="gpt2", vocab_size=512, max_seq=64, d_model=64, n_layers=2, n_heads=4,
                    n_kv_heads=4, d_ff=256, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=True)
    return dict(arch="llama", vocab_size=512, max_seq=64, d_model=64, n_layers=2, n_heads=4,
                n_kv_heads=2, d_ff=192, norm_eps=1e-5, rope_theta=10000.0, tie_embeddings=False)


def _numpy_loss(cfg: ModelConfig, W: Dict[str, "np.ndarray"], tokens, targets) -> float:
    """Independent float64 forward: explicit loops, no torch, Linear weights are [out, in]."""
    import numpy as np

    C, H, KVH = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
    D = C // H
    B, T = tokens.shape

    def lin(x, w, b=None):
        y = x @ w.T
        return y if b is None else y + b

    def layernorm(x, w, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg.norm_eps) * w + b

    def rmsnorm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * w

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    def attend(q, k, v):  # q: [T, D] one head, k/v: [T, D]
        o = np.zeros_like(q)
        for t in range(T):
            s = q[t] @ k[: t + 1].T / math.sqrt(D)
            s = np.exp(s - s.max())
            o[t] = (s / s.sum()) @ v[: t + 1]
        return o

    def rope(x):  # x [T, D]: pair i with i + D/2, angle t * theta^(-2i/D)
        y = x.copy()
        half = D // 2
        for t in range(T):
            for i in range(half):
                a = t * cfg.rope_theta ** (-2.0 * i / D)
                c, s = math.cos(a), math.sin(a)
                y[t, i] = x[t, i] * c - x[t, i + half] * s
                y[t, i + half] = x[t, i + half] * c + x[t, i] * s
        return y

    total, count = 0.0, 0
    for b in range(B):
        if cfg.arch == "gpt2":
            x = W["transformer.wte.weight"][tokens[b]] + W["transformer.wpe.weight"][:T]
            for l in range(cfg.n_layers):
                p = f"transformer.h.{l}."
                h = layernorm(x, W[p + "ln_1.weight"], W[p + "ln_1.bias"])
                qkv = lin(h, W[p + "attn.c_attn.weight"], W[p + "attn.c_attn.bias"])
                heads = []
                for hh in range(H):
                    q = qkv[:, hh * D : (hh + 1) * D]
                    k = qkv[:, C + hh * D : C + (hh + 1) * D]
                    v = qkv[:, 2 * C + hh * D : 2 * C + (hh + 1) * D]
                    heads.append(attend(q, k, v))
                x = x + lin(np.concatenate(heads, -1), W[p + "attn.c_proj.weight"], W[p + "attn.c_proj.bias"])
                h = layernorm(x, W[p + "ln_2.weight"], W[p + "ln_2.bias"])
                h = gelu_tanh(lin(h, W[p + "mlp.c_fc.weight"], W[p + "mlp.c_fc.bias"]))
                x = x + lin(h, W[p + "mlp.c_proj.weight"], W[p + "mlp.c_proj.bias"])
            x = layernorm(x, W["transformer.ln_f.weight"], W["transformer.ln_f.bias"])
            head = W["transformer.wte.weight"] if cfg.tie_embeddings else W["lm_head.weight"]
        else:
            x = W["model.embed_tokens.weight"][tokens[b]]
            for l in range(cfg.n_layers):
                p = f"model.layers.{l}."
                h = rmsnorm(x, W[p + "input_layernorm.weight"])
                q_all = lin(h, W[p + "self_attn.q_proj.weight"])
                k_all = lin(h, W[p + "self_attn.k_proj.weight"])
                v_all = lin(h, W[p + "self_attn.v_proj.weight"])
                heads = []
                for hh in range(H):
                    kvh = hh // (H // KVH)
                    q = rope(q_all[:, hh * D : (hh + 1) * D])
                    k = rope(k_all[:, kvh * D : (kvh + 1) * D])
                    heads.append(attend(q, k, v_all[:, kvh * D : (kvh + 1) * D]))
                x = x + lin(np.concatenate(heads, -1), W[p + "self_attn.o_proj.weight"])
                h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
                g = lin(h, W[p + "mlp.gate_proj.weight"])
                u = lin(h, W[p + "mlp.up_proj.weight"])
                x = x + lin(g / (1 + np.exp(-g)) * u, W[p + "mlp.down_proj.weight"])
            x = rmsnorm(x, W["model.norm.weight"])
            head = W["model.embed_tokens.weight"] if cfg.tie_embeddings else W["lm_head.weight"]
        logits = x @ head.T
        for t in range(T):
            if targets[b, t] < 0:
                continue
            z = logits[t] - logits[t].max()
            total += math.log(np.exp(z).sum()) - z[targets[b, t]]
            count += 1
    return total / count


def _self_test_arch(arch: str, tmp: str) -> None:
    import numpy as np

    torch.manual_seed(1234 if arch == "gpt2" else 4321)
    cfg_d = _tiny_config(arch)
    cfg = ModelConfig.from_dict(cfg_d)
    B, T = 2, 16
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    targets[0, 3] = targets[1, 10] = -1  # exercise ignore_index
    # Random weights with non-trivial norms and biases (init values 1 / 0 would hide mistakes).
    ref = build_model(cfg, torch.float32, init_seed=7)
    weights = {}
    for n, p in ref.named_parameters():
        if p.dim() == 1:
            weights[n] = (1.0 if n.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape)
        else:
            weights[n] = p.detach().clone() * 3  # std 0.06: a loss visibly away from log V
    d = os.path.join(tmp, arch)
    os.makedirs(d)
    write_safetensors(os.path.join(d, "weights.safetensors"), weights)
    decay = [n for n in weights if weights[n].dim() == 2]
    adamw = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0, decay=decay)
    spec = dict(config=cfg_d, tokens=tokens.tolist(), targets=targets.tolist(), steps=3, adamw=adamw)
    with open(os.path.join(d, "input.json"), "w") as f:
        json.dump(spec, f)

    run_reference(d)
    out, meta = read_safetensors(os.path.join(d, "torch_out.safetensors"))
    assert all(v.dtype == torch.float64 for v in out.values())
    names = sorted(weights)
    assert sorted(k[5:] for k in out if k.startswith("grad.")) == names
    assert sorted(k[6:] for k in out if k.startswith("final.")) == names
    loss = out["loss"]
    assert loss.shape == (4,) and bool(loss[-1] < loss[0]), f"loss did not fall: {loss.tolist()}"

    # 1. forward against numpy.
    W = {n: w.double().numpy() for n, w in weights.items()}
    np_loss = _numpy_loss(cfg, W, tokens.numpy(), targets.numpy())
    err = abs(np_loss - loss[0].item()) / abs(np_loss)
    print(f"  [{arch}] loss {loss[0].item():.12f}  numpy {np_loss:.12f}  rel err {err:.1e}")
    assert err < 1e-10, "forward disagrees with the numpy implementation"

    # 2. gradients against central differences: for every tensor, its largest-|grad| entry and a
    #    random one (restricted to rows actually used, so the check is not a trivial 0 == 0).
    model = build_model(cfg, torch.float64, init_seed=None)
    model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=True)
    params = dict(model.named_parameters())
    h, worst = 1e-5, 0.0
    gen = torch.Generator().manual_seed(0)
    for n in names:
        g = out[f"grad.{n}"].reshape(-1)
        picks = {int(g.abs().argmax())}
        nz = torch.nonzero(g).reshape(-1)
        if len(nz):
            picks.add(int(nz[torch.randint(len(nz), (1,), generator=gen)]))
        for i in picks:
            flat = params[n].data.view(-1)
            orig = flat[i].item()
            with torch.no_grad():
                flat[i] = orig + h
                lp = model(tokens, targets).item()
                flat[i] = orig - h
                lm = model(tokens, targets).item()
                flat[i] = orig
            fd = (lp - lm) / (2 * h)
            rel = abs(fd - g[i].item()) / max(abs(fd), abs(g[i].item()), 1e-6)
            worst = max(worst, rel)
            assert rel < 1e-5, f"{n}[{i}]: autograd {g[i].item():.10e} vs finite difference {fd:.10e}"
    print(f"  [{arch}] finite differences: {len(names)} tensors, worst rel err {worst:.1e}")

    # 3. the first AdamW step by hand: clip, then p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p).
    gn = math.sqrt(sum(float((out[f"grad.{n}"] ** 2).sum()) for n in names))
    assert abs(gn - out["grad_norm"][0].item()) < 1e-9 * gn
    scale = min(1.0, adamw["clip"] / (gn + 1e-6)) if adamw["clip"] > 0 else 1.0
    manual = build_model(cfg, torch.float64, init_seed=None)
    manual.load_state_dict({k: v.double() for k, v in weights.items()}, strict=True)
    with torch.no_grad():
        for n, p in manual.named_parameters():
            g = out[f"grad.{n}"] * scale
            m_hat = (1 - adamw["beta1"]) * g / (1 - adamw["beta1"])
            v_hat = (1 - adamw["beta2"]) * g * g / (1 - adamw["beta2"])
            wd = adamw["weight_decay"] if n in decay else 0.0
            p.mul_(1 - adamw["lr"] * wd).sub_(adamw["lr"] * m_hat / (v_hat.sqrt() + adamw["eps"]))
    one = dict(spec, steps=1)
    d1 = os.path.join(tmp, arch + "_1step")
    os.makedirs(d1)
    with open(os.path.join(d1, "input.json"), "w") as f:
        json.dump(one, f)
    write_safetensors(os.path.join(d1, "weights.safetensors"), weights)
    out1 = run_reference(d1)
    dmax = max((out1[f"final.{n}"] - p).abs().max().item() for n, p in manual.named_parameters())
    print(f"  [{arch}] AdamW step vs hand-written update: max abs diff {dmax:.1e} (clip scale {scale:.3f})")
    assert dmax < 1e-12, "AdamW step disagrees with the textbook update"

    # Strict loading must refuse a renamed tensor.
    bad = dict(weights)
    bad[names[0] + "_renamed"] = bad.pop(names[0])
    write_safetensors(os.path.join(d1, "weights.safetensors"), bad)
    try:
        run_reference(d1)
    except ReferenceError as e:
        assert names[0] in str(e)
    else:
        raise AssertionError("a renamed tensor was accepted")


def self_test() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("gpt2", "llama"):
            _self_test_arch(arch, tmp)
    print("torch_reference self-test: OK")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="directory with input.json and weights.safetensors")
    ap.add_argument("--self-test", action="store_true", help="check this reference on tiny models and exit")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.self_test:
        self_test()
        return 0
    if not args.dir:
        ap.error("--dir is required (or --self-test)")
    try:
        out = run_reference(args.dir)
    except (ReferenceError, SafetensorsError, ValueError, OSError, json.JSONDecodeError) as e:
        print(f"torch_reference: error: {e}", file=sys.stderr)
        return 2
    print(f"torch_reference: loss {[round(x, 6) for x in out['loss'].tolist()]} -> "
          f"{os.path.join(args.dir, 'torch_out.safetensors')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
