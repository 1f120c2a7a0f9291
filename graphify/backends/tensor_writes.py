"""Capture leaves state as it found it.

Warm-ups (and the simulation's capture) run the function eagerly, so every in-place write
it makes lands for real: K/V rows in a cache, a position counter's `add_`, a buffer's
running statistic. `StateKeeper.record` runs the function once under a dispatch mode that,
before each in-place write to a tensor that existed before the call (an argument, a
module buffer, a tensor reached through a closure or a static object such as a
transformers `StaticCache`), saves what the write is about to overwrite: for indexed
writes (`index_copy_`, `index_put_`, `scatter_`) only the rows it touches, otherwise the
written view. `restore()` writes the saved values back, newest first, so after it every
such tensor holds what it held before the run.

Every later eager run of the same size starts from the restored state and writes the same
places, so restoring after each run keeps the state untouched through warm-ups, compiled
warm-ups (which must not run under a dispatch mode) and capture. Nothing is recorded while
a CUDA stream is capturing: a graph being recorded executes nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass, is_traceable_wrapper_subclass_type

from graphify.backends.op_guard import first_run_guards
from graphify.reads.code_ran import recording_now
from graphify.reads.stateful_types import capture_contexts, put_owned

__all__ = ["StateKeeper", "KinWrites", "Unguarded", "schema_facts", "UNANNOTATED_VIEWS", "UNANNOTATED_WRITES"]

log = logging.getLogger("graphify")
_aten = torch.ops.aten

_INDEXED = {  # op -> how to read back and write back exactly the rows it writes
    "aten::index_copy_": "index",
    "aten::index_fill_": "index",
    "aten::index_add_": "index",
    "aten::index_put_": "put",
    "aten::_index_put_impl_": "put",
    "aten::scatter_": "scatter",
    "aten::scatter_add_": "scatter",
    "aten::scatter_reduce_": "scatter",
}
_UNRESTORABLE = {"aten::set_", "aten::resize_", "aten::resize_as_"}
# What some schemas do not say. Batch norm in training mode updates its running statistics
# (arguments 3 and 4) in place, with no `Tensor(a!)` annotation; these ops return views of
# their first argument with none either. `transforms._writes` reads the same tables.
UNANNOTATED_WRITES = {
    "aten::native_batch_norm": (3, 4), "aten::cudnn_batch_norm": (3, 4), "aten::miopen_batch_norm": (3, 4),
    "aten::_batch_norm_impl_index": (3, 4), "aten::_native_batch_norm_legit": (3, 4),
}
UNANNOTATED_VIEWS = frozenset({
    "aten::_unsafe_view", "aten::_reshape_alias", "aten::unsafe_split", "aten::unsafe_split_with_sizes",
    "aten::unsafe_chunk", "aten::lift",
})
_schema_facts: dict = {}


def schema_facts(func) -> tuple[tuple[int, ...], bool]:
    """(positions of the arguments `func` writes in place, whether it returns a view of
    an input), from its schema's `Tensor(a!)` / `Tensor(a)` annotations and the tables of
    what schemas do not say; cached per op. The recorder and `transforms._writes` both ask."""
    found = _schema_facts.get(func)
    if found is None:
        schema = func._schema
        written = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
        found = _schema_facts[func] = (
            tuple(sorted(written | set(UNANNOTATED_WRITES.get(schema.name, ())))),
            any(r.alias_info is not None for r in schema.returns) or schema.name in UNANNOTATED_VIEWS,
        )
    return found


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class _Recorder(TorchDispatchMode):
    """Saves what in-place writes to pre-existing tensors overwrite; see the module doc."""

    def __init__(self, keeper: "StateKeeper"):
        super().__init__()
        self.keeper = keeper
        self.created: set[int] = set()  # storages allocated during this run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a tensor subclass (DTensor) dispatches itself: see the plain ops it issues
        kwargs = kwargs or {}
        written, aliases = schema_facts(func)
        if written and not _capturing():
            name = func._schema.name
            schema_args = func._schema.arguments
            for i in written:
                target = args[i] if i < len(args) else kwargs.get(schema_args[i].name)
                if isinstance(target, torch.Tensor) and target.numel():
                    self._save(name, target, args, kwargs)
        out = func(*args, **kwargs)
        if not written and not aliases:  # views share their base's storage: not new
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.numel() and not is_traceable_wrapper_subclass(t):  # no storage
                    self.created.add(t.untyped_storage().data_ptr())
        return out

    def _save(self, name: str, target: torch.Tensor, args, kwargs) -> None:
        storage = target.untyped_storage().data_ptr()
        if storage in self.created or storage in self.keeper.exclude:
            return
        if name in _UNRESTORABLE:
            self.keeper.unrestorable.add(name)
            return
        how = _INDEXED.get(name) if target is args[0] else None
        if how == "index":
            dim, index = args[1], args[2].clone()
            saved = target.index_select(dim, index)
            undo = lambda t=target, d=dim, i=index, s=saved: t.index_copy_(d, i, s)  # noqa: E731
        elif how == "put":
            indices = [None if i is None else i.clone() for i in args[1]]
            saved = _aten.index.Tensor(target, indices)
            undo = lambda t=target, i=indices, s=saved: _aten.index_put_.default(t, i, s)  # noqa: E731
        elif how == "scatter":
            dim, index = args[1], args[2].clone()
            saved = target.gather(dim, index)
            undo = lambda t=target, d=dim, i=index, s=saved: t.scatter_(d, i, s)  # noqa: E731
        else:
            where = (storage, target.storage_offset(), tuple(target.shape), target.stride())
            if where in self.keeper.seen:  # already saved before its first write in this run
                return
            self.keeper.seen.add(where)
            saved = target.clone()
            undo = lambda t=target, s=saved: t.copy_(s)  # noqa: E731
        self.keeper.undo.append(undo)
        self.keeper.saved_bytes += saved.numel() * saved.element_size()
        self.keeper.targets.add(storage)


@attrs.define
class KinWrites:
    """What a structure's recorded captures wrote outside the call, for a kin that captures the
    same code compiled (`graphify.capture.kin_writes`): `own` its last recorded capture's,
    `carried` those of the structure it replaces, `whole` the storages the current capture
    undoes by whole copies."""

    own: tuple | None = None
    carried: tuple | None = None
    whole: tuple | None = None
    spoilt: bool = False  # a recorded capture wrote what positions cannot say: `own` stays None

    def note(self, found: tuple | None) -> None:
        """Add one recorded capture's writes (`kin_writes.written_positions`) to `own`: the
        union over the session's captures; None for good once one could not say."""
        if found is None or self.spoilt or (self.own is not None and self.own[0] != found[0]):
            self.own, self.spoilt = None, True
        else:
            self.own = found if self.own is None else (found[0], self.own[1] | found[1])


class StateKeeper:
    """Record one eager run's in-place writes to outside state; undo them after each run.

    `exclude` holds storages never to restore (graphify's own static input buffers,
    whose writes the capture reports as an error instead)."""

    def __init__(self, enabled: bool = True, exclude: "set[int] | None" = None):
        self.enabled = enabled
        self.exclude = exclude or set()
        self.undo: list[Callable[[], Any]] = []
        self.seen: set = set()
        self.targets: set[int] = set()
        self.unrestorable: set[str] = set()
        self.saved_bytes = 0
        self.peak_bytes = 0  # the most snapshot memory held at once
        self.restored: set[int] = set()  # storages restored over the whole capture
        self.since: set[int] = set()  # storages restored since `since` was last emptied (one capture's)
        self.recorded = 0  # runs recorded (not covered) since then
        self.kin = KinWrites()
        self._covered = False
        # (object, attribute names, values) of Python state registered types own
        # (`graphify.reads.stateful_types`): put back after every run, so each run sees the call's state
        self.owned: list = []
        self.put_back = False  # a capture put back state outside the call (`CaptureReport.restores`)

    def record_writes(self, fn: Callable, *args):
        """`fn(*args)` with its outside writes recorded; call `restore()` after it. While
        `covering()`, nothing is recorded: the record so far covers the run."""
        if not self.enabled or self._covered:
            return fn(*args)
        self.recorded += 1
        with _Recorder(self):
            return fn(*args)

    def begin(self, whole: "tuple | None") -> None:
        """A capture starts: what it records is counted afresh (`since`, `recorded`), and
        `whole` (`KinWrites.whole`) undoes its compiled warm-ups where it is not None."""
        self.since, self.recorded, self.kin.whole = set(), 0, whole

    def take_whole(self, storages) -> None:
        """Undo by whole copies of `storages`, taken now: for runs that cannot be recorded
        (compiled code), where what they write is known (`KinWrites`); run them `covering()`."""
        for storage in storages:
            saved = storage.clone()
            self.undo.append(lambda s=storage, c=saved: s.copy_(c))  # noqa: E731
            self.saved_bytes += saved.nbytes()
            self.targets.add(storage.data_ptr())

    @contextlib.contextmanager
    def covering(self):
        """Within, runs write only what the current record already holds (a schedule
        replay at the same shapes learnt it), so `record_writes` just runs them."""
        outer, self._covered = self._covered, True
        try:
            yield
        finally:
            self._covered = outer

    def restore(self) -> None:
        """Write back what the recorded run overwrote (newest first), and the owned Python
        state as it was before the capture."""
        put_owned(self.owned)
        if not self.undo:
            return
        with torch.no_grad():
            for undo in reversed(self.undo):
                undo()

    def forget(self) -> None:
        """Drop the snapshots (after the last run of one size has been restored)."""
        self.peak_bytes = max(self.peak_bytes, self.saved_bytes)
        self.restored |= self.targets
        self.since |= self.targets
        self.undo.clear()
        self.seen.clear()
        self.targets = set()
        self.saved_bytes = 0


class Unguarded:
    """The eager twin of a compiled function, for a first warm-up whose writes are recorded
    but that runs outside the op guard and the code recording: a capture of the same code
    (a structure's kin, or the structure its compiled graphs replace) was checked and
    recorded already. Those two cost most of a recorded run (a 32-layer model's ~1,800 ops
    through two more Python dispatch layers)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)


def _first_run(fn: Callable, guard, *args):
    """`fn(*args)`, or its eager twin `guard(*args)`, under the op guard when `guard` is set
    (and then the Python code it runs recorded: `graphify.reads.code_ran`); an `Unguarded` twin runs
    outside both."""
    if isinstance(guard, Unguarded):
        return guard(*args)
    with (first_run_guards() if guard else contextlib.nullcontext()), (recording_now() if guard else contextlib.nullcontext()):
        return (guard if callable(guard) else fn)(*args)


def eager_runs(
    fn: Callable, args: tuple, *, keeper: "StateKeeper | None", guard, count: int, finish=None, record: bool = True,
):
    """Run `fn(*args)` eagerly `count` times, the state restored after each run.

    The first run is recorded by `keeper` (unless `record` is False: an earlier run of the
    same call was, and its record serves this one) and runs under the op guard (when
    `guard` is set; a callable `guard` is the eager twin of a compiled `fn` and runs in
    its place).
    `finish(out)` sees the last run's result before its writes are undone (the
    simulation clones its outputs there); returns what it returns."""
    result = None
    with capture_contexts():  # code asking whether a graph captures sees what the capture will
        for i in range(count):
            if i == 0:  # module-level helper, not a closure: a kept traceback must not pin `args`
                recorded = keeper is not None and record
                out = keeper.record_writes(_first_run, fn, guard, *args) if recorded else _first_run(fn, guard, *args)
            else:
                out = fn(*args)
            if i == count - 1 and finish is not None:
                result = finish(out)
            del out
            if keeper is not None:
                keeper.restore()
    return result


_PLAIN = (bool, int, float, str, type(None))


def python_state(roots: dict[str, Any], depth: int = 3) -> dict[str, Any]:
    """Plain attribute values (numbers, strings, flags) of the objects in `roots` and of
    the objects they hold in attributes, lists and dicts, `depth` levels down: the
    Python-side state a call could change where a graph cannot follow. Maps a path to
    (holder, key, value, is_attribute), so `restore_python_state` can put values back."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, level: int) -> None:
        if id(obj) in seen or level > depth or isinstance(obj, (torch.Tensor, torch.nn.Module, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj[:256]):
                walk(x, f"{path}[{i}]", level + 1)
            return
        if isinstance(obj, dict):
            for k, x in list(obj.items())[:256]:
                if isinstance(x, _PLAIN):
                    found[f"{path}[{k!r}]"] = (obj, k, x, False)
                else:
                    walk(x, f"{path}[{k!r}]", level + 1)
            return
        attrs_ = getattr(obj, "__dict__", None)
        if not isinstance(attrs_, dict):
            return
        for k, x in attrs_.items():
            if isinstance(x, _PLAIN):
                found[f"{path}.{k}"] = (obj, k, x, True)
            elif not k.startswith("__"):
                walk(x, f"{path}.{k}", level + 1)

    for name, obj in roots.items():
        walk(obj, name, 0)
    return found


def python_state_change(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """The first plain attribute that differs, as 'path: old -> new', or None."""
    for path in sorted(before.keys() | after.keys()):
        old = before[path][2] if path in before else "<absent>"
        new = after[path][2] if path in after else "<absent>"
        if type(old) is not type(new) or old != new:
            return f"{path}: {old!r} -> {new!r}"
    return None


def restore_python_state(before: dict[str, Any]) -> None:
    """Put back the plain values `python_state` recorded."""
    for holder, key, value, is_attr in before.values():
        if is_attr:
            object.__setattr__(holder, key, value)
        else:
            holder[key] = value
