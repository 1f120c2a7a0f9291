"""Dynamo's compiled entries of a closure's code, kept to the graphified function that made them.

Dynamo keeps its compiled entries on the code object, shared by every function made from
that code: each new closure of a factory (`make_step(model)`) is served by entries traced
over an earlier closure wherever the guards pass. Dynamo guards what it traced through
closure cells by the cells' contents, and an inlined function by its code, but torch 2.11
keeps no guard on that function's `__defaults__`: an entry traced over a helper whose default
was 3.0 served a new closure whose helper's default is 2.0 (the GPU suite: a wrong answer at
the first call of a capture, depending on which test ran before in the process). torch 2.13
guards the defaults.

So, where this torch does not guard them (`dynamo_guards_defaults`, found out once a process
by a compile of a two-line closure), a graphified closure's compile first drops the entries
of its code made for another graphified function (`claim`). Bound methods and modules are
left alone: the functions their code reaches are the same objects for every instance (a
module global, a method), and instances of one class share their entries on purpose
(`graphify.compile.compiled.shared_backend`). Within one graphified function, graphify's watch
drops the entries when what they were traced over changes (`forget_compiled`).
"""

from __future__ import annotations

import functools
import logging
import types
import weakref
from typing import Any

import torch

__all__ = ["claim", "dynamo_guards_defaults", "reset_code"]

log = logging.getLogger("graphify")

# code object -> a weak reference to the graphified function whose compile made its entries
_CLAIMS: "weakref.WeakKeyDictionary[types.CodeType, weakref.ref]" = weakref.WeakKeyDictionary()


def reset_code(code: types.CodeType) -> None:
    """Drop dynamo's compiled entries of `code` (nothing where this torch has no such call)."""
    reset = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "reset_code", None)
    if reset is not None:
        reset(code)


def claim(fn: Any, owner: Any) -> None:
    """Before `owner` (a graphified function's handle) runs the compile of `fn`: where `fn`
    is a closure and this torch does not guard inlined functions' defaults, drop the entries
    of its code that another owner's compiles made."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return
    code = fn.__code__
    held = _CLAIMS.get(code)
    if held is not None and held() is owner:
        return
    if not dynamo_guards_defaults():
        reset_code(code)
    _CLAIMS[code] = weakref.ref(owner)


@functools.cache
def dynamo_guards_defaults() -> bool:
    """Whether this torch's dynamo recompiles when a function it inlined gets new defaults
    (torch 2.13 does, 2.11 does not); False where the check cannot run (the safe answer)."""
    def made():
        def helper(y, scale=2.0):
            return y * scale

        def step(x):
            return helper(x)

        return step, helper

    step, helper = made()
    try:
        compiled = torch.compile(step, backend="eager", dynamic=False)
        x = torch.ones(1)
        compiled(x)
        helper.__defaults__ = (3.0,)
        guarded = float(compiled(x)[0]) == 3.0
    except Exception as exc:  # noqa: BLE001 - no answer: assume the guard is missing
        log.debug("graphify: could not tell whether dynamo guards functions' defaults (%s)", exc)
        return False
    finally:
        reset_code(step.__code__)
    return guarded
