"""The storage under parameters: one generation that moves whenever Python swaps it.

Graphs read the storage their parameters had at capture. The Parameter object can stay in
its module while the memory under it moves: `p.data = t`, `p.set_(...)`, `p.resize_(...)`,
`torch.utils.swap_tensors`, `.to()` / `.half()` / `.cuda()` (`Module._apply`, which does
one of those). Comparing every parameter's address before every call costs about 20 µs at
8B (291 parameters, torch's C++ comparison on the H100), so these hooks move one integer
instead, and `graphify.reads.watch` compares addresses only when it moved:

- `Parameter.__setattr__` for `.data`;
- `Parameter.set_`, `resize_`, `resize_as_`, `as_strided_` and the in-place view ops
  (`t_`, `transpose_`, `squeeze_`, ...): new shape or strides over the same storage;
- `torch._C._swap_tensor_impl`, under every `torch.utils.swap_tensors`;
- `Module._apply`, whichever way torch converts;
- `Module.__setattr__` for `__class__` (`torch.nn.utils.parametrize` swaps a module's
  class; the class decides which code runs).

Plain tensors (buffers, closure tensors) have no such hook for `.data =`: `graphify.reads.watch`
compares their addresses on every call, which is cheap since a model has few.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["generation", "install_hooks"]

# in-place ops that change what memory a Parameter's elements are read from
_METADATA_OPS = ("set_", "resize_", "resize_as_", "as_strided_", "t_", "transpose_", "swapdims_", "swapaxes_",
                 "squeeze_", "unsqueeze_")

_generation = [0]
_hooked = [False]


def generation() -> int:
    """How many times Python may have moved a parameter's storage (or a module's class)."""
    return _generation[0]


def _bump() -> None:
    _generation[0] += 1


def _set_parameter_attr(self, name: str, value) -> None:
    object.__setattr__(self, name, value)
    if name == "data":  # new storage under a Parameter: any graph may read the old
        _bump()


def _bumping(method):
    @functools.wraps(method)
    def bumping(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            _bump()

    return bumping


def _module_setattr(setattr_):
    @functools.wraps(setattr_)
    def __setattr__(self, name, value):
        if name == "__class__":
            _bump()
        setattr_(self, name, value)

    return __setattr__


def install_hooks() -> None:
    """Install what moves the generation (once); see the module doc."""
    if _hooked[0]:
        return
    parameter = torch.nn.Parameter
    parameter.__setattr__ = _set_parameter_attr
    for name in _METADATA_OPS:
        if hasattr(torch.Tensor, name):
            setattr(parameter, name, _bumping(getattr(torch.Tensor, name)))
    torch._C._swap_tensor_impl = _bumping(torch._C._swap_tensor_impl)
    torch.nn.Module._apply = _bumping(torch.nn.Module._apply)
    torch.nn.Module.__setattr__ = _module_setattr(torch.nn.Module.__setattr__)
    _hooked[0] = True
