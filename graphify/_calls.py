"""Running one call, the layer below first use and `Graphified`: eagerly, through a runtime
(pad, dispatch, replay), or for a function of CuPy / NumPy arrays through torch views."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._dispatch import Dispatcher
from ._function import FunctionSpec
from ._interop import ForeignFunction, module, to_torch, tree_from_torch
from ._keys import KeySet
from ._mode import Mode
from ._runtime import GraphSource, Runtime
from ._stats import Stats
from ._table import GraphTable

__all__ = ["eager", "run", "runtime_for"]


def eager(spec: FunctionSpec, stats: Stats, args: tuple, kwargs: dict):
    """`fn(*args, **kwargs)` as written, counted as an eager call."""
    stats.record(Mode.NONE, _leading_rows(args) or _leading_rows(tuple(kwargs.values())), None)
    return spec.fn(*args, **kwargs)


def run(runtime: Runtime, slots: tuple, stats: Stats):
    """A call's bound arguments through `runtime`. CuPy / NumPy arrays go in as torch views
    and the outputs come back as arrays; with CuPy, copies and replay run on the caller's
    current CuPy stream."""
    library = runtime.library
    if library is None:
        return runtime.run(slots, stats)
    targs = tuple(map(to_torch, slots))
    if library == "cupy":
        from .backends.streams import caller_cupy_stream

        with caller_cupy_stream():
            out = runtime.run(targs, stats)
    else:
        out = runtime.run(targs, stats)
    return tree_from_torch(out, module(library))


def runtime_for(
    spec: FunctionSpec, table: GraphTable, keys: KeySet | None = None, source: "GraphSource | None" = None,
) -> Runtime:
    """The call machinery over `table`, dispatching over `keys` (ahead of time: the table's
    own; first use: a structure's planned keys, its `source` capturing what is missing)."""
    lib = table.library
    fn = ForeignFunction(spec.fn, lib) if lib else spec.fn
    batching = spec.batching
    return Runtime(
        call=spec.call,
        fn=table.layout.caller(fn),
        table=table,
        dispatcher=Dispatcher(keys if keys is not None else table.keys, spec.options.max_padding_ratio),
        uniform_fn=batching.uniform,
        lora_fn=batching.has_lora,
        outputs=spec.outputs,
        full_ok_fn=spec.options.allow_full,
        source=source,
    )


def _leading_rows(args: Sequence[Any]) -> int:
    for a in args:
        shape = getattr(a, "shape", None)
        if shape:
            return int(shape[0])
    return 0
