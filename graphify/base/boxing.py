"""Outputs of any pytree come back in their own type.

torch's pytree knows tuples, lists, dicts, namedtuples and the classes registered with it
(transformers registers its `ModelOutput`s). Dataclasses it does not know are boxed while
graphify holds them, as a node of graphify's own (registered once, here), and unboxed
when a call hands them back: a copy of the captured instance with its fields replaced.
No user class is registered or patched.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["box", "unbox", "has_boxes"]


class _Box:
    """An unregistered dataclass instance as a pytree node: its fields are children."""

    __slots__ = ("template", "names", "values")

    def __init__(self, template: Any, names: tuple[str, ...], values: tuple):
        self.template, self.names, self.values = template, names, values


pytree.register_pytree_node(
    _Box,
    lambda b: (list(b.values), (b.template, b.names)),
    lambda values, ctx: _Box(ctx[0], ctx[1], tuple(values)),
)


def _unknown_dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES


def _box_one(x: Any) -> Any:
    names = tuple(f.name for f in dataclasses.fields(x))
    return _Box(x, names, tuple(box(getattr(x, n)) for n in names))


def box(tree: Any) -> Any:
    """`tree` with every unregistered dataclass instance boxed (so it flattens)."""
    if _unknown_dataclass(tree):
        return _box_one(tree)
    return pytree.tree_map(lambda x: _box_one(x) if _unknown_dataclass(x) else x, tree, is_leaf=_unknown_dataclass)


def _unbox_one(b: _Box) -> Any:
    out = copy.copy(b.template)
    for name, value in zip(b.names, b.values):
        object.__setattr__(out, name, unbox(value))
    return out


def unbox(tree: Any) -> Any:
    """The inverse of `box`: boxed nodes back to instances of their dataclass."""
    if isinstance(tree, _Box):
        return _unbox_one(tree)
    return pytree.tree_map(lambda x: _unbox_one(x) if isinstance(x, _Box) else x, tree,
                           is_leaf=lambda x: isinstance(x, _Box))


def has_boxes(spec: pytree.TreeSpec) -> bool:
    """Whether a flattened output's structure holds a boxed dataclass."""
    if spec.type is _Box:
        return True
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    return any(has_boxes(c) for c in children)
