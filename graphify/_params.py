"""Parameters and buffers rebound after capture, and calls in grad mode.

Graphs read the storage their modules' tensors had at capture. `load_state_dict(...,
assign=True)`, a replaced Parameter or buffer, or `.to()` / `.half()` (which swap each
parameter's `.data`) leave the graphs reading stale memory. `ModuleWatch` notices:

- registrations of parameters, buffers or submodules onto a watched module (torch's global
  registration hooks bump one counter; a call compares one integer; registrations on
  other modules, such as the ModuleList transformers makes by slicing its layers on every
  forward, are ignored, and a compiled trace never sees the hook count), and
- the storage of the first and last parameter (what `.to()` and `.half()` change),

and then checks every tensor of the watched modules. `Options(full_checks=True)`
checks every tensor on every call (about 0.1 us per tensor), which also catches a
single `p.data = ...`.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Iterable

import torch

from ._errors import StateChangedError

__all__ = ["ModuleWatch", "install_hooks"]

_generation = [0]
_hooked = [False]
_watched: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # every module a watch covers


def _bump(module, *_args, **_kwargs):
    if torch.compiler.is_compiling():  # traced code: the hook is gone from the compiled graph, keep no guard on it
        return
    if module in _watched:
        _generation[0] += 1


def install_hooks() -> None:
    """Install torch's global registration hooks that bump the generation (once)."""
    if _hooked[0]:
        return
    from torch.nn.modules import module as nn_module

    nn_module.register_module_parameter_registration_hook(_bump)
    nn_module.register_module_buffer_registration_hook(_bump)
    nn_module.register_module_module_registration_hook(_bump)
    _hooked[0] = True


class ModuleWatch:
    """The tensors of some modules as captured; `check()` raises if any was rebound."""

    def __init__(self, call: str, modules: Iterable[torch.nn.Module], full: bool = False):
        install_hooks()
        self.call = call
        self.full = full
        self.modules = tuple(dict.fromkeys(modules))
        for module in self.modules:
            _watched.update(module.modules())
        self.tensors = tuple(self._named())
        self.ptrs = tuple(t.data_ptr() for _, t in self.tensors)
        self.generation = _generation[0]
        params = [t for _, t in self.tensors if isinstance(t, torch.nn.Parameter)]
        self.ends = (params[0], params[-1]) if params else ()
        self.end_ptrs = tuple(t.data_ptr() for t in self.ends)
        self.requires_grad = any(t.requires_grad for _, t in self.tensors)
        self.warned = False

    def _named(self):
        for m, module in enumerate(self.modules):
            prefix = f"{type(module).__name__}." if len(self.modules) == 1 else f"{type(module).__name__}[{m}]."
            for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
                yield prefix + name, t

    def check(self) -> None:
        """Cheap unless something changed; raises `StateChangedError` naming the tensor."""
        if self.full or _generation[0] != self.generation:
            return self._check_all()
        for t, p in zip(self.ends, self.end_ptrs):  # a loop, not any(genexpr): this runs on every call
            if t.data_ptr() != p:
                return self._check_all()

    def _check_all(self) -> None:
        now = dict(self._named())
        for (name, t), ptr in zip(self.tensors, self.ptrs):
            cur = now.pop(name, None)
            if cur is None:
                why = "was removed"
            elif cur is not t:
                why = "is a new tensor (replaced, or load_state_dict(..., assign=True))"
            elif cur.data_ptr() != ptr:
                why = "has new storage (.to(), .half(), or an assignment to .data)"
            else:
                continue
            raise StateChangedError(
                f"{self.call}: {name} {why} since capture; the graphs read the storage captured: "
                "capture again (update tensors in place with copy_ to keep the graphs)"
            )
        if now:
            raise StateChangedError(
                f"{self.call}: {sorted(now)[0]} was added since capture; the graphs do not read it: capture again"
            )
        self.generation = _generation[0]  # an unrelated registration elsewhere: nothing to do

    def warn_grad(self, args) -> None:
        """Once: graphs record no autograd history, so outputs in grad mode have none."""
        if self.warned:
            return
        if self.requires_grad or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self.warned = True
            warnings.warn(
                f"{self.call}: called with grad mode on and tensors that require grad, but CUDA graphs replay "
                "without autograd: the outputs carry no gradient history. Call under torch.no_grad() or "
                "torch.inference_mode() (graphify is for inference), or use the function itself for training.",
                stacklevel=4,
            )
