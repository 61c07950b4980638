"""Reference GPT-2 and Llama models in stock torch.nn, for Loom's parity tests and benchmark.

Why this exists: Loom's loss and every gradient are checked against an independent
implementation (the llm.c practice).  This file is written from the published model
definitions in the style of Hugging Face's `modeling_gpt2.py` / `modeling_llama.py`,
not ported from Loom, so that a shared misunderstanding is unlikely.  It uses only
torch.nn building blocks whose semantics are well known (Linear, Embedding, LayerNorm,
GELU(tanh), softmax, cross_entropy) and autograd for the backward pass.

Parameter names match Hugging Face's checkpoints (and therefore Loom's import/export),
so `load_state_dict(strict=True)` by name works:

GPT-2 (arch "gpt2"):
    transformer.wte.weight [V, C]            transformer.wpe.weight [max_seq, C]
    transformer.h.{i}.ln_1.{weight,bias}     transformer.h.{i}.attn.c_attn.{weight,bias}  C -> 3C (q | k | v)
    transformer.h.{i}.attn.c_proj.{weight,bias}
    transformer.h.{i}.ln_2.{weight,bias}     transformer.h.{i}.mlp.c_fc.{weight,bias}      C -> d_ff
    transformer.h.{i}.mlp.c_proj.{weight,bias}                                             d_ff -> C
    transformer.ln_f.{weight,bias}           lm_head.weight (only when not tied)
Llama (arch "llama"):
    model.embed_tokens.weight                model.layers.{i}.input_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (no biases; GQA with n_kv_heads)
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight                        lm_head.weight (only when not tied)
Mixture of experts (config "moe"), Mixtral's names, in place of a block's mlp:
    model.layers.{i}.block_sparse_moe.gate.weight [E, C]    (GPT-2 style: transformer.h.{i}.moe.*)
    ...block_sparse_moe.experts.{e}.{w1,w3,w2}.weight       gate, up, down of a SwiGLU expert
    ...block_sparse_moe.shared_experts.{gate,up,down}_proj.weight (DeepSeek's always-on experts)

All Linear weights use torch.nn.Linear's layout [out_features, in_features] (note: Hugging
Face's GPT-2 stores Conv1D weights transposed, [in, out]; we do not).  When embeddings are
tied the LM head reuses the embedding matrix and there is no separate tensor.

The model runs in whatever dtype its parameters have: float64 for the parity reference,
float32 or bfloat16-autocast for the benchmark.  Norm statistics and the loss are
computed in at least float32 so that bf16 autocast behaves like the usual recipes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast bf16/fp16 to fp32 but leave fp32/fp64 alone (float64 stays exact)."""
    return x.float() if x.dtype in _LOW_PRECISION else x


@dataclasses.dataclass
class MoeConfig:
    """Mixture of experts; the same fields as Loom's [model.moe] (see MoeBlock for their meaning)."""

    experts: int
    top_k: int
    d_expert: int = 0  # 0: the model's d_ff
    shared_experts: int = 0
    every: int = 1
    first_dense: int = 0
    score: str = "softmax"  # or "sigmoid"
    normalize_top_k: bool = True
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0  # only moves a selection bias between steps; the reference takes one batch

    def is_moe_layer(self, l: int) -> bool:
        return l >= self.first_dense and (l - self.first_dense + 1) % self.every == 0


@dataclasses.dataclass
class ModelConfig:
    """Model shape; the same fields as Loom's parity `input.json` "config" object."""

    arch: str  # "gpt2" or "llama"
    vocab_size: int  # V
    max_seq: int  # longest sequence (size of GPT-2's position table; a bound for Llama)
    d_model: int  # C
    n_layers: int  # L
    n_heads: int  # H; head dim D = C / H
    n_kv_heads: int  # KVH (Llama grouped-query attention; must equal H for GPT-2)
    d_ff: int  # MLP hidden width
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    rope_theta: float = 10000.0  # Llama rotary base
    tie_embeddings: bool = True  # LM head reuses the token embedding
    moe: Optional[MoeConfig] = None  # mixture-of-experts MLPs (a dict in JSON)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from a JSON dict; unknown keys are an error so a field Loom added (say,
        an MoE width) cannot be silently ignored by the reference."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}; known: {sorted(names)}")
        d = dict(d)
        d.setdefault("n_kv_heads", d.get("n_heads"))
        if d.get("moe") is not None and not isinstance(d["moe"], MoeConfig):
            moe_names = {f.name for f in dataclasses.fields(MoeConfig)}
            unknown = sorted(set(d["moe"]) - moe_names)
            if unknown:
                raise ValueError(f"model config: unknown moe field(s) {unknown}; known: {sorted(moe_names)}")
            d["moe"] = MoeConfig(**d["moe"])
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.arch not in ("gpt2", "llama"):
            raise ValueError(f"model config: arch must be 'gpt2' or 'llama', got {self.arch!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model config: d_model {self.d_model} not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model config: n_heads {self.n_heads} not divisible by n_kv_heads {self.n_kv_heads}")
        if self.arch == "gpt2" and self.n_kv_heads != self.n_heads:
            raise ValueError("model config: gpt2 has no grouped-query attention (n_kv_heads must equal n_heads)")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"model config: rotary embeddings need an even head dim, got {self.head_dim}")


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal softmax attention, q/k/v [B, H, T, D] -> [B, H, T, D], scale 1/sqrt(D).

    Written out (no fused kernel; torch 1.13 has none on CPU) so the reference is obvious.
    """
    T, D = q.shape[-2], q.shape[-1]
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(_at_least_f32(scores), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over positions whose target is >= 0 (ignore_index = -1)."""
    V = logits.shape[-1]
    return F.cross_entropy(_at_least_f32(logits).reshape(-1, V), targets.reshape(-1), ignore_index=-1)


# ----------------------------------------------------------------------------- mixture of experts


class MoeExpert(nn.Module):
    """One SwiGLU expert, Mixtral's names: w2(silu(w1 x) * w3 x)."""

    def __init__(self, C: int, F_: int):
        super().__init__()
        self.w1 = nn.Linear(C, F_, bias=False)
        self.w3 = nn.Linear(C, F_, bias=False)
        self.w2 = nn.Linear(F_, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SharedExperts(nn.Module):
    def __init__(self, C: int, F_: int):
        super().__init__()
        self.gate_proj = nn.Linear(C, F_, bias=False)
        self.up_proj = nn.Linear(C, F_, bias=False)
        self.down_proj = nn.Linear(F_, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeBlock(nn.Module):
    """Top-k routed SwiGLU experts (Mixtral; DeepSeek-V3's sigmoid scores and shared experts).

    scores = softmax(gate(x)) or sigmoid(gate(x)); each token takes its top_k experts, weighted by
    their scores (renormalised to sum 1 when normalize_top_k).  With capacity_factor > 0 an expert
    takes at most ceil(factor * N * top_k / E) (token, slot) pairs: every token's first choice before
    any second choice, tokens in order (GShard / Switch); the rest are dropped (contribute nothing).
    The Switch load-balancing loss E / (N k) * sum_e routed_e * mean_t p[t, e] (routed counted before
    dropping; p the softmax scores, or the sigmoid scores over their per-token sum) is kept in
    self.aux_loss for the caller to add with its weight."""

    def __init__(self, cfg: "ModelConfig"):
        super().__init__()
        m = cfg.moe
        self.m = m
        F_ = m.d_expert or cfg.d_ff
        self.gate = nn.Linear(cfg.d_model, m.experts, bias=False)
        self.experts = nn.ModuleList(MoeExpert(cfg.d_model, F_) for _ in range(m.experts))
        self.shared_experts = SharedExperts(cfg.d_model, m.shared_experts * F_) if m.shared_experts else None
        self.aux_loss: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        N, E, k = h.shape[0], m.experts, m.top_k
        logits = self.gate(h)
        scores = torch.softmax(logits, dim=-1) if m.score == "softmax" else torch.sigmoid(logits)
        top_w, top_e = torch.topk(scores, k, dim=-1)
        if m.normalize_top_k:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        keep = torch.ones(N, k, dtype=torch.bool)
        if m.capacity_factor > 0:
            cap = math.ceil(m.capacity_factor * N * k / E)
            taken = [0] * E
            for j in range(k):
                for t in range(N):
                    e = int(top_e[t, j])
                    if taken[e] < cap:
                        taken[e] += 1
                    else:
                        keep[t, j] = False
        out = torch.zeros_like(h)
        for e in range(E):
            t_idx, j_idx = torch.where((top_e == e) & keep)
            if t_idx.numel():
                out = out.index_add(0, t_idx, self.experts[e](h[t_idx]) * top_w[t_idx, j_idx].unsqueeze(-1))
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        routed = torch.bincount(top_e.reshape(-1), minlength=E).to(scores.dtype)
        p = scores if m.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        self.aux_loss = E / (N * k) * (routed * p.mean(dim=0)).sum()
        return out.reshape(shape)


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of every MoE block's load-balancing loss from the last forward (0 for a dense model)."""
    total = torch.zeros((), dtype=torch.float64)
    for mod in model.modules():
        if isinstance(mod, MoeBlock) and mod.aux_loss is not None:
            total = total + mod.aux_loss
    return total


# ----------------------------------------------------------------------------- GPT-2


class GPT2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H, D = self.n_heads, C // self.n_heads
        q, k, v = self.c_attn(x).split(C, dim=-1)  # output columns: q | k | v
        # Each of q, k, v: head h owns columns [h*D, (h+1)*D).
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer):
            self.moe = MoeBlock(cfg)
        else:
            self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + (self.moe if hasattr(self, "moe") else self.mlp)(self.ln_2(x))
        return x


class GPT2Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.d_model)
        self.h = nn.ModuleList(GPT2Block(cfg, l) for l in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)[None]
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Transformer(cfg)
        # A tied head is not a module: a shared Parameter would appear twice in state_dict().
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [B, T] int64 -> mean cross-entropy (targets given) or logits [B, T, V]."""
        if tokens.shape[1] > self.config.max_seq:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq {self.config.max_seq}")
        h = self.transformer(tokens)
        w = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, w)
        return logits if targets is None else _lm_loss(logits, targets)


# ----------------------------------------------------------------------------- Llama


class LlamaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight, statistics in at least fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _at_least_f32(x)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_cos_sin(T: int, D: int, theta: float, dtype: torch.dtype, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """HF Llama rotary tables [T, D]: inv_freq = theta^(-arange(0, D, 2)/D), angle = pos * inv_freq,
    cos/sin of cat(freqs, freqs).  Computed in float64, then cast, so the fp64 reference is exact."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D))
    pos = torch.arange(T, dtype=torch.float64, device=device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Pairs element i with i + D/2 (HF convention, not the interleaved GPT-J one)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        C, D = cfg.d_model, cfg.head_dim
        self.q_proj = nn.Linear(C, cfg.n_heads * D, bias=False)
        self.k_proj = nn.Linear(C, cfg.n_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(C, cfg.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * D, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, KVH, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, KVH, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KVH, D).transpose(1, 2)
        cos, sin = rotary_cos_sin(T, D, self.rope_theta, q.dtype, q.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Grouped-query attention: query head h reads kv head h // (H / KVH).
        rep = H // KVH
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer):
            self.block_sparse_moe = MoeBlock(cfg)
        else:
            self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        mlp = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        x = x + mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, l) for l in range(cfg.n_layers))
        self.norm = LlamaRMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [B, T] int64 -> mean cross-entropy (targets given) or logits [B, T, V]."""
        if tokens.shape[1] > self.config.max_seq:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq {self.config.max_seq}")
        h = self.model(tokens)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, w)
        return logits if targets is None else _lm_loss(logits, targets)


# ----------------------------------------------------------------------------- helpers

# Output projections that write into the residual stream; GPT-2 scales their init by 1/sqrt(2L).
_RESIDUAL_PROJ = ("attn.c_proj.weight", "mlp.c_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                  ".w2.weight", "shared_experts.down_proj.weight")


def init_weights(model: nn.Module, seed: int = 0) -> None:
    """GPT-2-style initialisation for the benchmark (parity runs load Loom's weights instead):
    matrices and embeddings ~ N(0, 0.02), residual projections ~ N(0, 0.02/sqrt(2L)),
    norm weights 1, biases 0.  Deterministic for a given seed (parameters visited by name)."""
    n_layers = model.config.n_layers
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm / RMSNorm weight
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(_RESIDUAL_PROJ) else 0.02
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


def build_model(cfg, dtype: torch.dtype = torch.float32, init_seed: Optional[int] = 0) -> nn.Module:
    """Build the model for `cfg` (ModelConfig or dict) with parameters in `dtype`.

    init_seed: initialise with init_weights(seed); None leaves torch's default init
    (use that when the weights will be loaded right away)."""
    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.from_dict(cfg)
    cfg.validate()
    model = GPT2LMHeadModel(cfg) if cfg.arch == "gpt2" else LlamaForCausalLM(cfg)
    if init_seed is not None:
        init_weights(model, init_seed)
    return model.to(dtype)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
