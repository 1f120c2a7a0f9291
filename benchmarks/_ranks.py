"""Ranks that end together: a torchrun job where one rank's failure, or its death, ends every
rank, even one waiting on a device for a collective whose peer is gone (`ExitTogether`), plus
joining the process group with a timeout and the failures the tests inject."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["ExitTogether", "init", "maybe_fail", "rank_options"]

PREFIX = "benchmarks.tensor_parallel"
ABORT_KEY = f"{PREFIX}/failed-rank"


def _alive_key(rank: int) -> str:
    """A rank's heartbeat: a counter its watcher bumps every poll."""
    return f"{PREFIX}/alive/{rank}"


def _done_key(rank: int) -> str:
    """Set by a rank that finished normally (`ExitTogether.stop`): its silence is no death."""
    return f"{PREFIX}/done/{rank}"


def _leave(code: int, message: str) -> None:
    """Print `message` and end the process now: no teardown that could wait on other ranks
    (destroy_process_group, graphify's release at exit, a device sync)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


class ExitTogether:
    """When one rank fails or dies, every rank ends. The failing rank (`fail`) prints its
    traceback, posts its rank in the process group's store and leaves; a thread on every rank
    polls the store and leaves when another rank posted, when the store is gone (its host
    rank died), or when a peer stopped beating. torchrun also ends the others once one exits
    non-zero; this covers plain launches and ranks stuck on a device waiting for a collective
    inside a graph (which no NCCL timeout sees).

    Heartbeats: a rank killed outright (SIGKILL, the OOM killer) posts nothing, and unless
    it hosted the store the store stays up. So each poll the thread also bumps this rank's
    counter in the store and reads its peers'; a peer whose counter has not moved for
    `dead_after_s` (timed on this rank's clock, from when this thread started for a peer not
    yet heard) is taken for dead. The beats come from a Python thread: a rank whose main
    thread holds the GIL in one C call for that long (none of the benchmark's do: collectives,
    syncs and graph replays release it) would look dead, hence a generous default, still well
    under the 30 s in which every rank must have ended."""

    def __init__(self, rank: int, poll_s: float = 1.0, dead_after_s: float = 10.0):
        from torch.distributed.distributed_c10d import _get_default_store

        self.rank, self.poll_s, self.dead_after_s = rank, poll_s, dead_after_s
        self.world = dist.get_world_size()
        self.store = _get_default_store()
        self.done = threading.Event()
        _quietly(lambda: self.store.add(_alive_key(rank), 1))  # a first beat now: "never answered" is "never got here"
        threading.Thread(target=self._watch, name="exit-together", daemon=True).start()

    def _watch(self) -> None:
        start = time.monotonic()
        heard = {peer: (0, start) for peer in range(self.world) if peer != self.rank}  # peer -> (count, since)
        while not self.done.wait(self.poll_s):
            try:
                why = self._why(heard)
            except Exception as exc:  # the store's host is gone: a rank died
                why = f"the store is unreachable ({type(exc).__name__}): its host rank died"
            if why is not None and not self.done.is_set():
                _leave(1, f"[rank {self.rank}] stopping: {why}")

    def _why(self, heard: dict) -> str | None:
        """One poll: beat, then the reason to stop, if any (a posted failure first, then a
        peer silent for `dead_after_s`). `heard`: per peer still expected to beat, its
        counter and the time it last moved; a peer that finished (`stop`) is dropped."""
        if self.store.check([ABORT_KEY]):
            return f"rank {self.store.get(ABORT_KEY).decode()} failed"
        self.store.add(_alive_key(self.rank), 1)
        for peer, (count, since) in list(heard.items()):
            now, new = time.monotonic(), self.store.add(_alive_key(peer), 0)  # adding 0 reads it
            if new != count:
                heard[peer] = (new, now)
            elif now - since >= self.dead_after_s:
                if self.store.check([_done_key(peer)]):  # it finished, its thread stopped beating
                    del heard[peer]
                elif count == 0:
                    return f"rank {peer} never answered in {now - since:.0f} s (killed before it started?)"
                else:
                    return f"rank {peer} stopped answering for {now - since:.0f} s (killed?)"
        return None

    def stop(self) -> None:
        """Every rank is past the last collective: from here on a rank leaving is the end. No
        more checks here; this rank says it is done, so a peer still checking (slower out of
        the last barrier) does not take its silence for death. The store's host (rank 0)
        waits a little for the others to say so, so that its exit, which takes the store
        along, is not seen as a death by a peer still checking."""
        self.done.set()
        keys = [_done_key(r) for r in range(self.world) if r != self.rank]

        def post() -> None:
            self.store.set(_done_key(self.rank), "1")
            if self.rank == 0 and keys:
                self.store.wait(keys, timedelta(seconds=self.dead_after_s))

        poster = threading.Thread(target=_quietly, args=(post,), name="exit-together-done", daemon=True)
        poster.start()
        poster.join(self.dead_after_s + 5)  # a dead store host or peer must not keep this rank here

    def fail(self, exc: BaseException) -> None:
        """Report `exc`, tell the other ranks, leave (never returns)."""
        self.done.set()
        print(f"[rank {self.rank}] failed:", file=sys.stderr)
        traceback.print_exception(exc)
        poster = threading.Thread(target=self.store.set, args=(ABORT_KEY, str(self.rank)), daemon=True)
        poster.start()
        poster.join(5)  # a dead store host must not keep this rank alive
        _leave(1, f"[rank {self.rank}] the other ranks were told to stop")


def _quietly(fn) -> None:
    """Run `fn`, ignoring its failure (a store gone or a peer that never said it was done:
    the run is over either way)."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        pass


def rank_options(parser, *, smoke: str, cpu: str, timeout: float) -> None:
    """The options every torchrun benchmark takes: `--smoke` and `--cpu` (their help saying
    what they mean there), rank 0's `--out` JSON, and how long a collective waits (`--timeout`)."""
    parser.add_argument("--smoke", action="store_true", help=smoke)
    parser.add_argument("--cpu", action="store_true", help=cpu)
    parser.add_argument("--out", help="rank 0 also writes the results as JSON here")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds a collective waits before giving up")


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
    `--fail-how kill`: the rank is killed (SIGKILL, as by the OOM killer) and posts nothing;
    only the heartbeats tell the others. At "stuck" the other ranks wait forever instead, as
    a rank does on a device whose collective's peer is gone: only `ExitTogether` can end them.
    Every rank is in the group first (a barrier): a rank still forming it when its peer dies
    ends through `init` instead, for another reason than the one this stage is there to show."""
    if args.fail_at != stage or args.fail_rank is None:
        return
    if stage == "stuck":
        dist.barrier()
    if args.fail_rank == rank:
        if getattr(args, "fail_how", "raise") == "kill":
            print(f"injected kill on rank {rank} at {stage} (--fail-how kill)", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure on rank {rank} at {stage} (--fail-rank {rank} --fail-at {stage})")
    while stage == "stuck":
        time.sleep(1)
