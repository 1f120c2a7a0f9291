"""Lockstep for graphified functions that run collectives (tensor parallelism).

Every rank must capture the same graphs in the same order, and replay the same graph on
every call, or the collectives inside them pair up wrongly and hang. Before capture the
ranks compare their capture plans and after it whether each succeeded, on a gloo (CPU)
group of the same ranks. On each call, `Options(lockstep=...)` picks the check:

- "graph" (default): each FULL graph begins with a check recorded into it: one all-reduce
  (MAX) of [code, -code] over the function's own group, where the code names the graph,
  and a device-side assert that the ranks' codes agree. It costs no host time per call
  and one tiny collective on the device. PIECEWISE and eager calls run the same check
  eagerly first, so a rank replaying a FULL graph and one running eagerly still pair up.
  A mismatch stops every rank: on CUDA a device-side assert (the process's CUDA context
  is lost: restart it), on the CPU a `DispatchMismatchError`.
- "host": every call all-gathers (mode, tokens, requests) on the gloo group first and
  raises `DispatchMismatchError` naming every rank's choice; nothing is lost, but it
  blocks the host for a round trip (`benchmarks.tensor_parallel` measures it).
- "off": no per-call check (the caller guarantees equal batches on every rank).

Graphs that hold collectives must be freed before their process group is destroyed:
`release_all()` does it, and graphify calls it itself before
`torch.distributed.destroy_process_group` and at interpreter exit. That covers graphs
captured without `group=` while a process group exists too (a transformers model loaded
with `tp_plan="auto"` through the one line: DTensor's all-reduces inside the graphs); on
NCCL a communicator torn down under a live graph that launches it never returns.
"""

from __future__ import annotations

import atexit
import functools
import gc
import weakref
from collections.abc import Callable, Sequence

import torch

from graphify.base.errors import CaptureError, DispatchMismatchError
from graphify.base.options import LOCKSTEP_POLICIES

__all__ = ["Lockstep", "DispatchMismatchError", "release_all", "track_ungrouped", "ungrouped_graphs", "TEARDOWNS", "LOCKSTEP_POLICIES"]

_CPU_GROUPS: dict = {}
_LIVE: "weakref.WeakSet[Lockstep]" = weakref.WeakSet()
_UNGROUPED: "weakref.WeakSet" = weakref.WeakSet()  # tables captured without group= while a group existed
TEARDOWNS = [0]  # how many times `release_all` released such tables: first use then captures anew
_HOOKED = [False]
_TOKEN_BITS = 24  # bits for tokens and for requests + 1 in a graph code


def graph_code(mode: int, tokens: int, reqs: int) -> int:
    """One int64 naming a call's choice: runtime mode index, token rows, request rows (-1: none)."""
    return (mode << (2 * _TOKEN_BITS)) | (tokens << _TOKEN_BITS) | (reqs + 1)


def describe_choice(mode: int, tokens: int, reqs: int) -> str:
    """'FULL graph for 8 tokens, 8 requests' from a call's (mode index, tokens, requests)."""
    from graphify.base.modes import Mode

    chosen = tuple(Mode)[mode]
    what = "eager" if chosen is Mode.NONE else f"{chosen.value} graph"
    return f"{what} for {tokens} tokens" + (f", {reqs} requests" if reqs >= 0 else "")


def decode_code(code: int) -> tuple[int, int, int]:
    mask = (1 << _TOKEN_BITS) - 1
    return code >> (2 * _TOKEN_BITS), (code >> _TOKEN_BITS) & mask, (code & mask) - 1


def release_all(group=None) -> int:
    """Free the graphs of every graphified callable whose graphs run collectives on
    `group` (every group when None) and return how many graphs were freed. Calls through
    those callables then raise, saying to capture again. graphify calls this before
    `torch.distributed.destroy_process_group` and at exit; call it yourself before any
    other teardown of the group (a graph holding collectives must not outlive it)."""
    freed = 0
    for lockstep in list(_LIVE):
        if group is None or lockstep.group is group or lockstep.cpu is group:
            freed += lockstep.release()
    # No group= says which group their collectives use (DTensor's meshes make their own):
    # every teardown releases them, a recapture being the price of never hanging.
    ungrouped = sum(table.release() for table in list(_UNGROUPED) if not table.released)
    if ungrouped:
        TEARDOWNS[0] += 1
    freed += ungrouped
    if freed:
        gc.collect()  # the CUDA graphs themselves go when their last reference does
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return freed


def track_ungrouped(table) -> None:
    """Release `table` with any process group (see the module doc) if one exists now: its
    graphs may launch that group's collectives although no `group=` said so."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _install_hooks()
        _UNGROUPED.add(table)


def ungrouped_graphs() -> int:
    """How many graphs captured without `group=` under a process group are still held."""
    return sum(len(table.entries) for table in list(_UNGROUPED) if not table.released)


def _install_hooks() -> None:
    """Once per process: release graphs before `destroy_process_group` and at exit."""
    if _HOOKED[0]:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    destroy = distributed_c10d.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group=None, *args, **kwargs):
        release_all(group)  # the default group's teardown takes every group with it
        return destroy(group, *args, **kwargs)

    destroy_process_group.__graphify_wrapped__ = destroy
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    atexit.register(release_all)
    _HOOKED[0] = True


def _group_device(group) -> torch.device:
    """Where the group's collectives run: the current CUDA device for NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cpu_group(group):
    """A gloo group over `group`'s ranks (the group itself if it is gloo), made once."""
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _CPU_GROUPS:  # every rank of the group reaches this in the same order (capture is collective)
        # A subgroup's ranks make it alone: ranks of other subgroups (tensor parallelism in
        # pairs on four GPUs) capture their own graphs and never reach this call for it.
        local = {"use_local_synchronization": True} if len(ranks) < dist.get_world_size() else {}
        _CPU_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", **local)
    return _CPU_GROUPS[ranks]


class Lockstep:
    """Agreement among the ranks of `group` for one graphified function (see module doc)."""

    def __init__(self, group, label: str, policy: str = "graph"):
        import torch.distributed as dist

        self.dist, self.label, self.policy = dist, label, policy  # the policy was validated by Options
        self.group = group if group is not None else dist.group.WORLD
        self.device = _group_device(self.group)  # where the per-call check's collective runs
        self.cpu = _cpu_group(self.group)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._mine = torch.zeros(3, dtype=torch.int64)
        self._all = [torch.zeros(3, dtype=torch.int64) for _ in range(self.world)]
        self.tables: "weakref.WeakSet" = weakref.WeakSet()
        _install_hooks()
        _LIVE.add(self)

    def track(self, table) -> None:
        """Track a table whose graphs hold this group's collectives (for `release_all`)."""
        self.tables.add(table)

    def release(self) -> int:
        """Release every tracked table's graphs; how many were freed."""
        return sum(table.release() for table in list(self.tables) if not table.released)

    @property
    def in_graph(self) -> bool:
        return self.policy == "graph"

    def checked(self, fn: Callable | None, code: int) -> Callable | None:
        """`fn` preceded by the agreement check on `code`: what a FULL capture records under
        the "graph" policy (its warm-ups run the check eagerly, in step on every rank)."""
        if fn is None:
            return None

        def checked_fn(*args):
            self.guard(code)
            return fn(*args)

        return checked_fn

    def guard(self, code: int) -> None:
        """All ranks must pass the same `code`: one all-reduce (MAX) of [code, -code] over
        the group, then a device-side assert on CUDA (recordable into a graph) or a
        `DispatchMismatchError` on the CPU."""
        device = self.device
        both = torch.full((2,), code, dtype=torch.int64, device=device)
        both[1:].neg_()
        # the functional collective and its wait are ops of their own: a CUDA graph and the
        # simulation's tape both record the pair (c10d's in-place all_reduce waits in Python)
        functional = torch.ops._c10d_functional
        both = functional.wait_tensor(functional.all_reduce(both, "max", self.group.group_name))
        if device.type == "cuda":
            torch._assert_async(
                both.sum() == 0,
                f"{self.label}: ranks chose different graphs for this call (lockstep='graph'); every rank must call "
                "with the same batch. Options(lockstep='host') names each rank's choice",
            )
            return
        # On the CPU, one op that compares and raises: the simulation's tape records it, so
        # a replayed graph carries the check as a CUDA graph carries its assert.
        _agree_op(both, code, self.rank, self.label)

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
            raise CaptureError(f"{self.label}: rank {rank} could not prepare its capture ({msg}); no rank captured")
        plans = [e["plan"] for e in everyone]
        if any(p != plans[0] for p in plans):
            other = next(r for r, p in enumerate(plans) if p != plans[0])
            first = next((i for i, (a, b) in enumerate(zip(plans[0], plans[other])) if a != b), None)
            where = (f"graph {first}: rank 0 plans {plans[0][first]}, rank {other} plans {plans[other][first]}"
                     if first is not None else f"rank 0 plans {len(plans[0])} graphs, rank {other} {len(plans[other])}")
            raise CaptureError(
                f"{self.label}: ranks disagree on what to capture ({where}); every rank must graphify with the "
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
            raise CaptureError(f"{self.label}: capture failed on rank {rank} ({msg}); released this rank's graphs too")

    def agree_call(self, mode: int, tokens: int, reqs: int) -> None:
        """Before a call runs: every rank must run the same graph (or the same eager shape)."""
        mine = self._mine
        mine[0], mine[1], mine[2] = mode, tokens, reqs
        self.dist.all_gather(self._all, mine, group=self.cpu)
        if any(not torch.equal(row, mine) for row in self._all):
            choices = ", ".join(f"rank {r}: {describe_choice(*row.tolist())}" for r, row in enumerate(self._all))
            raise DispatchMismatchError(
                f"{self.label}: ranks chose different graphs for this call ({choices}); every rank must call with "
                "the same batch (num_tokens and num_reqs), or their collectives would not pair up"
            )


@torch.library.custom_op("graphify::lockstep_agree", mutates_args=())
def _agree_op(both: torch.Tensor, code: int, rank: int, label: str) -> None:
    """The CPU check: `both` is the group's MAX of [code, -code]; raise unless every rank
    passed `code` (a CPU read, not a device sync)."""
    high, low = int(both[0]), -int(both[1])
    if high != low:
        mine = "the highest" if code == high else "the lowest" if code == low else "another"
        choice, lowest, highest = (describe_choice(*decode_code(c)) for c in (code, low, high))
        raise DispatchMismatchError(
            f"{label}: ranks chose different graphs for this call (rank {rank} chose {choice}, "
            f"{mine} choice among the ranks; they range from {lowest} to {highest}); "
            "every rank must call with the same batch (num_tokens and num_reqs), or their collectives would not "
            "pair up. Options(lockstep='host') names each rank's choice"
        )
