"""The captured-graph table: an immutable mapping from (runtime mode, key) to an entry,
plus the static input buffers every entry reads from."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from ._axes import ArgSpec, Kind
from ._descriptor import BatchDescriptor
from ._keys import KeySet
from ._mode import Mode

__all__ = ["Entry", "GraphTable", "StaticBuffers"]


@attrs.frozen(eq=False)
class Entry:
    """One captured graph: its key, how to replay it, and where its outputs land."""

    mode: Mode
    key: BatchDescriptor
    replay: Any = attrs.field(repr=False)
    graph: Any = attrs.field(repr=False)
    flat_outputs: tuple = attrs.field(repr=False)
    out_spec: Any = attrs.field(repr=False)
    out_axes: tuple[str | None, ...] = attrs.field(repr=False)
    nbytes: int = 0
    seconds: float = 0.0
    sized: bool = False

    @property
    def label(self) -> str:
        return f"{self.mode.value} {self.key}"


@attrs.frozen(eq=False)
class StaticBuffers:
    """One buffer per padded or fixed argument, sized for the largest key; every graph
    reads a leading slice of it. `pads` holds the padding rows to copy in; `persistent`
    keeps the captured persistent tensors alive as long as the graphs that read them."""

    buffers: tuple[torch.Tensor | None, ...]
    pads: tuple[torch.Tensor | None, ...]
    persistent: tuple[torch.Tensor | None, ...]

    def slots(self, specs: Sequence[ArgSpec], tokens: int, reqs: int | None, values: Sequence[Any] = ()):
        """Per argument slot, for a batch of `tokens` tokens and `reqs` requests (None: as
        many as tokens): (slot, spec, what the graphs read, real rows). What the graphs read
        is the leading rows of the buffer (tokens and reqs axes, with their row count), the
        buffer (fixed), the captured tensor (persistent) or `values[slot]` (static; the
        spec's value without `values`). The one walk over static buffers by axis kind."""
        rows = {Kind.TOKENS: tokens, Kind.REQS: tokens if reqs is None else reqs}
        for b, spec in enumerate(specs):
            kind = spec.axis.kind
            if kind.padded:
                yield b, spec, self.buffers[b][: rows[kind]], rows[kind]
            elif kind is Kind.FIXED:
                yield b, spec, self.buffers[b], None
            elif kind is Kind.PERSISTENT:
                yield b, spec, self.persistent[b], None
            else:
                yield b, spec, values[b] if values else spec.value, None

    @classmethod
    def allocate(
        cls, specs: Sequence[ArgSpec], args: Sequence[Any], rows: Mapping[str, int], empty=torch.empty
    ) -> "StaticBuffers":
        """Buffers from `empty(shape, dtype, device)`: the backend's allocator (CuPy memory
        for the cupy backend), so static inputs live where the graphs' library expects."""
        buffers, pads = [], []
        persistent = tuple(arg if spec.axis.kind is Kind.PERSISTENT else None for spec, arg in zip(specs, args))
        for spec, arg in zip(specs, args):
            kind = spec.axis.kind
            if kind.padded:
                shape = (rows[kind], *spec.trailing)
                pad = empty(shape, spec.dtype, spec.device).fill_(spec.axis.pad)
                buffers.append(empty(shape, spec.dtype, spec.device).copy_(pad))
                pads.append(pad)
            elif kind is Kind.FIXED:
                buffers.append(empty(tuple(arg.shape), spec.dtype, spec.device).copy_(arg))
                pads.append(None)
            else:
                buffers.append(None)
                pads.append(None)
        return cls(tuple(buffers), tuple(pads), persistent)

    def args_for(self, specs: Sequence[ArgSpec], key: BatchDescriptor, example: Sequence[Any]) -> tuple:
        """The capture-time arguments for `key`: all-padding slices, fixed buffers, and
        the example's persistent tensors and static values."""
        return tuple(arg for _, _, arg, _ in self.slots(specs, key.num_tokens, key.reqs_rows, example))

    def storages(self) -> set[int]:
        """Data pointers of the padded and fixed buffers' storages."""
        return {b.untyped_storage().data_ptr() for b in self.buffers if b is not None}

    def changed(self, specs: Sequence[ArgSpec], loaded: "Sequence | None" = None) -> list[str]:
        """Names of padded arguments whose buffers no longer hold what was put there: only
        padding, or `loaded` (per buffer, a copy of its contents; None where all padding)."""
        return [
            spec.name
            for i, (spec, buf, pad) in enumerate(zip(specs, self.buffers, self.pads))
            if pad is not None and not torch.equal(buf, loaded[i] if loaded is not None and loaded[i] is not None else pad)
        ]

    def load(self, specs: Sequence[ArgSpec], args: Sequence[Any], key: BatchDescriptor, dirty: list) -> list:
        """Copy a call's padded and fixed arguments into the buffers for `key` (real rows,
        then padding up to the key's rows), so a first-use capture warms up on the call's
        own data. Updates `dirty` (rows past which a buffer holds padding) and returns, per
        buffer, a copy of what it now holds (None for non-buffers)."""
        loaded = []
        for b, spec, view, top in self.slots(specs, key.num_tokens, key.reqs_rows, args):
            if top is not None:  # a padded argument: its real rows, then padding up to the key's
                arg = args[b]
                real = arg.shape[0]
                view[:real].copy_(arg)
                view[real:top].copy_(self.pads[b][real:top])
                dirty[b] = dirty[b] if dirty[b] > top else real
            elif spec.axis.kind is Kind.FIXED:
                view.copy_(args[b])
            loaded.append(self.buffers[b].clone() if self.buffers[b] is not None else None)
        return loaded


@attrs.frozen(eq=False)
class GraphTable:
    """Immutable: (runtime mode, key) -> `Entry`, the `KeySet` dispatch reads, the
    argument specs calls are checked against, and the static buffers."""

    entries: Mapping[tuple[Mode, BatchDescriptor], Entry]
    keys: KeySet
    specs: tuple[ArgSpec, ...]
    static: StaticBuffers
    backend: Any
    pool: Any
    device: torch.device | None
    seconds: float = 0.0
    library: str | None = None
    lockstep: Any = None  # tensor parallelism: ranks agree on every call (graphify._distributed)
    layout: Any = None  # how calls bind to argument slots (graphify._signature.CallLayout)
    watch: Any = None  # the modules whose tensors the graphs read (graphify._params.ModuleWatch)
    state_tensors: int = 0  # outside tensors that capture wrote and restored
    state_bytes: int = 0  # the most snapshot memory that restoring held at once
    examples: Any = None  # per argument, the example's tokens-axis tensor (what check() draws rows like)
    hold: Any = None  # library objects the graphs launch, kept alive with them (graphify._keepalive)
    reach: tuple = ()  # what the graphs read through static objects and the closure (graphify._reach)
    _store: dict | None = attrs.field(default=None, repr=False, alias="store")

    def release(self) -> int:
        """Drop every graph (their pool memory becomes free for reuse or `Pool.trim()`);
        returns how many. Calls through this table then raise, saying to capture again."""
        count = len(self.entries)
        if self._store is not None:
            self._store.clear()
        if self.hold is not None:
            self.hold.release()
        return count

    def __getitem__(self, pair: tuple[Mode, BatchDescriptor]) -> Entry:
        return self.entries[pair]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
