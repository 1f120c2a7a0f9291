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
schedule replayed ~10% slower on the H100); the writes those warm-ups make are learnt from
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

from .._mode import Mode

__all__ = ["mode_capturers"]


def mode_capturers(
    backend, fn: Callable, twin: Callable | None, piecewise_fn=None, full_for: Callable | None = None,
    specialise: frozenset = frozenset(), whole: bool = False,
) -> dict[Mode, Callable]:
    """{mode: capturer}; a capturer takes (args, *, key, pool, warmups, weak_outputs, stream,
    keeper, probe, first, sibling, quick) and returns a `Captured`. `twin` is the eager function
    behind a compiled `fn`; `piecewise_fn` the split function for PIECEWISE keys;
    `full_for(key) -> (fn, twin)` what a FULL key records instead (tensor parallelism
    prefixes each with the ranks' agreement check on that key's code). `specialise`: the
    token counts whose captures run compiled pieces specialised to their shapes. `whole`: FULL
    keys of the split function record `fn`, the function it was split from compiled whole
    (`Options(compile=True)`), which may compile at any new size, so every key warms up."""
    executes = backend.name != "cuda"  # the simulation runs what it captures
    split = piecewise_fn is not None
    compiled = piecewise_fn is not None and piecewise_fn.compiled
    if full_for is None:
        def full_for(key):
            return fn, twin

    def shaped(key):
        """The context a key's warm-ups and capture run in: compiled pieces specialised
        to its shapes where its size is chosen."""
        if compiled and key.num_tokens in specialise:
            return piecewise_fn.specialised(key.num_tokens)
        return contextlib.nullcontext()

    def full(args, *, key, **kw):
        with shaped(key):
            return full_capture(args, key=key, **kw)

    def full_capture(args, *, key, warmups, keeper, probe, first, sibling, quick=False, **kw):
        fn, twin = full_for(key)
        if whole:  # the first key checks the eager original under the op guard; each warms up
            return backend.capture(fn, args, warmups=max(warmups, 2), guard=twin if first else False,
                                   keeper=keeper, **kw)
        if quick and twin is None and not compiled:
            # First use, a structure whose kin (the same code at other static shapes, such as
            # a new transformers cache length) captured before: capture straight away. A
            # capture executes nothing on CUDA, so nothing to record or undo there.
            return backend.capture(fn, args, warmups=0, guard=False, keeper=keeper, **kw)
        # Replaying the schedule runs its graph pieces for real, unrecorded: only where they
        # write nothing outside the call (`Piecewise.pieces_write_outside`).
        replayable = sibling is not None and not first and not piecewise_fn.pieces_write_outside

        def learn_from_schedule():
            """Replay the same-size PIECEWISE schedule with its split ops at this key's shape
            (compiling or tuning what they need) under the recorder: it writes what a run at
            this key writes, in ~2 ms instead of an eager pass over the whole function."""
            keeper.record_writes(sibling.graph.replay, key.num_tokens, key.reqs_rows, True)
            keeper.restore()

        if not first and sibling is not None and not compiled:
            if sibling.key.reqs_rows == key.reqs_rows:  # its capture pass ran every op of this graph at these shapes
                return backend.capture(fn, args, warmups=0, guard=False, keeper=keeper, **kw)
            if not replayable:
                return backend.capture(fn, args, warmups=max(warmups, 1), guard=False, keeper=keeper, **kw)
            learn_from_schedule()
            keeper.forget()  # let go of what it wrote before capturing: the pool may reuse it
            return backend.capture(fn, args, warmups=0, guard=False, keeper=keeper, **kw)
        if replayable and compiled:
            # Compiled pieces never capture straight after the schedule: their FULL graph, with no
            # eager run of the compiled code at these shapes first, replayed the same kernels,
            # launch dimensions and topology ~10% slower on the H100 (more idle time between every
            # pair of kernels: 1.25 vs 1.14 ms a batch-8 step, four probes), and a specialised
            # compile for this key's request rows may not exist yet. Both warm-ups run the
            # compiled code; the schedule's record covers what they write.
            learn_from_schedule()
            with keeper.covering():
                return backend.capture(fn, args, warmups=max(warmups, 2), guard=False, keeper=keeper, **kw)
        if twin is not None:
            # torch.compile'd code called under the op guard's dispatch mode falls back to
            # eager for good, so the guard checks the eager twin; an unguarded warm-up then
            # compiles on these very arguments and the capture records inductor's kernels.
            return backend.capture(fn, args, warmups=max(warmups, 2), guard=twin if first or not split else False,
                                   keeper=keeper, **kw)
        # Compiled pieces run as traced in the first, recorded warm-up (no compile under a
        # dispatch mode), so a second one compiles what this key's shapes need before capture.
        return backend.capture(fn, args, warmups=max(warmups, 2 if compiled else 1), guard=first or not split,
                               keeper=keeper, **kw)

    capturers = {Mode.FULL: full}
    if piecewise_fn is not None:

        def piecewise(args, *, key, warmups, keeper, probe, first, sibling, quick=False, **kw):
            warm = first or compiled or executes
            # The pass runs graph pieces eagerly (warm-ups): learn the whole function's writes
            # first, unless only the split ops can write outside state (their writes are then
            # recorded as they run in the pass).
            probed = warm and probe is not None and (first or executes or piecewise_fn.pieces_write_outside)
            if probed:
                keeper.record_writes(probe, *args)
                keeper.restore()
            try:
                with shaped(key):
                    return piecewise_fn.capture_pieces(
                        backend, args, warmups=max(warmups, 1) if warm else 0, guard=first, keeper=keeper,
                        record=not probed, **kw,
                    )
            finally:
                keeper.restore()

        capturers[Mode.PIECEWISE] = piecewise
    return capturers
