"""Before every replay, whether anything a deep walk recorded changed: a microsecond or two.

A deep `Reach` (`graphify.reads.reach`) records everything a call reads beyond its arguments
and its static objects: modules wherever they sit, with their parameters, buffers, hooks,
`training` and plain attributes; the globals and closures of the code that runs; the class
dicts whose methods run. Comparing tens of thousands of edges before every replay would
cost milliseconds at 8B, so `Watch` splits them by what can tell it that they changed:

- edges held by a dict (module `__dict__`s and their parameter, buffer, submodule and hook
  dicts, globals, class dicts, plain objects' attributes): `graphify.reads.dict_marks.DictMarks`,
  one counter compare on Python 3.12+ (dict watchers), a C pass over version tags before;
- edges no dict holds (closure cells, list items, slots, and before Python 3.12 functions'
  code and defaults, which a function watcher follows from 3.12 on): compared by identity
  every call, in C;
- the storage under parameters: `graphify.reads.parameter_storage` moves a generation whenever Python
  rebinds it (`.data =`, `set_`, `swap_tensors`, `.to()`, in-place transposes); other tensors'
  addresses, shapes and strides are compared every call (they are few: rotary tables,
  closure tensors).

When any of these moved, `verify` compares the edges of the dicts that moved, or every
edge (values by equality, tensors by identity, address and shape): a real change raises `StateChangedError` naming its path; a
move that changed nothing graphs read (an unrelated dict, a number rebound to an equal one)
settles the marks and the call replays.
"""

from __future__ import annotations

import functools
import types
from operator import attrgetter

import torch

from graphify.reads import parameter_storage as _params
from graphify.base.errors import StateChangedError
from graphify.reads.reach import Reach, has_address
from graphify.reads.dict_marks import WATCHERS, DictMarks, cell_value, function_state, same_cells, same_functions, same_lists

__all__ = ["Watch"]

_data_ptr = torch.Tensor.data_ptr
_shape = attrgetter("shape")
_stride = torch.Tensor.stride
# holders whose edges cannot change, or that `same_functions` covers
_IMMUTABLE_HOLDERS = (tuple, frozenset, types.MethodType, functools.partial, types.FunctionType)


class Watch:
    """The per-call check of one deep walk; see the module doc. `label` names the callable
    in errors."""

    def __init__(self, label: str, reach: Reach):
        _params.install_hooks()
        self.label, self.reach = label, reach
        dicts: dict = {}
        lists: dict = {}
        cells: dict = {}
        slots: list = []
        for edges in reach.all_edges():
            for holder, key, _, _ in edges:
                if isinstance(holder, dict):
                    dicts[id(holder)] = holder
                elif isinstance(holder, list):
                    lists[id(holder)] = holder
                elif isinstance(holder, types.CellType):
                    cells[id(holder)] = holder
                elif edges.attr and not isinstance(holder, _IMMUTABLE_HOLDERS) and key != "__class__":
                    slots.append((holder, key))  # (a module's class: the generation moves when it is set)
        for holder in reach.sized.holders:
            (dicts if isinstance(holder, dict) else lists)[id(holder)] = holder
        self.marks = DictMarks(dicts.values())
        # what no dict holds, compared by identity every call: cells, lists, functions, (holder, slot)
        self.held = (tuple(cells.values()), tuple(lists.values()), tuple(f for f, _ in reach.functions), tuple(slots))
        # tensors whose storage Python can swap without a hook: checked by address every call
        plain = tuple(t for t in reach.tensors if not isinstance(t, torch.nn.Parameter) and has_address(t))
        self.plain = (plain, tuple(map(_data_ptr, plain)), list(map(_shape, plain)), list(map(_stride, plain)))
        self.requires_grad = any(t.requires_grad for t in reach.tensors)
        self.expected: tuple = ()
        self._take()
        self.verified = 0  # full comparisons made (a change, or a move elsewhere): tests count them
        self.warned = False  # about grad mode (`graphify.reads.table_reads`), once

    def _take(self) -> None:
        """What the per-call identity checks compare against: the values now."""
        cells, lists, functions, slots = self.held
        self.expected = (
            _params.generation(), tuple(map(cell_value, cells)), tuple(map(tuple, lists)),
            tuple(map(function_state, functions)), tuple(getattr(h, k) for h, k in slots),
        )

    def unchanged(self) -> bool:
        """The fast check: True if nothing recorded can have changed since capture (or the
        last settled move)."""
        return not self.marks.moved() and self._held_same(functions=not WATCHERS)

    def _held_same(self, functions: bool = True) -> bool:
        """Everything but the watched dicts as expected: the generation, what no dict holds,
        the plain tensors' addresses and shapes. `functions`: the functions' code and
        defaults too (with watchers, their changes move the counter instead)."""
        generation, cell_values, list_items, function_states, slot_values = self.expected
        cells, lists, functions, slots = self.held
        tensors, ptrs, shapes, strides = self.plain
        return (
            _params.generation() == generation
            and same_cells(cells, cell_values)
            and same_lists(lists, list_items)
            and (not functions or same_functions(functions, function_states))
            and (not slots or all(getattr(h, k) is v for (h, k), v in zip(slots, slot_values)))
            and tuple(map(_data_ptr, tensors)) == ptrs
            and list(map(_shape, tensors)) == shapes
            and list(map(_stride, tensors)) == strides
        )

    def guard(self) -> None:
        """Raise `StateChangedError` naming what changed, if anything graphs read did."""
        if self.unchanged():
            return
        what = self.verify()
        if what is not None:
            raise StateChangedError(
                f"{self.label}: {what} since capture. The graphs replay what the call read then (kernels chosen "
                "by Python, tensors by address, numbers baked in), so they cannot stand in for this call: update "
                "tensors in place (copy_) to keep the graphs, or capture again"
            )

    def verify(self) -> str | None:
        """Compare the edges of what moved (the dicts that moved, where only dicts did and
        version tags say which; else every edge); None (and the marks settled) if nothing
        graphs read changed, else the first change as 'path: what'."""
        self.verified += 1
        reach = self.reach
        which = self.marks.which() if self._held_same() else None
        if which is not None:  # only watched dicts moved (with watchers, maybe none of these): compare their edges
            within = {id(self.marks.dicts[i]) for i in which}
            what = reach.describe(within, plains=not reach.plains_are_effects) if within else None
        else:
            what = reach.describe() if reach.changed() else None
        if what is not None:
            return what
        self.marks.settle()
        self._take()
        return None
