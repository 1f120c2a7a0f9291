"""The worker process of `Options(compile="background")` (see `graphify._background`).

    python -m graphify._compile_worker FD

Reads messages from the connection on file descriptor FD: `("fn", id, payload)` a function
(with the objects it is bound to), `("job", id, fn id, payload)` one call of it to compile,
as a capture's warm-up calls it, `("forget", id)`. Each job is answered `("done", id,
seconds)` or `("failed", id, why, seconds)`. It runs at a lower priority than its parent,
whose decode loop must not wait on it, and ends when the parent's end closes.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from multiprocessing.connection import Connection

import torch


def scrub(obj) -> None:
    """Remove what stood for graphify's callables in `obj`'s modules (their own methods show)."""
    from graphify._background import DROPPED

    modules = obj.modules() if isinstance(obj, torch.nn.Module) else [obj]
    for m in modules:
        attributes = getattr(m, "__dict__", {})
        for name in [n for n, v in attributes.items() if v is DROPPED]:
            del attributes[name]


def run_job(fn, job: dict, compiled: dict) -> None:
    """Compile `fn` as the parent does and call it once on a copy of the job's call."""
    from graphify._compiled import compile_for_captures
    from graphify._state_types import capture_contexts

    if "transformers" in sys.modules:  # its capture contexts, as the parent applies them
        import graphify.transforms.hf  # noqa: F401 - registers its contexts
    args = job["args"]  # the call's tensors arrive as copies (the weights it reads through `fn` by IPC)
    how = job["how"]
    key = repr(how)
    if key not in compiled:
        compiled[key] = compile_for_captures(job["label"], fn, how)
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    if device is not None:
        torch.cuda.set_device(device)
    with torch.no_grad(), capture_contexts():
        job["layout"].caller(compiled[key])(*args)
    if device is not None:
        torch.cuda.synchronize(device)


def main(fd: int) -> None:
    conn = Connection(fd)
    try:
        os.nice(10)
    except OSError:
        pass
    functions: dict[int, object] = {}  # id -> function, or why it could not be rebuilt here
    compiled: dict[int, dict] = {}
    while True:
        try:
            kind, ident, *rest = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
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
            fn = functions.get(fn_id)
            if isinstance(fn, str):
                raise RuntimeError(fn)
            run_job(fn, pickle.loads(payload), compiled[fn_id])
            conn.send_bytes(pickle.dumps(("done", ident, time.perf_counter() - start)))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which keeps its plain graphs
            why = f"{type(exc).__name__}: {exc}"
            if kind == "fn":
                functions[ident] = f"the function could not be rebuilt in the compile worker ({why})"
                continue
            traceback.print_exc()  # to the parent's stderr: where in the compile it failed
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            conn.send_bytes(pickle.dumps(("failed", ident, detail[-2000:] or why, time.perf_counter() - start)))


if __name__ == "__main__":
    main(int(sys.argv[1]))
