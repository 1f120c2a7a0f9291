"""A capture session: what the captures of one table share, and the tables it produces.

`capture()` (ahead of time) opens a session, captures every planned key in `KeySet.pairs()`
order (mixed keys largest first, then uniform keys) and closes it: on any failure the
graphs captured so far are released and a `CaptureError` names the key that failed.

First-use capture (`graphify._first_use`) keeps a session open for the life of a callable's
call structure and captures one key at a time, when a call first needs it, warmed up on
that call's own rows. Each capture returns a new immutable `GraphTable` holding every entry
so far; a failed key leaves the entries before it (and the table the callable holds) as
they were.

A session holds the static input buffers (sized for the largest planned key), the pool
handle, the capture stream, the state keeper and the library hold (`graphify._keepalive`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
import types
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from .._axes import Kind, WeakStatic, by_value, weaken
from .._distributed import graph_code
from .._errors import CaptureError, StateReplacedError
from .._function import FunctionSpec
from .._keepalive import LibraryHold, holding
from .._keys import KeySet, specialised_sizes
from .._mode import Mode
from .._params import ModuleWatch
from .._pool import Pool
from .._reach import Reach
from .._roots import function_roots
from .._signature import fn_name, module_of
from .._state import StateKeeper
from .._table import Entry, GraphTable, StaticBuffers
from .capturers import mode_capturers
from .context import device_of, device_scope, freeze_gc, progress
from .errors import as_capture_error
from .outputs import consistent_out_axes, infer_out_axes
from .prepare import Prepared

__all__ = ["CaptureSession"]

log = logging.getLogger("graphify")
MiB = 1 << 20


class CaptureSession:
    """Captures keys of one table for the function `spec` describes, called as `prepared`
    binds it; see the module docstring. `keys`: what may be captured (ahead of time every
    planned key; first use a structure's). `lockstep` (tensor parallelism): the ranks'
    agreement, recorded into each FULL graph under its "graph" policy. `weak_statics`
    (first use): hold static objects weakly."""

    def __init__(
        self, spec: FunctionSpec, prepared: Prepared, keys: KeySet, *, lockstep=None, weak_statics: bool = False,
    ):
        call, specs, example, backend = spec.call, prepared.specs, prepared.args, prepared.backend
        options, split = spec.options, spec.split
        try:
            self.device = device_of(specs)
        except CaptureError as exc:
            raise CaptureError(f"{call}: {exc}") from None
        backend.validate(call, self.device)
        self.call, self.fn, self.keys, self.specs = call, prepared.fn, keys, specs
        self.example, self.backend, self.library = tuple(example), backend, prepared.library
        self.pool = spec.pool if spec.pool is not None else Pool(fn_name(spec.fn))
        self.capturers = mode_capturers(
            backend, prepared.fn, prepared.twin, split, _lockstep_full(lockstep, prepared),
            specialised_sizes(options.compile_sizes, keys), whole=split is not None and spec.compiled is not None,
        )
        self.warmups, self.largest_first = options.warmups, options.largest_first
        self.weak_outputs = options.weak_outputs and backend.name == "cuda"
        self.out_axes = spec.out_axes if spec.out_axes is not None else ((split.out_axes if split is not None else None) or None)
        self.probe = prepared.layout.caller(split.fn) if split is not None else None
        self.uses_fft = split is not None and any(name.startswith("aten::_fft_") for name in split.op_names)
        # what the function reads besides its arguments; a split function's pieces are traced
        # ATen graphs, so what its closure held is baked in
        self.fn_roots = {} if split is not None else function_roots(spec.fn, fn_name(spec.fn))
        modules = [m for m in [module_of(spec.fn)] if m is not None]
        modules += [a for a, s in zip(example, specs) if s.axis.kind is Kind.STATIC and isinstance(a, torch.nn.Module)]
        self.table_fields = dict(
            layout=prepared.layout, watch=ModuleWatch(call, modules, full=options.full_checks),
            examples=tuple(a.detach().clone() if s.axis.kind is Kind.TOKENS else None for a, s in zip(example, specs)),
        )
        self.reach: tuple[Reach, ...] = ()  # (static objects', function's), as the graphs read them
        self.entries: dict = {}
        self.seen: set = set()  # modes whose first key is captured (it alone runs the full protocol)
        self.seconds = 0.0
        self.hold = LibraryHold()
        rows = {Kind.TOKENS: keys.max_tokens(), Kind.REQS: max((k.reqs_rows for _, k in keys.pairs()), default=1)}
        with device_scope(self.device), torch.no_grad():
            self.static = StaticBuffers.allocate(specs, example, rows, backend.empty)
            self.keeper = StateKeeper(options.restore_state, exclude=self.static.storages())
            self.handle = self.pool.handle_for(backend, self.device, call)
            self.stream = backend.new_stream(self.device)
            self.out_rule = infer_out_axes(prepared.fn, specs, example, self.out_axes)
        # First use holds static objects weakly (`WeakStatic`): each capture then reads them
        # from the call that needs it, and nothing here keeps a dropped cache alive.
        self.weak_statics = weak_statics
        if weak_statics:
            self.specs = specs = tuple(
                attrs.evolve(s, value=weaken(s.value)) if s.axis.kind is Kind.STATIC else s for s in specs
            )
            self.example = tuple(weaken(a) if s.axis.kind is Kind.STATIC else a for s, a in zip(specs, example))

    def _objects(self, args: Sequence[Any]) -> dict:
        """The static objects of a call: roots of the Python state a graph cannot follow."""
        return {s.name: a for s, a in zip(self.specs, args) if s.axis.kind is Kind.STATIC and not by_value(a)}

    # -- capture ----------------------------------------------------------------------------
    def capture(
        self, pairs, *, call_args: Sequence[Any] | None = None, dirty: list | None = None, quick: bool = False,
        collect: bool = True,
    ) -> GraphTable:
        """Capture `pairs` ((mode, key) in order) and return the table of every entry so far.
        With `call_args` (first use: one key), the call's own rows are copied into the static
        buffers first and the warm-ups run on them; `dirty` is the runtime's padding record.
        `quick`: capture with no warm-up and no op guard (first use, for a structure whose kin
        was captured before: the same code at other shapes). `collect`: run the garbage
        collector once before capturing."""
        start = time.perf_counter()
        done_before = len(self.entries)
        new: dict = {}
        try:
            with device_scope(self.device), torch.no_grad(), holding(self.hold, self.device, uses_fft=self.uses_fft):
                loaded = None
                example = self.example
                if call_args is not None:
                    (_, key), = pairs
                    loaded = self.static.load(self.specs, call_args, key, dirty)
                    example = tuple(call_args)
                elif self.weak_statics:
                    raise ValueError(f"{self.call}: a first-use session captures for a call (call_args)")
                objects = self._objects(example)
                reach = (Reach.walk(objects), Reach.walk(self.fn_roots, lengths=False))
                with freeze_gc(collect=collect):
                    for mode, key in progress(pairs, self.call, call_args is None):
                        sibling = self.entries.get((Mode.PIECEWISE, key.relaxed())) or new.get((Mode.PIECEWISE, key.relaxed()))
                        entry = self.capture_key(mode, key, example, sibling, loaded, quick)
                        new[mode, key] = self._weak_outputs(entry, objects) if self.weak_statics else entry
                        self.seen.add(mode)
                        self._unchanged(reach)
            entries = {**self.entries, **new}
            if self.out_axes is None:
                entries = consistent_out_axes(self.call, entries)
        except BaseException as exc:
            if self.device is not None and self.device.type == "cuda":  # warm-ups may still run on the side stream
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
            with contextlib.suppress(Exception):  # a failure between a run and its restore: undo what it wrote
                self.keeper.restore()
            self.keeper.forget()
            done = done_before + len(new)
            new.clear()  # release what this call captured; earlier entries stay
            traceback.clear_frames(exc.__traceback__)  # its frames hold capture-time tensors
            if self.device is not None and self.device.type == "cuda":
                self.pool.trim()
            if not isinstance(exc, Exception):
                raise
            raise as_capture_error(self.call, exc, done, done_before + len(pairs)) from exc
        self.entries = entries
        for entry in entries.values():
            self.pool.track(entry, f"{self.call} {entry.label}", entry.nbytes)
        self.reach = tuple(r.freeze() for r in reach)
        self.seconds += time.perf_counter() - start
        return self.table()

    def capture_key(self, mode: Mode, key, example: Sequence[Any], sibling, loaded, quick: bool) -> Entry:
        """Capture one key: the per-graph step. The first key of its mode in this table alone
        checks for in-place writes to arguments; the capturer decides what else it skips at
        later keys (`graphify.capture.capturers`). `sibling`: the PIECEWISE entry of the same
        token count, already captured, whose schedule warms a FULL capture up cheaply.
        `loaded`: what a first-use capture copied into the static buffers (the call's own
        rows), which the function must leave as they are; None: all padding. `quick`: no
        warm-up, no op guard (first use, code whose kin was captured before)."""
        first = mode not in self.seen
        args = self.static.args_for(self.specs, key, example)
        keeper = self.keeper
        t0 = time.perf_counter()
        try:
            captured = self.capturers[mode](
                args, key=key, pool=self.handle, warmups=self.warmups, weak_outputs=self.weak_outputs,
                stream=self.stream, keeper=keeper, probe=self.probe if keeper.enabled else None, first=first,
                sibling=sibling, quick=quick,
            )
            keeper.forget()
        except Exception as exc:
            exc.graphify_key = (mode, key)
            raise
        changed = self.static.changed(self.specs, loaded) if first and not quick else None
        if changed:
            raise CaptureError(
                f"{self.call}: the function writes to argument(s) {changed} in place; graphify copies padded "
                "arguments into static buffers, so such writes are lost: mark them persistent() or return the result"
            )
        flat, out_spec = pytree.tree_flatten(captured.outputs)
        return Entry(
            mode, key, captured.replay, captured.graph, tuple(flat), out_spec,
            self.out_rule(key.num_tokens, key.reqs_rows, flat), captured.nbytes, time.perf_counter() - t0,
            captured.sized,
        )

    def _unchanged(self, reach: tuple[Reach, ...]) -> None:
        """Raise if the run changed what the static objects or the closure hold (after
        putting it back): a graph cannot follow Python state or replaced tensors."""
        for r in reach:
            change = r.first_change()
            if change is None:
                continue
            r.restore()
            what, replaced = change
            if replaced:
                raise StateReplacedError(
                    f"{self.call}: each call replaces a tensor it reads through a static argument or the closure "
                    f"({what}); a graph reads the memory it captured and would go on reading the old tensor. "
                    + _REPLACED_ADVICE, replaced=True,
                )
            raise StateReplacedError(
                f"{self.call}: each call changes Python state of a static argument ({what}); a graph "
                "replays kernels, not Python, so that state would stop changing and the graphs would "
                "go stale. Keep such state in tensors updated in place (a transformers StaticCache's "
                "full-attention layers do; its sliding-window layers keep a Python counter, so give such "
                "a model a config without sliding windows), or leave this function ungraphified"
            )

    def _weak_outputs(self, entry, objects: dict):
        """`entry` with the static objects it returns (a model returning its cache) held
        weakly by the very references the specs hold (so `rebind` can swap both)."""
        held = {id(o): s.value for s in self.specs for o in objects.values()
                if isinstance(s.value, WeakStatic) and s.value() is o}
        if not any(id(t) in held for t in entry.flat_outputs):
            return entry
        return attrs.evolve(entry, flat_outputs=tuple(held.get(id(t), t) for t in entry.flat_outputs))

    def statics_alive(self) -> bool:
        """Whether every weakly held static object still exists (a call can still match)."""
        return all(s.value() is not None for s in self.specs if isinstance(s.value, WeakStatic))

    def rebind(self, objects: dict) -> None:
        """Hold `objects` ({argument name: new object}) in place of the static objects the
        graphs were captured with (first use adopted a new cache into their memory)."""
        held = {}
        specs = []
        for s in self.specs:
            if s.name in objects:
                held[id(s.value)] = weaken(objects[s.name])
                s = attrs.evolve(s, value=held[id(s.value)] if self.weak_statics else objects[s.name])
            specs.append(s)
        self.specs = tuple(specs)
        self.example = tuple(
            (weaken(objects[s.name]) if self.weak_statics else objects[s.name]) if s.name in objects else a
            for s, a in zip(self.specs, self.example)
        )
        self.entries = {
            k: attrs.evolve(e, flat_outputs=tuple(held.get(id(t), t) for t in e.flat_outputs))
            if any(id(t) in held for t in e.flat_outputs) else e
            for k, e in self.entries.items()
        }
        current = {s.name: objects[s.name] for s in self.specs if s.name in objects}
        self.reach = (Reach.walk(current).freeze(), self.reach[1] if len(self.reach) > 1 else Reach())

    def table(self) -> GraphTable:
        """The table of every entry captured so far (a new immutable value). Its `release()`
        drops its own references; the session's go with the session (or `abort()`)."""
        own = dict(self.entries)
        return GraphTable(
            types.MappingProxyType(own), _captured_keys(own, self.keys), self.specs, self.static,
            self.backend, self.pool, self.device, self.seconds, self.library, store=own,
            state_tensors=len(self.keeper.restored), state_bytes=self.keeper.peak_bytes, hold=self.hold,
            reach=tuple(r for r in self.reach if r), **self.table_fields,
        )

    def abort(self) -> None:
        """Release every graph of this session and what it holds (a failed `capture()`, a
        released callable): a kept exception's frames may still reference the session."""
        self.entries = {}
        self.static = self.keeper = self.example = None
        self.hold.release()
        if self.device is not None and self.device.type == "cuda":
            self.pool.trim()


_REPLACED_ADVICE = (
    "transformers' DynamicCache (generate()'s default) grows this way: pass cache_implementation=\"static\" "
    "to generate() (or a StaticCache as past_key_values), whose tensors are updated in place. Otherwise keep "
    "such state in tensors written in place, or leave this function ungraphified"
)


def _captured_keys(entries: dict, planned: KeySet) -> KeySet:
    """The keys `entries` hold, as a `KeySet` (what dispatch of a finished table reads)."""
    full = [k for (m, k) in entries if m is Mode.FULL]
    piecewise = [k for (m, k) in entries if m is Mode.PIECEWISE]
    if len(full) == len(planned.full) and len(piecewise) == len(planned.piecewise):
        return planned
    return KeySet(full, piecewise, planned.uniform_query_len)


def _lockstep_full(lockstep, prepared: Prepared):
    """`full_for(key) -> (fn, twin)`: what a FULL key records under tensor parallelism's
    "graph" policy, the ranks' agreement check on that key's code first; None otherwise."""
    if lockstep is None or not lockstep.in_graph:
        return None
    full = tuple(Mode).index(Mode.FULL)

    def full_for(key):
        code = graph_code(full, key.num_tokens, key.reqs_rows)
        return lockstep.checked(prepared.fn, code), lockstep.checked(prepared.twin, code)

    return full_for
