"""Compiles in another process while plain graphs serve: `Options(compile="background")`.

Inductor's compile of a model's decode step takes tens of seconds, most of it code
generation and Triton's kernel builds; in the caller's process it holds the GIL (a compiling
thread made decode steps hundreds of milliseconds long). Here one worker process
(`graphify.compile.background.worker`, started on the first job, one per process) runs the same
compile on the same call instead: the function's weights cross once by CUDA IPC handle
(not copied, only read), the call's tensors as copies taken when the job is sent (the
caller goes on writing its buffers and cache), so nothing the caller owns is written there. What it compiles lands in torch's
on-disk caches (AOTAutograd's and inductor's FX graph caches, Triton's kernels, autotuning
results), which the caller's own compile of that call then loads instead of building; and, where
torch can (`graphify.compile.aot`), it saves the compiled function whole, which the caller loads
without tracing the model again.

First use (`graphify.first_use.first_use`) serves plain graphs (eager kernels) meanwhile, submits one
job per kind of call that compiles apart (`job_kind`), and re-captures those calls with the
compiled function once their job is done. A job that fails (a function the worker cannot
import, a compile error) leaves the plain graphs serving, with one warning.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import pickle
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

import attrs
import torch

from graphify.compile import aot as _aot
from graphify.compile import aot_identity as _aot_identity
from graphify.compile import aot_store as _aot_store
from graphify.compile.background.job_pickle import dumps, parameters_of, torch_state
from graphify.compile.background.triton_env import as_inductor_compiles

log = logging.getLogger("graphify")

__all__ = ["Ticket", "submit", "forget", "settled", "wait", "job_kind", "reset", "DEADLINE_S"]

# The longest one job's compile may run in the worker before the worker is stopped (its jobs
# fail, their calls keep plain graphs): an 8B decode step compiles in about a minute on an
# H100; a compile past this is stuck, and `wait_compiles(None)` must not wait for ever.
DEADLINE_S = 1200.0
TICK_S = 0.5  # how often the reading thread looks at the running job's clock


@attrs.define(eq=False)
class Ticket:
    """One job's outcome: "pending", then "ready" (its compile is in the caches) or
    "failed" (`error` says why)."""

    id: int
    deadline_s: float = 0.0  # the longest its compile may run in the worker
    state: str = "pending"
    error: str | None = None
    seconds: float | None = None  # the worker's time for the job
    started: float | None = None  # monotonic time the worker began it
    done: threading.Event = attrs.field(factory=threading.Event)
    aot_path: str | None = None  # where the worker saves the compiled function whole
    loaded: Any = None  # that function, loaded here before the ticket is ready (`load_saved`)
    guards: dict | None = None  # the guard types it kept and dropped
    load_s: float | None = None  # seconds its load took here
    load_error: str | None = None  # why it was not loaded (the capture traces it here instead)
    loading: threading.Lock = attrs.field(factory=threading.Lock)  # one load, whichever thread asks first


def job_kind(family: tuple, branch: Any, args: tuple, per_shape: bool = False) -> tuple:
    """What decides whether two calls compile apart under dynamic shapes: the call's family
    and branch, which tensor dimensions are 0 or 1 and which ints are (dynamo specialises
    those), and autocast (dynamo guards on it). For a function compiled per shape
    (`graphify.compile.shape_policy`), every dimension."""
    def small(a):
        if isinstance(a, torch.Tensor):
            return a.dtype, tuple(d if d in (0, 1) or per_shape else None for d in a.shape)
        return a if type(a) is int and a in (0, 1) else None

    autocast = tuple(d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d))
    return family, branch, tuple(map(small, args)), autocast


# -- the worker and its jobs ---------------------------------------------------------------------
class _Compiler:
    """The worker process and the tickets of its jobs (`compiler()`: one per process)."""

    def __init__(self):
        self.lock = threading.RLock()  # a finalizer (`_forget`) may run inside `submit`
        self.outbox: "queue.SimpleQueue[bytes | None]" = queue.SimpleQueue()  # sent by a thread: never waits on the worker
        self.conn: Connection | None = None
        self.proc: subprocess.Popen | None = None
        self.tickets: dict[int, Ticket] = {}
        self.ids = itertools.count(1)
        self.functions: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.settled = 0  # tickets that left "pending": first use compares it on each call
        self.broken: str | None = None  # why the worker is gone, once it is
        self.files = ""  # the directory the worker saves compiled functions in (made with the worker)

    def submit(self, owner: Any, fn: Any, job: dict, deadline_s: float = DEADLINE_S) -> Ticket:
        """Send `job` (a call of `fn`, compiled for `owner`, one per graphified function) to
        the worker; the ticket settles when the worker answers, cannot be reached, or its
        compile runs past `deadline_s`."""
        ticket = Ticket(next(self.ids), deadline_s)
        with self.lock:
            self.tickets[ticket.id] = ticket
            try:
                _importable(fn)
                self._start()
                if job.pop("whole", False):  # where the worker saves it whole: the store, or here
                    job["aot_path"] = ticket.aot_path = job.get("aot_path") or os.path.join(self.files,
                                                                                             f"{ticket.id}.aot")
                fn_id = self.functions.get(owner)
                shared = parameters_of(fn)
                if fn_id is None:  # the function once (its parameters by IPC handle), then calls of it
                    fn_id = self.functions[owner] = next(self.ids)
                    self._send("fn", fn_id, dumps(fn, shared))
                    weakref.finalize(owner, self._forget, fn_id)
                self._send("job", ticket.id, fn_id, dumps({**job, "state": torch_state()}, shared))
            except Exception as exc:  # noqa: BLE001 - an unpicklable call or a dead worker: this job fails
                self._settle(ticket.id, "failed", f"{type(exc).__name__}: {exc}")
        return ticket

    def _send(self, *message) -> None:
        """Queue a message (its payloads pickled apart: the worker reads which job it is even
        where a payload cannot be rebuilt there) for the sending thread."""
        self.outbox.put(pickle.dumps(message))

    def _write(self) -> None:
        conn = self.conn
        while (message := self.outbox.get()) is not None:
            try:
                conn.send_bytes(message)
            except Exception:  # noqa: BLE001 - the worker is gone: `_read` settles what was sent
                return

    def _start(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if self.proc is not None:
            return
        self.files = tempfile.mkdtemp(prefix="graphify-compiled-")  # the functions saved whole
        ours, theirs = socket_pair()
        as_inductor_compiles()  # Triton's keys and folder alike in both processes (the GEMV's binaries found here)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.proc = subprocess.Popen(  # its own session: a Ctrl-C this process survives leaves it running
                [sys.executable, "-m", "graphify.compile.background.worker", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:  # no worker: nothing of its own left behind
            shutil.rmtree(self.files, ignore_errors=True)
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = ours
        threading.Thread(target=self._read, name="graphify-compile-results", daemon=True).start()
        threading.Thread(target=self._write, name="graphify-compile-jobs", daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        conn = self.conn
        try:
            while True:
                if not conn.poll(TICK_S):
                    self._past_deadline()
                    continue
                kind, job_id, *rest = pickle.loads(conn.recv_bytes())
                if kind == "started" and (ticket := self.tickets.get(job_id)) is not None:
                    ticket.started = time.monotonic()
                elif kind == "done":
                    self._saved(job_id, rest[1] if len(rest) > 1 else None)
                    self._settle(job_id, "ready", None, rest[0])
                elif kind == "failed":
                    self._settle(job_id, "failed", rest[0], rest[1])
        except Exception as exc:  # noqa: BLE001 - EOF, a closed or broken connection: the worker is gone
            code = self.proc.poll() if self.proc is not None else None
            with self.lock:
                self.broken = self.broken or f"the compile worker ended (exit code {code}, {type(exc).__name__})"
                for job_id, t in list(self.tickets.items()):
                    self._settle(job_id, "failed", self.broken)

    def _saved(self, job_id: int, guards: dict | None) -> None:
        """The worker saved a job's compiled function whole (`guards`: what it kept and dropped):
        loaded here, on the thread that reads the worker's answers, before the job is ready, so
        the call that takes it in only captures."""
        ticket = self.tickets.get(job_id)
        if ticket is not None and ticket.aot_path is not None and guards is not None:
            ticket.guards = guards
            load_saved(ticket)

    def _past_deadline(self) -> None:
        """Stop the worker when the job it runs is past its deadline: that job fails with the
        reason, the worker's other jobs as it ends (one compile runs at a time there)."""
        now = time.monotonic()
        late = next((t for t in tuple(self.tickets.values())
                     if t.started is not None and now - t.started > t.deadline_s), None)
        if late is None:
            return
        with self.lock:
            why = (f"its compile ran past its deadline of {late.deadline_s:g} s, so the worker was stopped "
                   "(Options(compile={'background': True, 'deadline_s': ...}) sets it)")
            self._settle(late.id, "failed", why)
            self.broken = f"the compile worker was stopped: a compile ran past its deadline of {late.deadline_s:g} s"
        self.proc.kill()  # its end of the connection closes: the loop above settles the rest

    def _settle(self, job_id: int, state: str, error: str | None, seconds: float | None = None) -> None:
        ticket = self.tickets.pop(job_id, None)
        if ticket is None:
            return
        ticket.state, ticket.error, ticket.seconds = state, error, seconds
        self.settled += 1
        ticket.done.set()

    def _forget(self, fn_id: int) -> None:
        """The graphified function is gone: the worker drops its copy (and its IPC views)."""
        if self.conn is not None and self.broken is None:
            self._send("forget", fn_id)

    def close(self) -> None:
        """End the worker (at exit, or `reset`): its running compile is abandoned."""
        proc, conn = self.proc, self.conn
        if proc is None:
            return
        shutil.rmtree(self.files, ignore_errors=True)
        self.broken = self.broken or "the compile worker was closed"
        self.outbox.put(None)
        try:  # wakes the reading thread (it settles what is pending) and tells the worker
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:  # still compiling: stop it
            proc.kill()
            proc.wait()


def _importable(fn: Any) -> None:
    """Refuse, by name, a function a new process cannot import: one of the script run as
    `__main__` (the worker's `__main__` is itself)."""
    for what in (getattr(fn, "__func__", fn), type(getattr(fn, "__self__", fn))):
        if getattr(what, "__module__", None) == "__main__":
            raise ValueError(
                f"{getattr(what, '__qualname__', what)} is defined in the script run as __main__, which the "
                "compile worker cannot import; define it in a module of its own"
            )


def socket_pair() -> tuple[Connection, Connection]:
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


def submit(owner: Any, fn: Any, job: dict, deadline_s: float = DEADLINE_S) -> Ticket:
    return compiler().submit(owner, fn, job, deadline_s)


def forget(owner: Any) -> None:
    """The worker drops `owner`'s function; its next job sends it again."""
    if _compiler is not None:
        fn_id = _compiler.functions.pop(owner, None)
        if fn_id is not None:
            _compiler._forget(fn_id)


def load_saved(ticket: Ticket) -> Any:
    """The compiled function the worker saved whole for `ticket`, loaded once (None where it was
    not saved, or did not load: the capture then compiles here, from the caches). The thread
    that reads the worker's answers loads it (no call waits on the load; inductor's kernels
    are loaded there, not launched, and graphify captures in CUDA's thread-local mode, which
    lets other threads load modules meanwhile). It imports nothing: `graphify(...)` imported
    what a load needs on the caller's thread (`_aot.preimport`)."""
    with ticket.loading:
        return _load_once(ticket)


def _load_once(ticket: Ticket) -> Any:
    if ticket.loaded is None and ticket.guards is not None and ticket.load_error is None:
        start = time.perf_counter()
        try:
            kept = _aot_store.read(ticket.aot_path)
            if kept is None:
                raise RuntimeError("the saved function and its guards are not a pair (another process saved over it?)")
            ticket.loaded, ticket.guards = _aot.load(ticket.aot_path, kept[0]), kept[1]
            _aot_identity.prehash_classes(ticket.guards.get("classes", ()))
        except Exception as exc:  # noqa: BLE001 - the capture traces the function here instead
            ticket.load_error = f"{type(exc).__name__}: {exc}"
            log.warning("graphify: a compiled function from the worker did not load (%s); the capture compiles "
                        "it here from the caches", ticket.load_error)
        ticket.load_s = time.perf_counter() - start
        if _compiler is not None and os.path.dirname(ticket.aot_path) == _compiler.files:  # not kept for later
            _aot_store.forget(ticket.aot_path)
    return ticket.loaded


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


def _forget_after_fork() -> None:
    """In a forked child: the parent's worker is not this process's (and its socket, held
    open here, would keep the worker from seeing its parent go)."""
    global _compiler
    old, _compiler = _compiler, None
    if old is not None and old.conn is not None:
        try:
            os.close(old.conn.fileno())
        except OSError:
            pass


os.register_at_fork(after_in_child=_forget_after_fork)


def reset() -> None:
    """End this process's worker and forget its jobs (tests; a later job starts a new one)."""
    global _compiler
    with _compiler_lock:
        old, _compiler = _compiler, None
    if old is not None:
        old.close()
