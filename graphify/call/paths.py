"""Which way a call runs: eagerly, or through a table's `Runtime` (`graphify.call.runtime`),
with CuPy / NumPy arrays going in and out as torch views; and the runtime made over a table."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from graphify.plan.dispatch import dispatcher_for
from graphify.capture.spec import FunctionSpec
from graphify.call.hand_out import hand_out_for
from graphify.base.interop import ForeignFunction, module, to_torch, tree_from_torch
from graphify.plan.keys import KeySet
from graphify.base.modes import Mode
from graphify.call.runtime import CallRules, Miss, Runtime
from graphify.plan.stats import Stats
from graphify.plan.table import GraphTable

__all__ = ["eager", "run", "runtime_for", "stream_scope"]


def eager(spec: FunctionSpec, stats: Stats, args: tuple, kwargs: dict, tokens: int | None = None):
    """`fn(*args, **kwargs)` as written, counted as an eager call of `tokens` rows (default:
    the first argument with a shape's leading dimension)."""
    if tokens is None:
        tokens = _leading_rows(args) or _leading_rows(tuple(kwargs.values()))
    stats.record(Mode.NONE, tokens, None)
    return spec.fn(*args, **kwargs)


def run(runtime: Runtime, slots: tuple, stats: Stats, checked: tuple | None = None):
    """A call's bound arguments through `runtime`: its result, or the runtime's `Miss`
    (`checked`: see `Runtime.run`). CuPy / NumPy arrays go in as torch views and the outputs
    come back as arrays; with CuPy, copies and replay run on the caller's current CuPy stream."""
    library = runtime.table.library
    if library is None:
        return runtime.run(slots, stats, checked)
    with stream_scope(runtime):
        out = runtime.run(tuple(map(to_torch, slots)), stats)
    return out if type(out) is Miss else tree_from_torch(out, module(library))


def stream_scope(runtime: Runtime):
    """Where a runtime's copies, replays and captures go: for CuPy callers, the caller's
    current CuPy stream."""
    if runtime.table.library == "cupy":
        from graphify.backends.streams import caller_cupy_stream

        return caller_cupy_stream()
    return contextlib.nullcontext()


def runtime_for(spec: FunctionSpec, table: GraphTable, keys: KeySet | None = None, shared=None) -> Runtime:
    """The call machinery over `table`, dispatching over `keys` (ahead of time: the table's
    own; first use: a structure's planned keys, the missing ones coming back as `Miss`);
    `shared`: what it shares with the runtimes of other graphs in its pool (`SharedCalls`)."""
    lib = table.library
    fn = ForeignFunction(spec.fn, lib) if lib else spec.fn
    batching = spec.batching
    rules = CallRules(batching.uniform, batching.has_lora, spec.options.allow_full, table.keys.uniform_query_len)
    return Runtime(
        spec.label, table.layout.caller(fn), table,
        dispatcher_for(keys if keys is not None else table.keys, spec.options.limits.padding_ratio), rules,
        hand_out_for(spec.label, spec.outputs, table.device), shared,
    )


def _leading_rows(args: Sequence[Any]) -> int:
    for a in args:
        shape = getattr(a, "shape", None)
        if shape:
            return int(shape[0])
    return 0
