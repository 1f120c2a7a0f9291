"""Compiles in another process while plain graphs serve: `Options(compile="background")`.

Inductor's compile of a model's decode step takes tens of seconds, most of it code
generation and Triton's kernel builds; in the caller's process it holds the GIL (a compiling
thread made decode steps hundreds of milliseconds long). Here one worker process
(`graphify._compile_worker`, started on the first job, one per process) runs the same
compile on the same call instead: the function's weights cross once by CUDA IPC handle
(not copied, only read), the call's tensors as copies taken when the job is sent (the
caller goes on writing its buffers and cache), so nothing the caller owns is written there. What it compiles lands in torch's
on-disk caches (AOTAutograd's and inductor's FX graph caches, Triton's kernels, autotuning
results), which the caller's own compile of that call then loads instead of building.

First use (`graphify._first_use`) serves plain graphs (eager kernels) meanwhile, submits one
job per kind of call that compiles apart (`job_kind`), and re-captures those calls with the
compiled function once their job is done. A job that fails (a function the worker cannot
import, a compile error) leaves the plain graphs serving, with one warning.
"""

from __future__ import annotations

import atexit
import io
import itertools
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import types
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import attrs
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions (CUDA IPC) with ForkingPickler

__all__ = ["Ticket", "submit", "settled", "wait", "job_kind", "reset", "DROPPED", "dumps"]

log = logging.getLogger("graphify")


@attrs.define(eq=False)
class Ticket:
    """One job's outcome: "pending", then "ready" (its compile is in the caches) or
    "failed" (`error` says why)."""

    id: int
    state: str = "pending"
    error: str | None = None
    seconds: float | None = None  # the worker's time for the job
    done: threading.Event = attrs.field(factory=threading.Event)


def job_kind(family: tuple, branch: Any, args: tuple) -> tuple:
    """What decides whether two calls compile apart under dynamic shapes: the call's family
    and branch, and which tensor dimensions are 1 (dynamo specialises sizes 0 and 1)."""
    ones = tuple(tuple(d == 1 for d in a.shape) if isinstance(a, torch.Tensor) else None for a in args)
    return family, branch, ones


# -- pickling a job ------------------------------------------------------------------------------
class _Dropped:
    """What a graphify callable installed on an object (`model.forward = graphify(...)`)
    becomes in the worker, which removes it there so the object's own method shows."""

    def __reduce__(self):
        return _dropped, ()


DROPPED = _Dropped()


def _dropped() -> _Dropped:
    return DROPPED


def _bound(func, obj):
    return types.MethodType(func, obj)


def _on_device(host: torch.Tensor, device: str) -> torch.Tensor:
    return host.to(device)


class _JobPickler(ForkingPickler):
    """ForkingPickler (CUDA tensors by IPC handle) with CPU tensors copied by value (torch's
    own sharing would move their storage into shared memory under the caller), graphify's
    callables dropped and bound methods rebuilt from their class's function. `by_value`:
    CUDA tensors are copied too (a call's arguments: a snapshot taken now, which the caller
    goes on writing), except those in `shared` (weights, read-only: by IPC handle)."""

    def __init__(self, file, by_value: bool = False, shared: frozenset = frozenset()):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.by_value, self.shared = by_value, shared

    def reducer_override(self, obj):
        if getattr(type(obj), "dropped_in_workers", False) is True:  # a graphify callable
            return _dropped, ()
        if isinstance(obj, types.MethodType) and not isinstance(obj.__self__, type):
            return _bound, (obj.__func__, obj.__self__)
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        if self.by_value and isinstance(obj, torch.Tensor) and id(obj) not in self.shared:
            return _on_device, (obj.detach().to("cpu"), str(obj.device))
        storage = obj._untyped_storage if isinstance(obj, torch.TypedStorage) else obj
        if isinstance(storage, torch.UntypedStorage) and storage.device.type == "cpu":
            return obj.__reduce__()
        return NotImplemented


def dumps(value: Any, by_value: bool = False, shared: frozenset = frozenset()) -> bytes:
    buf = io.BytesIO()
    _JobPickler(buf, by_value, shared).dump(value)
    return buf.getvalue()


def weights_of(fn: Any) -> frozenset:
    """ids of the parameters and buffers of the module `fn` is (or is a method of)."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(owner, torch.nn.Module):
        return frozenset()
    return frozenset(id(t) for t in (*owner.parameters(), *owner.buffers()))


# -- the worker and its jobs ---------------------------------------------------------------------
class _Compiler:
    """The worker process and the tickets of its jobs (`compiler()`: one per process)."""

    def __init__(self):
        self.lock = threading.RLock()  # a finalizer (`_forget`) may run inside `submit`
        self.conn: Connection | None = None
        self.proc: subprocess.Popen | None = None
        self.tickets: dict[int, Ticket] = {}
        self.ids = itertools.count(1)
        self.functions: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.settled = 0  # tickets that left "pending": first use compares it on each call
        self.broken: str | None = None  # why the worker is gone, once it is

    def submit(self, owner: Any, fn: Any, job: dict) -> Ticket:
        """Send `job` (a call of `fn`, compiled for `owner`, one per graphified function) to
        the worker; the ticket settles when the worker answers (or cannot be reached)."""
        ticket = Ticket(next(self.ids))
        with self.lock:
            self.tickets[ticket.id] = ticket
            try:
                self._start()
                fn_id = self.functions.get(owner)
                if fn_id is None:  # the function once (its weights by IPC handle), then calls of it
                    fn_id = self.functions[owner] = next(self.ids)
                    self._send("fn", fn_id, dumps(fn))
                    weakref.finalize(owner, self._forget, fn_id)
                self._send("job", ticket.id, fn_id, dumps(job, by_value=True, shared=weights_of(fn)))
            except Exception as exc:  # noqa: BLE001 - an unpicklable call or a dead worker: this job fails
                self._settle(ticket.id, "failed", f"{type(exc).__name__}: {exc}")
        return ticket

    def _send(self, *message) -> None:
        """A message whose payloads are pickled apart: the worker reads which job it is even
        where a payload cannot be rebuilt there."""
        self.conn.send_bytes(pickle.dumps(message))

    def _start(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if self.proc is not None:
            return
        ours, theirs = socket_pair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphify._compile_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        theirs.close()
        self.conn = ours
        threading.Thread(target=self._read, name="graphify-compile-results", daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        conn = self.conn
        try:
            while True:
                kind, job_id, *rest = pickle.loads(conn.recv_bytes())
                if kind == "done":
                    self._settle(job_id, "ready", None, rest[0])
                elif kind == "failed":
                    self._settle(job_id, "failed", rest[0], rest[1])
        except (EOFError, OSError) as exc:
            code = self.proc.poll() if self.proc is not None else None
            with self.lock:
                self.broken = f"the compile worker ended (exit code {code}, {type(exc).__name__})"
                for job_id, t in list(self.tickets.items()):
                    self._settle(job_id, "failed", self.broken)

    def _settle(self, job_id: int, state: str, error: str | None, seconds: float | None = None) -> None:
        ticket = self.tickets.pop(job_id, None)
        if ticket is None:
            return
        ticket.state, ticket.error, ticket.seconds = state, error, seconds
        self.settled += 1
        ticket.done.set()

    def _forget(self, fn_id: int) -> None:
        """The graphified function is gone: the worker drops its copy (and its IPC views)."""
        with self.lock:
            if self.conn is not None and self.broken is None:
                try:
                    self._send("forget", fn_id)
                except OSError:
                    pass

    def close(self) -> None:
        """End the worker (at exit): its running compile is abandoned."""
        proc, conn = self.proc, self.conn
        if proc is None:
            return
        self.broken = self.broken or "the compile worker was closed"
        try:
            conn.close()
            proc.wait(timeout=2)
        except Exception:  # noqa: BLE001 - still compiling: stop it
            proc.kill()


def socket_pair() -> tuple[Connection, Connection]:
    import socket

    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


_compiler: _Compiler | None = None
_compiler_lock = threading.Lock()


def compiler() -> _Compiler:
    global _compiler
    with _compiler_lock:
        if _compiler is None:
            _compiler = _Compiler()
        return _compiler


def submit(owner: Any, fn: Any, job: dict) -> Ticket:
    return compiler().submit(owner, fn, job)


def settled() -> int:
    """How many jobs have settled in this process: unchanged means nothing to look at."""
    return _compiler.settled if _compiler is not None else 0


def wait(tickets, timeout: float | None) -> bool:
    """Wait for `tickets` to settle, at most `timeout` seconds in all; whether they did."""
    end = None if timeout is None else time.monotonic() + timeout
    for t in tickets:
        left = None if end is None else max(0.0, end - time.monotonic())
        if not t.done.wait(left):
            return False
    return True


def reset() -> None:
    """End this process's worker and forget its jobs (tests; a later job starts a new one)."""
    global _compiler
    with _compiler_lock:
        old, _compiler = _compiler, None
    if old is not None:
        old.close()
