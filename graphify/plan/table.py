"""The captured-graph table: an immutable mapping from (runtime mode, key) to an entry,
plus the static input buffers every entry reads from."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from graphify.base.axes import ArgSpec
from graphify.base.descriptor import BatchDescriptor
from graphify.plan.keys import KeySet
from graphify.plan.static_buffers import StaticBuffers
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


@attrs.frozen
class CaptureReport:
    """What capturing a table cost: seconds, and the outside tensors its runs wrote and
    restored (with the most snapshot memory restoring held at once)."""

    seconds: float = 0.0
    state_tensors: int = 0
    state_bytes: int = 0
    # its captures put back state outside the call (tensors, registered types' Python state, the
    # random generators): captures sharing a call lock hold it (`graphify.call.shared_calls`)
    restores: bool = False


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
