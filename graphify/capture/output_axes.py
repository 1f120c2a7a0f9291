"""Which outputs follow the batch: each output's axis (tokens, requests or none), inferred
from shapes, probed with fake tensors, and made consistent across every captured size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from graphify.base.axes import ArgSpec, Kind
from graphify.base.errors import CaptureError

__all__ = ["infer_out_axes", "consistent_out_axes"]


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

    probed = _probe_out_axes(fn, specs, args) if any(s.axis.kind is Kind.REQS for s in specs) else None

    def rule(tok: int, req: int, flat: Sequence[Any]) -> tuple[str | None, ...]:
        if probed is not None and len(probed) == len(flat):
            return probed
        axes = []
        for t in flat:
            lead = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else None
            axes.append(Kind.TOKENS if lead == tok else Kind.REQS if lead == req else None)
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
                if kind.padded:
                    rows = tok_rows if kind is Kind.TOKENS else req_rows
                    fake.append(torch.full((rows, *spec.trailing), spec.axis.pad, dtype=spec.dtype, device=spec.device))
                elif kind is Kind.STATIC:
                    fake.append(arg)
                else:
                    fake.append(mode.from_tensor(arg))
            flat, _ = pytree.tree_flatten(fn(*fake))
    except Exception:  # a function fake tensors cannot run: fall back to the leading-dim rule
        return None
    return tuple(
        (Kind.TOKENS if t.shape[0] == tok_rows else Kind.REQS if t.shape[0] == req_rows else None)
        if isinstance(t, torch.Tensor) and t.dim()
        else None
        for t in flat
    )


def consistent_out_axes(label: str, entries: dict) -> dict:
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
        tokens, reqs = Kind.TOKENS, Kind.REQS
        for kind in (first, reqs if first == tokens else tokens) if first in (tokens, reqs) else (tokens, reqs):
            rows = [e.key.num_tokens if kind == tokens else e.key.reqs_rows for _, e in items]
            if all(len(sh) and sh[0] == n for sh, n in zip(shapes, rows)) and len({sh[1:] for sh in shapes}) == 1:
                for axes in axes_per_entry:
                    axes[i] = kind
                break
        else:
            (_, a), (_, b) = items[0], items[-1]
            raise CaptureError(
                f"{label}: output {i} has shape {shapes[0]} at {a.key} but {shapes[-1]} at {b.key}: it grows with the "
                "batch, but not as dim 0 following the tokens or the requests, so graphify cannot cut the padded "
                "rows off. Return the batch on dim 0 (for example .movedim(1, 0) for a vmapped ensemble, or reshape "
                "a 2x-per-row output to (rows, 2, ...)); out_axes marks dim-0 axes only ('tokens', 'reqs' or None)"
            )
    return {
        k: attrs.evolve(e, out_axes=tuple(axes)) if tuple(axes) != e.out_axes else e
        for (k, e), axes in zip(items, axes_per_entry)
    }


