"""Types that keep Python state a replay cannot run, and how graphs follow them.

A graph replays kernels, not Python: a counter an object keeps as a Python int (a
transformers sliding-window cache layer's `cumulative_length_int`, which picks the branch
its `update()` takes) would stop advancing under replays, and the branch would be frozen at
the one captured. As `torch.utils._pytree.register_pytree_node` tells pytree how to walk a
type, `register_state_type` tells graphify how to follow one:

- `owns`: the attributes whose values the type's code changes on every call;
- `branch(obj, call)`: what those values decide for this call (a hashable: graphs are
  captured and replayed per branch), or None where a graph cannot stand in for the call
  (it runs eagerly);
- `after(obj, call)`: the values of `owns` after the call, as the type's own code would
  leave them: set after each replay, and checked against what each eager run left (a
  prediction that is ever wrong turns graphs off for those calls);
- `per_call(call)` (optional): what `branch` and `after` need of the call, computed once a
  call for all objects of the type and passed to them in place of `call`.

`call` is the call's arguments by parameter name. Lookups go by the type's MRO, so
subclasses are covered. Adapters for a library's types are declared as the library's
`graphify.adapters` entry point (`graphify.base.plugins`; graphify's own adapter registers
transformers' cache layers) and loaded when a call first passes an object from that library
(`adapters_of_imported`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ContextManager

import attrs

from graphify.base import plugins

__all__ = [
    "StateType", "register_state_type", "state_type_of", "any_registered", "adapters_of_imported",
    "register_capture_context", "capture_contexts", "owned_values", "put_owned", "register_forward_adapter",
    "adapt_forward_owner",
]


@attrs.frozen
class StateType:
    """How graphs follow one registered type; see the module docstring."""

    owns: tuple[str, ...]
    branch: Callable[[Any, Any], Hashable | None]
    after: Callable[[Any, Any], tuple]
    per_call: Callable[[Mapping[str, Any]], Any] | None = None

    def given(self, call: Mapping[str, Any]) -> Any:
        """What `branch` and `after` are given for this call: `per_call(call)`, else `call`."""
        return call if self.per_call is None else self.per_call(call)


_REGISTRY: dict[type, StateType] = {}
_CONTEXTS: list = []
_FORWARD_ADAPTERS: list = []

_loaded: set[str] = set()  # libraries whose adapters were looked up


def register_state_type(cls: type, state_type: StateType) -> None:
    """Follow instances of `cls` (and its subclasses) as `state_type` says."""
    if not isinstance(cls, type):
        raise TypeError(f"register_state_type: expected a class, got {cls!r}")
    _REGISTRY[cls] = state_type


def register_capture_context(make: Callable[[], ContextManager]) -> None:
    """Run every eager run of a capture (warm-ups, the simulation's capture run) inside
    `make()`: code that asks whether a CUDA graph is capturing (transformers skips a host
    read of its mask then) must take, in those runs, the path the capture takes."""
    _append_once(_CONTEXTS, make)


def register_forward_adapter(adapt: Callable[[Any], None]) -> None:
    """Call `adapt(model)` when a library model's bound `forward` is graphified: what the
    library's own loop around the forward does that graphs make needless (transformers
    builds a decode step's mask on the host) is the adapter's to change, on that model."""
    _append_once(_FORWARD_ADAPTERS, adapt)


def _append_once(registry: list, fn: Callable) -> None:
    """Append `fn` unless it is there already, as itself or as one function's source loaded
    under a second module name (`transforms.hf` and `graphify.transforms.hf` both register)."""
    if not any(fn is g or _same_function_elsewhere(fn, g) for g in registry):
        registry.append(fn)


def _same_function_elsewhere(f: Any, g: Any) -> bool:
    """Whether `f` and `g` are one function's source in two module objects."""
    cf, cg = getattr(f, "__code__", None), getattr(g, "__code__", None)
    return (cf is not None and cg is not None and f.__module__ != g.__module__ and f.__qualname__ == g.__qualname__
            and (cf.co_filename, cf.co_firstlineno) == (cg.co_filename, cg.co_firstlineno))


def adapt_forward_owner(model: Any) -> None:
    """Import `model`'s library adapters, then run every registered forward adapter on it."""
    adapters_of_imported()
    for adapt in _FORWARD_ADAPTERS:
        adapt(model)


@contextlib.contextmanager
def capture_contexts():
    """Every registered capture context, entered."""
    with contextlib.ExitStack() as stack:
        for make in _CONTEXTS:
            stack.enter_context(make())
        yield


def owned_values(obj: Any, names: tuple[str, ...]) -> tuple:
    """The values of `obj`'s attributes `names` now."""
    return tuple(getattr(obj, name) for name in names)


_setattr = object.__setattr__


def put_owned(owned) -> None:
    """Set each (object, attribute names, values) of `owned` (past any custom __setattr__,
    as capture puts state back)."""
    for obj, names, values in owned:
        if len(names) == 1:  # the common case, without a zip per object
            _setattr(obj, names[0], values[0])
            continue
        for name, value in zip(names, values):
            _setattr(obj, name, value)


def any_registered() -> bool:
    """Whether any type is registered (else no walk need look for them)."""
    return bool(_REGISTRY)


def state_type_of(obj: Any) -> StateType | None:
    """The registration covering `obj`'s type (nearest in its MRO), or None."""
    if not _REGISTRY:
        return None
    for klass in type(obj).__mro__:
        found = _REGISTRY.get(klass)
        if found is not None:
            return found
    return None


def adapters_of_imported() -> None:
    """Load the adapters declared for every library this process has imported, once each
    (`graphify.base.plugins`): an object of a library proves it imported, so its types are
    registered before graphify walks them, wherever the object sits (an argument, a closure,
    `self`), and a compile worker applies the caller's capture contexts."""
    for library in plugins.declared(plugins.ADAPTERS):
        if library in sys.modules and library not in _loaded:
            _loaded.add(library)
            plugins.load(plugins.ADAPTERS, library)
