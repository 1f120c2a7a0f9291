"""The worker process of `Options(compile="background")` (see `graphify.compile.background.line`).

    python -m graphify.compile.background.worker FD PARENT_PID

Reads messages from the connection on file descriptor FD: `("fn", id, payload)` a function
(with the objects it is bound to), `("job", id, fn id, payload)` one call of it to compile,
as a capture's warm-up calls it, under the caller's settings (`graphify.compile.background.job_pickle`),
`("forget", id)`. Each job is announced `("started", id)` when its compile begins (the parent
times it against the job's deadline from then) and answered `("done", id, seconds, guards)`
(guards: those kept and dropped where the job's compiled function was saved whole) or
`("failed", id, why, seconds)`. A thread reads the connection while a compile runs, so the parent never waits to
send. It runs at a lower priority than its parent, whose decode loop must not wait on it,
gives its GPU memory back after each job, and ends when the parent closes its end or is gone.
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch


def run_job(fn, job: dict, compiled: dict) -> dict | None:
    """Compile `fn` as the parent does and call it once on the job's call (its own copy).
    With `aot_path` in the job: compiled whole and saved there for the parent to load
    (`graphify.compile.aot`), with the guards kept and dropped (returned); where that cannot be
    done, compiled as the parent's own compile will look it up in the caches (None)."""
    from graphify.compile.compiled import compile_for_captures
    from graphify.compile.background.job_pickle import applied
    from graphify.reads.stateful_types import capture_contexts

    from graphify.compile.background.job_pickle import scrub
    from graphify.reads.stateful_types import adapters_of_imported

    adapters_of_imported()  # the capture contexts of the libraries loaded (transformers'), as the parent applies them

    args, how = job["args"], job["how"]
    scrub(getattr(fn, "__self__", fn))  # again, with the hooks of libraries imported since (their adapters)
    for a in args:
        if isinstance(a, torch.nn.Module):
            scrub(a)
    key = repr(how)
    if key not in compiled:
        compiled[key] = compile_for_captures(job["label"], fn, how)
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    if device is not None:
        torch.cuda.set_device(device)
    guards = None
    with applied(job["state"]), torch.no_grad(), capture_contexts():
        if job.get("aot_path"):
            guards = save_whole(fn, job, how)
        if guards is None:
            job["layout"].caller(compiled[key])(*args)
    if device is not None:
        torch.cuda.synchronize(device)
    return guards


def save_whole(fn, job: dict, how) -> dict | None:
    """`graphify.compile.aot.save` of the job's call as the parent's captures make it; None (logged
    to the parent's stderr) where torch cannot compile or save it so."""
    from graphify.compile import aot as _aot
    from graphify.compile import aot_store as _aot_store
    from graphify.compile.compiled import DYNAMO_CONFIG, compile_settings

    args, kwargs = job["layout"].call_of(job["args"])
    kept = False
    try:
        # One eager call first: the caller ran the function before it captured, and libraries
        # fill registries on a first call (transformers' output-capturing registry of model
        # classes), which the compiled function's kept guards then read as the caller has them.
        fn(*args, **kwargs)
        os.makedirs(os.path.dirname(job["aot_path"]), exist_ok=True)
        guards = _aot.save(fn, args, kwargs, compile_settings(how), job["aot_path"], DYNAMO_CONFIG)
        _aot_store.write_guards(job["aot_path"], guards)  # for later processes (`graphify.compile.aot_store`)
        kept = True
        return guards
    except Exception:  # noqa: BLE001 - the parent's own compile traces it instead, from the caches
        print("graphify: the compile worker could not save the compiled function whole; the caller will trace it",
              file=sys.stderr)
        traceback.print_exc()
        return None
    finally:
        if not kept:  # nothing half-written stays for a later process
            _aot_store.forget(job["aot_path"])


def read_into(conn: Connection, inbox: queue.SimpleQueue) -> None:
    while True:
        try:
            inbox.put(conn.recv_bytes())
        except Exception:  # noqa: BLE001 - the parent closed its end
            inbox.put(None)
            return


def watch_parent(parent: int) -> None:
    """End this process when its parent is gone (its socket may live on in a forked child)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main(fd: int, parent: int) -> None:
    from graphify.compile.background.job_pickle import scrub

    conn = Connection(fd)
    try:
        os.nice(10)
    except OSError:
        pass
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_into, args=(conn, inbox), daemon=True).start()
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    functions: dict[int, object] = {}  # id -> function, or why it could not be rebuilt here
    compiled: dict[int, dict] = {}
    while (message := inbox.get()) is not None:
        try:
            kind, ident, *rest = pickle.loads(message)
        except Exception:  # noqa: BLE001 - a message this side cannot read: skip it
            continue
        if kind == "forget":
            functions.pop(ident, None)
            compiled.pop(ident, None)
            continue
        start = time.perf_counter()
        try:
            if kind == "fn":
                fn = pickle.loads(rest[0])
                scrub(getattr(fn, "__self__", fn))
                functions[ident], compiled[ident] = fn, {}
                continue
            fn_id, payload = rest
            conn.send_bytes(pickle.dumps(("started", ident)))
            fn = functions.get(fn_id)
            if isinstance(fn, str):
                raise RuntimeError(fn)
            guards = run_job(fn, pickle.loads(payload), compiled[fn_id])
            answer = ("done", ident, time.perf_counter() - start, guards)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which keeps its plain graphs
            why = f"{type(exc).__name__}: {exc}"
            if kind == "fn":
                functions[ident] = f"the function could not be rebuilt in the compile worker ({why})"
                continue
            traceback.print_exc()  # to the parent's stderr: where in the compile it failed
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            answer = ("failed", ident, detail[-2000:] or why, time.perf_counter() - start)
        if torch.cuda.is_initialized():  # the job's copies and activations: back to the device
            torch.cuda.empty_cache()
        try:
            conn.send_bytes(pickle.dumps(answer))
        except OSError:
            return


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
