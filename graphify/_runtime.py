"""The call path: check arguments, dispatch, copy into static buffers, replay, cut outputs.

This is the only per-call code, so it is written for host speed: argument checks are
precomputed tuples, dispatch is one list index, all copies (real rows and padding rows)
go through one `torch._foreach_copy_`, and each (graph, real size) pair caches its copy
plan and its cut output views.
"""

from __future__ import annotations

import functools
import threading
from operator import is_
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch
from torch.utils import _pytree as pytree

from ._alias import alias_maker
from ._arg_checks import ArgChecks
from ._axes import Kind, WeakStatic
from ._outputs import has_boxes, unbox
from ._dispatch import Dispatcher
from ._distributed import graph_code
from ._errors import GraphifyError, InputMismatchError, StaleReachError
from ._mode import Mode
from ._stats import Stats
from ._table import Entry, GraphTable

__all__ = ["Runtime", "GraphSource"]


_NONE = Mode.NONE
_FULL = Mode.FULL
MAX_PLANS = 4096  # (graph, tokens, requests) plans kept; beyond it the cache starts over
_set_storage_msg = getattr(torch._C, "_set_storage_access_error_msg", None)  # CUDA builds of torch


@attrs.frozen(eq=False)
class _Plan:
    """Everything one (graph, real tokens, real requests) call needs, precomputed.

    `inputs` holds (argument index, destination view, its data_ptr) for every copied
    argument; `pads` holds (buffer number, real rows) per padded buffer."""

    inputs: tuple
    pads: tuple
    replay: Callable[[], None]
    outputs: list
    out_spec: Any
    single: bool
    padded: int
    aliases: tuple = ()  # (output index, alias maker) per tensor output, for checked views
    boxed: bool = False  # the outputs hold dataclasses to rebuild (graphify._outputs)
    weak: tuple = ()  # indices of outputs that are weakly held static objects (a returned cache)


def _result(plan: _Plan, outputs: list):
    """The call's return value in the function's own structure."""
    if plan.weak:
        outputs = list(outputs)
        for i in plan.weak:
            outputs[i] = outputs[i]()
    if plan.single:
        return outputs[0]
    tree = pytree.tree_unflatten(outputs, plan.out_spec)
    return unbox(tree) if plan.boxed else tree


class GraphSource(Protocol):
    """Where a runtime gets a graph its table lacks (first use: a call structure)."""

    def capture_for(self, decision, args: Sequence[Any]) -> "Entry | None":
        """Capture the graph `decision` names, warmed up on the call's `args` (the runtime's
        lock held), and return its entry; None where no more may be captured (the call runs
        eagerly)."""


class Runtime:
    """Per-table call machinery. Calls are serialised by a lock: static buffers and
    outputs are shared, so two threads must never interleave copy and replay."""

    def __init__(
        self,
        *,
        call: str,
        fn: Callable,
        table: GraphTable,
        dispatcher: Dispatcher,
        uniform_fn: Callable[..., bool] | None,
        lora_fn: Callable[..., bool] | None,
        outputs: str = "copy",
        full_ok_fn: Callable[..., bool] | None = None,
        source: "GraphSource | None" = None,
    ):
        self.call, self.fn, self.table, self.dispatcher = call, fn, table, dispatcher
        # First use (graphify._first_use): a table that grows; `source` captures what a call
        # needs (and `adopt` then swaps in the new table).
        self.source = source
        self.uniform_fn, self.lora_fn, self.full_ok_fn = uniform_fn, lora_fn, full_ok_fn
        self.library = table.library
        self.reach = table.reach  # checked before every replay: what graphs read without a copy
        self.lockstep = table.lockstep
        self.layout = table.layout
        self.watch = table.watch
        self.modes = tuple(Mode)
        self.q = table.keys.uniform_query_len
        specs = table.specs
        self.nargs = len(specs)
        self._check_with(ArgChecks(call, specs))
        self.lock = threading.Lock()
        self.plans: dict = {}
        self.fast: tuple | None = None  # (static_inputs() tuple, tokens, requests)
        self.fast_clean = False  # no other call since the last one with that tuple
        self.fast_plan: tuple | None = None  # (plan, mode, tokens) of calls with exactly that tuple
        # No per-call predicates: a call's graph follows from its shapes alone.
        self.simple = uniform_fn is None and lora_fn is None and full_ok_fn is None
        # Tensor parallelism: the per-call agreement check (graphify._distributed) that runs
        # on the host; under the default "graph" policy FULL graphs carry it themselves.
        policy = self.lockstep.policy if self.lockstep is not None else "off"
        self.host_agree = policy == "host"
        self.eager_check = policy == "graph"
        if self.lockstep is not None:
            self.lockstep.adopt(self)
        self.handed: list = []
        self.released = False
        self.stale_msg = (
            f"{call}: this output was overwritten by a later call (Options(outputs='view') hands out the graph's "
            "static output buffers, valid until the next call); clone() what you keep, or use Options(outputs='copy')"
        )
        if outputs == "copy":
            self.hand_out = self._copy
        elif outputs == "view" and table.device is not None and table.device.type == "cuda" and _set_storage_msg is not None:
            self.hand_out = self._checked_view
        else:  # "view" where torch cannot poison a storage (CPU builds): plain views, documented
            self.hand_out = self._view
        # Rows of each padded buffer that may hold real data; rows past it hold padding.
        # Padding is copied in only where a smaller batch follows a larger one.
        self.dirty = [0] * len(specs)

    def _check_with(self, checks: ArgChecks) -> None:
        self.checks = checks
        self.rows_and_check = checks.rows  # bound once: the hot path calls it directly
        self.req_idx = checks.req_idx

    # -- the call -------------------------------------------------------------------------
    def run_trusted(self, stats: Stats):
        """A call with exactly `static_inputs()`'s tuple (the caller checked identity): our
        own buffers, checked when the tuple was made. With no per-call predicates the same
        plan serves every such call: only padding a larger batch left (when another call
        ran since), the replay, the tally and the outputs remain."""
        watch = self.watch
        if watch is not None:
            watch.check()
            if watch.requires_grad and torch.is_grad_enabled():
                watch.warn_grad(self.fast[0])
        if self.fast_plan is None:  # learnt on the first such call (or released: run says so)
            return self.run(self.fast[0], stats, checked=True)
        return self._replay_fast(stats)

    def _replay_fast(self, stats: Stats):
        with self.lock:
            if self.fast_plan is None:  # released meanwhile
                raise self._released()
            plan, mode, n = self.fast_plan
            if self.reach and any(r.changed() for r in self.reach):
                raise self._stale()
            if not self.fast_clean:  # another call ran since: it may have left rows past ours
                self._restore_padding(plan, [], [])
                self.fast_clean = True
            plan.replay()
            stats.tally(mode, n, plan.padded)
            outputs = self.hand_out(plan)
        return _result(plan, outputs)

    def run(self, args: Sequence[Any], stats: Stats, checked: bool = False):
        """A call's bound arguments; `checked`: the module watch already ran for it."""
        watch = self.watch
        fast = self.fast
        trusted = fast is not None and len(args) == len(fast[0]) and all(map(is_, args, fast[0]))
        if watch is not None and not checked:
            watch.check()
            # static_inputs()'s tuple holds graphify's own buffers, which never require grad
            if (watch.requires_grad or not trusted) and torch.is_grad_enabled():
                watch.warn_grad(args)
        if trusted and self.fast_plan is not None:
            return self._replay_fast(stats)
        self.fast_clean = False  # this call may write rows past the static tuple's
        if trusted:  # exactly the tuple static_inputs() handed out: our own views, checked then
            n, r = fast[1], fast[2]
        else:
            if len(args) != self.nargs:
                raise InputMismatchError(f"{self.call}: expected {self.nargs} arguments as captured, got {len(args)}")
            n, r = self.rows_and_check(args)
        if n < 0:
            n = r
        if n == 0:  # an empty batch: what eager returns, no graph
            with self.lock:
                stats.tally(_NONE, 0, None)
            return self.fn(*args)
        if self.uniform_fn is not None:
            uniform = bool(self.uniform_fn(*args))
        else:
            uniform = self.q == 1 if r < 0 else n == r * self.q
        has_lora = bool(self.lora_fn(*args)) if self.lora_fn is not None else False
        if self.full_ok_fn is None:
            decision = self.dispatcher.lookup(n, uniform, has_lora)
        else:
            decision = self.dispatcher.lookup(n, uniform, has_lora, bool(self.full_ok_fn(*args)))
        if self.released and decision.mode is not _NONE:  # before any collective: the others must not wait on it
            raise self._released()
        if self.host_agree:
            self._agree(decision, n, r)
        elif self.eager_check and decision.mode is not _FULL:  # FULL graphs check in the graph
            self._check_eagerly(decision, n, r)
        if decision.mode is _NONE:
            with self.lock:
                stats.tally(_NONE, n, None)
            return self.fn(*args)
        if self.reach and any(r.changed() for r in self.reach):
            raise self._stale()  # never replay a graph over memory its objects no longer hold
        r_real = n if r < 0 else r
        plan_key = (id(decision), n, r_real)  # decisions are unique objects of the dispatcher
        with self.lock:
            plan = self.plans.get(plan_key)
            if plan is None:
                entry = self.table.entries.get((decision.mode, decision.key))
                if entry is None:
                    entry = self._missing(decision, args)
                    if entry is None:  # first use may capture no more graphs: this call runs eagerly
                        stats.tally(_NONE, n, None)
                        return self.fn(*args)
                if len(self.plans) >= MAX_PLANS:  # many distinct (tokens, requests) pairs: bound the cache
                    self.plans.clear()
                plan = self.plans[plan_key] = self._plan(entry, n, r_real)
            dsts, srcs = [], []
            if trusted:
                if self.simple and not self.host_agree and not (self.eager_check and decision.mode is not _FULL):
                    self.fast_plan = (plan, decision.mode, n)  # the same plan serves every later call with this tuple
            else:
                for i, view, ptr in plan.inputs:
                    a = args[i]
                    if a.data_ptr() != ptr:  # an argument that already is the static view needs no copy
                        dsts.append(view)
                        srcs.append(a)
            self._restore_padding(plan, dsts, srcs)
            plan.replay()
            stats.tally(decision.mode, n, plan.padded)
            outputs = self.hand_out(plan)
        return _result(plan, outputs)

    def _restore_padding(self, plan: _Plan, dsts: list, srcs: list) -> None:
        """Copy the inputs in `dsts`/`srcs`, plus padding wherever a larger batch left real
        rows past this one's, in one `_foreach_copy_`."""
        dirty = self.dirty
        for b, real in plan.pads:
            held = dirty[b]
            if held > real:  # a larger batch left data past this one: restore padding there
                dsts.append(self.table.static.buffers[b][real:held])
                srcs.append(self.table.static.pads[b][real:held])
            dirty[b] = real
        if dsts:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    torch._foreach_copy_(dsts, srcs)
            else:
                torch._foreach_copy_(dsts, srcs)

    def _stale(self) -> StaleReachError:
        what = next((d for d in (r.describe() for r in self.reach) if d is not None), "something it reads")
        return StaleReachError(
            f"{self.call}: {what} since capture. The graphs read what was captured (tensors by address, numbers "
            "baked into kernels), so this call cannot replay them: update tensors in place (copy_) instead of "
            "replacing them, keep numbers the function reads fixed, or capture again"
        )

    def forget(self) -> None:
        """Drop every cached plan (the graphs are being released)."""
        with self.lock:
            self.plans.clear()
            self.fast = self.fast_plan = None

    def _released(self) -> GraphifyError:
        return GraphifyError(
            f"{self.call}: this callable's graphs were released (release()); use the callable "
            "release() returned and capture it again"
        )

    def _copy(self, plan: _Plan) -> list:
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in plan.outputs]

    def _view(self, plan: _Plan) -> list:
        return plan.outputs

    def _checked_view(self, plan: _Plan) -> list:
        """Views on their own storage objects; the previous call's are poisoned first, so
        reading a view after the next replay raises instead of returning new data."""
        msg = self.stale_msg
        for t in self.handed:
            _set_storage_msg(t, msg)
        out = list(plan.outputs)
        handed = []
        for i, make in plan.aliases:
            handed.append(make())
            out[i] = handed[-1]
        self.handed = handed
        return out

    def _choice(self, decision, n: int, r: int) -> tuple[int, int, int]:
        """(mode index, tokens, requests) of a call: what all ranks must agree on."""
        key = decision.key
        tokens, reqs = (n, r) if key is None else (key.num_tokens, key.reqs_rows)
        return self.modes.index(decision.mode), tokens, reqs if reqs is not None else -1

    def _agree(self, decision, n: int, r: int) -> None:
        """All ranks must run the same graph, or eagerly on the same shape (host check)."""
        self.lockstep.agree_call(*self._choice(decision, n, r))

    def _check_eagerly(self, decision, n: int, r: int) -> None:
        """The check FULL graphs carry, run before a PIECEWISE or eager call."""
        self.lockstep.check(graph_code(*self._choice(decision, n, r)))

    def release(self) -> int:
        """Drop the plans and the table's graphs; returns how many graphs were freed."""
        self.forget()
        with self.lock:
            self.released = True
            return self.table.release()

    def _missing(self, decision, args) -> Entry | None:
        """The entry of a key this table lacks: captured now on first use, else the graphs
        were released."""
        if self.source is None or self.released:
            raise self._released()
        return self.source.capture_for(decision, args)

    def adopt(self, table: GraphTable) -> None:
        """Serve calls from `table` (a first-use capture's new table; the caller holds the
        lock). Cached plans go: output axes may have been re-read across the sizes."""
        self.table = table
        self.reach = table.reach
        self._check_with(ArgChecks(self.call, table.specs))
        self.plans.clear()
        self.fast = self.fast_plan = None
        self.fast_clean = False

    def _plan(self, entry: Entry, n: int, r: int) -> _Plan:
        key = entry.key
        inputs, pads = [], []
        for b, spec, view, real in self.table.static.slots(self.table.specs, n, r):
            if real is not None:
                inputs.append((spec.index, view, view.data_ptr()))
                pads.append((b, real))
            elif spec.axis.kind is Kind.FIXED:
                inputs.append((spec.index, view, view.data_ptr()))
        rows = {Kind.TOKENS: n, Kind.REQS: r}
        outputs = [
            t[: rows[axis]] if isinstance(t, torch.Tensor) and axis in rows else t
            for t, axis in zip(entry.flat_outputs, entry.out_axes)
        ]
        single = entry.out_spec.num_leaves == 1 and entry.out_spec.num_children == 0
        replay = functools.partial(entry.replay, n, r) if entry.sized else entry.replay
        aliases = ()
        if self.hand_out == self._checked_view:
            aliases = tuple((i, alias_maker(t)) for i, t in enumerate(outputs) if isinstance(t, torch.Tensor))
        weak = tuple(i for i, t in enumerate(outputs) if isinstance(t, WeakStatic))
        return _Plan(
            tuple(inputs), tuple(pads), replay, outputs, entry.out_spec, single, key.num_tokens, aliases,
            has_boxes(entry.out_spec), weak,
        )

    def static_inputs(self, n: int, r: int | None) -> tuple:
        """Arguments that are the static buffers themselves (views of `n` token rows and
        `r` request rows): write the next batch into them and call with them, and no
        input is copied."""
        out = []
        with self.lock:
            for b, spec, arg, real in self.table.static.slots(self.table.specs, n, r):
                out.append(arg)
                if real is not None:
                    self.dirty[b] = max(self.dirty[b], real)  # the caller will write these rows
        out = tuple(out)
        tokens_rows, reqs_rows = self.rows_and_check(out)
        with self.lock:
            self.fast = (out, tokens_rows, reqs_rows)  # calls with exactly these skip checks and copies
            self.fast_plan = None  # learnt again on the first call with them
            self.fast_clean = False
        return out
