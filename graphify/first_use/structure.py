"""A first-use call structure with graphs, and the branches its Python state takes.

A structure (`graphify.first_use.kinds`) gets one table of graphs per *branch*: what the Python
state of the registered types it reaches (`graphify.reads.stateful_types`) decides for a call. A
structure that reaches none has one branch, `()`. Each branch holds a capture open for its
graphs (`graphify.capture.CallCapture`) and a runtime that replays them; all branches read
the same objects, so a new object of the same shapes takes over all of them at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import attrs

from graphify.distributed.lockstep import TEARDOWNS
from graphify.base.errors import InputMismatchError
from graphify.reads.reach import Reach
from graphify.call.runtime import Runtime
from graphify.reads.stateful_types import owned_values, put_owned
from graphify.reads.takeover import can_take_over, owners, take_over
from graphify.capture import CallCapture

__all__ = [
    "Branch", "CallStructure", "NO_STATE", "branch_of", "fitting", "take_over_idle",
]

NO_STATE: tuple = ()  # the branch of a structure that reaches no registered type


def branch_of(stateful: Sequence, names: Sequence[str], slots: Sequence[Any]) -> Hashable | None:
    """The branch a call (`slots` by parameter `names`) takes through the registered objects
    `stateful` ((object, StateType, path) each): one key per object, or None where any says
    a graph cannot stand in for the call."""
    if not stateful:
        return NO_STATE
    return _step(stateful, dict(zip(names, slots)), True, False)[0]


def _step(stateful: Sequence, call: dict, branches: bool, predict: bool) -> tuple:
    """(the branch key, or None; the predicted state, (object, attribute names, values) per
    object) in one pass, each type's `per_call` computed once per run of its objects."""
    key, predicted = [], []
    last = seen = branch = after = owns = None
    for obj, st, _ in stateful:
        if st is not last:
            last, seen, branch, after, owns = st, st.given(call), st.branch, st.after, st.owns
        if branches:
            key.append(branch(obj, seen))
        if predict:
            predicted.append((obj, owns, tuple(after(obj, seen))))
    return (tuple(key) if branches and None not in key else None), predicted


@attrs.define(eq=False)
class Branch:
    """The graphs of one branch: its capture, its runtime, what it captured and refused."""

    key: Any  # what the structure's Python state decides (`NO_STATE` where it reaches none)
    capture: CallCapture
    runtime: Runtime
    graphs: int = 0
    at_limit: bool = False  # exact sizes only: `MAX_EXACT_GRAPHS` reached (warned once)
    uncapturable: set = attrs.field(factory=set)  # (mode, key) whose capture failed: their calls run eagerly
    waiting: dict = attrs.field(factory=dict)  # (mode, key) captured plain -> the ticket of its compile
    changed_once: set = attrs.field(factory=set)  # (mode, key) whose capture changed Python state once

    def release(self) -> int:
        freed = self.runtime.table.release()
        self.runtime.forget()
        self.capture.abort()
        return freed


@attrs.define(eq=False)
class CallStructure:
    """One call structure with graphs: how calls bind, its branches (the most recently opened
    first: `default` is the newest, not the most used), and what first use needs to decide
    about new objects and kin."""

    layout: Any
    branches: dict  # branch key -> Branch
    exact: bool  # every batch size its own graph (no `sizes=`)
    family: tuple = ()  # what kin share (`graphify.first_use.kinds.family_of`)
    likeness: tuple = ()  # the family plus every shape and plain value: what a new object must match
    kin_keys: frozenset = frozenset()  # (branch, mode, key) its kin captured: captured here with no warm-up
    stateful: tuple = ()  # (object, StateType, path) of the registered types its objects reach
    owners: tuple = ()  # references to its objects' tensors after the last capture (`graphify.reads.takeover`)
    follows_state: bool = True  # False once a StateType mispredicted an eager run: calls run eagerly
    teardowns: int = attrs.field(factory=lambda: TEARDOWNS[0])  # process-group teardowns seen

    @property
    def default(self) -> Branch:
        return next(iter(self.branches.values()))

    @property
    def runtime(self) -> Runtime:
        return self.default.runtime

    @property
    def capture(self) -> CallCapture:
        return self.default.capture

    @property
    def graphs(self) -> int:
        return sum(b.graphs for b in self.branches.values())

    def alive(self) -> bool:
        return self.default.capture.alive()

    def writes(self) -> tuple | None:
        """What its captures wrote outside the call (`graphify.capture.kin_writes`), where it
        has one branch; else None."""
        return self.default.capture.written if len(self.branches) == 1 else None

    def known_keys(self) -> frozenset:
        """(branch, (mode, key)) captured here or by its kin: what a kin of it captures with
        no warm-up."""
        return self.kin_keys | {(key, pair) for key, b in self.branches.items() for pair in b.runtime.table.entries}

    def settle(self) -> None:
        """Count the references to the objects' tensors now that the tables moved on (the
        baseline `graphify.reads.takeover.can_take_over` compares with)."""
        if self.capture.reach:
            self.owners = owners(self.capture.reach[0])

    def rebind(self, objects: dict) -> None:
        """After a takeover: every branch holds `objects`, and the registered types are the
        new objects' (hold no runtime lock: each branch's is taken in turn)."""
        for branch in self.branches.values():
            with branch.runtime.exclusive():
                branch.runtime.install(branch.capture.rebind(objects))
        self.stateful = tuple(self.capture.reach[0].stateful) if self.capture.reach else ()

    def release(self) -> int:
        return sum(b.release() for b in self.branches.values())

    def torn_down(self) -> bool:
        """Whether a process group's teardown released its graphs (graphify.distributed.lockstep:
        graphs that may launch its collectives must go with it); its calls then capture anew.
        One compare a call until a teardown happens."""
        if self.teardowns == TEARDOWNS[0]:
            return False
        self.teardowns = TEARDOWNS[0]
        return any(b.runtime.table.released for b in self.branches.values())

    # -- the Python state its graphs follow ------------------------------------------------
    def step(self, names: Sequence[str], slots: Sequence[Any]) -> tuple:
        """(the branch a call takes, None where a graph cannot stand in for it; the state
        predicted after it, (object, attribute names, values) per registered object)."""
        return _step(self.stateful, dict(zip(names, slots)), self.follows_state, True)

    def advance(self, predicted: list) -> None:
        """What a replay leaves the Python state as: the values `step` predicted."""
        put_owned(predicted)

    def verify(self, predicted: list) -> str | None:
        """After an eager run: None if the state is as predicted, else what differs."""
        for obj, names, values in predicted:
            now = owned_values(obj, names)
            if now != values:
                return f"{type(obj).__name__}.{names} is {now} after a call, predicted {values}"
        return None


# -- finding a call's structure ----------------------------------------------------------------
def fitting(structures, args: tuple, kwargs: dict) -> "CallStructure | None":
    """The first structure a call fits, checked without running it."""
    for structure in structures:
        try:
            structure.runtime.rows_and_check(structure.layout.bind(args, kwargs))
        except InputMismatchError:
            continue
        return structure
    return None


def take_over_idle(structures, likeness: tuple, objects: dict) -> "CallStructure | None":
    """An idle structure (its objects gone) that took over a call's new static `objects`
    (`graphify.reads.takeover`): their tensors moved into the memory its graphs read, every branch
    rebound to them. None where none can."""
    if not objects:
        return None
    for structure in structures:
        if structure.likeness != likeness or structure.alive() or not structure.capture.reach:
            continue
        new = Reach.walk(objects)
        held = structure.capture.reach[0]
        if not can_take_over(held, structure.owners, new):
            continue
        take_over(held, new)
        del new, held
        structure.rebind(objects)
        structure.settle()
        return structure
    return None

