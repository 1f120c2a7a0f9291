"""Whether watched dicts changed, in one compare where Python allows, and identity checks in C.

The per-call check of what a graph reads (`graphify.reads.watch`) must see a change to any of a
few thousand dicts (every module's `__dict__`, its parameter, buffer and hook dicts, the
globals of the functions a call runs, class dicts) within a microsecond or two. `DictMarks`
does it with graphify's C helper (`graphify/_dictwatch.c`): on Python 3.12 and newer a dict
watcher moves one counter on any change to a watched dict, so the check is one integer
compare; on older Pythons it compares every dict's version tag (PEP 509) in one C loop.
Without the helper (no compiler at install), torch's own `dict_version` reads the tags from
Python: exact, slower per call.

`same_cells`, `same_lists` and `same_functions` check, by identity, what no dict holds
(closure cells, list items, a function's code and defaults; on Python 3.12+ a function
watcher moves the counter on the latter too); `attach_dict` makes an object's `__dict__`
one that reports its changes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from operator import is_

try:  # by name: the C helper sits beside this file, built at install (setup.py)
    _c = importlib.import_module(f"{__package__}._dictwatch")
except ImportError:  # built without the C helper
    _c = None

__all__ = [
    "DictMarks", "WATCHERS", "HELPER", "attach_dict", "cell_value", "function_state", "same_cells", "same_functions",
    "same_lists", "versions",
]

HELPER = _c is not None
WATCHERS = bool(HELPER and _c.HAVE_WATCHERS)


def _python_versions():
    try:
        from torch._C._dynamo.guards import dict_version
    except ImportError:  # an old torch: a dict's contents by identity stand in for its version
        def dict_version(d):
            return tuple((k, id(v)) for k, v in d.items())
    return lambda dicts: tuple(map(dict_version, dicts))


if HELPER and _c.HAVE_VERSIONS:
    versions = _c.versions
    _packed = _c.packed_versions
    _same_versions = _c.same_versions
elif HELPER:  # Python 3.14+: no version tags; watchers alone say that something moved
    versions = _packed = _same_versions = None
else:
    versions = _packed = _python_versions()

    def _same_versions(dicts, tags):
        return versions(dicts) == tags


def attach_dict(obj) -> dict | None:
    """`obj.__dict__`, made a dict whose changes watchers and version tags see (None if
    `obj` has none). Python 3.13 stores the attributes of most objects inline, and an
    attribute set there changes the dict `__dict__` shows without telling its watchers;
    assigning the dict back as the object's own ends that (once, at record time)."""
    d = getattr(obj, "__dict__", None)
    if not isinstance(d, dict):
        return None
    if sys.version_info >= (3, 13):
        try:
            obj.__dict__ = d
        except (AttributeError, TypeError):
            pass
    return d


class DictMarks:
    """Some dicts as they are now; `moved()` says whether any changed since (or since the
    last `settle()`), `which()` which ones (where version tags exist)."""

    __slots__ = ("dicts", "mark", "tags", "packed")

    def __init__(self, dicts: Sequence[dict]):
        self.dicts = tuple(dicts)
        if WATCHERS:
            _c.watch(self.dicts)
        self.mark = self.tags = self.packed = None
        self.settle()

    def settle(self) -> None:
        """Take the dicts as they are now as the mark."""
        if WATCHERS:
            self.mark = _c.epoch()
        if versions is not None:
            self.tags = versions(self.dicts)
            self.packed = _packed(self.dicts)

    def moved(self) -> bool:
        """Whether any dict may have changed since the mark (with watchers, a change to any
        watched dict anywhere counts: `which()` tells)."""
        if WATCHERS:
            return _c.epoch() != self.mark
        return not _same_versions(self.dicts, self.packed)

    def which(self) -> list[int] | None:
        """Indices of the dicts changed since the mark; None where Python keeps no version
        tags (every dict must then be compared)."""
        if versions is None:
            return None
        now = versions(self.dicts)
        return [i for i, (a, b) in enumerate(zip(now, self.tags)) if a != b]


def function_state(f) -> tuple:
    """What `same_functions` compares: (__code__, __defaults__, __kwdefaults__)."""
    return f.__code__, f.__defaults__, f.__kwdefaults__


_EMPTY = object()


def cell_value(cell):
    """What a closure cell holds (a sentinel for an empty one: never what `same_cells` expects)."""
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _EMPTY


if HELPER:
    same_cells = _c.same_cells
    same_lists = _c.same_lists
    same_functions = _c.same_functions
else:
    def same_cells(cells: tuple, values: tuple) -> bool:
        return all(map(is_, map(cell_value, cells), values))

    def same_lists(lists: tuple, contents: tuple) -> bool:
        return all(len(a) == len(b) and all(map(is_, a, b)) for a, b in zip(lists, contents))

    def same_functions(funcs: tuple, states: tuple) -> bool:
        return all(all(map(is_, function_state(f), s)) for f, s in zip(funcs, states))
