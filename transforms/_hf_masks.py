"""A graphified transformers model's decode masks cost the host next to nothing.

With a static cache, `generate()`'s `prepare_inputs_for_generation` builds the 4D attention
masks on the host at every step (`create_masks_for_generate`, looked up on the model first),
about half of that function's host time, and a token pays it before its graph can launch
(notes/issue41.md, notes/issue40.md). For a model whose `forward` is graphified,
`pad_masks_in_forward` gives the model its own `create_masks_for_generate`:

- over a cache of plain full-attention static layers, a decode step gets the 2D mask padded
  with zeros to the cache's length (all ones where `generate()` dropped an all-ones mask), a
  shape that stays fixed for the whole `generate()`, and the forward builds the 4D mask from
  it itself, inside the captured graph. Zeros are what transformers pads a short 2D mask
  with (`prepare_padding_mask`), and past the step's position the causal part masks every
  entry whatever the 2D mask holds there, so the mask is the same;
- over sliding-window and hybrid static caches, whose sliding masks move with a Python
  counter and so stay inputs of the graph, a decode step gets transformers' 4D masks made
  from slices of the 2D mask in two or three tensor ops (`_hf_hybrid_masks`).

The prompt keeps transformers' masks, so it stays a kind of call of its own that runs
eagerly. Each kind and shape of mask is checked once against transformers' own function (on
the mask as given); where they differ, the model gets transformers' masks from then on (one
log line). Everything else (chunked attention, masks a model class builds its own way, extra
mask functions, attention other than sdpa and eager, a forward no longer graphified) gets
transformers' function unchanged.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from ._hf_hybrid_masks import arange_length, hybrid_masks, hybrid_sizes

__all__ = ["pad_masks_in_forward"]

log = logging.getLogger("graphify")

_IMPLEMENTATIONS = ("sdpa", "eager")  # whose masks a padded 2D mask makes the same way
MAX_CHECKED = 64  # shapes remembered (agreement, all-ones masks) before starting over
_KEEP = object()  # this call keeps transformers' mask
_EXTRA = ("or_mask_function", "and_mask_function", "block_sequence_ids", "token_type_ids", "mm_token_type_ids")


def pad_masks_in_forward(model: Any) -> None:
    """Give `model` (a transformers generative model whose forward is being graphified) the
    `create_masks_for_generate` above: only a class transformers itself defines (whose
    forward builds its masks with transformers' mask functions), and not one that brings its
    own mask function."""
    cls = type(model)
    if not cls.__module__.startswith("transformers.models.") or hasattr(cls, "create_masks_for_generate"):
        return  # a subclass or remote code may build its masks its own way in its forward
    if not hasattr(model, "prepare_inputs_for_generation"):
        return
    if "create_masks_for_generate" not in vars(model):
        model.create_masks_for_generate = MaskPadding(model)


class MaskPadding:
    """The model's `create_masks_for_generate`; see the module docstring."""

    def __init__(self, model: Any):
        self.model = weakref.ref(model)  # the model holds this: no cycle
        self.checked: dict = {}  # (given mask's kind, padded shape, device) -> whether transformers' masks agreed
        self.ones: dict = {}  # (padded shape, device) -> an all-ones mask
        self.ranges: dict = {}  # device -> an arange long enough for the hybrid masks so far
        self.layouts: dict = {}  # the last hybrid cache's layout (`hybrid_sizes`)
        self.memo: tuple | None = None  # the last config and cache's `facts`
        self.off = False

    def __reduce__(self):
        """A pickled or deep-copied model gets a padding of its own (its checks start over)."""
        return MaskPadding, (self.model(),)

    def __call__(self, **kwargs):
        made = _KEEP if self.off else self.padded(kwargs)
        if made is _KEEP:
            return _transformers_masks(**kwargs)
        mask, kind = made
        given = kwargs.get("attention_mask")
        key = (kind, None if given is None else given.dtype, _shapes(mask))
        agreed = self.checked.get(key)
        if agreed is None:
            if len(self.checked) >= MAX_CHECKED:
                self.checked.clear()
            agreed = self.checked[key] = self.agree(kwargs, mask, kind)
        return mask if agreed else _transformers_masks(**kwargs)

    def padded(self, kwargs: dict):
        """(the masks this decode step hands the forward, their kind), or `_KEEP` where this
        call keeps transformers' masks. Over full-attention static layers: the 2D mask padded
        to the cache's length (all ones where `generate()` dropped an all-ones mask), kind
        "pad"; over sliding-window and hybrid static caches: transformers' 4D masks made from
        slices of the 2D mask (`_hf_hybrid_masks`), kind "filling" or "full" (the window's)."""
        model = self.model()
        mask, embeds = kwargs.get("attention_mask"), kwargs.get("inputs_embeds", kwargs.get("input_embeds"))
        if model is None or not isinstance(vars(model).get("forward"), _graphified()):
            return _KEEP
        if not (isinstance(embeds, torch.Tensor) and embeds.dim() >= 2 and embeds.shape[1] == 1):
            return _KEEP  # not a decode step: the prompt keeps its own kind of mask, so it stays its own kind of call
        if not (mask is None or isinstance(mask, torch.Tensor) and mask.dim() == 2):
            return _KEEP
        if any(kwargs.get(name) is not None for name in _EXTRA):
            return _KEEP
        cache = _cache_of(kwargs)  # its layers' exact types are checked below: static layers only
        text, full, length = self.facts(kwargs.get("config"), cache)
        if text is None:
            return _KEEP
        if not full:
            return self.hybrid(text, cache, mask, embeds)
        if length is None or mask is not None and mask.shape[-1] > length:
            return _KEEP
        if mask is None:  # the causal part masks every position past the step's: ones are the same as none
            key = (embeds.shape[0], length, embeds.device)
            ones = self.ones.get(key)
            if ones is None:
                if len(self.ones) >= MAX_CHECKED:
                    self.ones.clear()
                ones = self.ones[key] = torch.ones(key[:2], dtype=torch.long, device=key[2])
            return ones, "pad"
        return torch.nn.functional.pad(mask, (0, length - mask.shape[-1])), "pad"

    def facts(self, config: Any, cache: Any) -> tuple:
        """(the causal text config or None, full attention only, the static cache's length or
        None) of `config` and `cache`, worked out once per pair: both stay the same objects for
        a whole `generate()`, and reading them costs a decode step tens of µs (transformers'
        config attributes, every cache layer). The attention implementation is read every
        call: a model may switch it (`set_attn_implementation`) with the same config."""
        memo = self.memo
        if memo is not None and memo[0] is config and memo[1]() is cache and \
                getattr(memo[2], "_attn_implementation", None) == memo[3]:
            return memo[2], memo[4], memo[5]
        text = _causal_text(config)
        facts = (text, text is not None and _full_attention_only(text), _static_length(cache))
        if text is not None and cache is not None:
            try:
                self.memo = (config, weakref.ref(cache), text, text._attn_implementation, *facts[1:])
            except TypeError:  # an object no weak reference can follow: worked out every call
                pass
        return facts

    def hybrid(self, text: Any, cache: Any, mask, embeds: torch.Tensor):
        """A sliding-window or hybrid cache's decode masks, or `_KEEP`."""
        sizes = hybrid_sizes(text, cache, self.layouts)
        if sizes is None:
            return _KEEP
        arange = None
        if mask is None:  # positions up to the step's: a cached arange, compared with the step
            need = arange_length(sizes)
            arange = self.ranges.get(embeds.device)
            if arange is None or arange.shape[0] < need:
                arange = self.ranges[embeds.device] = torch.arange(max(need, 256), device=embeds.device)
        made = hybrid_masks(sizes, mask, embeds, text._attn_implementation, arange)
        return _KEEP if made is None else (made, "filling" if sizes[3] < sizes[2] else "full")

    def agree(self, kwargs: dict, made: Any, kind: str) -> bool:
        """Whether transformers' own masks equal those `made` gives the forward (for a padded
        2D mask: transformers' masks from it), once per kind of mask and shape; if not,
        this model gets transformers' masks from then on."""
        mine = _transformers_masks(**{**kwargs, "attention_mask": made}) if kind == "pad" else made
        same = _equal(_transformers_masks(**kwargs), mine)
        if not same:
            self.off = True
            log.info("graphify: transformers' decode masks differ from graphify's (%s) for %s; its decode masks "
                     "are built on the host as transformers builds them", kind, type(self.model()).__name__)
        return same


def _transformers_masks(**kwargs):
    """transformers' `create_masks_for_generate`, as `prepare_inputs_for_generation` finds it."""
    from transformers.generation import utils

    return utils.create_masks_for_generate(**kwargs)


def _graphified() -> type:
    from graphify import Graphified

    return Graphified


def _cache_of(kwargs: dict):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _causal_text(config: Any) -> Any:
    """The text config of a causal model whose attention builds its masks as transformers'
    mask functions do (sdpa or eager), or None."""
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "is_causal", True) and getattr(text, "_attn_implementation", None) in _IMPLEMENTATIONS:
        return text
    return None


def _full_attention_only(text: Any) -> bool:
    """Every layer attends to the whole cache (no sliding window, no chunks): the forward can
    build its masks from a padded 2D mask inside the graph."""
    types = getattr(text, "layer_types", None)
    full = set(types) <= {"full_attention"} if types else not getattr(text, "sliding_window", None)
    return full and not getattr(text, "attention_chunk_size", None)


def _static_length(cache: Any) -> int | None:
    """The length every layer of `cache` holds, where all of them are plain full-attention
    static layers (whose masks depend on no Python state that moves); else None."""
    from transformers import cache_utils

    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    lengths = {getattr(layer, "max_cache_len", None) for layer in layers if type(layer) is cache_utils.StaticLayer}
    if len(lengths) != 1 or sum(type(layer) is cache_utils.StaticLayer for layer in layers) != len(layers):
        return None
    (length,) = lengths
    return length if isinstance(length, int) else None


def _shapes(made: Any) -> tuple:
    """What keys a check of `made` (a mask or a dict of them): names, shapes, dtypes, devices."""
    items = sorted(made.items()) if isinstance(made, dict) else [(None, made)]
    return tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in items)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a is None and b is None
