"""First-use capture: graphs captured when a call first needs them, as `jax.jit` compiles.

A layer above the runtime. Per *call structure* (`graphify.first_use.kinds`: what a graph is
specialised to apart from the batch) it keeps a runtime over a table that grows one graph
at a time: where the table lacks a call's graph the runtime hands back a `Miss`, and this
layer captures it (`graphify.capture.CallCapture`), installs the new table and runs the call
again. Nothing below calls back up here. The policy:
- A structure is captured once it has run eagerly in two consecutive calls (the first is
  its warm-up); one that does not repeat back to back (a prompt's prefill) never costs a
  capture. A new batch size is captured by the call that meets it, on its own rows.
- Without `sizes=` every batch size gets its own unpadded graph (up to `Limits`'
  `exact_max_tokens` tokens, `graphs_per_structure` graphs a structure, `structures` structures).
- Python state of registered types (`graphify.reads.stateful_types`: a sliding-window cache
  layer's counter) splits a structure into *branches*, a table each; the state is advanced
  after each replay as the type predicts, and checked against each eager run.
- Under `Options(compile="background")` captures record the function as written until a
  worker has compiled their kind of call; then they capture again, as kin of the structures
  they replace (no eager warm-up call; the op guard and code recording not run again). So
  do structures whose graphs a process group's teardown released
  (`graphify.distributed.lockstep.release_all`).
- What cannot be graphed runs eagerly with one warning naming the cause and the fix; other
  sizes and branches keep their graphs. `Options(first_use="strict")` raises instead.
- What a call reads beyond its arguments is checked before every replay: a structure over
  anything that changed is dropped and its calls start over (`MAX_STALE` times a kind, then
  eagerly); a call replacing a tensor it reads (DynamicCache's cat) runs eagerly, warned once.
- New objects of known shapes (a new StaticCache every `generate()`): an idle structure
  whose objects are gone (at most `MAX_IDLE`) is taken over by a new object of the same
  skeleton (`graphify.reads.takeover`); one *kin* to a structure captured before (a cache of
  another length) captures without warm-up; past `Limits.structures`, the kind's least
  recently used structure makes room (`graphify.first_use.room`).
Tables stay immutable values, swapped in under the runtime's lock. A capture costs its call
about two eager runs; structures share one walk of what the function reaches.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings

from graphify.call import paths as _call_paths
from graphify.first_use.failures import CaptureFailures
from graphify.first_use.structure import Branch, CallStructure, branch_of, fitting, take_over_idle
from graphify.compile.background.jobs import CompileJobs, capture_with
from graphify.compile.compiled import forget_compiled
from graphify.base.errors import (CaptureError, GraphifyError, InputMismatchError, PersistentSwapError, StateChangedError,
                                   StateReplacedError)
from graphify.capture.spec import FunctionSpec
from graphify.plan.keys import exact_keys
from graphify.call.runtime import Miss
from graphify.call.shared_calls import SharedCalls
from graphify.plan.stats import Stats
from graphify.plan.pool import PoolsByDevice
from graphify.reads.reach import stateful_in
from graphify.first_use.room import Room
from graphify.base.axes import static_objects
from graphify.first_use.kinds import (DRIFTS_BEFORE_WARNING, Pending, Sightings, after_drift, drift_warning, family_of, first_sighting, fits,
                          likeness_of)
from graphify.capture import CallCapture, FunctionReads, Prepared, prepare

__all__ = ["FirstUse", "MAX_IDLE"]

log = logging.getLogger("graphify")

MAX_IDLE = 2  # structures whose objects are gone, kept for a new object of the same shapes
MAX_STALE = 3  # structures of one kind dropped because their objects changed, before its calls run eagerly


class FirstUse:
    """The first-use state of one `Graphified`; see the module docstring. `open_capture`:
    what holds a structure's capture open (`CallCapture`; tests pass a recording one)."""

    def __init__(self, spec: FunctionSpec, stats: Stats, open_capture=CallCapture):
        self.spec, self.stats = spec, stats  # (its structures share one walk of what the function reaches, one pool)
        self.open_capture = functools.partial(open_capture, function=FunctionReads.for_spec(spec), pools=PoolsByDevice.for_spec(spec, SharedCalls))
        self.lock = threading.Lock()
        self.structures: list[CallStructure] = []  # most recently used first
        self.seen = Sightings()  # the previous call, which ran eagerly, and recent first sightings
        self.refused: list[Pending] = []  # structures whose calls a graph cannot take as they are
        self.stale: dict = {}  # family -> structures dropped because their objects changed
        self.refused_families: list[tuple] = []  # kinds of calls that run eagerly (state a graph cannot follow)
        self.released = False
        self.warned: set[str] = set()  # the once-only warnings given
        self.failures = CaptureFailures(spec.options.first_use == "strict", self.warned)
        self.room = Room()  # structures released to make room for new objects of their kind
        self.collected = False  # the GC runs before the first capture only
        self.jobs = CompileJobs.for_spec(spec)  # Options(compile="background"): a worker's compiles

    @property
    def limits(self):
        """The bounds of `Options.limits` (`graphify.base.limits.Limits`)."""
        return self.spec.options.limits

    # -- the call ---------------------------------------------------------------------------
    def run(self, args: tuple, kwargs: dict):
        if self.released:
            raise GraphifyError(f"{self.spec.label}: this callable's graphs were released (release()); use "
                                "the callable release() returned")
        if self.jobs is not None and self.jobs.settled():
            for structure in self.jobs.superseded(self.structures):
                self._drop(structure)  # its calls capture again, compiled, as its kin (`CompileJobs.replaced`)
        for structure in tuple(self.structures):
            if structure.torn_down():  # its graphs went with a process group: capture anew
                self._drop(structure)
                self.seen.recent.clear()
                continue
            try:
                out = self._via(structure, args, kwargs)
            except InputMismatchError:
                continue  # not this structure
            except (StateChangedError, PersistentSwapError):  # what its graphs read moved: start over
                self._stale(structure)
                continue
            except StateReplacedError as exc:
                if not exc.replaced:
                    raise
                return self._refuse(structure, exc, args, kwargs)
            self.seen.pending = None
            self._to_front(structure)
            return out
        return self._new_structure(args, kwargs)

    def _via(self, structure: CallStructure, args: tuple, kwargs: dict):
        """A call through `structure`: the branch its Python state takes (`InputMismatchError`
        if the call is not of this structure), that state advanced after a replay as the
        registered types say, and checked after an eager run."""
        slots = structure.layout.bind(args, kwargs)
        checks = structure.runtime.checks  # the arguments before the watch: a call of another structure goes on
        checked = (checks, checks.rows(slots))  # to the next one unwatched; one that fits is watched before a replay
        if not structure.stateful:
            return self._through(structure, structure.default, slots, args, kwargs, checked)
        key, predicted = structure.step(structure.layout.slot_names, slots)
        branch = structure.branches.get(key) if key is not None else None
        if branch is None and key is not None:
            branch = self._open_branch(structure, key, args, kwargs)
        if branch is None:
            out = self._eager(args, kwargs)
            self._check_prediction(structure, predicted)
            return out
        before = branch.runtime.replayed
        out = self._through(structure, branch, slots, args, kwargs, checked)
        if branch.runtime.replayed != before:
            structure.advance(predicted)
        else:  # it ran eagerly, as written
            self._check_prediction(structure, predicted)
        return out

    def _through(self, structure: CallStructure, branch: Branch, slots: tuple, args: tuple, kwargs: dict,
                 checked: tuple | None = None):
        """A call through one branch's runtime, capturing the graph it lacks (or running
        eagerly where no more may be captured); `checked`: see `Runtime.run`."""
        runtime = branch.runtime
        out = _call_paths.run(runtime, slots, self.stats, checked)
        if type(out) is Miss:
            if not self._grow(structure, branch, out):
                return _call_paths.eager(self.spec, self.stats, args, kwargs, out.tokens)
            out = _call_paths.run(runtime, slots, self.stats)
            if type(out) is Miss:  # released by another thread meanwhile
                return _call_paths.eager(self.spec, self.stats, args, kwargs, out.tokens)
        return out

    def _eager(self, args: tuple, kwargs: dict):
        return _call_paths.eager(self.spec, self.stats, args, kwargs)

    def _to_front(self, structure: CallStructure) -> None:
        if self.structures and self.structures[0] is not structure:
            with self.lock:
                if structure in self.structures:
                    self.structures.remove(structure)
                    self.structures.insert(0, structure)

    def _new_structure(self, args: tuple, kwargs: dict):
        try:
            prepared = prepare(self.spec, args, kwargs)
        except (ValueError, TypeError, InputMismatchError):  # nothing to graph (no batch axis, ...)
            self.seen.pending = None
            return self._eager(args, kwargs)
        slots, specs, layout = prepared.args, prepared.specs, prepared.layout
        family = family_of(layout, specs)
        objects = static_objects(specs, slots)
        if any(fits(r, layout, slots) for r in self.refused) or family in self.refused_families:
            return self._eager(args, kwargs)
        if first_sighting(self, prepared, family, objects):  # its warm-up, before the walk of its objects
            self.seen.note(after_drift(self.seen.pending, Pending(layout, specs, self.spec.label, family), slots), objects)
            if self.seen.pending.drifts == DRIFTS_BEFORE_WARNING and "drift" not in self.warned:
                self.warned.add("drift")
                warnings.warn(drift_warning(self.seen.pending, bool(objects)), stacklevel=4)
            return self._eager(args, kwargs)
        branch = branch_of(stateful := stateful_in(objects), layout.slot_names, slots)
        if branch is None:  # a state no graph stands in for (a cache window's crossing)
            return self._eager(args, kwargs)
        with self.lock:
            self._purge()
            taken_over = self._home_for(likeness_of(layout, specs), objects)
        if taken_over is not None:
            return self.run(args, kwargs)  # served by the structure that took the new objects over
        # kin: the same call with new static objects (a new cache, maybe of another length)
        sighted = first_sighting(self, prepared, family, objects, takeover=False)  # no idle look-alike took it
        self.seen.pending = Pending(layout, specs, self.spec.label, family)
        if sighted:
            return self._eager(args, kwargs)
        kin = next((s for s in self.structures if s.family == family and s.graphs), None) if objects else None
        with self.lock:  # another thread may have made it meanwhile
            structure = fitting(self.structures, args, kwargs) or self._open_within_bounds(
                prepared, family, kin, stateful, branch, objects)
        if structure is None:
            return self._eager(args, kwargs)
        return self._first_call(structure, args, kwargs)

    def _open_within_bounds(self, prepared: Prepared, family: tuple, kin: "CallStructure | None", stateful: tuple,
                            branch, objects: dict) -> "CallStructure | None":
        """A new structure for `prepared`'s call, its first branch `branch` (lock held), or
        None where `Limits.structures` are taken and none makes room (logged once)."""
        if len(self.structures) >= self.limits.structures and not (  # the kind's least recently used makes room
                kin is not None and self.room.make(self.structures, family, objects, self.spec.label)):
            self._warn_once(
                "structures", "%s: %d call structures already have graphs; calls of other structures run eagerly "
                "(capture() the one you need, or call with fewer distinct shapes and keywords)",
                self.spec.label, self.limits.structures,
            )
            return None
        kin_keys, writes = self.jobs.take_replaced(family) if self.jobs is not None else (frozenset(), None)
        if kin is not None:  # (what it wrote: the new structure's compiled captures need no recorded run)
            kin_keys, writes = kin_keys | kin.known_keys(), writes if writes is not None else kin.writes()
        structure = CallStructure(prepared.layout, {}, self.spec.sizes is None, family,
                                  likeness_of(prepared.layout, prepared.specs), frozenset(kin_keys), stateful)
        self._add_branch(structure, branch, prepared).capture.carry(writes)
        self.structures.insert(0, structure)
        return structure

    def _add_branch(self, structure: CallStructure, key, prepared: Prepared) -> Branch:
        """A new branch of `structure`, its capture open on `prepared`'s call, first in line."""
        spec = self.spec
        keys = spec.keys if not structure.exact else exact_keys(spec.resolution.mode, spec.batching, self.limits.exact_max_tokens)
        capture = self.open_capture(spec, prepared, keys, tiered=structure.exact)  # buffers grow with the sizes met
        branch = Branch(key, capture, _call_paths.runtime_for(spec, capture.session.table(), keys, capture.session.pool.shared))
        structure.branches = {key: branch, **structure.branches}
        return branch

    def _open_branch(self, structure: CallStructure, key, args: tuple, kwargs: dict) -> Branch | None:
        """A branch of `structure`'s Python state not met before; None past `Limits.branches`."""
        if len(structure.branches) >= self.limits.branches:
            return None
        with self.lock:
            found = structure.branches.get(key)
            return found if found is not None else self._add_branch(structure, key, prepare(self.spec, args, kwargs))

    def _first_call(self, structure: CallStructure, args: tuple, kwargs: dict):
        """The call that opened `structure`, through it; a structure its calls cannot go
        through is dropped, and calls of its kind run eagerly."""
        refused, self.seen.pending = self.seen.pending, None
        try:
            return self._via(structure, args, kwargs)
        except InputMismatchError as exc:  # e.g. weights passed as tokens-axis arguments (default axes)
            self._drop(structure, refused)
            log.warning("%s: these calls cannot be graphed as they are (%s); they run eagerly", self.spec.label, exc)
            return self._eager(args, kwargs)
        except StateReplacedError as exc:
            if not exc.replaced:
                self._drop(structure)
                raise
            return self._refuse(structure, exc, args, kwargs)

    # -- growing a structure's table ---------------------------------------------------------
    def _grow(self, structure: CallStructure, branch: Branch, miss: Miss) -> bool:
        """Capture the graph `miss` asks for into `branch` and install the new table; False
        past the bound or where it cannot be captured."""
        if structure.exact and branch.graphs >= self.limits.graphs_per_structure:
            if not branch.at_limit:
                branch.at_limit = True
                log.warning(
                    "%s: %d graphs captured on first use for one call structure; batches of other sizes run "
                    "eagerly (pass sizes=... to pad to a schedule, or capture() ahead of time)",
                    self.spec.label, self.limits.graphs_per_structure,
                )
            return False
        pair = (miss.decision.mode, miss.decision.key)
        if pair in branch.uncapturable:
            return False
        runtime = branch.runtime  # (a split function's capture runs in the pool: it holds off other structures' calls)
        with _call_paths.stream_scope(runtime), runtime.capturing(whole=self.spec.split is not None):
            if pair in runtime.table.entries:  # another thread captured it meanwhile
                return True
            collect, self.collected = not self.collected, True
            kin, job = (branch.key, pair) in structure.kin_keys, None
            try:  # (loading may add a tier of static buffers, and find no memory for it)
                loaded, written = branch.capture.load(pair, miss.args)
                runtime.wrote(written)
                job = self.jobs.job_for(structure, branch, pair, miss.args) if self.jobs is not None else None
                table, plain = capture_with(job, lambda plain: branch.capture.capture_first_use(
                    pair, miss.args, loaded, kin=kin, collect=collect, plain=plain),
                    strict=self.spec.options.first_use == "strict")
            except CaptureError as exc:
                self.failures.after(exc, structure.family, branch, pair, kin, job)  # raises what must go up
                return False
            runtime.install(table)
            self.failures.captured(structure.family)
            if plain:  # until its compile is made elsewhere
                branch.waiting[pair] = job.send()
        branch.graphs += 1
        structure.settle()
        return True

    def _check_prediction(self, structure: CallStructure, predicted: list) -> None:
        """After an eager run of a structure whose graphs follow Python state: a registered
        type whose prediction was wrong is not followed for it again (its calls run eagerly,
        one warning): a replay would have left that state wrong."""
        why = structure.verify(predicted)
        if why is not None and structure.follows_state:
            structure.follows_state = False
            warnings.warn(f"{self.spec.label}: {why}; graphs cannot follow that state, so these calls run eagerly",
                          stacklevel=5)

    # -- new objects, stale and refused structures -------------------------------------------
    def _home_for(self, likeness: tuple, objects: dict) -> "CallStructure | None":
        """An idle structure that took over this call's new static objects (lock held), now
        first in line."""
        structure = take_over_idle(self.structures, likeness, objects)
        if structure is not None:
            self.structures.remove(structure)
            self.structures.insert(0, structure)
        return structure

    def _purge(self) -> None:
        """Keep the `MAX_IDLE` most recently used structures whose static objects are gone
        (a transformers cache that generate() dropped), at the end; release the rest (lock
        held)."""
        idle = [s for s in self.structures if not s.alive()]
        for s in idle[MAX_IDLE:]:
            self.structures.remove(s)
            s.release()
        for s in idle[:MAX_IDLE]:  # behind the live ones: calls try those first
            self.structures.remove(s)
            self.structures.append(s)

    def _drop(self, structure: CallStructure, refused: "Pending | None" = None) -> None:
        """Release `structure`; with `refused`, later calls of its kind run eagerly."""
        with self.lock:
            if structure in self.structures:
                self.structures.remove(structure)
            if refused is not None and len(self.refused) < self.limits.structures:
                self.refused.append(refused)
        structure.release()

    def _stale(self, structure: CallStructure) -> None:
        """A structure over what changed (anything a call reads): dropped, its calls start
        over; a kind that changes again before its graphs replay `MAX_STALE` times, that many
        times in a row, runs eagerly from then on (a research loop changing a hook now and
        then keeps its graphs)."""
        thrash = sum(b.runtime.replayed for b in structure.branches.values()) < MAX_STALE
        count = self.stale[structure.family] = self.stale.get(structure.family, 0) + 1 if thrash else 1
        self._drop(structure)
        self.seen.recent.clear()  # sightings before the change do not say that calls after it come back
        forget_compiled(self.spec)  # dynamo's entries (Options.compile) were traced over the old state
        if self.jobs is not None:  # the worker's copy of the function may read the old weights
            self.jobs.start_over()
        if count >= MAX_STALE:
            self.refused_families.append(structure.family)
            log.warning("%s: what the graphs read changed before they could replay, %d times in a row; these calls "
                        "run eagerly from now on", self.spec.label, count)

    def _refuse(self, structure: CallStructure, exc: StateReplacedError, args: tuple, kwargs: dict):
        """Calls of this kind replace what their graphs would read: they run eagerly from
        now on, with one warning."""
        self._drop(structure)
        self.refused_families.append(structure.family)
        if "replaced" not in self.warned:
            self.warned.add("replaced")
            warnings.warn(f"{exc} (these calls run eagerly, without graphs)", stacklevel=4)
        return self._eager(args, kwargs)

    def _warn_once(self, what: str, message: str, *values) -> None:
        if what not in self.warned:
            self.warned.add(what)
            log.warning(message, *values)

    # -- the callable's other verbs ---------------------------------------------------------
    def wait_compiles(self, timeout: float | None) -> bool:
        """Wait for the compiles sent so far; whether all settled within `timeout` s."""
        return self.jobs.wait(timeout) if self.jobs is not None else True

    def current(self) -> CallStructure | None:
        return self.structures[0] if self.structures else None

    def release(self) -> int:
        """Free every structure's graphs; later calls raise. Returns how many were freed."""
        self.released = True
        with self.lock:
            structures, self.structures = self.structures, []
        return sum(s.release() for s in structures)

    def summary(self) -> str:
        structures = tuple(self.structures)
        branches = [b for s in structures for b in s.branches.values()]
        graphs = sum(len(b.runtime.table) for b in branches)
        mib = sum(b.runtime.table.nbytes for b in branches) / (1 << 20)
        seconds = sum(b.capture.seconds for b in branches)
        return (f"; first use: {graphs} graphs over {len(structures)} call structure(s) in {seconds:.2f} s, "
                f"{mib:.1f} MiB reserved")
