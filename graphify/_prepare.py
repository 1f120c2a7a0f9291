"""From a graphified function and one call to what capture needs: the call bound to its
argument slots, the backend, the eager twin, and the arguments of a `CaptureSession`
(ahead of time every planned key; on first use a call structure's)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._axes import layout_for, specs_for
from ._capturers import mode_capturers
from ._distributed import graph_code
from ._interop import ForeignFunction, foreign_library, to_torch
from ._keys import specialised_sizes
from ._mode import Mode
from ._outputs import box
from ._params import ModuleWatch
from ._roots import function_roots
from ._pool import Pool
from ._signature import CallLayout, module_of
from .backends import get_backend

__all__ = ["prepare", "session_args"]


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def prepare(g, example_args, example_kwargs) -> tuple:
    """Bind the example call and pick the backend:
    (fn, eager twin, slot args, specs, backend, library, layout)."""
    layout = CallLayout.build(g._call, g.fn, example_args, example_kwargs)
    args = layout.bind(example_args, example_kwargs)
    library = foreign_library(g._call, args)
    fn, twin = g.fn, _eager_twin(g.fn)
    if library is not None:  # CuPy / NumPy arrays: capture a torch-facing view of fn
        if getattr(fn, "is_split", False):
            raise ValueError(f"{g._call}.capture: split functions take torch tensors, not {library} arrays")
        fn, args = ForeignFunction(fn, library), tuple(map(to_torch, args))
    fn = _boxing(layout.caller(fn))
    twin = _boxing(layout.caller(twin)) if twin is not None else None
    axes = g.axes if g.axes is not None else getattr(g.fn, "axes", None)
    arg_axes = layout_for(g._call, layout.slot_names, axes, args)
    if not any(a.kind in ("tokens", "reqs") for a in arg_axes):
        raise ValueError(
            f"{g._call}.capture: no argument grows with the batch; mark at least one tokens() or reqs()"
        )
    specs = specs_for(g._call, layout.slot_names, arg_axes, args)
    device = next((s.device for s in specs if s.device is not None), None)
    try:
        backend = get_backend(g.backend, device, library)
    except ValueError as exc:
        raise ValueError(f"{g._call}.capture: {exc}") from None
    return fn, twin, args, specs, backend, library, layout

def session_args(g, fn, twin, args, specs, backend, library, layout, keys, lockstep=None) -> dict:
    """What a `CaptureSession` over this function needs: ahead of time every planned
    key, on first use a structure's."""
    opts = g.options
    modules = [m for m in [module_of(g.fn)] if m is not None]
    modules += [a for a, s in zip(args, specs) if s.axis.kind == "static" and isinstance(a, torch.nn.Module)]
    split = getattr(g.fn, "is_split", False)
    full_for = None
    if lockstep is not None and lockstep.in_graph:  # each FULL graph records the ranks' check on its code
        full = tuple(Mode).index(Mode.FULL)

        def full_for(key):
            code = graph_code(full, key.num_tokens, key.reqs_rows)
            return lockstep.checked(fn, code), lockstep.checked(twin, code)

    capturers = mode_capturers(
        backend, fn, twin, g.fn if split else None, full_for, specialised_sizes(opts.compile_sizes, keys)
    )
    return dict(
        call=g._call,
        fn=fn,
        capturers=capturers,
        keys=keys,
        specs=specs,
        example=args,
        backend=backend,
        pool=g.pool if g.pool is not None else Pool(f"{_fn_name(g.fn)}"),
        warmups=opts.warmups,
        weak_outputs=opts.weak_outputs and backend.name == "cuda",
        out_axes=g.out_axes if g.out_axes is not None else (getattr(g.fn, "out_axes", None) or None),
        progress=opts.progress,
        largest_first=opts.largest_first,
        library=library,
        restore_state=opts.restore_state,
        probe=layout.caller(g.fn.fn) if split else None,
        layout=layout,
        watch=ModuleWatch(g._call, modules, full=opts.full_checks),
        examples=tuple(a.detach().clone() if s.axis.kind == "tokens" else None for a, s in zip(args, specs)),
        uses_fft=split and any(name.startswith("aten::_fft_") for name in g.fn.op_names),
        # a split function's pieces are traced ATen graphs: what its closure held is baked in
        fn_roots={} if split else function_roots(g.fn, _fn_name(g.fn)),
    )


def _eager_twin(fn: Callable) -> Callable | None:
    """The uncompiled function behind a torch.compile'd one (or behind a split function
    with compiled pieces), to run under the op guard; None for uncompiled functions."""
    if getattr(fn, "is_split", False):
        return fn.fn if getattr(fn, "compiled", False) else None
    return getattr(fn, "_torchdynamo_orig_callable", None)


def _boxing(fn: Callable) -> Callable:
    """`fn` with unregistered dataclasses in its outputs boxed, so they flatten."""

    def boxed(*args):
        return box(fn(*args))

    return boxed
