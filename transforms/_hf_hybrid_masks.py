"""A decode step's masks over transformers' sliding-window and hybrid static caches, made on
the host from slices of the 2D mask instead of transformers' mask functions.

A sliding layer's mask moves with a Python counter (`cumulative_length_int`, from which
transformers takes the window's offset), so unlike a full-attention cache's it cannot be
built inside a graph that replays across steps: it stays an input of the graph, made every
step on the host. transformers makes it, and the full layers' mask beside it, with about a
dozen small tensor ops each (the larger part of `prepare_inputs_for_generation`'s host time
on Gemma 3, notes/issue40.md). At a decode step, one query token at position `cum` with a 2D
mask of `cum + 1` columns, both reduce to slices of that mask:

- a full layer (a `StaticLayer` of length L): the 2D mask padded with zeros to L; the causal
  part masks exactly the padded columns;
- a sliding layer of window W while it fills (`cum < W`): the same, padded to W (the window
  reaches back past the first token);
- a sliding layer once full (`cum >= W`): the mask's last W columns (the keys the layer
  holds, all of them causal and inside the window).

As transformers makes them: (B, 1, 1, kv) booleans for sdpa, 0 or the dtype's minimum for
eager attention, one per layer type in a dict where the config lists layer types. The caller
checks once per kind and shape that they equal transformers' own (`_hf_masks.MaskPadding`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


def hybrid_sizes(text: Any, cache: Any, memo: dict | None = None) -> tuple | None:
    """(layer types or None, L or None, W, cum) where every layer of `cache` is a plain static
    layer of the type `text` (the text config) gives it and at least one slides; else None.
    `memo` (a dict the caller keeps) holds the last cache's layout, keyed by its layers'
    identities, so a decode step reads only the sliding layers' counters."""
    window = getattr(text, "sliding_window", None)
    listed = getattr(text, "layer_types", None)
    layers = getattr(cache, "layers", None)
    if not isinstance(window, int) or not layers or getattr(text, "attention_chunk_size", None):
        return None
    key = (window, tuple(listed) if listed else None)
    layout = _remembered(memo, key, layers)
    if layout is False:
        layout = _layout(window, listed, layers)
        if memo is not None:  # weak references: a finished generate()'s cache is not kept alive
            memo.clear()
            memo.update(key=key, layers=tuple(weakref.ref(layer) for layer in layers), layout=layout)
    if layout is None:
        return None
    types, length, w, indices = layout
    sliding = [layers[i] for i in indices]
    cum = sliding[0].cumulative_length_int
    if not isinstance(cum, int) or any(layer.cumulative_length_int != cum for layer in sliding):
        return None
    if length is not None and cum >= length:
        return None
    return types, length, w, cum


def _remembered(memo: dict | None, key: tuple, layers: list):
    """The layout `memo` holds if it was made for these very layers, else False."""
    if not memo or memo["key"] != key or len(memo["layers"]) != len(layers):
        return False
    return memo["layout"] if all(ref() is layer for ref, layer in zip(memo["layers"], layers)) else False


def _layout(window: int, listed: Any, layers: list) -> tuple | None:
    """(layer types or None, L or None, W, the sliding layers' indices) of a cache whose layers are all
    plain static layers of the types the config lists, at least one sliding; else None."""
    from transformers import cache_utils

    types = list(listed) if listed else [SLIDING] * len(layers)
    if len(types) != len(layers) or SLIDING not in types or not set(types) <= {FULL, SLIDING}:
        return None
    full, widths, sliding = set(), set(), []
    for i, (kind, layer) in enumerate(zip(types, layers)):
        if kind == FULL and type(layer) is cache_utils.StaticLayer:
            full.add(layer.max_cache_len)
        elif kind == SLIDING and type(layer) is cache_utils.StaticSlidingWindowLayer:
            widths.add(layer.max_cache_len)
            sliding.append(i)
        else:
            return None
    if len(full) > 1 or len(widths) != 1:
        return None
    (length,) = full or {None}
    (w,) = widths
    if not isinstance(w, int) or w > window or length is not None and not (isinstance(length, int) and w <= length):
        return None
    return (list(dict.fromkeys(types)) if listed else None), length, w, tuple(sliding)


def hybrid_masks(sizes: tuple, mask: torch.Tensor | None, embeds: torch.Tensor, implementation: str,
                 arange: torch.Tensor | None = None):
    """transformers' decode-step masks for the cache `sizes` describes (`hybrid_sizes`), from the
    2D `mask` (None: every position seen so far, and then `arange`, a cached `torch.arange` at
    least `arange_length(sizes)` long on `embeds`'s device, is required). None where the 2D
    mask does not end at the step (its columns are not `cum + 1`)."""
    types, length, w, cum = sizes
    n = cum + 1
    if mask is None:  # positions up to the step's; a full window sees all of its keys
        total = arange_length(sizes)
        base = arange[:total] <= cum
        base = base.expand(embeds.shape[0], total)
        start = 0
    else:
        if mask.shape[-1] != n or mask.shape[0] != embeds.shape[0]:
            return None
        total = length if length is not None else max(w, n)
        base = torch.nn.functional.pad(mask.to(device=embeds.device, dtype=torch.bool), (0, total - n))
        start = 0 if cum < w else n - w
    if implementation == "eager":
        base = torch.where(base, torch.zeros((), device=base.device, dtype=embeds.dtype), torch.finfo(embeds.dtype).min)
    sliding = base[:, None, None, start:start + w]
    if types is None:
        return sliding
    return {kind: sliding if kind == SLIDING else base[:, None, None, :] for kind in types}


def arange_length(sizes: tuple) -> int:
    """How long an arange the masks of `sizes` take where the 2D mask is None: the full layers'
    length, or the window's (bounded: it does not grow with the sequence)."""
    _, length, w, _ = sizes
    return length if length is not None else w
