"""Parameters and buffers rebound after capture, and calls in grad mode.

Graphs read the storage their modules' tensors had at capture. `load_state_dict(...,
assign=True)`, a replaced Parameter or buffer, or `.to()` / `.half()` (which swap each
parameter's `.data`) leave the graphs reading stale memory. `ModuleWatch` notices:

- a *weights generation*, one integer a call compares, bumped by whatever rebinds a
  parameter: torch's global registration hooks (a new Parameter, buffer or submodule on a
  watched module, which is what `load_state_dict(..., assign=True)` does; registrations on
  other modules, such as the ModuleList transformers makes by slicing its layers on every
  forward, are ignored, and a compiled trace never sees the hook count), an assignment to
  any Parameter's `.data` (`Parameter.__setattr__`), and `Module._apply` (`.to()`,
  `.half()`, `.cuda()`, whichever way torch converts), and
- the storage under every buffer (few, and plain tensors: their `.data` has no hook),

and when either moved, checks every tensor by name: a move that rebound nothing of ours
costs that one check, a rebinding raises `StateChangedError` naming the tensor. Checking
every parameter's storage on every call instead (what torch's CUDA graph trees do, in C++)
costs a call about a hundred times more at 8B (`benchmarks.call_cost`). Not seen: storage
swapped without Python (`p.set_(...)`, `torch.utils.swap_tensors`, writes to
`module._parameters`); `copy_` into the tensors, which graphs see, is the way to update.
"""

from __future__ import annotations

import functools
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


def _set_parameter_attr(self, name: str, value) -> None:
    object.__setattr__(self, name, value)
    if name == "data":  # new storage under a Parameter: any graph may read the old
        _generation[0] += 1


def _applied(apply):
    @functools.wraps(apply)
    def _apply(self, *args, **kwargs):
        try:
            return apply(self, *args, **kwargs)
        finally:  # .to() / .half() / .cuda(): new storage, by `.data`, swap_tensors or new Parameters
            _generation[0] += 1

    return _apply


def install_hooks() -> None:
    """Install what bumps the weights generation (once): torch's global registration hooks,
    `Parameter.__setattr__` for `.data`, and a wrapper of `Module._apply`."""
    if _hooked[0]:
        return
    from torch.nn.modules import module as nn_module

    nn_module.register_module_parameter_registration_hook(_bump)
    nn_module.register_module_buffer_registration_hook(_bump)
    nn_module.register_module_module_registration_hook(_bump)
    torch.nn.Parameter.__setattr__ = _set_parameter_attr
    torch.nn.Module._apply = _applied(torch.nn.Module._apply)
    _hooked[0] = True


class ModuleWatch:
    """The tensors of some modules as captured; `check()` raises if any was rebound."""

    def __init__(self, label: str, modules: Iterable[torch.nn.Module]):
        install_hooks()
        self.label = label
        self.modules = tuple(dict.fromkeys(modules))
        for module in self.modules:
            _watched.update(module.modules())
        self.tensors = tuple(self._named())
        self.ptrs = tuple(t.data_ptr() for _, t in self.tensors)
        self.buffers = tuple(t for _, t in self.tensors if not isinstance(t, torch.nn.Parameter))
        self.buffer_ptrs = list(map(torch.Tensor.data_ptr, self.buffers))
        self.generation = _generation[0]
        self.requires_grad = any(t.requires_grad for _, t in self.tensors)
        self.warned = False

    def _named(self):
        for m, module in enumerate(self.modules):
            prefix = f"{type(module).__name__}." if len(self.modules) == 1 else f"{type(module).__name__}[{m}]."
            for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
                yield prefix + name, t

    def check(self) -> None:
        """Cheap unless something changed; raises `StateChangedError` naming the tensor."""
        if _generation[0] != self.generation or list(map(torch.Tensor.data_ptr, self.buffers)) != self.buffer_ptrs:
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
                f"{self.label}: {name} {why} since capture; the graphs read the storage captured: "
                "capture again (update tensors in place with copy_ to keep the graphs)"
            )
        if now:
            raise StateChangedError(
                f"{self.label}: {sorted(now)[0]} was added since capture; the graphs do not read it: capture again"
            )
        self.generation = _generation[0]  # an unrelated registration elsewhere: nothing to do

    def warn_grad(self, args) -> None:
        """Once: graphs record no autograd history, so outputs in grad mode have none."""
        if self.warned:
            return
        if self.requires_grad or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self.warned = True
            warnings.warn(
                f"{self.label}: called with grad mode on and tensors that require grad, but CUDA graphs replay "
                "without autograd: the outputs carry no gradient history. Call under torch.no_grad() or "
                "torch.inference_mode() (graphify is for inference), or use the function itself for training.",
                stacklevel=4,
            )
