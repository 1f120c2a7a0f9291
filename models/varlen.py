"""The reference decoder on a varlen batch: prefill, decode and mixed requests in one
flat token stream, a paged KV cache, and attention as a registered op.

A batch is described by tensors only: per token `token_ids`, `positions`, `slot_mapping`;
per request `query_lens`, `seq_lens` and `block_tables` (`BatchLayout.build` makes them).
The step returns the logits of each request's last token, `[num_reqs, vocab]`.

Weights are `Decoder`'s (same names, `init_params`), so both models share checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from graphify import Support, reqs, tokens, persistent
from graphify.extend import weakest

from ._reduce_norm import add_norm_fn
from .attention import BACKENDS
from .decoder import Decoder, DecoderConfig, _rope

__all__ = [
    "VarlenDecoder", "varlen_step", "varlen_axes", "new_paged_cache", "BatchLayout", "BlockTables", "split_ops",
    "model_support",
]


def _backend_names(cfg: DecoderConfig, attention: "str | Sequence[str]") -> tuple[str, ...]:
    names = (attention,) * cfg.layers if isinstance(attention, str) else tuple(attention)
    if len(names) != cfg.layers:
        names = tuple(names[i % len(names)] for i in range(cfg.layers))
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise ValueError(f"unknown attention backend(s) {unknown}; valid backends are {sorted(BACKENDS)}")
    return names


class VarlenDecoder(Decoder):
    """`Decoder` whose attention is a registered op per layer (a split point)."""

    def __init__(self, cfg: DecoderConfig, attention: "str | Sequence[str]" = "unified", reduce=None, gather=None,
                 add_norm=None):
        super().__init__(cfg)
        self.attention = _backend_names(cfg, attention)
        self.reduce = reduce if reduce is not None else _identity  # TP: sum partial outputs over ranks
        # a row-parallel output into the residual, then the next norm (default: the three ops)
        self.add_norm = add_norm or add_norm_fn(self.reduce, cfg.eps)
        self.gather = gather  # TP, a vocab-parallel LM head: joins the ranks' slices of the logits
        if gather is not None:  # this rank's rows of the (tied) LM head
            if cfg.vocab_size % cfg.tp:
                raise ValueError(f"VarlenDecoder: tp={cfg.tp} does not divide vocab_size={cfg.vocab_size}")
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size // cfg.tp, cfg.hidden))

    def forward(self, token_ids, positions, slot_mapping, query_lens, seq_lens, block_tables, kv_cache):
        cfg = self.cfg
        t, d, h, kv = token_ids.shape[0], cfg.head_dim, cfg.local_heads, cfg.local_kv_heads
        x = self.embed[token_ids]
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        y = F.rms_norm(x, (cfg.hidden,), self.layers[0].input_norm, cfg.eps)
        for i, layer in enumerate(self.layers):
            q, k, v = F.linear(y, layer.qkv_weight, layer.qkv_bias).split((h * d, kv * d, kv * d), dim=-1)
            q = _rope(q.reshape(t, h, d), cos, sin)
            k = _rope(k.reshape(t, kv, d), cos, sin)
            out = torch.empty_like(q)
            BACKENDS[self.attention[i]].op(
                q, k, v.reshape(t, kv, d), kv_cache, i, slot_mapping, positions, query_lens, seq_lens, block_tables, out
            )
            x, y = self.add_norm(F.linear(out.reshape(t, h * d), layer.o_weight), x, layer.post_norm)
            gate, up = F.linear(y, layer.gate_up_weight).chunk(2, dim=-1)
            down = F.linear(F.silu(gate) * up, layer.down_weight)
            if i + 1 < len(self.layers):  # the next layer's input norm with this layer's end
                x, y = self.add_norm(down, x, self.layers[i + 1].input_norm)
            else:  # the final norm reads the last token of each request only
                x = x + self.reduce(down)
        last = (torch.cumsum(query_lens, 0) - 1).clamp_(min=0)
        y = F.rms_norm(x[last], (cfg.hidden,), self.final_norm, cfg.eps)
        if self.gather is not None:
            return self.gather(F.linear(y, self.lm_head))
        return F.linear(y, self.embed)


def _identity(x):
    return x


def varlen_step(cfg: DecoderConfig, params: dict[str, torch.Tensor], attention: "str | Sequence[str]" = "unified",
                reduce=None, gather=None, add_norm=None):
    """`step(token_ids, positions, slot_mapping, query_lens, seq_lens, block_tables, kv_cache)`
    -> last-token logits per request, a pure function of `params` via `functional_call`.
    `reduce` sums a row-parallel linear's partial output over tensor-parallel ranks; `gather`
    (a vocab-parallel LM head, `params["lm_head"]` this rank's rows) joins the logits' slices;
    `add_norm(partial, residual, weight) -> (x, y)` (default: the reduce, the add and the norm
    as three ops) takes a layer's row-parallel output into the residual and norms the sum."""
    module = VarlenDecoder(cfg, attention, reduce, gather, add_norm).to("meta")

    def step(token_ids, positions, slot_mapping, query_lens, seq_lens, block_tables, kv_cache):
        return functional_call(module, params, (token_ids, positions, slot_mapping, query_lens, seq_lens, block_tables, kv_cache))

    step.__name__ = "varlen_step"
    return step


def varlen_axes():
    """graphify axes of `varlen_step`: padded tokens read slot 0 (scratch), padded requests
    have no tokens and read block 0 (scratch)."""
    return (tokens(), tokens(), tokens(), reqs(), reqs(), reqs(), persistent())


def split_ops(attention: "str | Sequence[str]") -> list:
    """The ops to `split` a model with these backends at."""
    names = (attention,) if isinstance(attention, str) else tuple(attention)
    return [BACKENDS[n].op for n in dict.fromkeys(names)]


def model_support(attention: "str | Sequence[str]") -> Support:
    """The weakest CUDA-graph support among the model's attention backends."""
    names = (attention,) if isinstance(attention, str) else tuple(attention)
    return weakest([BACKENDS[n].support for n in names])


def new_paged_cache(cfg: DecoderConfig, num_blocks: int, block_size: int = 16, *, device="cpu", seed: int = 0):
    """A paged KV cache of `num_blocks` blocks (block 0 is scratch), random contents."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (cfg.layers, 2, num_blocks, block_size, cfg.local_kv_heads, cfg.head_dim)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(cfg.dtype)


@attrs.frozen
class BatchLayout:
    """Where each request's tokens go: its new tokens and how many it already cached."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    block_size: int = 16
    max_blocks: int = 16

    def build(self, cfg: DecoderConfig, *, device="cpu", seed: int = 0, first_block: int = 1) -> tuple:
        """The step's batch arguments (all but the cache): requests own consecutive blocks
        from `first_block` on; token ids are random."""
        gen = torch.Generator().manual_seed(seed)
        ids, pos, slots, tables = [], [], [], []
        block = first_block
        for ql, ctx in zip(self.query_lens, self.context_lens):
            total = ctx + ql
            need = -(-total // self.block_size)
            if need > self.max_blocks or total > cfg.max_seq_len:
                raise ValueError(f"BatchLayout: a request of {total} tokens exceeds max_blocks or max_seq_len")
            row = list(range(block, block + need)) + [0] * (self.max_blocks - need)
            block += need
            for p in range(ctx, total):
                pos.append(p)
                slots.append(row[p // self.block_size] * self.block_size + p % self.block_size)
            tables.append(row)
            ids += torch.randint(0, cfg.vocab_size, (ql,), generator=gen).tolist()
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        seq = [q + c for q, c in zip(self.query_lens, self.context_lens)]
        return (as_long(ids), as_long(pos), as_long(slots), as_long(list(self.query_lens)), as_long(seq), as_long(tables))

    @property
    def blocks_needed(self) -> int:
        return 1 + sum(-(-(q + c) // self.block_size) for q, c in zip(self.query_lens, self.context_lens))


class BlockTables:
    """Per-request KV blocks across steps, as a serving engine keeps them: a request's
    blocks grow as its sequence grows and return to the free list when it finishes.
    Block 0 stays scratch. `batch(...)` turns one step into the model's batch tensors."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks: int):
        self.block_size, self.max_blocks = block_size, max_blocks
        self.free = list(range(num_blocks - 1, 0, -1))
        self.owned: dict[int, list[int]] = {}

    def _grow(self, rid: int, total: int) -> list[int]:
        blocks = self.owned.setdefault(rid, [])
        need = -(-total // self.block_size)
        if need > self.max_blocks:
            raise ValueError(f"BlockTables: request {rid} needs {need} blocks, more than max_blocks={self.max_blocks}")
        while len(blocks) < need:
            if not self.free:
                raise RuntimeError("BlockTables: out of KV blocks; give the cache more blocks")
            blocks.append(self.free.pop())
        return blocks

    def release(self, rid: int) -> None:
        self.free.extend(reversed(self.owned.pop(rid, [])))

    def batch(self, cfg: DecoderConfig, request_ids, query_lens, context_lens, *, device="cpu", seed: int = 0) -> tuple:
        """(token_ids, positions, slot_mapping, query_lens, seq_lens, block_tables) for one step."""
        gen = torch.Generator().manual_seed(seed)
        ids, pos, slots, tables = [], [], [], []
        for rid, ql, ctx in zip(request_ids, query_lens, context_lens):
            blocks = self._grow(rid, ctx + ql)
            for p in range(ctx, ctx + ql):
                pos.append(p)
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
            tables.append(blocks + [0] * (self.max_blocks - len(blocks)))
            ids += torch.randint(0, cfg.vocab_size, (ql,), generator=gen).tolist()
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        seq = [q + c for q, c in zip(query_lens, context_lens)]
        return (as_long(ids), as_long(pos), as_long(slots), as_long(list(query_lens)), as_long(seq), as_long(tables))
