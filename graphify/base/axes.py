"""Argument axes, in the spirit of vmap's in_axes: how each argument relates to the batch.

- `tokens(pad)`: dim 0 grows with the tokens of the batch; padded into a static buffer.
- `reqs(pad)`: dim 0 grows with the requests of the batch; padded into a static buffer.
- `fixed()`: a tensor of one fixed shape, copied into a static buffer on every call.
- `persistent()`: the same storage on every call (weights, KV cache); never copied, checked.
- `static()`: a non-tensor value baked into the graph; every call must pass an equal one.

A pad value must describe a harmless row (a KV slot that writes nowhere, a sequence length
of 1): padded rows run through the graph, and capture runs on all-padding batches.
"""

from __future__ import annotations

import enum
import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from graphify.base.errors import InputMismatchError

__all__ = [
    "Axis", "Kind", "tokens", "reqs", "fixed", "persistent", "static", "ArgSpec", "layout_for", "specs_for",
    "WeakStatic", "weaken", "static_objects",
]


class Kind(str, enum.Enum):
    """What an argument is to the batch. A `str` enum: equal to its name as a string, which
    is how users write axes and output axes ("tokens", "reqs")."""

    TOKENS = "tokens"
    REQS = "reqs"
    FIXED = "fixed"
    PERSISTENT = "persistent"
    STATIC = "static"

    def __str__(self) -> str:
        return self.value

    @property
    def padded(self) -> bool:
        """Dim 0 follows the batch: copied into the leading rows of a static buffer, the
        rest padding."""
        return self in PADDED


KINDS = tuple(k.value for k in Kind)
PADDED = (Kind.TOKENS, Kind.REQS)


@attrs.frozen
class Axis:
    """How one argument relates to the batch; build it with `tokens()`, `reqs()`, ..."""

    kind: Kind = attrs.field(converter=Kind)
    pad: int | float | bool = 0

    @classmethod
    def parse(cls, value: "Axis | str") -> "Axis":
        if isinstance(value, Axis):
            return value
        if isinstance(value, str) and value.lower() in KINDS:
            return cls(value.lower())
        raise ValueError(f"unknown axis {value!r}; valid axes are {', '.join(map(repr, KINDS))} or an Axis")

    def __str__(self) -> str:
        return f"{self.kind}(pad={self.pad})" if self.kind.padded else f"{self.kind}()"


def tokens(pad: int | float | bool = 0) -> Axis:
    """Dim 0 grows with tokens; padded rows are filled with `pad`."""
    return Axis(Kind.TOKENS, pad)


def reqs(pad: int | float | bool = 0) -> Axis:
    """Dim 0 grows with requests; padded rows are filled with `pad`."""
    return Axis(Kind.REQS, pad)


def fixed() -> Axis:
    """A fixed-shape tensor copied into its static buffer on every call."""
    return Axis(Kind.FIXED)


def persistent() -> Axis:
    """Same storage on every call (weights, KV cache): not copied, its address is checked."""
    return Axis(Kind.PERSISTENT)


def static() -> Axis:
    """A non-tensor value baked into the graph: later calls must pass an equal value."""
    return Axis(Kind.STATIC)


@attrs.frozen(eq=False)
class ArgSpec:
    """What one argument looked like at capture; calls are checked against it."""

    index: int
    name: str
    axis: Axis
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    shape: tuple[int, ...] = ()
    data_ptr: int = 0
    value: Any = None
    stride: tuple[int, ...] = ()  # persistent tensors: the layout the graphs read them in

    @property
    def trailing(self) -> tuple[int, ...]:
        return self.shape[1:] if self.axis.kind.padded else self.shape

    def describe(self) -> str:
        if self.axis.kind is Kind.STATIC:
            return f"static value {self.value!r}"
        lead = {Kind.TOKENS: "num_tokens", Kind.REQS: "num_reqs"}.get(self.axis.kind)
        dims = ", ".join([lead] * (lead is not None) + [str(d) for d in self.trailing])
        return f"{self.axis.kind} tensor of shape ({dims}), dtype {self.dtype}, device {self.device}"


def param_names(fn: Callable, count: int) -> tuple[str, ...]:
    """Positional parameter names of `fn`, falling back to arg0, arg1, ..."""
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return tuple(params[i] if i < len(params) else f"arg{i}" for i in range(count))


def layout_for(
    label: str, names: Sequence[str], axes: "Sequence | Mapping | None", args: Sequence[Any]
) -> tuple[Axis, ...]:
    """One `Axis` per argument slot: from `axes` (a sequence, or a mapping by parameter
    name), or by default (`default_axis`) tensors as `tokens()` and other values as `static()`."""
    rows = batch_rows(args)
    if axes is None:
        return tuple(default_axis(a, rows) for a in args)
    if isinstance(axes, Mapping):
        unknown = sorted(set(axes) - set(names))
        if unknown:
            raise ValueError(f"{label}: axes names unknown parameter(s) {unknown}; parameters are {list(names)}")
        return tuple(Axis.parse(axes[n]) if n in axes else default_axis(a, rows) for n, a in zip(names, args))
    axes = tuple(axes)
    if len(axes) != len(args):
        raise ValueError(f"{label}: axes has {len(axes)} entries but the call passes {len(args)} arguments")
    return tuple(Axis.parse(a) for a in axes)


def batch_rows(args: Sequence[Any]) -> int | None:
    """The batch's rows among tensor arguments by default: the first dimension most of them
    share (the first tensor's where counts tie); None without a tensor of a dimension. Pure.

    !!! example
        >>> batch_rows([torch.zeros(2, 1), torch.zeros(2, 8), torch.zeros(3, 2, 1), None])
        2
    """
    firsts = [a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    return max(dict.fromkeys(firsts), key=firsts.count) if firsts else None


def default_axis(arg: Any, rows: int | None) -> Axis:
    """An argument's axis where none is given: a tensor whose first dimension is the batch's
    rows (`batch_rows`) grows with the batch (`tokens()`); any other tensor keeps its shape
    (`fixed()`: a vision-language decoder's rotary `position_ids` of [3, batch, length], a
    0-d scale); other values are `static()`."""
    if not isinstance(arg, torch.Tensor):
        return static()
    return tokens() if arg.dim() > 0 and arg.shape[0] == rows else fixed()


def specs_for(label: str, names: Sequence[str], layout: Sequence[Axis], args: Sequence[Any]) -> tuple[ArgSpec, ...]:
    """Record each argument's spec from the example call; reject impossible layouts."""
    specs = []
    for i, (axis, arg, name) in enumerate(zip(layout, args, names)):
        if axis.kind is Kind.STATIC:
            if isinstance(arg, torch.Tensor):
                raise InputMismatchError(
                    f"{label}: argument {name!r} is a tensor but its axis is static(); "
                    "mark it tokens(), reqs(), fixed() or persistent()"
                )
            specs.append(ArgSpec(i, name, axis, value=arg))
            continue
        if not isinstance(arg, torch.Tensor):
            raise InputMismatchError(
                f"{label}: argument {name!r} has axis {axis} but is a {type(arg).__name__}, not a tensor; "
                "mark non-tensor arguments static()"
            )
        if axis.kind.padded and arg.dim() == 0:
            raise InputMismatchError(f"{label}: argument {name!r} has axis {axis} but is a 0-d tensor")
        specs.append(
            ArgSpec(i, name, axis, arg.dtype, arg.device, tuple(arg.shape), arg.data_ptr() if axis.kind is Kind.PERSISTENT else 0,
                    stride=tuple(arg.stride()) if axis.kind is Kind.PERSISTENT and arg.layout is torch.strided else ())
        )
    return tuple(specs)


class WeakStatic:
    """A static object held weakly: calls must pass this very object, and once it is gone no
    call can, so nothing graphify keeps should keep it (or the memory its tensors hold)
    alive. First-use capture holds a transformers cache this way: generate() makes a new
    one per call and drops the old one, whose graphs are then freed."""

    __slots__ = ("ref", "type_name", "__weakref__")

    def __init__(self, obj: Any):
        self.ref = weakref.ref(obj)
        self.type_name = type(obj).__name__

    def __call__(self) -> Any:
        return self.ref()

    def __repr__(self) -> str:
        return f"<{self.type_name} object{'' if self.ref() is not None else ', gone'}>"


def weaken(value: Any) -> Any:
    """`value` as a `WeakStatic` when it is an object compared by identity that can be
    referenced weakly; plain values (and objects that cannot be) as they are."""
    if by_value(value) or isinstance(value, WeakStatic):
        return value
    try:
        return WeakStatic(value)
    except TypeError:
        return value


_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


def by_value(value: Any) -> bool:
    """Whether a static value is compared by equality (plain values: None, numbers,
    strings, dtypes, enums and tuples/lists/dicts of them) rather than by identity
    (every other object: a cache, a config, a module)."""
    if isinstance(value, _VALUE_TYPES) or isinstance(value, enum.Enum):
        return True
    if isinstance(value, (tuple, list, frozenset)):
        return all(map(by_value, value))
    if isinstance(value, dict):
        return all(by_value(k) and by_value(v) for k, v in value.items())
    return False


def same_static(arg: Any, value: Any) -> bool:
    """`arg` may stand for the captured static `value`: the same object, or an equal
    plain value of the same type."""
    if arg is value:
        return True
    if isinstance(value, WeakStatic):
        return arg is value()
    if not by_value(value) or type(arg) is not type(value):
        return False
    try:
        return bool(arg == value)
    except Exception:  # a container holding values whose == is not a bool
        return False


def mismatch(label: str, spec: ArgSpec, arg: Any) -> Exception | None:
    """The error for `arg` against its captured `spec`, or None when it fits."""
    from graphify.base.errors import PersistentSwapError

    kind = spec.axis.kind
    if kind is Kind.STATIC:
        if same_static(arg, spec.value):
            return None
        if not by_value(spec.value):
            return InputMismatchError(
                f"{label}: argument {spec.name!r} is a different {type(arg).__name__} object from the "
                f"{getattr(spec.value, 'type_name', type(spec.value).__name__)} captured; objects are static by identity because the graphs read the "
                "captured object's tensors: pass the same object (reset it in place) or capture again"
            )
        return InputMismatchError(
            f"{label}: argument {spec.name!r} is {arg!r} but was captured as {spec.value!r}; "
            "static arguments are baked into the graphs: capture again with the new value"
        )
    if not isinstance(arg, torch.Tensor):
        return InputMismatchError(f"{label}: argument {spec.name!r} must be a tensor; captured {spec.describe()}")
    got = f"dtype {arg.dtype}, device {arg.device}, shape {tuple(arg.shape)}"
    if arg.dtype != spec.dtype or arg.device != spec.device or tuple(arg.shape[1:] if kind.padded else arg.shape) != spec.trailing:
        if kind is Kind.PERSISTENT:
            return PersistentSwapError(
                f"{label}: persistent argument {spec.name!r} changed: got {got}, captured {spec.describe()}; "
                "pass the same tensor that was captured (update it in place) or capture again"
            )
        fix = ""
        if arg.dtype != spec.dtype:
            fix = (
                f"; cast it to the captured dtype ({spec.name}.to({spec.dtype})) or capture again with {arg.dtype} "
                "(a callable that captures on first use, without capture(), captures a new structure by itself)"
            )
        return InputMismatchError(f"{label}: argument {spec.name!r} got {got}; captured {spec.describe()}{fix}")
    if kind.padded and arg.dim() == 0:
        return InputMismatchError(f"{label}: argument {spec.name!r} is 0-d; captured {spec.describe()}")
    if kind is Kind.PERSISTENT and arg.data_ptr() != spec.data_ptr:
        return PersistentSwapError(
            f"{label}: persistent argument {spec.name!r} is a different tensor from the one captured "
            f"(data_ptr {arg.data_ptr():#x}, captured {spec.data_ptr:#x}); the graphs read the captured "
            "storage: update that tensor in place (copy_) or capture again"
        )
    if kind is Kind.PERSISTENT and spec.stride and tuple(arg.stride()) != spec.stride:
        return PersistentSwapError(
            f"{label}: persistent argument {spec.name!r} has strides {tuple(arg.stride())} at the captured address, "
            f"captured with {spec.stride} (a transposed or restrided view of the same memory); the graphs read it "
            "in the captured layout: pass it as captured (.contiguous() makes a copy) or capture again"
        )
    return None


def static_objects(specs, slots: Sequence[Any]) -> dict:
    """{argument name: object} of a call's static objects (compared by identity, not by
    value): the roots of the Python state a graph cannot follow."""
    return {s.name: slots[s.index] for s in specs if s.axis.kind is Kind.STATIC and not by_value(slots[s.index])}
