"""Hugging Face transformers decode with graphify: a static cache, graphs, greedy generation.

A transformers causal LM graphifies as it is: `graphify(model, mode="FULL", sizes=[B])`
captured with a keyword call `capture(input_ids=ids, past_key_values=cache, use_cache=True)`
replays one decode step of the model per call. The `StaticCache` is a static argument (the
same object on every call); the graphs read and write its tensors, including its in-place
position counters, and `capture()` leaves the cache as it found it. A static cache's batch
size is fixed, so each batch size is one captured size.

This module adds the few helpers a generation loop needs. transformers is imported only
here, and only when these helpers run (`pip install graphify[hf]`); graphify's core never
imports it.

!!! example
    >>> from graphify.transforms.hf import decode_graphs, greedy_generate, static_cache  # doctest: +SKIP
    >>> cache = static_cache(model, batch_size=8, max_cache_len=256)            # doctest: +SKIP
    >>> step = decode_graphs(model, cache)                                      # doctest: +SKIP
    >>> tokens = greedy_generate(model, prompt_ids, cache, 128, decode=step)     # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["static_cache", "decode_graphs", "greedy_generate"]


def static_cache(model: torch.nn.Module, batch_size: int, max_cache_len: int):
    """A transformers `StaticCache` for `model`, its tensors allocated now (on the model's
    device and dtype) rather than on the first forward, so graphs and compiled code can be
    made before the prompt is run."""
    from transformers import StaticCache

    config = model.config.get_text_config(decoder=True)
    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    param = next(model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    cache.early_initialization(batch_size, kv_heads, head_dim, param.dtype, param.device)
    return cache


def decode_graphs(model: torch.nn.Module, cache: Any, *, mode: str = "FULL", fn: Callable | None = None, **graphify_kwargs):
    """`model` (or `fn`, a compiled version of it) graphified for one decode step over
    `cache`, captured at the cache's batch size. Call the result as the model:
    `step(input_ids=ids, past_key_values=cache, use_cache=True)`; `ids` is
    `(batch_size, 1)`. The cache's contents are left as they were."""
    from graphify import graphify

    batch = cache.layers[0].keys.shape[0]
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.get_text_config(decoder=True).vocab_size, (batch, 1), device=device)
    g = graphify(fn if fn is not None else model, mode=mode, sizes=[batch], **graphify_kwargs)
    with torch.no_grad():
        return g.capture(input_ids=ids, past_key_values=cache, use_cache=True)


def greedy_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: Any,
    max_new_tokens: int,
    *,
    decode: Callable | None = None,
    sync_every_step: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Greedy generation: the prompt through `model` (eagerly), then `max_new_tokens - 1`
    decode steps through `decode` (graphs, a compiled model; default the model). Returns
    the new tokens, `(batch, max_new_tokens)`. `sync_every_step` reads the tokens on the
    host after each step, as a loop's stopping check does."""
    decode = decode if decode is not None else model
    with torch.no_grad():
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        tokens = [nxt]
        for i in range(max_new_tokens - 1):
            out = decode(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            if sync_every_step:
                nxt.cpu()
            if on_step is not None:
                on_step(i)
    return torch.cat(tokens, dim=1)
