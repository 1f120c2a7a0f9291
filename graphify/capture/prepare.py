"""From a graphified function and one call of it to what capture needs (`Prepared`): the
call bound to its argument slots, each argument's spec, the function as captures call it,
its eager twin, and the backend."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from graphify.base.axes import ArgSpec, layout_for, specs_for
from graphify.capture.spec import FunctionSpec
from graphify.base.interop import ForeignFunction, foreign_library, to_torch
from graphify.base.call_layout import CallLayout
from graphify.base.boxing import box
from graphify.backends import Backend, get_backend
from graphify.base.split_contract import as_split

__all__ = ["Prepared", "prepare"]


@attrs.frozen(kw_only=True, eq=False)
class Prepared:
    """One call of a function, ready to capture."""

    layout: CallLayout  # how calls bind to argument slots
    args: tuple  # this call, bound (CuPy / NumPy arrays as torch views)
    specs: tuple[ArgSpec, ...]  # what each argument looked like
    fn: Callable  # the function as captures call it: slot arguments in, outputs boxed
    twin: Callable | None  # a compiled function's eager original, called the same way
    backend: Backend
    library: str | None  # "cupy" / "numpy" for functions of those arrays


def prepare(spec: FunctionSpec, example_args: tuple, example_kwargs: dict) -> Prepared:
    """Bind the example call, read each argument's axis and spec, pick the backend."""
    label, fn = spec.label, spec.fn
    layout = CallLayout.build(label, fn, example_args, example_kwargs)
    split = as_split(fn)
    if spec.compiled is not None:  # Options(compile=...): captures record the compiled function
        fn = spec.compiled  # (a split function's: compiled whole, for FULL)
    twin = eager_twin(fn)
    args = layout.bind(example_args, example_kwargs)
    library = foreign_library(label, args)
    if library is not None:  # CuPy / NumPy arrays: capture a torch-facing view of fn
        if split is not None:
            raise ValueError(f"{label}.capture: split functions take torch tensors, not {library} arrays")
        fn, args = ForeignFunction(fn, library), tuple(map(to_torch, args))
    axes = spec.axes if spec.axes is not None else (split.axes if split is not None else None)
    arg_axes = layout_for(label, layout.slot_names, axes, args)
    if not any(a.kind.padded for a in arg_axes):
        raise ValueError(f"{label}.capture: no argument grows with the batch; mark at least one tokens() or reqs()")
    specs = specs_for(label, layout.slot_names, arg_axes, args)
    device = next((s.device for s in specs if s.device is not None), None)
    try:
        backend = get_backend(spec.backend, device, library)
    except ValueError as exc:
        raise ValueError(f"{label}.capture: {exc}") from None
    return Prepared(
        layout=layout, args=args, specs=specs, fn=_boxing(layout.caller(fn)),
        twin=_boxing(layout.caller(twin)) if twin is not None else None, backend=backend, library=library,
    )


def eager_twin(fn: Callable) -> Callable | None:
    """The uncompiled function behind a torch.compile'd one (or behind a split function
    with compiled pieces), to run under the op guard; None for uncompiled functions."""
    split = as_split(fn)
    if split is not None:
        return split.fn if split.compiled else None
    module = getattr(getattr(fn, "__wrapped__", fn), "_orig_mod", None)
    if isinstance(module, torch.nn.Module):  # a compiled module: the module itself, whose forward is looked up
        return module  # at every call (dynamo's record of it is the bound forward of compile time)
    return getattr(fn, "_torchdynamo_orig_callable", None)


def _boxing(fn: Callable) -> Callable:
    """`fn` with unregistered dataclasses in its outputs boxed, so they flatten."""

    def boxed(*args):
        return box(fn(*args))

    boxed.boxes = fn  # what it stands for, named in messages (`graphify.backends.sim`)
    return boxed
