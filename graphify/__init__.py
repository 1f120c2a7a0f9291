"""graphify: CUDA graphs as a composable, functional transform for PyTorch inference code.

    >>> from graphify import graphify, tokens, persistent
    >>> step = graphify(decode_step, mode="FULL", axes=(tokens(), tokens(), persistent()))  # doctest: +SKIP
    >>> step = step.capture(ids, positions, kv_cache)                                         # doctest: +SKIP
    >>> logits = step(ids, positions, kv_cache)                                                # doctest: +SKIP

Pure parts (modes, descriptors, support, sizes, keys, dispatch) never touch a device;
only the backends capture and replay.
"""

from ._axes import ArgSpec, Axis, fixed, persistent, reqs, static, tokens
from .capture import freeze_gc
from ._check import CheckReport, CheckRow
from ._descriptor import BatchDescriptor
from ._distributed import release_all
from ._dispatch import Decision, Dispatcher, dispatch, explain_miss
from ._errors import (
    CaptureError,
    DispatchMismatchError,
    GraphifyError,
    InputMismatchError,
    PersistentSwapError,
    StateChangedError,
    UnsupportedOpError,
)
from ._batching import Batching
from ._graphify import Graphified
from ._transform import graphify
from ._keys import KeySet, plan_keys
from ._options import Options
from ._mode import RUNTIME_MODES, Mode
from ._pool import Pool, PoolReport
from ._sizes import (
    normalize_sizes,
    pad_to,
    padding_table,
    round_to_multiple,
    sglang_decode_sizes,
    sglang_piecewise_sizes,
    vllm_sizes,
)
from ._stats import Stats, StatsRow
from ._support import Resolution, Support, resolve_mode, weakest
from ._table import Entry, GraphTable

__all__ = [
    "release_all",
    "ArgSpec", "Axis", "BatchDescriptor", "Batching", "CaptureError", "CheckReport", "CheckRow", "Decision", "DispatchMismatchError", "Dispatcher", "Entry",
    "GraphTable", "Graphified", "GraphifyError", "InputMismatchError", "KeySet", "Mode", "Options", "StateChangedError",
    "PersistentSwapError", "Pool", "PoolReport", "RUNTIME_MODES", "Resolution", "Stats", "StatsRow",
    "Support", "UnsupportedOpError", "dispatch", "explain_miss", "fixed", "freeze_gc", "graphify",
    "normalize_sizes", "pad_to", "padding_table", "persistent", "plan_keys", "reqs",
    "resolve_mode", "round_to_multiple", "sglang_decode_sizes", "sglang_piecewise_sizes",
    "static", "tokens", "vllm_sizes", "weakest",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`graphify.split` (and `SplitError`): `graphify.transforms.split`, imported when first
    asked for."""
    if name in ("split", "SplitError"):
        import importlib

        return getattr(importlib.import_module("graphify.transforms.split"), name)
    raise AttributeError(f"module 'graphify' has no attribute {name!r}")
