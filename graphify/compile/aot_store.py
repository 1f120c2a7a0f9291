"""Compiled functions saved whole, kept on disk for the processes that come later
(`Options(compile="background")`): a restarted service captures compiled graphs from its
first decode step, where it would otherwise serve plain graphs until its worker compiled.

The worker writes each job's compiled function (and the guards it kept and dropped) under a
name made of what the compile depends on: the function (by name and code), the kind of call,
the compile settings, torch's version and the process settings a compile reads. The name only
finds a candidate. What makes it safe to use is what makes a function loaded from this
process's own worker safe: its kept guards pass on the call, and the objects its dropped
guards stood for are the ones this process holds (`graphify.compile.aot.AotLoads`); otherwise the
call captures plain graphs and sends its job, whose compile writes the file anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle

import torch

from graphify.compile import aot as _aot

__all__ = ["path_for", "read", "write_guards", "forget", "canonical", "STORE_VERSION"]

STORE_VERSION = 1  # bump when what is written changes
DIRECTORY: str | None = None  # where the store is, if not under inductor's cache (tests: one per test)


def directory() -> str:
    """Under inductor's cache directory (TORCHINDUCTOR_CACHE_DIR where set): the caches a
    compiled function's kernels come from live there too."""
    if DIRECTORY is not None:
        return DIRECTORY
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "graphify-whole")


def path_for(fn, kind: tuple, settings: dict, state: dict) -> str:
    """Where the compiled function of `fn` for calls of `kind`, compiled with `settings` under
    the process `state` (`graphify.compile.background.job_pickle.torch_state`), is kept. A bound module's
    parameter names, shapes and dtypes are part of the name: two models of one class and other
    sizes keep one file each."""
    module = getattr(fn, "__self__", None)
    shapes = (tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters())
              if isinstance(module, torch.nn.Module) else ())
    # Not the libraries' carried state (`register_carried`): it is what this process has made so
    # far (transformers' registry of model classes), not what the compile is; where the traced
    # code read it, the kept function's own guards check it at the load.
    state = {k: v for k, v in state.items() if k != "carried"}
    what = canonical((STORE_VERSION, torch.__version__, _aot.identity(fn), shapes, kind, settings, state))
    return os.path.join(directory(), hashlib.sha256(what.encode()).hexdigest()[:40] + ".aot")


def canonical(value) -> str:
    """`repr` that two processes agree on: dicts by sorted keys, sets sorted (their order
    follows string hashes, which differ between processes)."""
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{canonical(k)}: {canonical(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(canonical, value))) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(map(canonical, value))
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def write_guards(path: str, guards: dict) -> None:
    """Beside the function at `path`: the guards it kept and dropped, with the hash of the
    function's bytes (a reader pairs them only where the hash matches: another process may
    replace the function between the two writes)."""
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    tmp = f"{path}.guards.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            pickle.dump({**guards, "sha256": digest}, f)
        os.replace(tmp, path + ".guards")
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def read(path: str) -> tuple[bytes, dict] | None:
    """(the function's bytes, its guards) kept at `path`, where both are there and belong
    together; None otherwise (nothing kept, a half-written pair, a file this build cannot read)."""
    try:
        with open(path + ".guards", "rb") as f:
            guards = pickle.load(f)
        with open(path, "rb") as f:
            data = f.read()
    except Exception:  # noqa: BLE001 - missing, truncated, or of another build: not used
        return None
    if not isinstance(guards, dict) or guards.get("sha256") != hashlib.sha256(data).hexdigest():
        return None
    return data, guards


def forget(path: str) -> None:
    """Remove what is kept at `path` (a save that did not finish)."""
    for p in (path, path + ".guards"):
        with contextlib.suppress(OSError):
            os.remove(p)
