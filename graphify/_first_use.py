"""First-use capture: graphs captured when a call first needs them, as `jax.jit` compiles.

A callable that was never `capture()`d keeps, per *call structure*, a table that grows one
graph at a time. A structure is what a graph is specialised to apart from the batch: which
arguments and keywords are passed, each tensor's dtype, device and non-batch dimensions,
and the static values (plain values by equality, objects such as a cache by identity).

The policy, and its bounds:
- A structure is captured once it has **run eagerly in two consecutive calls** (the first
  is its warm-up, as torch's CUDA graph trees record after a warm-up run). A structure that
  does not repeat back to back, such as one prompt's prefill before a decode loop, keeps
  running eagerly and never costs a capture; a decode loop's second step is captured.
- Within a captured structure, a batch size with no graph yet is captured by the call that
  meets it (its warm-up on that call's own rows, outside state put back as `capture()`
  does), and replayed for that call and every later one.
- Sizes: with `sizes=` the batch pads to that schedule as usual (each size captured on
  first use); without, every batch size gets a graph of its own, unpadded (a model over a
  fixed-batch cache cannot be padded), up to 512 tokens and at most 64 graphs per
  structure; other batches run eagerly.
- At most 8 structures get graphs; calls of others run eagerly (logged once). Static
  objects (a cache) are held weakly: a structure whose object is gone (transformers makes
  a new StaticCache per generate() and drops the old one) is released, its graphs freed,
  when the next structure is made.
- Captured tables stay immutable values; a structure's runtime swaps in its new table
  under its lock, so concurrent calls see the old table or the new one, never a mix.

What first use costs the call that captures: a warm-up and the capture, about two eager
runs of the function (plus inductor compilation if `fn` is compiled). `capture(*example)`
captures every size ahead of time instead, largest first into one pool (less pool memory
than first use, which captures in the order calls come).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from ._axes import mismatch
from ._dispatch import Dispatcher
from ._errors import GraphifyError, InputMismatchError
from ._keys import KeySet, plan_keys
from ._prepare import prepare, session_args
from ._runtime import Runtime
from ._session import CaptureSession

__all__ = ["FirstUse", "MAX_STRUCTURES", "MAX_EXACT_GRAPHS", "EXACT_MAX_TOKENS"]

log = logging.getLogger("graphify")

MAX_STRUCTURES = 8
MAX_EXACT_GRAPHS = 64
EXACT_MAX_TOKENS = 512


@attrs.define(eq=False)
class _Structure:
    """One call structure with graphs: how calls bind, the runtime that replays, and the
    open capture session its table grows from."""

    layout: Any
    runtime: Runtime
    session: CaptureSession
    exact: bool
    graphs: int = 0
    full: bool = False  # exact sizes only: the graph bound is reached


@attrs.define(eq=False)
class _Pending:
    """The previous call, which ran eagerly: its structure, to compare the next call with."""

    layout: Any
    specs: tuple
    call: str


class FirstUse:
    """The first-use state of one `Graphified`; see the module docstring."""

    def __init__(self, owner):
        self.owner = owner
        self.lock = threading.Lock()
        self.structures: list[_Structure] = []
        self.pending: _Pending | None = None
        self.refused: list[_Pending] = []  # structures whose calls a graph cannot take as they are
        self.released = False
        self.warned = False

    # -- the call ---------------------------------------------------------------------------
    def call(self, args: tuple, kwargs: dict):
        if self.released:
            raise GraphifyError(
                f"{self.owner._call}: this callable's graphs were released (release()); use the callable "
                "release() returned"
            )
        for structure in tuple(self.structures):  # most recently used first
            try:
                slots = structure.layout.bind(args, kwargs)
                out = self.owner._run(structure.runtime, slots)
            except InputMismatchError:
                continue  # not this structure
            self.pending = None
            if self.structures[0] is not structure:
                with self.lock:
                    if structure in self.structures:
                        self.structures.remove(structure)
                        self.structures.insert(0, structure)
            return out
        return self._new_structure(args, kwargs)

    def _new_structure(self, args: tuple, kwargs: dict):
        owner = self.owner
        try:
            prepared = prepare(owner, args, kwargs)
        except (ValueError, TypeError, InputMismatchError):  # nothing to graph (no batch axis, ...)
            self.pending = None
            return owner._eager(args, kwargs)
        fn, twin, slots, specs, backend, library, layout = prepared
        if any(_fits(r, layout, slots) for r in self.refused):
            return owner._eager(args, kwargs)
        previous, self.pending = self.pending, _Pending(layout, specs, owner._call)
        if previous is None or not _fits(previous, layout, slots):
            return owner._eager(args, kwargs)  # a first sighting: its warm-up
        with self.lock:
            self._purge()
            found = _fitting(self.structures, args, kwargs)  # another thread may have made it meanwhile
            if found is not None:
                return owner._run(*found)
            if len(self.structures) >= MAX_STRUCTURES:
                if not self.warned:
                    self.warned = True
                    log.warning(
                        "%s: %d call structures already have graphs; calls of other structures run eagerly "
                        "(capture() the one you need, or call with fewer distinct shapes and keywords)",
                        owner._call, MAX_STRUCTURES,
                    )
                return owner._eager(args, kwargs)
            structure = self._open(prepared)
            self.structures.insert(0, structure)
        refused, self.pending = self.pending, None
        try:
            return owner._run(structure.runtime, slots)
        except InputMismatchError as exc:  # e.g. weights passed as tokens-axis arguments (default axes)
            with self.lock:
                if structure in self.structures:
                    self.structures.remove(structure)
                if len(self.refused) < MAX_STRUCTURES:
                    self.refused.append(refused)
            structure.runtime.release()
            structure.session.abort()
            log.warning("%s: these calls cannot be graphed as they are (%s); they run eagerly", owner._call, exc)
            return owner._eager(args, kwargs)

    def _open(self, prepared) -> _Structure:
        """A structure with an open session and an empty table; graphs come on first use."""
        owner = self.owner
        fn, twin, slots, specs, backend, library, layout = prepared
        exact = owner.sizes is None
        keys = owner.keys if not exact else _exact_keys(owner)
        session = CaptureSession(
            **session_args(owner, fn, twin, slots, specs, backend, library, layout, keys), weak_statics=True
        )
        table = session.table()
        structure = None

        def grow(decision, call_args):
            return self._grow(structure, decision, call_args)

        runtime = owner._runtime_for(table, Dispatcher(keys, owner.max_padding_ratio), grow=grow)
        structure = _Structure(layout, runtime, session, exact)
        return structure

    def _grow(self, structure: _Structure, decision, call_args: Sequence[Any]):
        """Capture the key `decision` names (runtime lock held); None past the bound."""
        if structure.exact and structure.graphs >= MAX_EXACT_GRAPHS:
            if not structure.full:
                structure.full = True
                log.warning(
                    "%s: %d graphs captured on first use for one call structure; batches of other sizes run "
                    "eagerly (pass sizes=... to pad to a schedule, or capture() ahead of time)",
                    self.owner._call, MAX_EXACT_GRAPHS,
                )
            return None
        runtime = structure.runtime
        table = structure.session.capture(((decision.mode, decision.key),), call_args=call_args, dirty=runtime.dirty)
        runtime.adopt(table)
        structure.graphs += 1
        return table.entries[decision.mode, decision.key]

    def _purge(self) -> None:
        """Release structures whose static objects are gone (a transformers cache that
        generate() dropped): no call can match them again (lock held)."""
        dead = [s for s in self.structures if not s.session.statics_alive()]
        for s in dead:
            self.structures.remove(s)
            s.runtime.release()
            s.session.abort()

    # -- the callable's other verbs ---------------------------------------------------------
    def current(self) -> _Structure | None:
        return self.structures[0] if self.structures else None

    def release(self) -> int:
        """Free every structure's graphs; later calls raise. Returns how many were freed."""
        self.released = True
        with self.lock:
            structures, self.structures = self.structures, []
        freed = 0
        for s in structures:
            freed += s.runtime.release()
            s.session.abort()
        return freed

    def summary(self) -> str:
        structures = tuple(self.structures)
        graphs = sum(len(s.runtime.table) for s in structures)
        mib = sum(s.runtime.table.nbytes for s in structures) / (1 << 20)
        seconds = sum(s.session.seconds for s in structures)
        return (
            f"; first use: {graphs} graphs over {len(structures)} call structure(s) in {seconds:.2f} s, "
            f"{mib:.1f} MiB reserved"
        )


def _exact_keys(owner) -> KeySet:
    """Every batch size up to `EXACT_MAX_TOKENS` as its own (unpadded) key."""
    return plan_keys(
        owner.resolution.mode, range(1, EXACT_MAX_TOKENS + 1), uniform_query_len=owner.uniform_query_len,
        max_num_reqs=owner.max_num_reqs, lora=owner.lora,
    )


def _fitting(structures, args: tuple, kwargs: dict):
    """(runtime, slots) of the first structure a call fits, checked without running it."""
    for structure in structures:
        try:
            slots = structure.layout.bind(args, kwargs)
            structure.runtime.rows_and_check(slots)
        except InputMismatchError:
            continue
        return structure.runtime, slots
    return None


def _fits(pending: _Pending, layout, slots: Sequence[Any]) -> bool:
    """Whether a call (bound by its own `layout` to `slots`) has `pending`'s structure."""
    if (layout.names, layout.kinds, layout.trees) != (pending.layout.names, pending.layout.kinds, pending.layout.trees):
        return False
    return all(mismatch(pending.call, spec, slots[spec.index]) is None for spec in pending.specs)

