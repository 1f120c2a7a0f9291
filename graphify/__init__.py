"""graphify: CUDA graphs as a composable, functional transform for PyTorch inference code.

    >>> from graphify import graphify, tokens, persistent
    >>> step = graphify(decode_step, mode="FULL", axes=(tokens(), tokens(), persistent()))  # doctest: +SKIP
    >>> step = step.capture(ids, positions, kv_cache)                                         # doctest: +SKIP
    >>> logits = step(ids, positions, kv_cache)                                                # doctest: +SKIP

This is the public surface: the transform and its callable, its options, argument axes,
capture-size schedules, the pure dispatch that tests can call on plain data, and errors.
Code extending graphify builds on `graphify.extend`; graphify's own adapters are
`graphify.transforms` (`split`, transformers) and `graphify.models`. The packages under
`graphify/` are internal, layered from `base` up to `graphified` (see the README's layout).
"""

from graphify.base.axes import fixed, persistent, reqs, static, tokens
from graphify.base.batching import Batching
from graphify.base.descriptor import BatchDescriptor
from graphify.base.errors import (
    CaptureError,
    DispatchMismatchError,
    GraphifyError,
    InputMismatchError,
    PersistentSwapError,
    StateChangedError,
    UnsupportedOpError,
)
from graphify.base.limits import Limits
from graphify.base.modes import Mode
from graphify.base.options import Options
from graphify.distributed.lockstep import release_all
from graphify.graphified.callable import Graphified
from graphify.graphified.check import CheckReport
from graphify.graphified.transform import graphify
from graphify.plan.dispatch import Decision, dispatch, explain_miss
from graphify.plan.keys import KeySet
from graphify.plan.pool import Pool
from graphify.plan.sizes import pad_to, sglang_decode_sizes, sglang_piecewise_sizes, vllm_sizes
from graphify.plan.stats import Stats
from graphify.plan.support import Resolution, Support, resolve_mode

__all__ = [
    # the transform and its callable
    "graphify", "Graphified", "Options", "Limits", "Mode", "Batching", "Support", "Pool", "CheckReport", "Stats",
    "release_all",
    # argument axes
    "tokens", "reqs", "fixed", "persistent", "static",
    # capture sizes and the pure dispatch
    "vllm_sizes", "sglang_decode_sizes", "sglang_piecewise_sizes", "pad_to", "BatchDescriptor", "KeySet", "dispatch",
    "Decision", "explain_miss", "resolve_mode", "Resolution",
    # errors
    "GraphifyError", "CaptureError", "UnsupportedOpError", "InputMismatchError", "PersistentSwapError",
    "StateChangedError", "DispatchMismatchError",
]
__version__ = "0.1.0"
