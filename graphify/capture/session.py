"""A capture session: what the captures of one table share, and the tables it produces.

`capture()` (ahead of time) opens a session, captures every planned key in `KeySet.pairs()`
order (mixed keys largest first, then uniform keys) and closes it: on any failure the
graphs captured so far are released and a `CaptureError` names the key that failed.

First use (`graphify.capture.call_capture`) keeps a session open for the life of a call
structure and captures one key at a time, when a call first needs it. Each capture
returns a new immutable `GraphTable` holding every entry so far; a failed key leaves the
entries before it (and the table the callable holds) as they were.

A session holds the static input buffers (sized for the largest planned key), the pool
handle, the capture stream, the state keeper and the library hold (`graphify.backends.keepalive`).
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
from torch.utils import _pytree as pytree

from graphify.base.axes import Kind
from graphify.distributed.lockstep import graph_code, track_ungrouped
from graphify.base.errors import REPLACED_ADVICE, CaptureError, StateReplacedError
from graphify.capture.spec import FunctionSpec
from graphify.reads.torch_settings import GlobalState
from graphify.backends.keepalive import LibraryHold, holding
from graphify.plan.keys import KeySet, specialised_sizes
from graphify.base.call_layout import fn_name
from graphify.base.modes import Mode
from graphify.plan.pool import Pool
from graphify.reads.reach import Reach
from graphify.reads.code_ran import CodeRan
from graphify.reads.table_reads import Reads
from graphify.backends.rng import RandomStates
from graphify.reads.snapshot import Snapshot
from graphify.base.axes import static_objects
from graphify.backends.tensor_writes import StateKeeper
from graphify.plan.table import CaptureReport, Entry, GraphTable, Holdings, StaticBuffers
from graphify.capture.capturers import CaptureSettings, KeyCapture, mode_capturers
from graphify.capture.function_reads import FunctionReads
from graphify.capture.kin_writes import storages_at, written_positions
from graphify.capture.context import device_of, device_scope, freeze_gc, progress
from graphify.capture.failed import as_capture_error
from graphify.capture.output_axes import consistent_out_axes, infer_out_axes
from graphify.capture.prepare import Prepared

__all__ = ["CaptureSession", "CaptureSetup"]

log = logging.getLogger("graphify")


@attrs.frozen(eq=False)
class CaptureSetup:
    """What every key of a session is captured with, fixed when the session opens."""

    device: torch.device | None
    backend: Any
    capturers: dict  # runtime mode -> capturer (`graphify.capture.capturers`)
    settings: CaptureSettings  # pool handle, warm-ups, weak outputs, stream
    probe: Callable | None  # the split function as calls bind it: what the state keeper records
    uses_fft: bool  # the graphs may launch torch's cuFFT plans (kept alive with them)
    out_axes: Any  # as given (`Options.out_axes`, a split function's), or None: inferred
    out_rule: Callable  # (tokens, reqs, flat outputs) -> each output's axis
    grouped: bool  # its ranks agree through a Lockstep, released with its group (else `track_ungrouped`)


class CaptureSession:
    """Captures keys of one table for the function `spec` describes, called as `prepared`
    binds it; see the module docstring. `keys`: what may be captured (ahead of time every
    planned key; first use a structure's). `lockstep` (tensor parallelism): the ranks'
    agreement, recorded into each FULL graph under its "graph" policy. `function`: what the
    function reaches, shared by the sessions of one callable (first use: its structures)."""

    def __init__(self, spec: FunctionSpec, prepared: Prepared, keys: KeySet, *, lockstep=None,
                 function: FunctionReads | None = None, tiered: bool = False, pools=None):
        label, specs, example, backend = spec.label, prepared.specs, prepared.args, prepared.backend
        try:
            device = device_of(specs)
        except CaptureError as exc:
            raise CaptureError(f"{label}: {exc}") from None
        backend.validate(label, device)
        self.label, self.keys, self.specs, self.example = label, keys, specs, tuple(example)
        # the user's Pool, or the one a first-use callable's structures share (`PoolsByDevice`)
        self.pool = spec.pool if spec.pool is not None else pools(backend, device) if pools is not None else Pool(
            fn_name(spec.fn))
        # and torch's process-wide settings the captures run under (the caller's: `GlobalState`)
        self.table_fields = (*_table_fields(spec, prepared), GlobalState.take(label))
        self.reach: tuple[Reach, ...] = ()  # (static objects', function's), as the graphs read them
        self.entries: dict = {}
        self.seen: set = set()  # modes whose first key is captured (it alone runs the full protocol)
        self.seconds = 0.0
        self.hold = LibraryHold()
        # one tier of static buffers for every key, or (`tiered`: first use, every batch size a
        # key, met as calls come) tiers made as keys need them (`fit`)
        with device_scope(device), torch.no_grad():
            self.static = StaticBuffers.allocate(specs, example, None if tiered else _largest_rows(keys), backend.empty)
            self.keeper = StateKeeper(spec.options.restore_state, exclude=self.static.storages())
            self.setup = _setup(spec, prepared, keys, lockstep, device, self.pool.handle_for(backend, device, label))
        self.function = function if function is not None else FunctionReads.for_spec(spec)

    def fit(self, key) -> StaticBuffers:
        """The static buffers, with a tier added where none holds `key` yet (its storages
        never restored by the state keeper)."""
        static = self.static
        with device_scope(self.setup.device), torch.no_grad():
            grown = static.fitting(self.specs, key, _largest_rows(self.keys), self.setup.backend.empty)
        if grown is not static:
            self.static = grown
            self.keeper.exclude |= grown.storages()
        return grown

    def objects(self, args: Sequence[Any]) -> dict:
        """The static objects of a call: roots of the Python state a graph cannot follow."""
        return static_objects(self.specs, args)

    # -- capture ----------------------------------------------------------------------------
    def capture(
        self, pairs, *, example: Sequence[Any] | None = None, loaded: list | None = None, quick: bool = False,
        collect: bool = True, plain: bool = False,
    ) -> GraphTable:
        """Capture `pairs` ((mode, key) in order) and return the table of every entry so far.
        `example`: the call whose static objects the graphs read (default: the session's);
        `loaded`: what a first-use capture copied into the static buffers (the call's own
        rows), which the function must leave as they are. `quick`: capture with no warm-up
        and no op guard (first use, for a structure whose kin was captured before: the
        same code at other shapes). `collect`: run the garbage collector once first. `plain`:
        record the function as written where it is compiled for captures (first use, while
        the compile is made elsewhere: `graphify.compile.background.line`)."""
        start = time.perf_counter()
        example = self.example if example is None else tuple(example)
        new: dict = {}
        snapshots: tuple = ()
        try:
            with device_scope(self.setup.device), torch.no_grad(), \
                    holding(self.hold, self.setup.device, uses_fft=self.setup.uses_fft):
                objects = self.objects(example)
                shallow = Reach.walk(objects, limits=self.function.limits)
                deep = self.function.walk(shallow, objects)
                reach = (shallow, deep)
                _within_limits(self.label, reach)
                snapshots = tuple(map(Snapshot.take, reach))
                self.keeper.owned = [entry for s in snapshots for entry in s.owned]
                self.keeper.begin(storages_at(self.keeper.kin.carried, shallow) if quick else None)
                rng = RandomStates.take(self.setup.device, _generators(reach))
                ran = CodeRan()  # what this capture's runs execute
                try:
                    with freeze_gc(collect=collect), ran.collecting():
                        for mode, key in progress(pairs, self.label, loaded is None):
                            sibling = self.entries.get((Mode.PIECEWISE, key.relaxed())) or new.get((Mode.PIECEWISE, key.relaxed()))
                            new[mode, key] = self.capture_key(mode, key, example, sibling, loaded, quick, plain)
                            self.seen.add(mode)
                            _unchanged(self.label, reach, snapshots)
                finally:  # the runs drew random numbers; the call's replay draws what eager would
                    moved = rng.restore()
                    self.keeper.kin.whole = None  # the call's objects' storages: not held past the capture
                self.function.after(ran, deep)  # what code that ran for the first time reads
                if self.keeper.recorded:
                    self.keeper.kin.note(written_positions(self.keeper, shallow))
                _within_limits(self.label, reach)
            self.keeper.put_back |= moved or bool(self.keeper.since or self.keeper.owned)  # what it put back
            self.keeper.owned = []
            entries = {**self.entries, **new}
            if self.setup.out_axes is None:
                entries = consistent_out_axes(self.label, entries)
        except BaseException as exc:
            done, planned = len(self.entries) + len(new), len(self.entries) + len(pairs)
            self._undo(exc, new, snapshots)
            if not isinstance(exc, Exception):
                raise
            raise as_capture_error(self.label, exc, done, planned) from exc
        self.entries = entries
        for entry in entries.values():
            self.pool.track(entry, f"{self.label} {entry.label}", entry.nbytes)
        self.reach = reach
        self.seconds += time.perf_counter() - start
        return self.table()

    def _undo(self, exc: BaseException, new: dict, snapshots: tuple) -> None:
        """After a failed capture: outside state put back (tensors' contents, and the Python
        state of the static objects and the closure: the call then runs eagerly on them as
        it found them), this call's graphs released (earlier entries stay), nothing pinned
        by the exception's frames."""
        cuda = self.setup.device is not None and self.setup.device.type == "cuda"
        if cuda:  # warm-ups may still run on the side stream
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.setup.device)
        with contextlib.suppress(Exception):  # a failure between a run and its restore: undo what it wrote
            self.keeper.restore()
        self.keeper.forget()
        self.keeper.owned = []
        for snapshot in snapshots:
            with contextlib.suppress(Exception):
                snapshot.restore()
                snapshot.restore_owned()
        new.clear()
        traceback.clear_frames(exc.__traceback__)  # its frames hold capture-time tensors
        if cuda:
            self.pool.trim()

    def capture_key(self, mode: Mode, key, example: Sequence[Any], sibling, loaded, quick: bool,
                    plain: bool = False) -> Entry:
        """Capture one key: the per-graph step. The first key of its mode in this table alone
        checks for in-place writes to arguments; the capturer decides what else it skips at
        later keys (`graphify.capture.capturers`). `sibling`: the PIECEWISE entry of the same
        token count, already captured, whose schedule warms a FULL capture up cheaply.
        `loaded`: what a first-use capture copied into the static buffers, which the function
        must leave as they are; None: all padding. `quick`: no warm-up, no op guard."""
        first = mode not in self.seen
        setup, keeper = self.setup, self.keeper
        args = self.fit(key).args_for(self.specs, key, example)
        t0 = time.perf_counter()
        try:
            step = KeyCapture(key, keeper, first, setup.probe if keeper.enabled else None, sibling, quick, plain,
                              keeper.kin.whole if keeper.enabled else None)
            captured = setup.capturers[mode](args, step, setup.settings)
            keeper.forget()
        except Exception as exc:
            exc.graphify_key = (mode, key)
            raise
        changed = self.static.changed(self.specs, key, loaded) if first and not quick else None
        if changed:
            raise CaptureError(
                f"{self.label}: the function writes to argument(s) {changed} in place; graphify copies padded "
                "arguments into static buffers, so such writes are lost: mark them persistent() or return the result"
            )
        flat, out_spec = pytree.tree_flatten(captured.outputs)
        return Entry(
            mode, key, captured.replay, captured.graph, tuple(flat), out_spec,
            setup.out_rule(key.num_tokens, key.reqs_rows, flat), captured.nbytes, time.perf_counter() - t0,
            captured.sized,
        )

    def table(self) -> GraphTable:
        """The table of every entry captured so far (a new immutable value). Its `release()`
        drops its own references; the session's go with the session (or `abort()`)."""
        own = dict(self.entries)
        layout, examples, library, settings = self.table_fields
        setup = self.setup
        table = GraphTable(
            types.MappingProxyType(own), _captured_keys(own, self.keys), self.specs, self.static, setup.backend,
            self.pool, setup.device, library=library, layout=layout, examples=examples,
            reads=Reads(self.function.watching(self.reach[1]) if self.reach else None, tuple(r for r in self.reach[:1] if r),
                        settings),
            report=CaptureReport(self.seconds, len(self.keeper.restored), self.keeper.peak_bytes, self.keeper.put_back),
            holdings=Holdings(own, self.hold),
        )
        if not setup.grouped:  # released with any process group's teardown
            track_ungrouped(table)
        return table

    def abort(self) -> None:
        """Release every graph of this session and what it holds (a failed `capture()`, a
        released callable): a kept exception's frames may still reference the session."""
        self.entries = {}
        self.static = self.keeper = self.example = None
        self.hold.release()
        if self.setup.device is not None and self.setup.device.type == "cuda":
            self.pool.trim()




def _largest_rows(keys: KeySet) -> dict:
    """Rows of the largest key along each padded axis kind: what static buffers hold at most."""
    return {Kind.TOKENS: keys.max_tokens(), Kind.REQS: max((k.reqs_rows for _, k in keys.pairs()), default=1)}


def _unchanged(label: str, reach: tuple[Reach, ...], snapshots: tuple[Snapshot, ...]) -> None:
    """Raise if the run changed what the static objects or the closure hold (after
    putting it back): a graph cannot follow Python state or replaced tensors. Plain values
    that are side effects (`Options(side_effects="at_capture")`) keep what the run made
    of them, and the log says so once per capture."""
    for snapshot in snapshots:  # Python state registered types own: the graphs follow it, not the runs
        snapshot.restore_owned()
    for r, snapshot in zip(reach, snapshots):
        change = r.first_change()
        if change is None:
            continue
        what, replaced = change
        if not replaced and r.plains_are_effects and not r.changed():
            log.warning("%s: %s during capture; with Options(side_effects='at_capture') such Python side effects "
                        "happen when a capture runs, not on replays", label, what)
            continue
        snapshot.restore()
        if replaced:
            raise StateReplacedError(
                f"{label}: each call replaces a tensor it reads through a static argument or the closure "
                f"({what}); a graph reads the memory it captured and would go on reading the old tensor. "
                + REPLACED_ADVICE, replaced=True,
            )
        raise StateReplacedError(
            f"{label}: each call changes Python state of a static argument ({what}); a graph "
            "replays kernels, not Python, so that state would stop changing and the graphs would "
            "go stale. Keep such state in tensors updated in place (a transformers StaticCache's "
            "full-attention layers do; its sliding-window layers keep a Python counter, so give such "
            "a model a config without sliding windows), or leave this function ungraphified"
        )


def _table_fields(spec: FunctionSpec, prepared: Prepared) -> tuple:
    """(call layout, per-argument examples, array library) every table of a session carries."""
    specs, example = prepared.specs, prepared.args
    examples = tuple(a.detach().clone() if s.axis.kind is Kind.TOKENS else None for a, s in zip(example, specs))
    return prepared.layout, examples, prepared.library


def _generators(reach: tuple[Reach, ...]) -> list:
    """The random generators the function reaches (besides the default ones)."""
    return [v for r in reach for edges in r.objects for v in edges.values if isinstance(v, torch.Generator)]


def _within_limits(label: str, reach: tuple[Reach, ...]) -> None:
    """Refuse graphs over state a walk could not record whole: a change past its limit
    would go unseen, and a replay could be wrong."""
    for r in reach:
        if r.truncated is not None:
            raise CaptureError(
                f"{label}: what the call reads is larger than graphify records ({r.truncated}); a change there "
                "could not be seen before a replay, so these calls are not captured. Keep large Python containers "
                "out of what the function reaches (tensors are fine at any size), raise the walk's bounds "
                "(Options(limits=Limits(walk_items=..., walk_edges=...))), or leave it ungraphified"
            )


def _setup(spec: FunctionSpec, prepared: Prepared, keys: KeySet, lockstep, device, handle) -> CaptureSetup:
    """The session's fixed capture settings (device current, no grad)."""
    split, options, backend = spec.split, spec.options, prepared.backend
    out_axes = spec.out_axes if spec.out_axes is not None else ((split.out_axes if split is not None else None) or None)
    return CaptureSetup(
        device=device, backend=backend,
        capturers=mode_capturers(
            backend, prepared.fn, prepared.twin, split, _lockstep_full(lockstep, prepared),
            specialised_sizes(options.compile_sizes, keys), whole=split is not None and spec.compiled is not None,
        ),
        settings=CaptureSettings(handle, options.warmups, options.weak_outputs and backend.name == "cuda",
                                 backend.new_stream(device)),
        probe=prepared.layout.caller(split.fn) if split is not None else None,
        uses_fft=split is not None and any(name.startswith("aten::_fft_") for name in split.op_names),
        out_axes=out_axes, out_rule=infer_out_axes(prepared.fn, prepared.specs, prepared.args, out_axes),
        grouped=lockstep is not None,
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
