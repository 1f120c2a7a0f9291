"""What makes calls one *structure* (first use captures per structure), as plain data.

A structure is what a graph is specialised to apart from the batch: the call's layout,
each tensor's dtype, device and non-batch shape, plain static values, static objects by
identity. Two looser notions help first use decide what a call costs: its *family* (the
same call with other non-batch shapes and other objects of the same types: a transformers
decode step with a cache of another length) and its *likeness* (the family with every
shape fixed: what a new object must match to take over a structure's graphs).
"""

from __future__ import annotations

import collections

from collections.abc import Sequence
from typing import Any

import attrs

from graphify.base.axes import Kind, by_value, mismatch
from graphify.base.errors import REPLACED_ADVICE

__all__ = ["DRIFTS_BEFORE_WARNING", "Pending", "after_drift", "drift_warning", "family_of", "likeness_of", "fits",
           "first_sighting"]


# calls in a row whose shapes moved from the previous call's before one warning says why they run
# eagerly (a prefill then decode steps moves once; a mask growing with a DynamicCache moves every call)
DRIFTS_BEFORE_WARNING = 3
# first sightings of calls over no static object remembered: a call of a structure met among them
# is captured, not run eagerly again (shapes that come back, but not in a row: images at two sizes, an encoder's padded
# lengths); a call met once, never again (a prompt's prefill), stays eager
RECENT_SIGHTINGS = 16


@attrs.define(eq=False)
class Pending:
    """The previous call, which ran eagerly: its structure, to compare the next call with;
    `drifts`: how many calls in a row up to it moved a shape from the call before (`after_drift`)."""

    layout: Any
    specs: tuple
    label: str
    family: tuple = ()
    drifts: int = 0
    drift: str = ""  # what moved last
    step: tuple = ()  # how it moved: (argument, (dimension, change), ...)


@attrs.define(eq=False)
class Sightings:
    """The previous call, which ran eagerly (`pending`), and the recent first sightings of
    calls over no static object (`recent`: none of them keeps a cache alive)."""

    pending: Pending | None = None
    recent: collections.deque = attrs.field(factory=lambda: collections.deque(maxlen=RECENT_SIGHTINGS))

    def note(self, pending: Pending, objects: dict) -> None:
        self.pending = pending
        if not objects:  # a call over objects (a cache) finds its kin instead
            self.recent.append(pending)

    def met(self, layout, slots: Sequence[Any]) -> bool:
        """Whether a call of this structure ran eagerly just before, or among the recent ones."""
        return any(fits(p, layout, slots) for p in (self.pending, *self.recent) if p is not None)


def after_drift(previous: Pending | None, pending: Pending, slots: Sequence[Any]) -> Pending:
    """`pending` (a call of no structure, run eagerly), counting the calls in a row whose
    shapes moved from the previous one's by the same step: a call whose shapes grow every time
    (a mask that grows with a growing cache) never repeats its structure, so it never gets
    graphs. Shapes that move back and forth (images at two sizes, an encoder's requests of
    every length) repeat, and get graphs once they do."""
    drift = _shape_drift(previous, pending.family, slots)
    if drift is not None:
        pending.drift, pending.step = drift
        pending.drifts = previous.drifts + 1 if previous.step in ((), pending.step) else 1
    return pending


def drift_warning(pending: Pending, holds_objects: bool) -> str:
    """Why calls whose shapes move every call run eagerly, and what to do."""
    advice = (" " + REPLACED_ADVICE) if holds_objects else (
        ": keep those shapes fixed (pad to a fixed length), or leave this function ungraphified")
    return (f"{pending.label}: a shape outside the batch axis changes on every call ({pending.drift}), so no two "
            "calls in a row share a call structure and these calls run eagerly, without graphs (a graph keeps "
            f"every shape it was captured with){advice}")


def _shape_drift(pending: Pending | None, family: tuple, slots: Sequence[Any]) -> tuple[str, tuple] | None:
    """What changed from the previous call (`pending`) to a call of the same family (the same
    call with other non-batch shapes), and by what step; None where the families differ."""
    if pending is None or pending.family != family:
        return None
    for spec in pending.specs:
        if spec.axis.kind is not Kind.STATIC:
            wrong = mismatch(pending.label, spec, slots[spec.index])
            if wrong is not None:
                arg = slots[spec.index]
                shape = tuple(getattr(arg, "shape", ()))
                first = 1 if spec.axis.kind.padded else 0  # the batch axis moves freely
                step = tuple((d, a - b) for d, (a, b) in enumerate(zip(shape, spec.shape)) if d >= first and a != b)
                return str(wrong).removeprefix(f"{pending.label}: "), (spec.index, step)
    return None


def family_of(layout, specs) -> tuple:
    """What calls of one kind share apart from shapes and object identity: the call's
    layout, each argument's axis, dtype, device and rank, plain static values, and the
    types of static objects."""
    return (layout.names, layout.kinds, layout.trees) + tuple(
        (s.axis.kind, s.value if by_value(s.value) else type(s.value)) if s.axis.kind is Kind.STATIC
        else (s.axis.kind, s.dtype, s.device, len(s.shape))
        for s in specs
    )


def likeness_of(layout, specs) -> tuple:
    """`family_of` plus every non-batch shape and persistent address: a call this like a
    structure's, with objects of the same skeleton, can replay its graphs."""
    return family_of(layout, specs) + tuple(
        (s.trailing, s.data_ptr) for s in specs if s.axis.kind is not Kind.STATIC
    )


def fits(pending: Pending, layout, slots: Sequence[Any]) -> bool:
    """Whether a call (bound by its own `layout` to `slots`) has `pending`'s structure."""
    if (layout.names, layout.kinds, layout.trees) != (pending.layout.names, pending.layout.kinds, pending.layout.trees):
        return False
    return all(mismatch(pending.label, spec, slots[spec.index]) is None for spec in pending.specs)


def first_sighting(first_use, prepared, family: tuple, objects: dict, takeover: bool = True) -> bool:
    """Whether a call of no structure yet (first use's `prepared` call, of `family`, over the
    static `objects`) runs eagerly as a first sighting: its structure's warm-up, the caller then
    making it `first_use.seen.pending`. Not where another call may take it further: a structure of
    its family has graphs (a kin), compiled graphs replace its kind, the previous call or one
    of the recent first sightings (`first_use.seen`) was of its structure, or (`takeover`: asked before the walk of its objects, a cache's every layer,
    which only a capture or a take-over needs) an idle structure as like it may take its objects
    over. A prompt's prefill is one in every generate(). (Structures are read without the lock:
    one added meanwhile only sends the call the longer way, which looks again under it.)"""
    layout, specs, slots = prepared.layout, prepared.specs, prepared.args
    if objects:
        likeness = likeness_of(layout, specs) if takeover else None
        if any(s.family == family and s.graphs or takeover and s.likeness == likeness and not s.alive()
               for s in tuple(first_use.structures)):
            return False
    if first_use.jobs is not None and first_use.jobs.replaced(family):
        return False
    return not first_use.seen.met(layout, slots)
