"""Ranks that end together: a torchrun job where one rank's failure ends every rank, even
one waiting on a device for a collective whose peer is gone (`ExitTogether`), plus joining
the process group with a timeout and the failures the tests inject."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["ExitTogether", "init", "maybe_fail"]

ABORT_KEY = "benchmarks.tensor_parallel/failed-rank"


def _leave(code: int, message: str) -> None:
    """Print `message` and end the process now: no teardown that could wait on other ranks
    (destroy_process_group, graphify's release at exit, a device sync)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class ExitTogether:
    """When one rank fails, every rank ends. The failing rank (`fail`) prints its traceback,
    posts its rank in the process group's store and leaves; a thread on every rank polls the
    store and leaves when another rank posted, or when the store is gone (its host rank
    died). torchrun also ends the others once one exits non-zero; this covers plain
    launches and ranks stuck on a device waiting for a collective inside a graph."""

    def __init__(self, rank: int, poll_s: float = 1.0):
        from torch.distributed.distributed_c10d import _get_default_store

        self.rank, self.poll_s = rank, poll_s
        self.store = _get_default_store()
        self.done = threading.Event()
        threading.Thread(target=self._watch, name="exit-together", daemon=True).start()

    def _watch(self) -> None:
        while not self.done.wait(self.poll_s):
            try:
                why = f"rank {self.store.get(ABORT_KEY).decode()} failed" if self.store.check([ABORT_KEY]) else None
            except Exception as exc:  # the store's host is gone: a rank died
                why = f"the store is unreachable ({type(exc).__name__}): its host rank died"
            if why is not None and not self.done.is_set():
                _leave(1, f"[rank {self.rank}] stopping: {why}")

    def stop(self) -> None:
        """Every rank is past the last collective: from here on a rank leaving is the end."""
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        """Report `exc`, tell the other ranks, leave (never returns)."""
        self.done.set()
        print(f"[rank {self.rank}] failed:", file=sys.stderr)
        traceback.print_exception(exc)
        poster = threading.Thread(target=self.store.set, args=(ABORT_KEY, str(self.rank)), daemon=True)
        poster.start()
        poster.join(5)  # a dead store host must not keep this rank alive
        _leave(1, f"[rank {self.rank}] the other ranks were told to stop")


def init(cpu: bool, timeout_s: float) -> tuple[int, int, torch.device]:
    """Join the process group (torchrun's environment): gloo on the CPU, else NCCL on GPU
    LOCAL_RANK; collectives give up after `timeout_s`. Returns (rank, world, device)."""
    timeout = timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    if not cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))))
        torch.cuda.set_device(device)
    try:
        if cpu:
            dist.init_process_group("gloo", timeout=timeout)
        else:
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
    except dist.DistError as exc:  # a peer left while the group formed (it failed at once): end as ExitTogether would
        _leave(1, f"[rank {os.environ.get('RANK', '?')}] stopping: the group could not form, a peer rank left "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    return dist.get_rank(), dist.get_world_size(), device


def maybe_fail(args, rank: int, stage: str) -> None:
    """The failure `--fail-rank/--fail-at` asks for (tests: one rank fails, all must end).
    At "stuck" the other ranks wait forever instead, as a rank does on a device whose
    collective's peer is gone: only `ExitTogether` can end them."""
    if args.fail_at != stage or args.fail_rank is None:
        return
    if args.fail_rank == rank:
        raise RuntimeError(f"injected failure on rank {rank} at {stage} (--fail-rank {rank} --fail-at {stage})")
    while stage == "stuck":
        time.sleep(1)
