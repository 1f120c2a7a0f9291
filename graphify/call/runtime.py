"""A table's runtime: check arguments, dispatch, copy into static buffers, replay, cut outputs.

This is the only per-call code, so it is written for host speed: argument checks are
precomputed tuples, dispatch is one list index, all copies (real rows and padding rows)
go through one `torch._foreach_copy_`, and each (graph, real size) pair caches its copy
plan and its cut output views.

A runtime serves one table and never captures. A call whose graph the table lacks comes
back as a `Miss` (what was asked, for which rows, with which arguments); the layer above
(first use) decides whether to capture it and installs the new table with `install`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from operator import is_
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from graphify.call.arg_checks import ArgChecks
from graphify.base.axes import Kind, WeakStatic
from graphify.distributed.agreement import agreement_for
from graphify.plan.dispatch import Decision, Dispatcher
from graphify.base.errors import GraphifyError, InputMismatchError
from graphify.call.hand_out import HandOut
from graphify.call.shared_calls import SharedCalls
from graphify.base.modes import Mode
from graphify.base.boxing import has_boxes, unbox
from graphify.plan.stats import Stats
from graphify.plan.table import Entry, GraphTable

__all__ = ["Runtime", "Miss", "CallRules", "Plan"]

_NONE = Mode.NONE
MAX_PLANS = 4096  # (graph, tokens, requests) plans kept; beyond it the cache starts over


@attrs.frozen(eq=False)
class Miss:
    """A call whose graph the table lacks: the dispatch `decision`, the call's real token
    rows, and its bound arguments (torch tensors)."""

    decision: Decision
    tokens: int
    args: tuple


@attrs.frozen(eq=False)
class CallRules:
    """Per-call predicates (`Batching.uniform`, `Batching.has_lora`, `Options.allow_full`)
    and the uniform query length a uniform batch has without them."""

    uniform: Callable[..., bool] | None = None
    has_lora: Callable[..., bool] | None = None
    allow_full: Callable[..., bool] | None = None
    query_len: int = 1

    @property
    def shapes_only(self) -> bool:
        """Whether a call's graph follows from its shapes alone (no predicate to run)."""
        return self.uniform is None and self.has_lora is None and self.allow_full is None


@attrs.frozen(eq=False)
class Plan:
    """Everything one (graph, real tokens, real requests) call needs, precomputed.

    `inputs` holds (argument index, destination view, its data_ptr) for every copied
    argument; `pads` holds ((tier, slot), buffer, padding, real rows) per padded buffer
    (`graphify.plan.static_buffers`)."""

    inputs: tuple
    pads: tuple
    replay: Callable[[], None]
    outputs: list
    out_spec: Any
    single: bool
    padded: int
    aliases: tuple = ()  # (output index, alias maker) per tensor output, for checked views
    boxed: bool = False  # the outputs hold dataclasses to rebuild (graphify.base.boxing)
    weak: tuple = ()  # indices of outputs that are weakly held static objects (a returned cache)

    def result(self, outputs: list):
        """The call's return value in the function's own structure."""
        if self.weak:
            outputs = list(outputs)
            for i in self.weak:
                outputs[i] = outputs[i]()
        if self.single:
            return outputs[0]
        tree = pytree.tree_unflatten(outputs, self.out_spec)
        return unbox(tree) if self.boxed else tree


@attrs.define(eq=False)
class _StaticCall:
    """The tuple `static_inputs()` handed out, with what a call with exactly it needs (its
    plan, learnt on the first such call, is kept with the others under `STATIC_PLAN`)."""

    args: tuple
    tokens: int | None
    reqs: int | None
    clean: bool = False  # no other call since the last one with the tuple


STATIC_PLAN = "static"  # the plans' key of (plan, mode, tokens) for calls with the static tuple


class Runtime:
    """Per-table call machinery. Calls are serialised by a lock: static buffers and
    outputs are shared, so two threads must never interleave copy and replay."""

    def __init__(self, label: str, fn: Callable, table: GraphTable, dispatcher: Dispatcher, rules: CallRules,
                 hand_out: HandOut, shared: "SharedCalls | None" = None):
        self.label, self.fn, self.dispatcher, self.rules, self.hand_out = label, fn, dispatcher, rules, hand_out
        # `own`: this runtime's static buffers, plans and padding record, held by its calls and
        # captures; `shared`: the call lock (copy → replay → hand-out), capture lock and stream
        # order, the other runtimes' too where its graphs share their pool (`graphify.call.shared_calls`)
        self.own, self.shared = threading.RLock(), shared if shared is not None else SharedCalls()
        self.agreement = agreement_for(table.lockstep)
        self.static_call: _StaticCall | None = None
        self.replayed = 0  # graph replays so far: the layer above tells a replayed call from an eager one
        self._serve(table)
        # Rows of each padded buffer ((tier, slot)) that may hold real data; rows past it hold
        # padding. Padding is copied in only where a smaller batch follows a larger one.
        self.dirty: dict[tuple[int, int], int] = {}

    def _serve(self, table: GraphTable) -> None:
        self.table = table
        self.plans = table.holdings.plans  # the table's: released with its graphs
        self.checks = ArgChecks(self.label, table.specs)
        self.rows_and_check = self.checks.rows  # bound once: the hot path calls it directly

    # -- the call -------------------------------------------------------------------------
    def run(self, args: Sequence[Any], stats: Stats, checked: tuple | None = None):
        """A call's bound arguments: its result, or a `Miss` where the table lacks its graph.
        `checked`: (an `ArgChecks`, what its `rows(args)` gave) where the caller ran them on
        these very arguments; not run again if they are this table's."""
        static, table = self.static_call, self.table
        trusted = static is not None and len(args) == len(static.args) and all(map(is_, args, static.args))
        table.reads.guard(() if trusted else args)  # static_inputs()'s buffers never require grad
        learnt = self.plans.get(STATIC_PLAN) if trusted else None
        if learnt is not None:
            plan, mode, n = learnt
            with self.own, self.shared.lock:
                return self._replay(plan, mode, n, [], [], stats)
        if static is not None:
            static.clean = False  # this call may write rows past the static tuple's
        if trusted:  # exactly the tuple static_inputs() handed out: our own views, checked then
            n, r = static.tokens, static.reqs
        else:
            if len(args) != len(table.specs):
                raise InputMismatchError(f"{self.label}: expected {len(table.specs)} arguments as captured, got {len(args)}")
            n, r = checked[1] if checked is not None and checked[0] is self.checks else self.rows_and_check(args)
        if n is None:
            n = r
        if n == 0:  # an empty batch: what eager returns, no graph
            return self._eager(args, 0, stats)
        decision = self._decide(args, n, r)
        if decision.mode is not _NONE and table.released:  # before any collective: the others must not wait
            raise self._released()
        if self.agreement is not None and self.agreement.needed(decision.mode):
            self.agreement.before(decision, n, r)
        if decision.mode is _NONE:
            return self._eager(args, n, stats)
        return self._graphed(args, decision, n, n if r is None else r, trusted, stats)

    def _decide(self, args: Sequence[Any], n: int, r: int | None) -> Decision:
        rules = self.rules
        if rules.shapes_only:
            return self.dispatcher.lookup(n, rules.query_len == 1 if r is None else n == r * rules.query_len)
        uniform = bool(rules.uniform(*args)) if rules.uniform is not None else (
            rules.query_len == 1 if r is None else n == r * rules.query_len)
        has_lora = bool(rules.has_lora(*args)) if rules.has_lora is not None else False
        full_ok = bool(rules.allow_full(*args)) if rules.allow_full is not None else True
        return self.dispatcher.lookup(n, uniform, has_lora, full_ok)

    def _eager(self, args: Sequence[Any], n: int, stats: Stats):
        with self.shared.lock:
            stats.tally(_NONE, n, None)
        return self.fn(*args)

    def _graphed(self, args, decision: Decision, n: int, r: int, trusted: bool, stats: Stats):
        """A call that replays the graph `decision` names (a `Miss` if the table lacks it)."""
        plan_key = (id(decision), n, r)  # decisions are unique objects of the dispatcher
        with self.own, self.shared.lock:
            reads = self.table.reads
            if reads.reach and reads.stale():
                raise reads.stale_error(self.label)  # never replay (nor grow) graphs over memory objects no longer hold
            plan = self.plans.get(plan_key)
            if plan is None:
                entry = self.table.entries.get((decision.mode, decision.key))
                if entry is None:
                    return Miss(decision, n, tuple(args))
                if len(self.plans) >= MAX_PLANS:  # many distinct (tokens, requests) pairs: bound the cache
                    self.plans.clear()
                plan = self.plans[plan_key] = self._plan(entry, n, r)
            dsts, srcs = [], []
            if trusted and all(args[i].data_ptr() == ptr for i, _, ptr in plan.inputs):  # the graph's own buffers
                if self.rules.shapes_only and (self.agreement is None or not self.agreement.needed(decision.mode)):
                    self.plans[STATIC_PLAN] = (plan, decision.mode, n)  # the same plan serves every later call
            else:
                for i, view, ptr in plan.inputs:
                    a = args[i]
                    if a.data_ptr() != ptr:  # an argument that already is the static view needs no copy
                        dsts.append(view)
                        srcs.append(a)
            return self._replay(plan, decision.mode, n, dsts, srcs, stats, checked=True)

    def _replay(self, plan: Plan, mode: Mode, n: int, dsts: list, srcs: list, stats: Stats, checked: bool = False):
        """The tail every graphed call shares (lock held): what graphs read checked (unless
        `checked`), inputs and padding copied in, the graph replayed, the call counted,
        outputs handed out."""
        reads = self.table.reads
        if not checked and reads.reach and reads.stale():
            raise reads.stale_error(self.label)
        shared = self.shared
        if shared.cuda:  # after the last call's hand-out, where it ran on another stream
            shared.order()
        static = self.static_call
        if dsts or static is None or not static.clean:  # after a call with the static tuple, nothing moved
            self._restore_padding(plan, dsts, srcs)
            if static is not None:
                learnt = self.plans.get(STATIC_PLAN)
                static.clean = learnt is not None and learnt[0] is plan
        try:
            plan.replay()
            self.replayed += 1
            stats.tally(mode, n, plan.padded)
            return plan.result(self.hand_out(plan))
        finally:
            if shared.cuda:  # what the next call on another stream waits for: this one's copies out
                shared.mark()

    def _restore_padding(self, plan: Plan, dsts: list, srcs: list) -> None:
        """Copy the inputs in `dsts`/`srcs`, plus padding wherever a larger batch left real
        rows past this one's, in one `_foreach_copy_`."""
        dirty = self.dirty
        for slot, buffer, pad, real in plan.pads:
            held = dirty.get(slot, 0)
            if held > real:  # a larger batch left data past this one: restore padding there
                dsts.append(buffer[real:held])
                srcs.append(pad[real:held])
            dirty[slot] = real
        if dsts:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    torch._foreach_copy_(dsts, srcs)
            else:
                torch._foreach_copy_(dsts, srcs)

    def _released(self) -> GraphifyError:
        return GraphifyError(
            f"{self.label}: this callable's graphs were released (release()); use the callable "
            "release() returned and capture it again"
        )

    # -- the table it serves ------------------------------------------------------------------
    def exclusive(self):
        """Held, no call of this runtime runs: hold it to write its static buffers or
        `install` a table (a takeover's rebinding; a capture holds `capturing()`)."""
        return self.own

    @contextlib.contextmanager
    def capturing(self, whole: bool = True):
        """Held by a first-use capture into this runtime's table (which writes its static
        buffers, then `install`s the table that results): where the pool is shared, its
        captures one at a time; `exclusive()`; and the caller's stream ordered after the last
        replay's (`SharedCalls.order`). The shared call lock is held throughout where `whole`
        (a split function: its split ops, piece warm-ups and schedule replays run in the
        pool's blocks) or where the pool's captures put back state outside the call, or may
        (`SharedCalls.restores`: a warm-up's restore would undo other calls' writes made
        meanwhile); otherwise only for that order: warm-ups (compiles included) run outside
        the pool and a capture runs nothing, so other structures' calls go on meanwhile."""
        shared = self.shared
        with shared.captures, self.own:  # (one waiting for another's capture holds off none of its calls)
            before, whole = self.table, whole or shared.restores is not False
            if not whole:  # only ordered after the last replay; calls go on meanwhile
                with shared.lock:
                    if shared.cuda:
                        shared.order()
            with shared.window() if whole else contextlib.nullcontext():  # (the pool's window, throughout)
                yield
            if self.table is not before:  # a capture installed: whether its captures restore, learnt
                shared.restores = bool(shared.restores) or self.table.report.restores

    def install(self, table: GraphTable) -> None:
        """Serve calls from `table` (hold `exclusive()`): a first-use capture's new table.
        Cached plans go: output axes may have been re-read across the sizes. (Only this
        runtime's calls read its table: the shared call lock is not needed.)"""
        self._serve(table)  # its own, empty plans
        self.static_call = None

    def wrote(self, written: "dict[tuple[int, int], int]") -> None:
        """Note that a call's data now fills `written[(tier, slot)]` rows of that static
        buffer (hold `exclusive()`): a first-use capture loaded them, so later smaller
        batches restore padding there."""
        for slot, rows in written.items():
            self.dirty[slot] = max(self.dirty.get(slot, 0), rows)
        self.static_call = None

    def forget(self) -> None:
        """Drop every cached plan and the static tuple (the graphs being released)."""
        self.plans.clear()
        self.static_call = None

    def _plan(self, entry: Entry, n: int, r: int) -> Plan:
        inputs, pads = [], []
        static, key = self.table.static, entry.key
        tier = static.tier_of(key.num_tokens, key.reqs_rows) if static.tiers else None  # the one its graph reads
        for b, spec, view, real in static.slots(self.table.specs, n, r, key=key):
            if real is not None:
                inputs.append((spec.index, view, view.data_ptr()))
                pads.append(((tier, b), static.tiers[tier].buffers[b], static.tiers[tier].pads[b], real))
            elif spec.axis.kind is Kind.FIXED:
                inputs.append((spec.index, view, view.data_ptr()))
        rows = {Kind.TOKENS: n, Kind.REQS: r}
        outputs = [
            t[: rows[axis]] if isinstance(t, torch.Tensor) and axis in rows else t
            for t, axis in zip(entry.flat_outputs, entry.out_axes)
        ]
        single = entry.out_spec.num_leaves == 1 and entry.out_spec.num_children == 0
        replay = functools.partial(entry.replay, n, r) if entry.sized else entry.replay
        return Plan(
            tuple(inputs), tuple(pads), replay, outputs, entry.out_spec, single, entry.key.num_tokens,
            self.hand_out.aliases(outputs), has_boxes(entry.out_spec),
            tuple(i for i, t in enumerate(outputs) if isinstance(t, WeakStatic)),
        )

    def static_inputs(self, n: int, r: int | None) -> tuple:
        """Arguments that are the static buffers themselves (views of `n` token rows and
        `r` request rows): write the next batch into them and call with them, and no
        input is copied."""
        out = []
        with self.own:
            static = self.table.static
            tier = static.tier_of(n, r) if static.tiers else None
            for b, spec, arg, real in static.slots(self.table.specs, n, r):
                out.append(arg)
                if real is not None:  # the caller will write these rows
                    self.dirty[tier, b] = max(self.dirty.get((tier, b), 0), real)
        out = tuple(out)
        tokens, reqs = self.rows_and_check(out)
        with self.own:
            self.static_call = _StaticCall(out, tokens, reqs)  # calls with exactly these skip checks and copies
            self.plans.pop(STATIC_PLAN, None)  # learnt again on the first call with them
        return out
