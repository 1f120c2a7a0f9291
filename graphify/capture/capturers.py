"""How each runtime mode captures one key, and how little warming up each key needs.

The first key of a mode in a table runs the whole protocol: warm-ups, the first under the
op guard, with in-place writes to outside state recorded and undone. Later keys run the
same code at another batch size, so they skip what the size cannot change:

- the op guard, for split functions: `split` traced them into fixed ATen graphs, so the
  ops that run are the same at every size (an unsplit function is Python that may branch
  on its batch size, so it stays guarded at every size);
- PIECEWISE on CUDA: uncompiled graph pieces are plain ATen ops, warmed up at the first
  size; later sizes capture them straight away (a capture executes nothing), and only the
  split ops, which run eagerly in the capture pass, have their writes recorded;
- FULL of a split function of plain pieces: the PIECEWISE schedule of the same token
  count was captured just before. Where its key has as many request rows as this one (a
  decode batch of one token per request), its capture pass already ran every op the FULL
  graph holds at these very shapes (graph pieces captured, split ops eagerly), so FULL
  captures straight away. Otherwise (several query tokens per request) the schedule is
  replayed once with its split ops at this key's shape, compiling or tuning what they
  need, in a few milliseconds instead of an eager pass over the whole model.

Replaying a schedule runs its graph pieces unrecorded, so it stands in for a warm-up only
where `split` found that no graph piece writes in place to the function's inputs or
closed-over tensors (`Piecewise.pieces_write_outside`; a model whose attention op writes
its KV cache qualifies); otherwise those keys warm up eagerly, recorded.

Compiled pieces (inductor) keep a warm-up at every size, since a new shape may compile. For
PIECEWISE keys after the first, where graph pieces write nothing outside, the split ops'
writes are recorded as they run in the pass (as for plain pieces) instead of by an eager,
recorded run of the whole function first. FULL keys warm up twice, running the compiled
code at the key's shapes (without that run, a FULL graph captured straight after its
schedule replayed slower: benchmarks/results); the writes those warm-ups make are learnt from
one replay of the same-size schedule where it can stand in, else from a first warm-up
recorded under a dispatch mode, which runs the pieces as traced. At the
sizes chosen for specialisation (`Options(compile_sizes=...)`) compiled pieces run, in
warm-ups and capture alike, a compile for the key's exact shapes (made by the warm-up, never
inside a capture). FULL of an unsplit function warms up at every key (unknown code may set
itself up per shape). The simulation backend executes what it "captures", so there every
PIECEWISE key records the whole function's writes; its FULL keys follow the rules above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs

from graphify.compile.aot import checks_held
from graphify.base.modes import Mode
from graphify.reads.code_names import global_hooks_set
from graphify.backends.tensor_writes import Unguarded
from graphify.backends.interface import CompiledCode

__all__ = ["CaptureSettings", "KeyCapture", "mode_capturers"]


@attrs.frozen
class CaptureSettings:
    """The backend's capture keywords that every key of a session shares."""

    pool: Any  # the pool's handle for this device and backend
    warmups: int  # at least this many eager runs before a capture that warms up
    weak_outputs: bool
    stream: Any = None  # the side stream captures run on

    def for_backend(self, warmups: int) -> dict:
        return {"pool": self.pool, "warmups": warmups, "weak_outputs": self.weak_outputs, "stream": self.stream}


@attrs.frozen(eq=False)
class KeyCapture:
    """One key's capture, as the capturer decides its warm-ups from: `first` of its mode in
    the table; `sibling` the PIECEWISE entry of the same token count, captured already;
    `quick` (first use, kin captured before) for no warm-up (compiled: no op guard; `whole`,
    a kin's writes, undo its warm-ups without a recorded eager run); `probe` what the state keeper
    records to learn the whole function's writes; `plain` for the eager function where `fn`
    is compiled."""

    key: Any  # BatchDescriptor
    keeper: Any  # StateKeeper
    first: bool
    probe: Callable | None = None
    sibling: Any = None
    quick: bool = False
    plain: bool = False  # record the function as written, not compiled (`graphify.compile.background.line`)
    whole: tuple | None = None  # storages whose whole copies undo compiled warm-ups (`kin_writes`)


def mode_capturers(
    backend, fn: Callable, twin: Callable | None, piecewise_fn=None, full_for: Callable | None = None,
    specialise: frozenset = frozenset(), whole: bool = False,
) -> dict[Mode, Callable]:
    """{mode: capturer}; a capturer takes (args, `KeyCapture`, `CaptureSettings`) and returns
    a `Captured`. `twin` is the eager function behind a compiled `fn`; `piecewise_fn` the
    split function for PIECEWISE keys; `full_for(key) -> (fn, twin)` what a FULL key records
    instead (tensor parallelism prefixes each with the ranks' agreement check on that key's
    code). `specialise`: the token counts whose captures run compiled pieces specialised to
    their shapes. `whole`: FULL keys of the split function record `fn`, the function it was
    split from compiled whole (`Options(compile=True)`), which may compile at any new size,
    so every key warms up."""
    policy = _Capturers(backend, fn, twin, piecewise_fn, full_for, specialise, whole)
    capturers = {Mode.FULL: policy.full}
    if piecewise_fn is not None:
        capturers[Mode.PIECEWISE] = policy.piecewise
    return capturers


@attrs.frozen(eq=False)
class _Capturers:
    backend: Any
    fn: Callable
    twin: Callable | None
    split: Any  # the Piecewise function, or None
    full_for: Callable | None
    specialise: frozenset
    whole: bool

    @property
    def compiled(self) -> bool:
        return self.split is not None and self.split.compiled

    def _shaped(self, key):
        """The context a key's warm-ups and capture run in: compiled pieces specialised to
        its shapes where its size is chosen."""
        if self.compiled and key.num_tokens in self.specialise:
            return self.split.specialised(key.num_tokens)
        return contextlib.nullcontext()

    def full(self, args, step: KeyCapture, settings: CaptureSettings):
        fn, twin = self.full_for(step.key) if self.full_for is not None else (self.fn, self.twin)
        if twin is not None and (step.plain or global_hooks_set()):
            # as written: while the compile is made elsewhere, or where global module hooks are
            # set (torch 2.11's dynamo left them out of its traces: wrong graphs on the H100)
            fn, twin = twin, None
        keeper = step.keeper
        if twin is not None and step.quick and step.whole is not None and self.split is None:
            # a kin's recorded runs said what the call writes: the compiled warm-up alone runs,
            # undone by whole copies of those storages (`graphify.capture.kin_writes`)
            keeper.take_whole(step.whole)
            with keeper.covering(), checks_held():
                return self.backend.capture(CompiledCode(fn, twin), args, guard=False, keeper=keeper,
                                            **settings.for_backend(max(settings.warmups, 1)))
        warmups, guard, through_schedule = self._full_policy(step, twin, settings.warmups)
        with self._shaped(step.key):
            covering = contextlib.nullcontext()
            if through_schedule:
                _learn_from_schedule(step)
                if warmups:  # the warm-ups run what the schedule's record covers
                    covering = keeper.covering()
                else:
                    keeper.forget()  # let go of what it wrote before capturing: the pool may reuse it
            if twin is not None or self.compiled:  # compiled code: see `CompiledCode`
                fn = CompiledCode(fn, twin)
            with covering, checks_held():  # no user code between its compiled calls (the eager twin runs first)
                return self.backend.capture(fn, args, guard=guard, keeper=keeper, **settings.for_backend(warmups))

    def _full_policy(self, step: KeyCapture, twin, warmups: int) -> tuple:
        """(warm-ups, op guard, whether a replay of the same-size schedule learns the writes
        first) for a FULL key."""
        if self.whole:  # the first key checks the eager original under the op guard; each warms up
            return max(warmups, 2), twin if step.first else False, False
        compiled = self.compiled
        if step.quick and twin is None and not compiled:
            # First use, a structure whose kin (the same code at other static shapes, such as
            # a new transformers cache length) captured before: capture straight away. A
            # capture executes nothing on CUDA, so nothing to record or undo there.
            return 0, False, False
        # Replaying the schedule runs its graph pieces for real, unrecorded: only where they
        # write nothing outside the call (`Piecewise.pieces_write_outside`).
        replayable = step.sibling is not None and not step.first and not self.split.pieces_write_outside
        if not step.first and step.sibling is not None and not compiled:
            if step.sibling.key.reqs_rows == step.key.reqs_rows:  # its capture pass ran every op at these shapes
                return 0, False, False
            return (0, False, True) if replayable else (max(warmups, 1), False, False)
        if replayable and compiled:
            # Compiled pieces never capture straight after the schedule: their FULL graph, with
            # no eager run of the compiled code at these shapes first, replayed the same kernels
            # slower (more idle time between kernels), and a specialised compile for this key's
            # request rows may not exist yet. Both warm-ups run the compiled code.
            return max(warmups, 2), False, True
        split = self.split is not None
        if twin is not None and step.quick and not split:
            # A kin captured this key (the structure these compiled graphs replace, or the same
            # code over another cache length): its op guard and code recording ran over the
            # same code. The first warm-up still runs the eager twin, to record what to undo.
            return max(warmups, 2), Unguarded(twin), False
        if twin is not None:
            # torch.compile'd code called under the op guard's dispatch mode falls back to
            # eager for good, so the guard checks the eager twin; an unguarded warm-up then
            # compiles on these very arguments and the capture records inductor's kernels.
            return max(warmups, 2), twin if step.first or not split else False, False
        # Compiled pieces run as traced in the first, recorded warm-up (no compile under a
        # dispatch mode), so a second one compiles what this key's shapes need before capture.
        return max(warmups, 2 if compiled else 1), step.first or not split, False

    def piecewise(self, args, step: KeyCapture, settings: CaptureSettings):
        executes = self.backend.name != "cuda"  # the simulation runs what it captures
        warm = step.first or self.compiled or executes
        # The pass runs graph pieces eagerly (warm-ups): learn the whole function's writes
        # first, unless only the split ops can write outside state (their writes are then
        # recorded as they run in the pass).
        probed = warm and step.probe is not None and (step.first or executes or self.split.pieces_write_outside)
        keeper = step.keeper
        if probed:
            keeper.record_writes(step.probe, *args)
            keeper.restore()
        try:
            with self._shaped(step.key):
                return self.split.capture_pieces(
                    self.backend, args, guard=step.first, keeper=keeper, record=not probed,
                    **settings.for_backend(max(settings.warmups, 1) if warm else 0),
                )
        finally:
            keeper.restore()


def _learn_from_schedule(step: KeyCapture) -> None:
    """Replay the same-size PIECEWISE schedule with its split ops at this key's shape
    (compiling or tuning what they need) under the recorder: it writes what a run at this
    key writes, at a fraction of an eager pass over the whole function."""
    key = step.key
    step.keeper.record_writes(step.sibling.graph.replay, key.num_tokens, key.reqs_rows, True)
    step.keeper.restore()
