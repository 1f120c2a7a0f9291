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
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from ._axes import WeakStatic, by_value, weaken
from ._capture import (
    _as_capture_error,
    _capture_one,
    _device_of,
    _device_scope,
    _progress,
    consistent_out_axes,
    freeze_gc,
    infer_out_axes,
)
from ._errors import CaptureError, StateReplacedError
from ._keepalive import LibraryHold, holding
from ._keys import KeySet
from ._mode import Mode
from ._reach import Reach
from ._state import StateKeeper
from ._table import GraphTable, StaticBuffers

__all__ = ["CaptureSession", "capture_table"]

log = logging.getLogger("graphify")
MiB = 1 << 20


class CaptureSession:
    """Captures keys of one table; see the module docstring. `table_fields` go to every
    `GraphTable` it returns as they are."""

    def __init__(
        self, *, call: str, fn: Callable, capturers: dict[Mode, Callable], keys: KeySet, specs: tuple,
        example: Sequence[Any], backend, pool, warmups: int, weak_outputs: bool, out_axes, progress: bool,
        largest_first: bool = True, library: str | None = None, restore_state: bool = True,
        probe: Callable | None = None, uses_fft: bool = False, weak_statics: bool = False,
        fn_roots: dict | None = None, **table_fields,
    ):
        try:
            self.device = _device_of(specs)
        except CaptureError as exc:
            raise CaptureError(f"{call}: {exc}") from None
        backend.validate(call, self.device)
        self.call, self.fn, self.capturers, self.keys, self.specs = call, fn, capturers, keys, specs
        self.example, self.backend, self.pool, self.library = tuple(example), backend, pool, library
        self.warmups, self.weak_outputs, self.out_axes = warmups, weak_outputs, out_axes
        self.progress, self.largest_first, self.probe, self.uses_fft = progress, largest_first, probe, uses_fft
        self.table_fields = table_fields
        self.fn_roots = fn_roots or {}  # what the function reads besides its arguments (closure, globals)
        self.reach: tuple[Reach, ...] = ()  # (static objects', function's), as the graphs read them
        self.entries: dict = {}
        self.seen: set = set()  # modes whose first key is captured (it alone runs the full protocol)
        self.seconds = 0.0
        self.hold = LibraryHold()
        rows = {"tokens": keys.max_tokens(), "reqs": max((k.reqs_rows for _, k in keys.pairs()), default=1)}
        with _device_scope(self.device), torch.no_grad():
            self.static = StaticBuffers.allocate(specs, example, rows, backend.empty)
            self.keeper = StateKeeper(restore_state, exclude=self.static.storages())
            self.handle = pool.handle_for(backend, self.device, call)
            self.stream = backend.new_stream(self.device)
            self.out_rule = infer_out_axes(fn, specs, example, out_axes)
        # First use holds static objects weakly (`WeakStatic`): each capture then reads them
        # from the call that needs it, and nothing here keeps a dropped cache alive.
        self.weak_statics = weak_statics
        if weak_statics:
            self.specs = specs = tuple(
                attrs.evolve(s, value=weaken(s.value)) if s.axis.kind == "static" else s for s in specs
            )
            self.example = tuple(weaken(a) if s.axis.kind == "static" else a for s, a in zip(specs, example))

    def _objects(self, args: Sequence[Any]) -> dict:
        """The static objects of a call: roots of the Python state a graph cannot follow."""
        return {s.name: a for s, a in zip(self.specs, args) if s.axis.kind == "static" and not by_value(a)}

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
            with _device_scope(self.device), torch.no_grad(), holding(self.hold, self.device, uses_fft=self.uses_fft):
                loaded = None
                example = self.example
                if call_args is not None:
                    (_, key), = pairs
                    loaded = self.static.load(self.specs, call_args, key, dirty)
                    example = tuple(call_args)
                elif self.weak_statics:
                    raise ValueError(f"{self.call}: a first-use session captures for a call (call_args)")
                objects = self._objects(example)
                reach = (Reach.record(objects), Reach.record(self.fn_roots, lengths=False))
                with freeze_gc(collect=collect):
                    for mode, key in _progress(pairs, self.call, self.progress and call_args is None):
                        first = mode not in self.seen
                        sibling = self.entries.get((Mode.PIECEWISE, key.relaxed())) or new.get((Mode.PIECEWISE, key.relaxed()))
                        entry = _capture_one(
                            self.call, self.capturers[mode], mode, key, self.specs, self.static, example,
                            self.handle, self.stream, self.warmups, self.weak_outputs, self.out_rule, self.keeper,
                            self.probe, first, sibling, loaded, quick,
                        )
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
            raise _as_capture_error(self.call, exc, done, done_before + len(pairs)) from exc
        self.entries = entries
        for entry in entries.values():
            self.pool.track(entry, f"{self.call} {entry.label}", entry.nbytes)
        self.reach = tuple(r.freeze() for r in reach)
        self.seconds += time.perf_counter() - start
        return self.table()

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
        self.reach = (Reach.record(current).freeze(), self.reach[1] if len(self.reach) > 1 else Reach())

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


def capture_table(**session_args) -> GraphTable:
    """Capture every planned key ahead of time (`Graphified.capture`); see the module
    docstring. Raises `CaptureError` naming the key that failed, with nothing kept."""
    try:
        session = CaptureSession(**session_args)
    except Exception as exc:  # out_axes that cannot be, a pool of another device, ...
        raise _as_capture_error(session_args["call"], exc, 0, len(session_args["keys"])) from exc
    try:
        table = session.capture(session.keys.pairs(session.largest_first))
    except BaseException:
        session.abort()  # a kept exception's frames reference the session: it must pin nothing
        raise
    if session.keeper.unrestorable:
        log.warning("%s: capture ran %s on outside tensors, which cannot be undone", session.call, sorted(session.keeper.unrestorable))
    log.info(
        "%s: captured %d graphs in %.2f s, %.1f MiB in pool %r",
        session.call, len(table), table.seconds, table.nbytes / MiB, session.pool.name,
    )
    return table
