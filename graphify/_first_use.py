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
- What a graph reads through a static object or the closure (`graphify._reach`) is checked
  before every replay. A call that replaces such a tensor (transformers' DynamicCache grows
  with torch.cat) runs eagerly, with one warning saying what to do; a structure whose
  objects changed between calls is dropped and its calls start over.

New objects of known shapes (transformers makes a new StaticCache in every generate()):
- A structure whose static objects are gone stays *idle* (at most `MAX_IDLE`, the most
  recently used). A call whose new object has exactly the shapes, types and plain values
  of an idle structure's (`graphify._takeover`) takes it over: the new object's tensors are
  copied into the memory the graphs read and the object is pointed at that memory, values
  unchanged. No capture, no warm-up: one copy of the cache.
- A new structure *kin* to one captured before (the same call with other static shapes, a
  cache of another length) is captured by its first call, at batch sizes its kin captured,
  with no warm-up and no op guard (the same code at other shapes); a capture that fails
  that way is made again with the whole protocol.

What first use costs the call that captures: a warm-up and the capture, about two eager
runs of the function (plus inductor compilation if `fn` is compiled). `capture(*example)`
captures every size ahead of time instead, largest first into one pool (less pool memory
than first use, which captures in the order calls come).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import attrs

from . import _calls
from ._axes import Kind, by_value
from ._errors import CaptureError, GraphifyError, InputMismatchError, StaleReachError, StateReplacedError
from ._function import FunctionSpec
from ._keys import KeySet, plan_keys
from ._reach import Reach
from ._runtime import Runtime
from ._stats import Stats
from ._structures import Pending, fits
from ._structures import family as family_of
from ._structures import signature as signature_of
from ._takeover import adoptable, owners, take_over
from .capture import CaptureSession, Prepared, prepare

__all__ = ["FirstUse", "MAX_STRUCTURES", "MAX_EXACT_GRAPHS", "EXACT_MAX_TOKENS", "MAX_IDLE"]

log = logging.getLogger("graphify")

MAX_STRUCTURES = 8
MAX_EXACT_GRAPHS = 64
EXACT_MAX_TOKENS = 512
MAX_IDLE = 2  # structures whose objects are gone, kept for a new object of the same shapes
MAX_STALE = 3  # structures of one kind dropped because their objects changed, before its calls run eagerly


@attrs.define(eq=False)
class _Structure:
    """One call structure with graphs: how calls bind, the runtime that replays, and the
    open capture session its table grows from. It is its runtime's `GraphSource`: a graph
    the runtime lacks is captured through `capture_for`, by the policy of `owner`."""

    owner: "FirstUse"
    layout: Any
    session: CaptureSession
    exact: bool
    family: tuple = ()  # what kin share (`_family`)
    signature: tuple = ()  # the family plus every shape and plain value: what a new object must match
    kin_keys: frozenset = frozenset()  # (mode, key) its kin captured: captured here with no warm-up
    owners: tuple = ()  # references to its objects' tensors after the last capture (`graphify._takeover`)
    graphs: int = 0
    full: bool = False  # exact sizes only: the graph bound is reached
    runtime: Runtime | None = None  # set once made (the runtime's source is this structure)

    def capture_for(self, decision, args: Sequence[Any]):
        """`GraphSource`: capture the key a call of this structure needs (lock held)."""
        return self.owner.grow(self, decision, args)

    def alive(self) -> bool:
        return self.session.statics_alive()

    def settle(self) -> None:
        """Count the references to the objects' tensors now that the tables moved on (the
        baseline `adoptable` compares with)."""
        if self.session.reach:
            self.owners = owners(self.session.reach[0])


class FirstUse:
    """The first-use state of one `Graphified`; see the module docstring."""

    def __init__(self, spec: FunctionSpec, stats: Stats):
        self.spec, self.stats = spec, stats
        self.lock = threading.Lock()
        self.structures: list[_Structure] = []
        self.pending: Pending | None = None
        self.refused: list[Pending] = []  # structures whose calls a graph cannot take as they are
        self.stale: dict = {}  # family -> structures dropped because their objects changed
        self.refused_families: list[tuple] = []  # kinds of calls that run eagerly (state a graph cannot follow)
        self.released = False
        self.warned = False
        self.warned_replaced = False
        self.collected = False  # the GC runs before the first capture only

    # -- the call ---------------------------------------------------------------------------
    def call(self, args: tuple, kwargs: dict):
        if self.released:
            raise GraphifyError(
                f"{self.spec.call}: this callable's graphs were released (release()); use the callable "
                "release() returned"
            )
        for structure in tuple(self.structures):  # most recently used first
            try:
                slots = structure.layout.bind(args, kwargs)
                out = _calls.run(structure.runtime, slots, self.stats)
            except InputMismatchError:
                continue  # not this structure
            except StaleReachError:  # its objects hold other tensors or values now: start over
                self._stale(structure)
                continue
            except StateReplacedError as exc:
                if not exc.replaced:
                    raise
                return self._refuse(structure, exc, args, kwargs)
            self.pending = None
            if self.structures and self.structures[0] is not structure:
                with self.lock:
                    if structure in self.structures:
                        self.structures.remove(structure)
                        self.structures.insert(0, structure)
            return out
        return self._new_structure(args, kwargs)

    def _eager(self, args: tuple, kwargs: dict):
        return _calls.eager(self.spec, self.stats, args, kwargs)

    def _new_structure(self, args: tuple, kwargs: dict):
        call = self.spec.call
        try:
            prepared = prepare(self.spec, args, kwargs)
        except (ValueError, TypeError, InputMismatchError):  # nothing to graph (no batch axis, ...)
            self.pending = None
            return self._eager(args, kwargs)
        slots, specs, layout = prepared.args, prepared.specs, prepared.layout
        if any(fits(r, layout, slots) for r in self.refused):
            return self._eager(args, kwargs)
        family = family_of(layout, specs)
        if family in self.refused_families:
            return self._eager(args, kwargs)
        with self.lock:
            self._purge()
            adopter = self._adopter(family, signature_of(layout, specs), specs, slots)
        if adopter is not None:
            return self.call(args, kwargs)  # served by the structure that took the new objects over
        # kin: the same call with new static objects (a new cache, maybe of another length)
        objects = any(s.axis.kind is Kind.STATIC and not by_value(s.value) for s in specs)
        kin = next((s for s in self.structures if s.family == family and s.graphs), None) if objects else None
        previous, self.pending = self.pending, Pending(layout, specs, call)
        if kin is None and (previous is None or not fits(previous, layout, slots)):
            return self._eager(args, kwargs)  # a first sighting: its warm-up
        with self.lock:
            found = _fitting(self.structures, args, kwargs)  # another thread may have made it meanwhile
            if found is not None:
                return _calls.run(*found, self.stats)
            if len(self.structures) >= MAX_STRUCTURES:
                if not self.warned:
                    self.warned = True
                    log.warning(
                        "%s: %d call structures already have graphs; calls of other structures run eagerly "
                        "(capture() the one you need, or call with fewer distinct shapes and keywords)",
                        call, MAX_STRUCTURES,
                    )
                return self._eager(args, kwargs)
            structure = self._open(prepared, family, signature_of(layout, specs), kin)
            self.structures.insert(0, structure)
        refused, self.pending = self.pending, None
        try:
            return _calls.run(structure.runtime, slots, self.stats)
        except InputMismatchError as exc:  # e.g. weights passed as tokens-axis arguments (default axes)
            self._drop(structure, refused)
            log.warning("%s: these calls cannot be graphed as they are (%s); they run eagerly", call, exc)
            return self._eager(args, kwargs)
        except StateReplacedError as exc:
            if not exc.replaced:
                self._drop(structure)
                raise
            return self._refuse(structure, exc, args, kwargs)

    def _open(self, prepared: Prepared, family: tuple, signature: tuple, kin: "_Structure | None") -> _Structure:
        """A structure with an open session and an empty table; graphs come on first use."""
        spec = self.spec
        exact = spec.sizes is None
        keys = spec.keys if not exact else _exact_keys(spec)
        session = CaptureSession(spec, prepared, keys, weak_statics=True)
        kin_keys = frozenset(kin.runtime.table.entries) | kin.kin_keys if kin is not None else frozenset()
        structure = _Structure(self, prepared.layout, session, exact, family, signature, kin_keys)
        structure.runtime = _calls.runtime_for(spec, session.table(), keys, source=structure)
        return structure

    def grow(self, structure: _Structure, decision, call_args: Sequence[Any]):
        """Capture the key `decision` names for `structure` (its runtime's lock held); None
        past the bound."""
        if structure.exact and structure.graphs >= MAX_EXACT_GRAPHS:
            if not structure.full:
                structure.full = True
                log.warning(
                    "%s: %d graphs captured on first use for one call structure; batches of other sizes run "
                    "eagerly (pass sizes=... to pad to a schedule, or capture() ahead of time)",
                    self.spec.call, MAX_EXACT_GRAPHS,
                )
            return None
        runtime, session = structure.runtime, structure.session
        pairs = ((decision.mode, decision.key),)
        collect, self.collected = not self.collected, True
        if (decision.mode, decision.key) in structure.kin_keys:
            try:
                table = session.capture(pairs, call_args=call_args, dirty=runtime.dirty, quick=True, collect=collect)
            except StateReplacedError:
                raise
            except CaptureError as exc:  # the quick way failed: the whole protocol decides
                log.info("%s: a capture without warm-up failed (%s); capturing with one", self.spec.call, exc)
                table = session.capture(pairs, call_args=call_args, dirty=runtime.dirty)
        else:
            table = session.capture(pairs, call_args=call_args, dirty=runtime.dirty, collect=collect)
        runtime.adopt(table)
        structure.graphs += 1
        structure.settle()
        return table.entries[decision.mode, decision.key]

    def _adopter(self, family: tuple, signature: tuple, specs, slots) -> "_Structure | None":
        """An idle structure that took over this call's new static objects (lock held)."""
        objects = {s.name: slots[s.index] for s in specs if s.axis.kind is Kind.STATIC and not by_value(slots[s.index])}
        if not objects:
            return None
        for structure in self.structures:
            if structure.signature != signature or structure.alive() or not structure.session.reach:
                continue
            new = Reach.walk(objects, snapshots=False)
            home = structure.session.reach[0]
            if not adoptable(home, structure.owners, new):
                continue
            take_over(home, new)
            del new, home
            session = structure.session
            session.rebind(objects)
            with structure.runtime.lock:
                structure.runtime.adopt(session.table())
            structure.settle()
            self.structures.remove(structure)
            self.structures.insert(0, structure)
            return structure
        return None

    def _purge(self) -> None:
        """Keep the `MAX_IDLE` most recently used structures whose static objects are gone
        (a transformers cache that generate() dropped), at the end; release the rest (lock
        held)."""
        idle = [s for s in self.structures if not s.alive()]
        for s in idle[MAX_IDLE:]:
            self.structures.remove(s)
            s.runtime.release()
            s.session.abort()
        for s in idle[:MAX_IDLE]:  # behind the live ones: calls try those first
            self.structures.remove(s)
            self.structures.append(s)

    def _drop(self, structure: _Structure, refused: "Pending | None" = None) -> None:
        """Release `structure`; with `refused`, later calls of its kind run eagerly."""
        with self.lock:
            if structure in self.structures:
                self.structures.remove(structure)
            if refused is not None and len(self.refused) < MAX_STRUCTURES:
                self.refused.append(refused)
        structure.runtime.release()
        structure.session.abort()

    def _stale(self, structure: _Structure) -> None:
        """A structure whose objects changed between calls: dropped; a kind that keeps
        changing (`MAX_STALE` times) runs eagerly from then on."""
        count = self.stale[structure.family] = self.stale.get(structure.family, 0) + 1
        self._drop(structure)
        if count >= MAX_STALE:
            self.refused_families.append(structure.family)
            log.warning(
                "%s: what the graphs read through a static argument or the closure changed between calls %d "
                "times; these calls run eagerly from now on", self.spec.call, count,
            )

    def _refuse(self, structure: _Structure, exc: StateReplacedError, args: tuple, kwargs: dict):
        """Calls of this kind replace what their graphs would read: they run eagerly from
        now on, with one warning."""
        self._drop(structure)
        self.refused_families.append(structure.family)
        if not self.warned_replaced:
            self.warned_replaced = True
            warnings.warn(f"{exc} (these calls run eagerly, without graphs)", stacklevel=4)
        return self._eager(args, kwargs)

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


def _exact_keys(spec: FunctionSpec) -> KeySet:
    """Every batch size up to `EXACT_MAX_TOKENS` as its own (unpadded) key."""
    batching = spec.batching
    return plan_keys(
        spec.resolution.mode, range(1, EXACT_MAX_TOKENS + 1), uniform_query_len=batching.uniform_query_len,
        max_num_reqs=batching.max_num_reqs, lora=batching.lora,
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
