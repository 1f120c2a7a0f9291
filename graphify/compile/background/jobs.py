"""One graphified function's compiles in the worker process (`Options(compile="background")`).

First use asks, per capture, for the job of its kind of call (`graphify.compile.background.line.job_kind`:
calls of one kind share one compile under dynamic shapes). A job whose compile is ready
means: capture compiled, through the compiled function the worker saved whole and this
process loaded (`graphify.compile.aot`), or else by this process's compile, which loads from the
caches the worker filled. Otherwise the capture records the function as written and sends the job, once per
kind. When jobs settle, the structures holding plain graphs whose compile is now ready are
handed back to be dropped; a failed compile is warned of once and its calls keep plain graphs.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch._inductor.config  # noqa: F401 - freezing, read before a job is sent

from graphify.compile import aot as _aot
from graphify.compile import aot_store as _aot_store
from graphify.compile.background import line as _background
from graphify.compile.compiled import compile_settings
from graphify.compile.background.job_pickle import torch_state
from graphify.base.errors import CaptureError, StateReplacedError

__all__ = ["CompileJobs", "Job", "capture_with", "OOM_TRIES"]

OOM_TRIES = 3  # compiled captures of one kind that may run out of device memory before it gives up

log = logging.getLogger("graphify")


@attrs.define(eq=False)
class Job:
    """The compile one capture needs: `ready` when the worker made it; `send()` sends it
    (once per kind) and returns its ticket."""

    jobs: "CompileJobs"
    kind: tuple
    layout: Any  # how the call binds (`graphify.base.call_layout.CallLayout`)
    args: tuple  # the arguments the capture calls the function with
    exact: tuple | None = None  # its kind with every dimension (a function compiled per shape)

    @property
    def ready(self) -> bool:
        ticket = self.jobs.tickets.get(self.kind)
        return ticket is not None and ticket.state == "ready"

    @property
    def whole(self) -> bool:
        """Whether the worker saves this job's compiled function whole (`graphify.compile.aot`), to be
        loaded here and kept for later processes. Not under inductor's freezing (global or in
        the compile's options), which folds the weights into the compiled code: a function kept
        whole would serve other weights with the old ones; nor with a backend this torch cannot
        save (`graphify.compile.aot.saves`), nor with a backend given as a callable (it has no name a
        later process could compile with)."""
        how = self.jobs.spec.options.compile
        settings = compile_settings(how)
        options = settings.get("options") or {}
        frozen = bool(getattr(torch._inductor.config, "freezing", False)) or bool(
            isinstance(options, dict) and options.get("freezing"))
        return ((how.get("whole", True) if isinstance(how, dict) else True) and not frozen
                and isinstance(settings["backend"], str) and _aot.saves(settings["backend"]))

    def store_path(self) -> str | None:
        """Where this kind's compiled function is kept for later processes (`graphify.compile.aot_store`);
        None where it is not saved whole, or its name cannot be made."""
        if not self.whole:
            return None
        try:
            return _aot_store.path_for(self.jobs.spec.fn, self.kind, compile_settings(self.jobs.spec.options.compile),
                                       torch_state())
        except Exception as exc:  # noqa: BLE001 - saved whole for this process alone
            log.info("%s: no name for a kept compiled function (%s: %s)", self.jobs.spec.label, type(exc).__name__, exc)
            return None

    def from_store(self) -> bool:
        """Whether a compiled function an earlier process (or job) kept for this kind serves
        this call: loaded (once per kind) and passing its guards and identities here, at the
        kind's first capture and at its later ones (other sizes). Then the capture takes it,
        and no job is sent. Never after what the calls read changed in
        this process (`CompileJobs.start_over`): a kept function was compiled over the state
        before, and only a job sent since may serve."""
        loads = getattr(self.jobs.spec.compiled, "aot_loads", None)
        if loads is None or self.jobs.changed:
            return False
        try:
            if self.kind in self.jobs.store_tried:  # loaded once: it serves this kind's other sizes where it can
                return self.kind in self.jobs.store_served and loads.serves(*self.layout.call_of(self.args))
            self.jobs.store_tried.add(self.kind)
            if self._serve_from_store(loads):
                self.jobs.store_served.add(self.kind)
                return True
        except Exception as exc:  # noqa: BLE001 - plain graphs, and the job
            log.info("%s: a kept compiled function was not used (%s: %s)", self.jobs.spec.label, type(exc).__name__,
                     exc)
        return False

    def _serve_from_store(self, loads) -> bool:
        path = self.store_path()
        kept = _aot_store.read(path) if path is not None else None
        if kept is None:
            return False
        loaded = _aot.load(path, kept[0])
        loads.add(loaded, kept[1])
        if loads.serves(*self.layout.call_of(self.args)):
            return True
        loads.drop(loaded)
        return False

    def take_loaded(self) -> None:
        """The compiled function the worker saved whole for this kind, loaded here: the
        function's captures call it (`graphify.compile.aot.AotLoads`) instead of tracing the model."""
        ticket = self.jobs.tickets.get(self.kind)
        loads = getattr(self.jobs.spec.compiled, "aot_loads", None)
        try:
            if ticket is not None and loads is not None and _background.load_saved(ticket) is not None:
                loads.add(ticket.loaded, ticket.guards)
        except Exception as exc:  # noqa: BLE001 - the capture compiles here instead
            log.info("%s: a loaded compiled function was not taken (%s: %s)", self.jobs.spec.label,
                     type(exc).__name__, exc)

    def try_again_later(self) -> bool:
        """After a compiled capture ran out of memory (memory another call held may be free by
        then): whether this kind tries compiled again, at the next call, rather than give up
        (OOM_TRIES tries in all)."""
        tries = self.jobs.out_of_memory[self.kind] = self.jobs.out_of_memory.get(self.kind, 0) + 1
        if tries >= OOM_TRIES:
            return False
        self.jobs.seen = -1  # the next call looks at the jobs: this structure is superseded again
        return True

    def give_up(self, why: str) -> None:
        """This kind's calls keep plain graphs from now on (warned once)."""
        ticket = self.jobs.tickets[self.kind]
        ticket.state, ticket.error = "failed", why
        self.jobs.warn_failed()

    def send(self) -> "_background.Ticket":
        tickets = self.jobs.tickets
        if self.kind not in tickets:
            spec = self.jobs.spec
            how = spec.options.compile
            job = {"label": spec.label, "how": how, "layout": self.layout, "args": self.args, "whole": self.whole,
                   "aot_path": self.store_path()}
            deadline = how.get("deadline_s", _background.DEADLINE_S) if isinstance(how, dict) else _background.DEADLINE_S
            tickets[self.kind] = _background.submit(self.jobs, spec.fn, job, deadline)
            self.jobs.by_shape.setdefault(self.exact, tickets[self.kind])
        return tickets[self.kind]


class CompileJobs:
    """The tickets of one function's jobs, by kind (see the module docstring)."""

    def __init__(self, spec):
        self.spec = spec
        self.tickets: dict[tuple, _background.Ticket] = {}
        self.by_shape: dict[tuple, _background.Ticket] = {}  # each job's ticket by its call's exact shapes
        self.seen = 0  # `_background.settled()` when last looked at
        self.warned = False
        self.out_of_memory: dict[tuple, int] = {}  # compiled captures that ran out of memory, by kind
        self.store_tried: set[tuple] = set()  # kinds whose kept compiled function was looked for
        self.store_served: set[tuple] = set()  # of those, the kinds it served (loaded, guards passing)
        self.changed = False  # what the calls read changed since the first capture: kept functions not used
        self.dropped: list = []  # (family, keys, writes) of the structures compiled graphs replace (families: not hashable)
        self.swaps = 0  # calls that found compiled graphs ready and dropped plain structures for them

    @classmethod
    def for_spec(cls, spec) -> "CompileJobs | None":
        """The jobs of a function compiled in the background; None for any other (a split
        function compiles in this process, logged)."""
        if not spec.background or spec.compiled is None:
            return None
        if spec.split is not None:
            log.warning("%s: a split function compiles in this process (compile='background' is for whole "
                        "functions)", spec.label)
            return None
        return cls(spec)

    def job_for(self, structure, branch, pair: tuple, args: tuple) -> Job:
        """The job a capture of `pair` for a call of `branch` (of `structure`) needs."""
        capture = branch.capture
        called = capture.capture_args(pair, args)
        exact = _background.job_kind(structure.family, branch.key, called, per_shape=True)
        if not self.per_shape():
            return Job(self, _background.job_kind(structure.family, branch.key, called), capture.layout, called, exact)
        if exact not in self.tickets and exact in self.by_shape:  # sent before the function was known to be
            self.tickets[exact] = self.by_shape[exact]             # compiled per shape: that compile serves it
        return Job(self, exact, capture.layout, called, exact)

    def per_shape(self) -> bool:
        """Whether this function is known to compile per shape (`graphify.compile.shape_policy`):
        asked to (`"dynamic": False`), the worker said so of a job, or this process's own compile
        found it."""
        compiled = self.spec.compiled
        if compile_settings(self.spec.options.compile)["dynamic"] is False:
            return True
        return bool(getattr(compiled, "per_shape", None)) or any(
            (t.guards or {}).get("per_shape", False) for t in tuple(self.tickets.values()))

    def settled(self) -> bool:
        """Whether any job of this process settled since the last look (a counter's read)."""
        return bool(self.tickets) and _background.settled() != self.seen

    def superseded(self, structures) -> list:
        """The structures with plain graphs whose compile is ready; a failed job is warned of
        once."""
        self.seen = _background.settled()
        self.warn_failed()
        found = [s for s in tuple(structures)  # snapshots: another thread's capture may add to them
                 if any(t.state == "ready" for b in tuple(s.branches.values()) for t in tuple(b.waiting.values()))]
        self.dropped += [(s.family, s.known_keys(), s.writes()) for s in found]
        self.swaps += bool(found)
        return found

    def replaced(self, family: tuple) -> bool:
        """Whether compiled graphs replace a structure of `family`: the next one opened is its
        kin, captured at its first call (no eager warm-up call), its keys without the op guard
        and code recording that the plain captures ran over the same code."""
        return any(f == family for f, _, _ in self.dropped)

    def take_replaced(self, family: tuple) -> tuple[frozenset, tuple | None]:
        """The keys the replaced structures of `family` captured (`CallStructure.kin_keys`
        of the new one) and what their captures wrote (`graphify.capture.kin_writes`; None
        unless one structure, or all alike, said), forgotten here."""
        mine = [(k, w) for f, k, w in self.dropped if f == family]
        self.dropped = [d for d in self.dropped if d[0] != family]
        writes = {w for _, w in mine}
        return frozenset().union(*(k for k, _ in mine)), writes.pop() if len(writes) == 1 else None

    def warn_failed(self) -> None:
        failed = next((t for t in tuple(self.tickets.values()) if t.state == "failed"), None)
        if failed is not None and not self.warned:
            self.warned = True
            warnings.warn(
                f"{self.spec.label}: the compile in the background failed ({failed.error}); its calls keep "
                "graphs of the function as written. Use Options(compile=True) to compile in this process, "
                "or keep the function and its arguments importable by a new process", stacklevel=6,
            )

    def start_over(self) -> None:
        """What the graphs read moved (the weights, say): the worker drops its copy of the
        function, and later captures send it and their jobs again."""
        _background.forget(self)
        self.tickets, self.by_shape = {}, {}
        self.changed = True
        self.dropped = []  # code over the changed state is checked afresh

    def wait(self, timeout: float | None) -> bool:
        return _background.wait(tuple(self.tickets.values()), timeout)


def capture_with(job: "Job | None", capture: Callable[[bool], Any], strict: bool) -> tuple[Any, bool]:
    """(table, plain) from `capture(plain)`: plain where `job`'s compile is not ready (a
    plain capture that fails then says so on its error, `graphify_plain_first`: the compiled
    function may capture where it cannot). A compiled capture that fails gives the job up and
    captures plain instead (unless `strict`): the function as written had graphs before, and
    keeps them. One that ran out of device memory captures plain this time and tries compiled
    again later."""
    plain = job is not None and not job.ready and not job.from_store()
    if job is None or plain:
        try:
            return capture(plain), plain
        except CaptureError as exc:  # the function as written failed before its compile was made
            exc.graphify_plain_first = plain
            raise
    job.take_loaded()
    try:
        return capture(False), False
    except CaptureError as exc:
        if strict or isinstance(exc, StateReplacedError):  # the call's own state, compiled or not: first use decides
            raise
        if out_of_memory(exc) and job.try_again_later():
            return capture(True), True
        job.give_up(f"the compiled function could not be captured here ({type(exc).__name__}: {exc})")
    return capture(True), True


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` or what it was raised from is the device running out of memory."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
