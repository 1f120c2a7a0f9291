"""A graphified transformers model builds its decode mask inside its graphs, not on the host.

With a static cache, `generate()`'s `prepare_inputs_for_generation` builds the 4D attention
mask on the host at every step (`create_masks_for_generate`, looked up on the model first),
about half of that function's host time, and a token pays it before its graph can launch
(notes/issue41.md). For a model whose `forward` is graphified, `pad_masks_in_forward` gives
the model its own `create_masks_for_generate`: at a decode step over a cache of plain
full-attention static layers it returns the 2D mask padded with zeros to the cache's length
(all ones where `generate()` dropped an all-ones mask), a shape that stays fixed for the
whole `generate()`, and the forward builds the 4D mask from it itself, inside the captured
graph. The prompt keeps transformers' mask, so it stays a kind of call of its own that runs
eagerly.

Zeros are what transformers pads a short 2D mask with (`prepare_padding_mask`), and past the
step's position the causal part masks every entry whatever the 2D mask holds there, so the
mask is the same. Each kind and shape of mask checks that once: transformers' own function on
the mask as given and on the padded one must agree, or the padding is turned off for the
model (one log line). Everything else (sliding-window and hybrid caches, masks a model class
builds its own way, extra mask functions, a forward no longer graphified) gets transformers'
function unchanged.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

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
        self.off = False

    def __reduce__(self):
        """A pickled or deep-copied model gets a padding of its own (its checks start over)."""
        return MaskPadding, (self.model(),)

    def __call__(self, **kwargs):
        mask = _KEEP if self.off else self.padded(kwargs)
        if mask is _KEEP:
            return _transformers_masks(**kwargs)
        given = kwargs.get("attention_mask")
        key = (None if given is None else given.dtype, tuple(mask.shape), mask.device)
        agreed = self.checked.get(key)
        if agreed is None:
            if len(self.checked) >= MAX_CHECKED:
                self.checked.clear()
            agreed = self.checked[key] = self.agree(kwargs, mask)
        return mask if agreed else _transformers_masks(**kwargs)

    def padded(self, kwargs: dict):
        """The decode step's 2D mask padded to the cache's length (all ones where
        `generate()` dropped an all-ones mask), or `_KEEP` where this call keeps
        transformers' mask."""
        model = self.model()
        mask, embeds = kwargs.get("attention_mask"), kwargs.get("inputs_embeds", kwargs.get("input_embeds"))
        if model is None or not isinstance(vars(model).get("forward"), _graphified()):
            return _KEEP
        if not (isinstance(embeds, torch.Tensor) and embeds.dim() >= 2 and embeds.shape[1] == 1):
            return _KEEP  # not a decode step: the prompt keeps its own kind of mask, so it stays its own kind of call
        if not (mask is None or isinstance(mask, torch.Tensor) and mask.dim() == 2):
            return _KEEP
        if any(kwargs.get(name) is not None for name in _EXTRA) or not _plain_causal(kwargs.get("config")):
            return _KEEP
        cache = _cache_of(kwargs)
        length = _static_length(cache)
        if length is None or mask is not None and mask.shape[-1] > length:
            return _KEEP
        if mask is None:  # the causal part masks every position past the step's: ones are the same as none
            key = (embeds.shape[0], length, embeds.device)
            ones = self.ones.get(key)
            if ones is None:
                if len(self.ones) >= MAX_CHECKED:
                    self.ones.clear()
                ones = self.ones[key] = torch.ones(key[:2], dtype=torch.long, device=key[2])
            return ones
        return torch.nn.functional.pad(mask, (0, length - mask.shape[-1]))

    def agree(self, kwargs: dict, padded: torch.Tensor) -> bool:
        """Whether transformers' own masks from `padded` equal those from the mask as given
        (once per kind of mask and shape); if not, padding is off for the model."""
        same = _equal(_transformers_masks(**kwargs), _transformers_masks(**{**kwargs, "attention_mask": padded}))
        if not same:
            self.off = True
            log.info("graphify: transformers' mask from a zero-padded 2D mask differs from the unpadded one's for "
                     "%s; its decode masks are built on the host as transformers builds them",
                     type(self.model()).__name__)
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


def _plain_causal(config: Any) -> bool:
    """A causal model of full attention only, whose attention builds its mask from a 2D
    padding mask (a sliding window or chunks anywhere in the config: transformers' mask)."""
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    full = set(types) <= {"full_attention"} if types else not getattr(text, "sliding_window", None)
    return (full and not getattr(text, "attention_chunk_size", None) and getattr(text, "is_causal", True)
            and getattr(text, "_attn_implementation", None) in _IMPLEMENTATIONS)


def _static_length(cache: Any) -> int | None:
    """The length every layer of `cache` holds, where all of them are plain full-attention
    static layers (whose masks depend on no Python state that moves); else None."""
    from transformers import cache_utils

    layers = getattr(cache, "layers", None)
    if not layers or not getattr(cache, "is_compileable", False):
        return None
    lengths = {getattr(layer, "max_cache_len", None) for layer in layers if type(layer) is cache_utils.StaticLayer}
    if len(lengths) != 1 or sum(type(layer) is cache_utils.StaticLayer for layer in layers) != len(layers):
        return None
    (length,) = lengths
    return length if isinstance(length, int) else None


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a is None and b is None
