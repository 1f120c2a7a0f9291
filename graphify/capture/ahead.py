"""`capture()` ahead of time: every planned key in one session, into one pool.

Keys are captured in `KeySet.pairs()` order (mixed keys largest first, then uniform keys),
so smaller graphs reuse the larger ones' memory. On any failure the graphs captured so far
are released and a `CaptureError` names the key that failed. With `Options(group=...)` (tensor
parallelism) the ranks agree on the plan before capturing and on the outcome after, so a
rank that fails never leaves the others waiting.
"""

from __future__ import annotations

import logging

import attrs

from graphify.base.errors import CaptureError
from graphify.capture.spec import FunctionSpec
from graphify.reads.reach import stateful_in
from graphify.plan.table import GraphTable
from graphify.capture.failed import as_capture_error
from graphify.capture.prepare import prepare
from graphify.capture.session import CaptureSession

__all__ = ["capture_ahead"]

log = logging.getLogger("graphify")
MiB = 1 << 20


def capture_ahead(spec: FunctionSpec, example_args: tuple, example_kwargs: dict) -> GraphTable:
    """Capture every key `spec` plans, from one example call; the table of all of them."""
    lockstep = None
    if spec.group is not None:  # tensor parallel: every rank plans and captures the same graphs
        from graphify.distributed.lockstep import Lockstep

        lockstep = Lockstep(spec.group, spec.label, spec.options.lockstep)
    try:
        prepared = prepare(spec, example_args, example_kwargs)
    except Exception as exc:
        if lockstep is not None:  # the other ranks must hear of it, or they wait forever
            lockstep.agree_plan(None, exc)
        raise
    if lockstep is not None:
        lockstep.agree_plan(
            [f"mode {spec.resolution.mode.value}"]
            + [f"{m.value} {k}" for m, k in spec.keys.pairs(spec.options.largest_first)]
        )
    try:
        table = _capture_all(spec, prepared, lockstep)
    except BaseException as exc:
        if lockstep is not None:
            lockstep.agree_outcome(exc)
        raise
    if lockstep is not None:
        try:
            lockstep.agree_outcome(None)
        except CaptureError:
            table.release()
            raise
        table = attrs.evolve(table, lockstep=lockstep)
        lockstep.track(table)  # released with its group (`graphify.release_all`)
    return table


def _capture_all(spec: FunctionSpec, prepared, lockstep) -> GraphTable:
    try:
        session = CaptureSession(spec, prepared, spec.keys, lockstep=lockstep)
        _follows_no_state(spec, session)
    except Exception as exc:  # out_axes that cannot be, a pool of another device, ...
        raise as_capture_error(spec.label, exc, 0, len(spec.keys)) from exc
    try:
        table = session.capture(session.keys.pairs(spec.options.largest_first))
    except BaseException:
        session.abort()  # a kept exception's frames reference the session: it must pin nothing
        raise
    if session.keeper.unrestorable:
        log.warning("%s: capture ran %s on outside tensors, which cannot be undone", spec.label,
                    sorted(session.keeper.unrestorable))
    log.info("%s: captured %d graphs in %.2f s, %.1f MiB in pool %r", spec.label, len(table), table.seconds,
             table.nbytes / MiB, session.pool.name)
    return table


def _follows_no_state(spec: FunctionSpec, session: CaptureSession) -> None:
    """Refuse static objects whose Python state graphs must follow by branch
    (`graphify.reads.stateful_types`): ahead-of-time graphs serve one branch and cannot advance
    that state; first use (calling the function without `capture()`) follows it."""
    stateful = stateful_in(session.objects(session.example))
    if stateful:
        obj, _, path = stateful[0]
        raise CaptureError(
            f"{spec.label}: {path} ({type(obj).__name__}) keeps Python state that decides what each call runs "
            "(a sliding-window cache layer's counter); graphs captured ahead of time cannot follow it. Call the "
            "graphified function without capture(): first use captures a graph per branch and advances that state"
        )
