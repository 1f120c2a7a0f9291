"""Lockstep for graphified functions that run collectives (tensor parallelism).

Every rank must capture the same graphs in the same order, and replay the same graph on
every call, or the collectives inside them pair up wrongly and hang. `Lockstep` checks
both on a gloo (CPU) group of the same ranks, so a disagreement is an error on every rank,
never a hang: before capture the ranks compare their capture plans; after it, whether
each succeeded; on each call, the graph (or eager shape) each rank is about to run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._errors import CaptureError, DispatchMismatchError

__all__ = ["Lockstep", "DispatchMismatchError"]

_CPU_GROUPS: dict = {}


def _cpu_group(group):
    """A gloo group over `group`'s ranks (the group itself if it is gloo), made once."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _CPU_GROUPS:  # every rank reaches this in the same order (capture is collective)
        _CPU_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo")
    return _CPU_GROUPS[ranks]


class Lockstep:
    """Agreement among the ranks of `group` for one graphified function (see module doc)."""

    def __init__(self, group, call: str):
        import torch.distributed as dist

        self.dist, self.call = dist, call
        self.group = group if group is not None else dist.group.WORLD
        self.cpu = _cpu_group(self.group)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._mine = torch.zeros(3, dtype=torch.int64)
        self._all = [torch.zeros(3, dtype=torch.int64) for _ in range(self.world)]

    def _gather(self, obj) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.cpu)
        return out

    def agree_plan(self, plan: Sequence[str] | None, error: BaseException | None = None) -> None:
        """Raise on every rank unless all ranks plan the same graphs in the same order. A
        rank that failed before planning (`error`) passes None and re-raises its own error;
        the others raise a `CaptureError` naming it."""
        mine = {"plan": None if plan is None else list(plan),
                "error": None if error is None else f"{type(error).__name__}: {error}"}
        everyone = self._gather(mine)
        failed = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"] is not None]
        if failed:
            if error is not None:
                return  # the caller raises its own error
            rank, msg = failed[0]
            raise CaptureError(f"{self.call}: rank {rank} could not prepare its capture ({msg}); no rank captured")
        plans = [e["plan"] for e in everyone]
        if any(p != plans[0] for p in plans):
            other = next(r for r, p in enumerate(plans) if p != plans[0])
            first = next((i for i, (a, b) in enumerate(zip(plans[0], plans[other])) if a != b), None)
            where = (f"graph {first}: rank 0 plans {plans[0][first]}, rank {other} plans {plans[other][first]}"
                     if first is not None else f"rank 0 plans {len(plans[0])} graphs, rank {other} {len(plans[other])}")
            raise CaptureError(
                f"{self.call}: ranks disagree on what to capture ({where}); every rank must graphify with the "
                "same mode, sizes and options so that their collectives pair up"
            )
        self.dist.barrier(group=self.cpu)

    def agree_outcome(self, error: BaseException | None) -> None:
        """After capture: raise on every rank if any rank failed (naming the first)."""
        errors = self._gather(None if error is None else f"{type(error).__name__}: {error}")
        self.dist.barrier(group=self.cpu)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed and error is None:
            rank, msg = failed[0]
            raise CaptureError(f"{self.call}: capture failed on rank {rank} ({msg}); released this rank's graphs too")

    def agree_call(self, mode: int, tokens: int, reqs: int, describe) -> None:
        """Before a call runs: every rank must run the same graph (or the same eager shape)."""
        mine = self._mine
        mine[0], mine[1], mine[2] = mode, tokens, reqs
        self.dist.all_gather(self._all, mine, group=self.cpu)
        if any(not torch.equal(row, mine) for row in self._all):
            choices = ", ".join(f"rank {r}: {describe(*row.tolist())}" for r, row in enumerate(self._all))
            raise DispatchMismatchError(
                f"{self.call}: ranks chose different graphs for this call ({choices}); every rank must call with "
                "the same batch (num_tokens and num_reqs), or their collectives would not pair up"
            )
