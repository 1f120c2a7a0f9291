"""Capture helpers: one key's capture (`_capture_one`), the GC freeze, output axes, and
the errors a failed capture raises. `graphify._session` drives them, key by key."""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from ._axes import PADDED, ArgSpec
from ._errors import CaptureError, UnsupportedOpError
from ._table import Entry

__all__ = ["freeze_gc", "consistent_out_axes", "infer_out_axes"]

log = logging.getLogger("graphify")
MiB = 1 << 20


@contextlib.contextmanager
def freeze_gc(collect: bool = True):
    """Collect once (unless `collect` is False), then keep the GC from running (and from
    scanning old objects) while graphs are captured: a collection mid-capture costs time
    and can free memory the capture is using (vLLM's and SGLang's `freeze_gc`). A full
    collection in a process holding a model costs ~0.3 s, so first-use captures after the
    first one skip it."""
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def _device_of(specs: Sequence[ArgSpec]) -> torch.device | None:
    devices = {s.device for s in specs if s.device is not None}
    if len(devices) > 1:
        names = ", ".join(f"{s.name}: {s.device}" for s in specs if s.device is not None)
        raise CaptureError(f"arguments are on several devices ({names}); a graph runs on one device")
    return next(iter(devices), None)


def _device_scope(device: torch.device | None):
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def infer_out_axes(fn: Callable, specs: Sequence[ArgSpec], args: Sequence[Any], out_axes) -> Callable:
    """A function of (num_tokens rows, reqs rows, flat outputs) -> per-output axis.

    With explicit `out_axes` that is used. Otherwise an output whose leading dim equals
    the token rows follows tokens, else one that equals the request rows follows requests.
    Where both are equal and the function has request-axis inputs, the shapes are probed
    once with fake tensors (no device work, no side effects) at distinct row counts.
    """
    if out_axes is not None:
        fixed = tuple(out_axes) if isinstance(out_axes, (tuple, list)) else (out_axes,)
        bad = [a for a in fixed if a not in ("tokens", "reqs", None)]
        if bad:
            raise ValueError(f"out_axes: {bad[0]!r} is not an output axis; use 'tokens', 'reqs' or None")

        def given(tok: int, req: int, flat: Sequence[Any]) -> tuple[str | None, ...]:
            if len(fixed) == 1:
                return fixed * len(flat)
            if len(fixed) != len(flat):
                raise ValueError(f"out_axes has {len(fixed)} entries but the function returns {len(flat)} outputs")
            return fixed

        return given

    probed = _probe_out_axes(fn, specs, args) if any(s.axis.kind == "reqs" for s in specs) else None

    def rule(tok: int, req: int, flat: Sequence[Any]) -> tuple[str | None, ...]:
        if probed is not None and len(probed) == len(flat):
            return probed
        axes = []
        for t in flat:
            lead = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else None
            axes.append("tokens" if lead == tok else "reqs" if lead == req else None)
        return tuple(axes)

    return rule


def _probe_out_axes(fn, specs, args) -> tuple[str | None, ...] | None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    tok_rows, req_rows = 11, 7
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = []
            for spec, arg in zip(specs, args):
                kind = spec.axis.kind
                if kind in PADDED:
                    rows = tok_rows if kind == "tokens" else req_rows
                    fake.append(torch.full((rows, *spec.trailing), spec.axis.pad, dtype=spec.dtype, device=spec.device))
                elif kind == "static":
                    fake.append(arg)
                else:
                    fake.append(mode.from_tensor(arg))
            flat, _ = pytree.tree_flatten(fn(*fake))
    except Exception:  # a function fake tensors cannot run: fall back to the leading-dim rule
        return None
    return tuple(
        ("tokens" if t.shape[0] == tok_rows else "reqs" if t.shape[0] == req_rows else None)
        if isinstance(t, torch.Tensor) and t.dim()
        else None
        for t in flat
    )


def consistent_out_axes(call: str, entries: dict) -> dict:
    """One batch axis per output across every captured size, read from the real shapes.

    An output of the same shape at every size is not cut (even where its length happens
    to equal one size's token count). An output that changes with the batch must do so
    on dim 0 as the tokens or the requests do, with the other dims fixed; anything else
    (dim 0 twice the tokens, the batch on dim 1 as a vmapped ensemble returns) would hand
    out padded rows, so it is an error that says what to do."""
    items = list(entries.items())
    if len({(e.key.num_tokens, e.key.reqs_rows) for _, e in items}) < 2:
        return entries
    count = len(items[0][1].flat_outputs)
    axes_per_entry = [list(e.out_axes) for _, e in items]
    for i in range(count):
        shapes = [tuple(e.flat_outputs[i].shape) if isinstance(e.flat_outputs[i], torch.Tensor) else None for _, e in items]
        if shapes[0] is None or len(set(shapes)) == 1:
            for axes in axes_per_entry:
                axes[i] = None
            continue
        first = items[0][1].out_axes[i]  # where tokens and requests rows agree, the shape probe decided
        for kind in (first, "reqs" if first == "tokens" else "tokens") if first in ("tokens", "reqs") else ("tokens", "reqs"):
            rows = [e.key.num_tokens if kind == "tokens" else e.key.reqs_rows for _, e in items]
            if all(len(sh) and sh[0] == n for sh, n in zip(shapes, rows)) and len({sh[1:] for sh in shapes}) == 1:
                for axes in axes_per_entry:
                    axes[i] = kind
                break
        else:
            (_, a), (_, b) = items[0], items[-1]
            raise CaptureError(
                f"{call}: output {i} has shape {shapes[0]} at {a.key} but {shapes[-1]} at {b.key}: it grows with the "
                "batch, but not as dim 0 following the tokens or the requests, so graphify cannot cut the padded "
                "rows off. Return the batch on dim 0 (for example .movedim(1, 0) for a vmapped ensemble, or reshape "
                "a 2x-per-row output to (rows, 2, ...)); out_axes marks dim-0 axes only ('tokens', 'reqs' or None)"
            )
    return {
        k: attrs.evolve(e, out_axes=tuple(axes)) if tuple(axes) != e.out_axes else e
        for (k, e), axes in zip(items, axes_per_entry)
    }


def _capture_one(
    call, capturer, mode, key, specs, static, example, handle, stream, warmups, weak_outputs, out_rule, keeper, probe,
    first, sibling, loaded=None, quick=False,
):
    """Capture one key. `first`: the first key of its mode in this table, which alone
    checks for in-place writes to arguments; the capturer decides what else it skips at
    later keys (`graphify._capturers`). `sibling`: the PIECEWISE entry of the same token
    count, already captured, whose schedule warms a FULL capture up cheaply. `loaded`: what
    a first-use capture copied into the static buffers (the call's own rows), which the
    function must leave as they are; None: all padding. `quick`: no warm-up, no op guard
    (first use, code whose kin was captured before; see `graphify._capturers`)."""
    args = static.args_for(specs, key, example)
    t0 = time.perf_counter()
    try:
        captured = capturer(
            args, key=key, pool=handle, warmups=warmups, weak_outputs=weak_outputs, stream=stream, keeper=keeper,
            probe=probe if keeper.enabled else None, first=first, sibling=sibling, quick=quick,
        )
        keeper.forget()
    except Exception as exc:
        exc.graphify_key = (mode, key)
        raise
    changed = static.changed(specs, loaded) if first and not quick else None
    if changed:
        raise CaptureError(
            f"{call}: the function writes to argument(s) {changed} in place; graphify copies padded "
            "arguments into static buffers, so such writes are lost: mark them persistent() or return the result"
        )
    flat, spec = pytree.tree_flatten(captured.outputs)
    return Entry(
        mode, key, captured.replay, captured.graph, tuple(flat), spec,
        out_rule(key.num_tokens, key.reqs_rows, flat), captured.nbytes, time.perf_counter() - t0, captured.sized,
    )


def _as_capture_error(call: str, exc: Exception, done: int, total: int) -> CaptureError:
    if isinstance(exc, CaptureError) and str(exc).startswith(call):
        return exc  # already names the call (an in-place write, a pool on another device)
    key = getattr(exc, "graphify_key", None)
    where = f" at {key[0].value} graph {key[1]} ({done + 1} of {total})" if key else ""
    released = f"the {done} graph(s) captured before it were released; " if done else ""
    advice = "the callable you captured from is unchanged and still works"
    if isinstance(exc, torch.OutOfMemoryError):
        advice = (
            "out of device memory: capture fewer sizes or a smaller maximum (sizes=...), share one "
            "Pool between functions, or free memory first; " + advice
        )
    refused = _LIBRARY_REFUSED.search(str(exc)) if isinstance(exc, NotImplementedError) else None
    if refused is not None:  # CuPy checks the stream before calling the library: CUDA never saw it
        lib = refused.group(1)
        return UnsupportedOpError(
            f"{call}: capture failed{where}: {_user_frame(exc)} calls {lib}, which CuPy refuses inside a CUDA graph "
            f"capture; keep that call out of the graphified function (run it before or after the graphed part, or "
            f"make it a split op), or use torch's equivalent where it captures (torch.fft, torch.randn, "
            f"torch.linalg.*_ex); {released}{advice}"
        )
    cls = type(exc) if isinstance(exc, CaptureError) else CaptureError
    return cls(f"{call}: capture failed{where}: {type(exc).__name__}: {exc}; {released}{advice}")


_LIBRARY_REFUSED = re.compile(r"calling (cu[A-Za-z]+) API during stream capture is currently unsupported")


_LIBRARY_PACKAGES = frozenset({"graphify", "torch", "cupy", "cupyx", "cupy_backends"})


def _user_frame(exc: BaseException) -> str:
    """'file:line in function' of the innermost frame outside torch, CuPy and graphify:
    the user's call that raised."""
    # by module, not by folder name: a user's checkout may sit in a folder named graphify
    found = "the function"
    for frame, line in traceback.walk_tb(exc.__traceback__):
        path = frame.f_code.co_filename
        module = frame.f_globals.get("__name__") or ""
        if module.split(".", 1)[0] not in _LIBRARY_PACKAGES and not path.startswith("<frozen"):
            found = f"{path.rsplit('/', 1)[-1]}:{line} in {frame.f_code.co_name}"
    return found


def _progress(pairs, call: str, progress: bool):
    if not progress:
        return pairs
    from tqdm.auto import tqdm

    return tqdm(pairs, desc=f"{call}: capturing", unit="graph", leave=False, disable=None)
