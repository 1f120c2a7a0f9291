"""A Llama/Qwen2-shaped decoder, called as a pure function of its parameters.

`Decoder` only declares structure; weights live in a dict from `init_params` and every
call goes through `torch.func.functional_call`, so graphify never owns them. The decode
step reads positions and cache rows from tensors (no host values), so it can be captured.

KV cache layout: `[layers, 2, rows, kv_heads, max_seq_len, head_dim]`. Row 0 is a scratch
row: padded batch rows write there and read from there, so padding never touches a real
request's cache (pad `cache_rows` with 0, `positions` with 0).
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

__all__ = ["DecoderConfig", "Decoder", "init_params", "new_kv_cache", "decode_step", "SCRATCH_ROW"]

SCRATCH_ROW = 0


def _dtype(value) -> torch.dtype:
    return getattr(torch, value) if isinstance(value, str) else value


@attrs.frozen
class DecoderConfig:
    """Sizes of the decoder. `tiny()` for CPU tests, `qwen2_5_0_5b()` and `llama3_8b()` for benchmarks."""

    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_seq_len: int = 256
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6
    dtype: torch.dtype = attrs.field(default=torch.bfloat16, converter=_dtype)
    tp: int = 1  # tensor-parallel ranks: each holds heads/tp, kv_heads/tp and ffn/tp

    def __attrs_post_init__(self):
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"DecoderConfig: hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads} do not divide")
        if self.tp < 1 or self.heads % self.tp or self.kv_heads % self.tp or self.ffn % self.tp:
            raise ValueError(
                f"DecoderConfig: tp={self.tp} must divide heads={self.heads}, kv_heads={self.kv_heads} and ffn={self.ffn}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads // self.tp

    @property
    def local_ffn(self) -> int:
        return self.ffn // self.tp

    @classmethod
    def tiny(cls, **overrides) -> "DecoderConfig":
        base = dict(vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, max_seq_len=32, dtype=torch.float32)
        return cls(**{**base, **overrides})

    @classmethod
    def qwen2_5_0_5b(cls, **overrides) -> "DecoderConfig":
        base = dict(vocab_size=151936, hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, max_seq_len=256)
        return cls(**{**base, **overrides})

    @classmethod
    def llama3_8b(cls, **overrides) -> "DecoderConfig":
        """Llama-3-8B's shape (random weights in benchmarks; the varlen model keeps a qkv bias)."""
        base = dict(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, max_seq_len=256,
                    rope_theta=500_000.0, eps=1e-5)
        return cls(**{**base, **overrides})

    @classmethod
    def llama3_70b(cls, **overrides) -> "DecoderConfig":
        """Llama-3-70B's shape: 140 GB of bf16 weights, so it runs sharded (see
        `models.init_shard_params`), never whole on one GPU."""
        base = dict(vocab_size=128256, hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, max_seq_len=256,
                    rope_theta=500_000.0, eps=1e-5)
        return cls(**{**base, **overrides})


class _Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        d, h, kv, ffn = cfg.head_dim, cfg.local_heads, cfg.local_kv_heads, cfg.local_ffn
        self.input_norm = nn.Parameter(torch.empty(cfg.hidden))
        self.qkv_weight = nn.Parameter(torch.empty((h + 2 * kv) * d, cfg.hidden))
        self.qkv_bias = nn.Parameter(torch.empty((h + 2 * kv) * d))
        self.o_weight = nn.Parameter(torch.empty(cfg.hidden, h * d))
        self.post_norm = nn.Parameter(torch.empty(cfg.hidden))
        self.gate_up_weight = nn.Parameter(torch.empty(2 * ffn, cfg.hidden))
        self.down_weight = nn.Parameter(torch.empty(cfg.hidden, ffn))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention. q: [B, kv, group, T, d]; k, v: [B, kv, S, d]; bias: [B, 1, 1, T, S]."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
    probs = torch.softmax(scores + bias, dim=-1).to(v.dtype)
    return torch.matmul(probs, v.unsqueeze(2))


class Decoder(nn.Module):
    """Structure only; call through `decode_step` (or `functional_call`) with real params."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden))
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.Parameter(torch.empty(cfg.hidden))
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim // 2))
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim // 2))

    def forward(self, token_ids, positions, cache_rows, kv_cache):
        """One decode step: a token per request. Returns logits [B, vocab]."""
        cfg = self.cfg
        b, d, h, kv = token_ids.shape[0], cfg.head_dim, cfg.heads, cfg.kv_heads
        x = self.embed[token_ids]
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        valid = torch.arange(cfg.max_seq_len, device=positions.device) <= positions.unsqueeze(1)
        bias = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(~valid, -math.inf)
        bias = bias.view(b, 1, 1, 1, cfg.max_seq_len)
        for i, layer in enumerate(self.layers):
            y = F.rms_norm(x, (cfg.hidden,), layer.input_norm, cfg.eps)
            qkv = F.linear(y, layer.qkv_weight, layer.qkv_bias)
            q, k, v = qkv.split((h * d, kv * d, kv * d), dim=-1)
            q = _rope(q.view(b, h, d), cos, sin)
            k = _rope(k.view(b, kv, d), cos, sin)
            cache_k, cache_v = kv_cache[i, 0], kv_cache[i, 1]
            cache_k[cache_rows, :, positions] = k
            cache_v[cache_rows, :, positions] = v.view(b, kv, d)
            out = attend(q.view(b, kv, h // kv, 1, d), cache_k[cache_rows], cache_v[cache_rows], bias)
            x = x + F.linear(out.reshape(b, h * d), layer.o_weight)
            y = F.rms_norm(x, (cfg.hidden,), layer.post_norm, cfg.eps)
            gate, up = F.linear(y, layer.gate_up_weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down_weight)
        return F.linear(F.rms_norm(x, (cfg.hidden,), self.final_norm, cfg.eps), self.embed)


def init_params(cfg: DecoderConfig, *, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights (seeded, drawn on `device`) and RoPE tables, keyed as `Decoder`'s state dict."""
    if cfg.tp != 1:
        raise ValueError("init_params: build the full model (tp=1) and shard it with models.shard_params")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    params = {name: draw_weight(name, p.shape, p.shape[-1], gen, cfg.dtype)
              for name, p in Decoder(cfg).to("meta").named_parameters()}
    return {**params, **rope_tables(cfg, device)}


def draw_weight(name: str, shape, fan_in: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """One random weight on `gen`'s device: norms near 1, biases near 0, matrices scaled by
    1/sqrt(fan_in) so activations keep their size through the layers."""
    t = torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32)
    if len(shape) == 1 and "norm" in name:
        t = 1.0 + 0.02 * t
    elif len(shape) == 1:
        t = 0.02 * t
    else:
        t = t / math.sqrt(fan_in)
    return t.to(dtype)


def rope_tables(cfg: DecoderConfig, device) -> dict[str, torch.Tensor]:
    """The RoPE cos and sin tables, `[max_seq_len, head_dim / 2]`."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    angles = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return {"rope_cos": angles.cos().to(device=device, dtype=cfg.dtype),
            "rope_sin": angles.sin().to(device=device, dtype=cfg.dtype)}


def new_kv_cache(cfg: DecoderConfig, num_requests: int, *, device="cpu", seed: int | None = 0) -> torch.Tensor:
    """A KV cache with `num_requests` rows plus the scratch row 0, filled with random values."""
    shape = (cfg.layers, 2, num_requests + 1, cfg.kv_heads, cfg.max_seq_len, cfg.head_dim)
    gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(cfg.dtype)


def decode_step(cfg: DecoderConfig, params: dict[str, torch.Tensor]):
    """`step(token_ids, positions, cache_rows, kv_cache) -> logits`, a pure function of
    `params` (bound here) through `functional_call`."""
    module = Decoder(cfg).to("meta")

    def step(token_ids, positions, cache_rows, kv_cache):
        return functional_call(module, params, (token_ids, positions, cache_rows, kv_cache))

    step.__name__ = "decode_step"
    return step
