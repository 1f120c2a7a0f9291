"""Hugging Face transformers decode with graphify: a static cache, graphs, greedy generation.

A transformers causal LM graphifies as it is: `graphify(model, mode="FULL", sizes=[B])`
captured with a keyword call `capture(input_ids=ids, cache=cache, use_cache=True)`
(`past_key_values=cache` before transformers 5.24; `cache_keyword(model)` says which)
replays one decode step of the model per call. The `StaticCache` is a static argument (the
same object on every call); the graphs read and write its tensors, including its in-place
position counters, and `capture()` leaves the cache as it found it. A static cache's batch
size is fixed, so each batch size is one captured size.

This module adds the few helpers a generation loop needs, and tells graphify how to follow
the Python state of transformers' cache layers (`graphify.reads.stateful_types`): a sliding-window
layer keeps a Python counter that picks its update's branch (filling the window, or full:
roll), so first use captures a graph per branch and advances the counter after each replay.
A graphified model's decode masks are built inside its graphs (`graphify.transforms._hf_masks`).
graphify imports this module when a call first passes a transformers object. transformers
is imported only here (`pip install graphify[hf]`); graphify's core never imports it.

!!! example
    >>> from graphify.transforms.hf import decode_graphs, greedy_generate, static_cache  # doctest: +SKIP
    >>> cache = static_cache(model, batch_size=8, max_cache_len=256)            # doctest: +SKIP
    >>> step = decode_graphs(model, cache)                                      # doctest: +SKIP
    >>> tokens = greedy_generate(model, prompt_ids, cache, 128, decode=step)     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["static_cache", "decode_graphs", "greedy_generate", "query_length", "cache_keyword"]


# -- the Python state of cache layers ---------------------------------------------------------
def query_length(call: dict) -> int | None:
    """New tokens per sequence in a forward call (its arguments by name), or None if unknown."""
    for name, dim in (("cache_position", 0), ("input_ids", -1), ("inputs_embeds", 1), ("decoder_input_ids", -1)):
        t = call.get(name)
        if isinstance(t, torch.Tensor) and t.dim() > (dim if dim >= 0 else -dim - 1):
            return t.shape[dim]
    return None


def _sliding_branch(layer, q: int | None):
    """What `StaticSlidingWindowLayer.update` does with a call's q new tokens (`query_length`,
    once a call): "fill" (the window has room: written at the layer's tensor counter), "full"
    (roll by one, q = 1) or ("full", q) (concatenate); None for a call that crosses the
    window's end (its slices depend on the counter's value) or a layer not yet set up: those
    run eagerly."""
    if q is None or not getattr(layer, "is_initialized", True):
        return None
    seen, window = layer.cumulative_length_int, layer.max_cache_len
    if seen >= window:
        return "full" if q == 1 else ("full", q)
    return "fill" if seen + q <= window else None


def _sliding_after(layer, q: int | None) -> tuple:
    return (layer.cumulative_length_int + q,)


@contextlib.contextmanager
def _seen_as_capturing():
    """transformers asks `is_cuda_stream_capturing()` before host reads it can skip (the
    encoder mask's `padding_mask.all()` in T5's and Bart's masking: a capture materialises
    the mask instead, right for any mask). Warm-ups and the simulation's capture run are
    told the same, so they take the path the CUDA capture takes."""
    from transformers.utils import import_utils

    saved = import_utils.is_cuda_stream_capturing
    import_utils.is_cuda_stream_capturing = _capturing
    try:
        yield
    finally:
        import_utils.is_cuda_stream_capturing = saved


def _capturing() -> bool:
    return True


@contextlib.contextmanager
def _counter_reads_refused(sliding: type):
    """A forward that asks a sliding-window layer its length or mask sizes while it captures
    (a model building its own masks inside its forward: T5Gemma's decoder under transformers
    5.17) turns the layer's Python counter into constants of the graph: the query's position
    and the window's offset at capture, wrong at every later step. The state type follows the
    counter only for the update's branch, so such a capture is refused (UnsupportedOpError:
    its calls run eagerly, one warning). Masks handed in from outside, as `generate()` makes
    them for decoder-only models, never ask."""
    from graphify import UnsupportedOpError

    read: list = []
    saved = {name: vars(sliding)[name] for name in ("get_seq_length", "get_mask_sizes") if name in vars(sliding)}

    def counted(name: str, real):
        def ask(self, *args, **kwargs):
            read.append(name)
            return real(self, *args, **kwargs)
        return ask

    for name, real in saved.items():
        setattr(sliding, name, counted(name, real))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(sliding, name, real)
    if read:
        raise UnsupportedOpError(
            f"the call asks a sliding-window cache layer for its {read[0].removeprefix('get_')} inside the "
            "graph (a model that builds its own attention masks from the cache's Python counter): a graph "
            "would keep the position it was captured at. Such calls run eagerly; masks passed in (as "
            "generate() makes them for decoder-only models with cache_implementation=\"static\") avoid it")


def _register() -> None:
    """Register transformers' cache layers that keep Python state, and the capture context
    (where transformers is installed; the layer's update is the same code in 5.17 and 5.24)."""
    try:
        from transformers import cache_utils
        from transformers.utils import import_utils
    except ImportError:
        return
    from graphify.extend import (StateType, register_capture_context, register_carried, register_forward_adapter,
                                 register_rebuilt, register_sequence_padding, register_state_type)

    from ._hf_lengths import encoder_padding
    from ._hf_masks import pad_masks_in_forward

    sliding = getattr(cache_utils, "StaticSlidingWindowLayer", None)
    if sliding is not None:
        register_state_type(sliding, StateType(("cumulative_length_int",), _sliding_branch, _sliding_after,
                                                  query_length))
        register_capture_context(functools.partial(_counter_reads_refused, sliding))
    if hasattr(import_utils, "is_cuda_stream_capturing"):
        register_capture_context(_seen_as_capturing)
    register_forward_adapter(pad_masks_in_forward)
    register_sequence_padding(encoder_padding)
    register_rebuilt(_recorded_again)
    register_carried("transformers output-capturing registry", _registry_keys, _registry_in_order)


def _recorded_again(module) -> None:
    """In the compile worker: a transformers model rebuilt from the caller's copy skipped its
    `__init__`, which records the model's class in the output-capturing registry; the forward
    reads that registry, so a compiled function saved there would guard on its absence and
    never pass here. Recorded again, keyed as this transformers keys it: newer ones take the
    model and store its class's name, older ones (5.17) are a plain dict keyed by that name."""
    registry = _registry()
    if registry is None:
        return
    from transformers.modeling_utils import PreTrainedModel

    if isinstance(module, PreTrainedModel) and hasattr(module, "_can_record_outputs"):
        key = str(module.__class__) if type(registry) is dict else module
        registry[key] = module._can_record_outputs


def _registry():
    """transformers' output-capturing registry of model classes, or None (an older transformers)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # an older transformers: no such registry
        return None
    return _CAN_RECORD_REGISTRY


def _registry_keys() -> list | None:
    """The caller's output-capturing registry's keys, in order (class names: plain strings)."""
    registry = _registry()
    return None if registry is None else [k for k in dict.keys(registry) if isinstance(k, str)]


def _registry_in_order(keys: list | None) -> None:
    """In the compile worker: the registry's keys in the caller's order. The forward reads the
    registry through a dict lookup, which dynamo guards by the dict's keys in order; a caller
    that made other model families first holds their classes before this one's, so a fresh
    process's registry would fail that guard in the caller and refuse every loaded call. Keys
    this process has not recorded get the empty entry (what the registry answers for a class
    with nothing to record: the worker compiles only the caller's models, recorded again when
    rebuilt); its own entries keep their values, and any key the caller lacks goes last."""
    registry = _registry()
    if registry is None or keys is None:
        return
    own = dict(dict.items(registry))
    dict.clear(registry)
    for key in keys:
        dict.__setitem__(registry, key, own.pop(key, {}))
    for key, value in own.items():
        dict.__setitem__(registry, key, value)


_register()


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


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword `model`'s forward takes its cache by: `cache` from transformers 5.24 on
    (`past_key_values` there is deprecated, to go in 5.40), `past_key_values` before."""
    forward = getattr(model, "forward", model)
    try:
        names = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in names else "past_key_values"


def decode_graphs(model: torch.nn.Module, cache: Any, *, mode: str = "FULL", fn: Callable | None = None, **graphify_kwargs):
    """`model` (or `fn`, a compiled version of it) graphified for one decode step over
    `cache`, captured at the cache's batch size. Call the result as the model:
    `step(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True)` (`past_key_values=`
    before transformers 5.24); `ids` is `(batch_size, 1)`. The cache's contents are left as
    they were."""
    from graphify import graphify

    batch = cache.layers[0].keys.shape[0]
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.get_text_config(decoder=True).vocab_size, (batch, 1), device=device)
    g = graphify(fn if fn is not None else model, mode=mode, sizes=[batch], **graphify_kwargs)
    with torch.no_grad():
        return g.capture(input_ids=ids, **{cache_keyword(model): cache}, use_cache=True)


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
    past = {cache_keyword(model): cache}
    with torch.no_grad():
        out = model(input_ids=input_ids, **past, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        tokens = [nxt]
        for i in range(max_new_tokens - 1):
            out = decode(input_ids=nxt, **past, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            if sync_every_step:
                nxt.cpu()
            if on_step is not None:
                on_step(i)
    return torch.cat(tokens, dim=1)
