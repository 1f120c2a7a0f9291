"""Capture for one call: a session held open for a first-use call structure.

First use (`graphify.first_use.first_use`) captures one key at a time, when a call first needs it,
warmed up on that call's own rows. What only it needs lives here, around a plain
`CaptureSession`:

- static objects (a transformers cache) are held weakly (`WeakStatic`), by the specs and by
  entries whose outputs return them, so nothing here keeps a dropped cache alive and each
  capture reads the objects of the call that needs it;
- the call's rows are loaded into the static buffers first (`load`), and the rows written
  are handed back so the runtime keeps its padding record right, whether or not the capture
  that follows succeeds;
- a new object of the same shapes can be rebound in place of the captured one after it took
  over its memory (`graphify.reads.takeover`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from graphify.base.axes import Kind, WeakStatic, weaken
from graphify.base.errors import CaptureError, StateReplacedError
from graphify.capture.spec import FunctionSpec
from graphify.plan.keys import KeySet
from graphify.reads.reach import Reach
from graphify.plan.table import GraphTable
from graphify.capture.prepare import Prepared
from graphify.capture.session import CaptureSession

__all__ = ["CallCapture"]

log = logging.getLogger("graphify")


class CallCapture:
    """A session for one call structure; see the module docstring."""

    def __init__(self, spec: FunctionSpec, prepared: Prepared, keys: KeySet, function=None, tiered: bool = False,
                 pools=None):
        session = self.session = CaptureSession(spec, prepared, keys, function=function, tiered=tiered, pools=pools)
        session.specs = tuple(
            attrs.evolve(s, value=weaken(s.value)) if s.axis.kind is Kind.STATIC else s for s in session.specs
        )
        session.example = tuple(weaken(a) if s.axis.kind is Kind.STATIC else a for s, a in zip(session.specs, session.example))

    @property
    def reach(self) -> tuple[Reach, ...]:
        """What the graphs read through the static objects and the closure."""
        return self.session.reach

    @property
    def seconds(self) -> float:
        return self.session.seconds

    def load(self, pair: tuple, args: Sequence[Any]) -> tuple[list, tuple]:
        """Copy the call `args`' rows into the static buffers for a capture of `pair` (mode,
        key): (what was loaded, for `capture`; rows written per (tier, buffer), for the
        runtime's padding record). Hold the runtime's `exclusive()` lock: the buffers are its too."""
        try:
            static = self.session.fit(pair[1])
        except torch.OutOfMemoryError as exc:  # a new tier of static buffers: a capture that cannot be made
            raise CaptureError(f"{self.session.label}: no device memory for the static input buffers of "
                               f"{pair[1]} ({exc})") from None
        return static.load(self.session.specs, args, pair[1])

    def capture(self, pair: tuple, args: Sequence[Any], loaded: list, *, quick: bool = False,
                collect: bool = True, plain: bool = False) -> GraphTable:
        """Capture `pair` warmed up on the call `args`, whose rows `load` put in the static
        buffers (`loaded`); returns the new table. Hold the runtime's `exclusive()` lock.
        `plain`: record the function as written, not compiled."""
        session = self.session
        session.capture((pair,), example=args, loaded=loaded, quick=quick, collect=collect, plain=plain)
        session.entries[pair] = self._weak_outputs(session.entries[pair], session.objects(args))
        return session.table()

    def capture_first_use(self, pair: tuple, args: Sequence[Any], loaded: list, *, kin: bool, collect: bool,
                          plain: bool) -> GraphTable:
        """`capture`, without warm-up where the structure's kin captured that key (`kin`;
        made again with the whole protocol if that fails)."""
        if kin:
            try:
                return self.capture(pair, args, loaded, quick=True, collect=collect, plain=plain)
            except StateReplacedError:
                raise
            except CaptureError as exc:
                log.info("%s: a capture without warm-up failed (%s); capturing with one", self.session.label, exc)
        return self.capture(pair, args, loaded, collect=collect, plain=plain)

    @property
    def written(self) -> "tuple | None":
        """What its recorded captures wrote outside the call (`graphify.capture.kin_writes`)."""
        return self.session.keeper.kin.own

    def carry(self, writes: "tuple | None") -> None:
        """What the structure this one's graphs replace wrote (`graphify.capture.kin_writes`):
        its captures' writes too, for its own kin."""
        kin = self.session.keeper.kin
        kin.carried = writes
        if writes is not None:
            kin.note(writes)

    @property
    def layout(self):
        """How calls bind to the argument slots (`graphify.base.call_layout.CallLayout`)."""
        return self.session.table_fields[0]

    def capture_args(self, pair: tuple, args: Sequence[Any]) -> tuple:
        """The arguments a capture of `pair` calls the function with (the static buffers at
        the key's rows, the call's objects): what a compile of that capture sees."""
        return self.session.fit(pair[1]).args_for(self.session.specs, pair[1], args)

    def _weak_outputs(self, entry, objects: dict):
        """`entry` with the static objects it returns (a model returning its cache) held
        weakly by the very references the specs hold (so `rebind` can swap both)."""
        held = {id(o): s.value for s in self.session.specs for o in objects.values()
                if isinstance(s.value, WeakStatic) and s.value() is o}
        if not any(id(t) in held for t in entry.flat_outputs):
            return entry
        return attrs.evolve(entry, flat_outputs=tuple(held.get(id(t), t) for t in entry.flat_outputs))

    def statics(self) -> tuple[WeakStatic, ...]:
        """The static objects its graphs were captured over, as held (weakly)."""
        return tuple(s.value for s in self.session.specs if isinstance(s.value, WeakStatic))

    def alive(self) -> bool:
        """Whether every weakly held static object still exists (a call can still match)."""
        return all(w() is not None for w in self.statics())

    def rebind(self, objects: dict) -> GraphTable:
        """Hold `objects` ({argument name: new object}) in place of the static objects the
        graphs were captured with (they took over those objects' memory); the new table."""
        session = self.session
        held = {}
        specs = []
        for s in session.specs:
            if s.name in objects:
                held[id(s.value)] = weaken(objects[s.name])
                s = attrs.evolve(s, value=held[id(s.value)])
            specs.append(s)
        session.specs = tuple(specs)
        session.example = tuple(
            weaken(objects[s.name]) if s.name in objects else a for s, a in zip(session.specs, session.example)
        )
        session.entries = {
            k: attrs.evolve(e, flat_outputs=tuple(held.get(id(t), t) for t in e.flat_outputs))
            if any(id(t) in held for t in e.flat_outputs) else e
            for k, e in session.entries.items()
        }
        current = {s.name: objects[s.name] for s in session.specs if s.name in objects}
        session.reach = (Reach.walk(current), session.reach[1] if len(session.reach) > 1 else Reach())
        return session.table()

    def abort(self) -> None:
        self.session.abort()
