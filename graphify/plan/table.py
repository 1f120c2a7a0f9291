"""The captured-graph table: an immutable mapping from (runtime mode, key) to an entry,
plus the static input buffers every entry reads from."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from graphify.base.axes import ArgSpec, Kind
from graphify.base.descriptor import BatchDescriptor
from graphify.plan.keys import KeySet
from graphify.base.modes import Mode
from graphify.reads.table_reads import Reads

__all__ = ["CaptureReport", "Entry", "GraphTable", "Holdings", "StaticBuffers"]


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

    def load(self, specs: Sequence[ArgSpec], args: Sequence[Any], key: BatchDescriptor) -> tuple[list, tuple]:
        """Copy a call's padded and fixed arguments into the buffers for `key` (real rows,
        then padding up to the key's rows), so a first-use capture warms up on the call's
        own data. Returns, per buffer, a copy of what it now holds (None for non-buffers)
        and the rows that now hold the call's data (0 for non-padded arguments)."""
        loaded, written = [], []
        for b, spec, view, top in self.slots(specs, key.num_tokens, key.reqs_rows, args):
            real = 0
            if top is not None:  # a padded argument: its real rows, then padding up to the key's
                real = args[b].shape[0]
                view[:real].copy_(args[b])
                view[real:top].copy_(self.pads[b][real:top])
            elif spec.axis.kind is Kind.FIXED:
                view.copy_(args[b])
            loaded.append(self.buffers[b].clone() if self.buffers[b] is not None else None)
            written.append(real)
        return loaded, tuple(written)


@attrs.frozen
class CaptureReport:
    """What capturing a table cost: seconds, and the outside tensors its runs wrote and
    restored (with the most snapshot memory restoring held at once)."""

    seconds: float = 0.0
    state_tensors: int = 0
    state_bytes: int = 0


@attrs.define(eq=False)
class Holdings:
    """What a table owns until it is released: the mutable store behind its entries, the
    library objects its graphs launch (`graphify.backends.keepalive`), and the call plans a
    runtime made from its entries (`graphify.call.runtime.Plan`), which reference the graphs.
    Releasing drops all three, so the graphs go when the caller's last reference does."""

    store: dict | None = None
    hold: Any = None
    plans: dict = attrs.Factory(dict)
    released: bool = False

    def release(self) -> None:
        self.released = True
        self.plans.clear()
        if self.store is not None:
            self.store.clear()
        if self.hold is not None:
            self.hold.release()


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
    library: str | None = None
    layout: Any = None  # how calls bind to argument slots (graphify.base.call_layout.CallLayout)
    reads: Reads = attrs.field(factory=Reads)  # what the graphs read without a copy, checked every call
    examples: Any = None  # per argument, the example's tokens-axis tensor (what check() draws rows like)
    report: CaptureReport = attrs.field(factory=CaptureReport)
    lockstep: Any = None  # tensor parallelism: ranks agree on every call (graphify.distributed.lockstep)
    holdings: Holdings = attrs.field(factory=Holdings, repr=False)

    def release(self) -> int:
        """Drop every graph (their pool memory becomes free for reuse or `Pool.trim()`);
        returns how many. Calls through this table then raise, saying to capture again."""
        count = len(self.entries)
        self.holdings.release()
        return count

    @property
    def released(self) -> bool:
        return self.holdings.released

    @property
    def seconds(self) -> float:
        return self.report.seconds

    @property
    def state_tensors(self) -> int:
        return self.report.state_tensors

    @property
    def state_bytes(self) -> int:
        return self.report.state_bytes

    def __getitem__(self, pair: tuple[Mode, BatchDescriptor]) -> Entry:
        return self.entries[pair]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
