"""The static input buffers a table's graphs read: one buffer per padded or fixed argument.

A graph reads the leading rows of a padded argument's buffer, so a buffer must hold as many
rows as the largest key whose graph reads it. Captured ahead of time, the keys are known and
one set of buffers (a *tier*) is sized for the largest. Under first use every batch size is
its own key and the sizes come as calls do: the buffers grow in tiers, each at least twice
the rows of the last (powers of two), made when a key first needs them. A graph keeps reading
the tier it was captured on, the smallest that held its key then and so for good (later
tiers are larger). The tiers together hold at most about twice the rows of the largest key
met, where one tier sized for every possible key (512 rows of a 224x224 image: 147 MiB in
bf16) would be held from the first call on.

A tier's buffers hold one row more than its keys need: a graph's argument is then never a
view of its whole buffer. Dynamo guards a compiled function's view argument on whether it
covers its base (`x._base.size()[0] == x.size()[0]`), so a key that filled its tier and one
that did not would compile the function twice.

Padding of first use's tiers is one row broadcast along the rows (no memory per row); the one
tier of a callable captured ahead of time keeps a dense copy, whose copies fuse with the
inputs' into one launch. Fixed arguments have one buffer, shared by every tier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from graphify.base.axes import ArgSpec, Kind
from graphify.base.descriptor import BatchDescriptor

__all__ = ["StaticBuffers", "Tier", "tier_rows"]


@attrs.frozen(eq=False)
class Tier:
    """Buffers for keys of up to `rows[kind]` rows along each padded axis kind: per argument
    its buffer (None where not padded) and its padding (one row broadcast to `rows`)."""

    rows: Mapping[Kind, int]
    buffers: tuple[torch.Tensor | None, ...]
    pads: tuple[torch.Tensor | None, ...]
    kinds: frozenset = frozenset({Kind.TOKENS, Kind.REQS})  # the padded axis kinds its buffers have

    def holds(self, tokens: int, reqs: int) -> bool:
        """Whether its buffers have the rows: only the axis kinds some argument has count
        (a function without request-axis arguments has no request rows to hold)."""
        return ((Kind.TOKENS not in self.kinds or tokens <= self.rows[Kind.TOKENS])
                and (Kind.REQS not in self.kinds or reqs <= self.rows[Kind.REQS]))


def tier_rows(need: Mapping[Kind, int], largest: "Mapping[Kind, int] | None", limit: Mapping[Kind, int]) -> dict:
    """Rows of the next tier, per axis kind: the rows `need`ed rounded up to a power of two,
    at least twice the `largest` tier's, at most `limit` (the largest key). Pure."""
    out = {}
    for kind in (Kind.TOKENS, Kind.REQS):
        want = 1 << max(0, need[kind] - 1).bit_length()
        if largest is not None:
            want = max(want, 2 * largest[kind])
        out[kind] = max(need[kind], min(want, limit[kind]))
    return out


@attrs.frozen(eq=False)
class StaticBuffers:
    """The tiers (smallest first; see the module docstring), the fixed arguments' buffers,
    and the captured persistent tensors (kept alive as long as the graphs that read them).
    Immutable: `fitting` returns a new value with a tier added."""

    tiers: tuple[Tier, ...]
    fixed: tuple[torch.Tensor | None, ...]
    persistent: tuple[torch.Tensor | None, ...]

    @property
    def buffers(self) -> tuple:
        """The first tier's buffers, fixed arguments' among them (one tier: every graph's)."""
        first = self.tiers[0].buffers if self.tiers else (None,) * len(self.fixed)
        return tuple(f if f is not None else b for f, b in zip(self.fixed, first))

    def tier_of(self, tokens: int, reqs: int | None) -> int:
        """Index of the tier the graph of a key of `tokens` and `reqs` rows reads: the
        smallest that holds it (`reqs` None: any request rows, as `static_inputs(n)` asks)."""
        fits = [i for i, t in enumerate(self.tiers) if t.holds(tokens, 0 if reqs is None else reqs)]
        if not fits:
            raise ValueError(f"no static buffers hold {tokens} token rows and {reqs} request rows "
                             f"(tiers of {[dict(t.rows) for t in self.tiers]})")
        return min(fits, key=lambda i: self.tiers[i].rows[Kind.TOKENS])

    def slots(self, specs: Sequence[ArgSpec], tokens: int, reqs: int | None, values: Sequence[Any] = (),
              key: "BatchDescriptor | None" = None):
        """Per argument slot, for a batch of `tokens` tokens and `reqs` requests (None: as
        many as tokens) replayed by the graph of `key` (default: a key of those very rows):
        (slot, spec, what the graphs read, real rows). What the graphs read is the leading
        rows of the key's tier's buffer (tokens and reqs axes, with their row count), the
        buffer (fixed), the captured tensor (persistent) or `values[slot]` (static; the
        spec's value without `values`). The one walk over static buffers by axis kind."""
        rows = {Kind.TOKENS: tokens, Kind.REQS: tokens if reqs is None else reqs}
        tier = None
        for b, spec in enumerate(specs):
            kind = spec.axis.kind
            if kind.padded:
                if tier is None:
                    tier = self.tiers[self.tier_of(*((key.num_tokens, key.reqs_rows) if key is not None
                                                     else (tokens, reqs)))]
                yield b, spec, tier.buffers[b][: rows[kind]], rows[kind]
            else:
                yield b, spec, self.unpadded(b, spec, values), None

    def unpadded(self, b: int, spec: ArgSpec, values: Sequence[Any] = ()) -> Any:
        """What the graphs read for the argument in slot `b` that is not padded: its buffer
        (fixed), the captured tensor (persistent) or `values[b]` (static; the spec's value
        without `values`)."""
        kind = spec.axis.kind
        if kind is Kind.FIXED:
            return self.fixed[b]
        if kind is Kind.PERSISTENT:
            return self.persistent[b]
        return values[b] if values else spec.value

    @classmethod
    def allocate(cls, specs: Sequence[ArgSpec], args: Sequence[Any], rows: "Mapping[Kind, int] | None",
                 empty=torch.empty) -> "StaticBuffers":
        """Buffers from `empty(shape, dtype, device)`: the backend's allocator (CuPy memory
        for the cupy backend), so static inputs live where the graphs' library expects.
        `rows`: the one tier's rows (captured ahead of time), or None: tiers come as keys
        need them (`fitting`)."""
        fixed = tuple(empty(tuple(arg.shape), spec.dtype, spec.device).copy_(arg) if spec.axis.kind is Kind.FIXED
                      else None for spec, arg in zip(specs, args))
        persistent = tuple(arg if spec.axis.kind is Kind.PERSISTENT else None for spec, arg in zip(specs, args))
        made = cls((), fixed, persistent)
        return made if rows is None else attrs.evolve(made, tiers=(made._tier(specs, rows, empty),))

    def _tier(self, specs: Sequence[ArgSpec], rows: Mapping[Kind, int], empty, spare: int = 0,
              dense: bool = True) -> Tier:
        """`dense`: padding as a tensor of the buffer's size, whose copies `_foreach_copy_`
        fuses with the inputs' into one launch (a callable captured ahead of time pads most
        calls); else one row broadcast, no memory per row (first use: every size its own key,
        padding restored rarely)."""
        buffers, pads = [], []
        for spec in specs:
            if spec.axis.kind.padded:
                row = empty((1, *spec.trailing), spec.dtype, spec.device).fill_(spec.axis.pad)
                pad = row.expand(rows[spec.axis.kind] + spare, *spec.trailing)
                buffers.append(empty(tuple(pad.shape), spec.dtype, spec.device).copy_(pad))
                pads.append(empty(tuple(pad.shape), spec.dtype, spec.device).copy_(pad) if dense else pad)
            else:
                buffers.append(None)
                pads.append(None)
        return Tier(dict(rows), tuple(buffers), tuple(pads), frozenset(s.axis.kind for s in specs if s.axis.kind.padded))

    def fitting(self, specs: Sequence[ArgSpec], key: BatchDescriptor, limit: Mapping[Kind, int],
                empty=torch.empty) -> "StaticBuffers":
        """These buffers, or a new value with a tier added that holds `key` (`tier_rows`,
        at most `limit` rows)."""
        if any(t.holds(key.num_tokens, key.reqs_rows) for t in self.tiers) or not any(s.axis.kind.padded for s in specs):
            return self
        need = {Kind.TOKENS: key.num_tokens, Kind.REQS: key.reqs_rows}
        largest = self.tiers[-1].rows if self.tiers else None
        tier = self._tier(specs, tier_rows(need, largest, limit), empty, spare=1, dense=False)  # (module docstring)
        return attrs.evolve(self, tiers=(*self.tiers, tier))

    def args_for(self, specs: Sequence[ArgSpec], key: BatchDescriptor, example: Sequence[Any]) -> tuple:
        """The capture-time arguments for `key`: all-padding slices, fixed buffers, and
        the example's persistent tensors and static values."""
        return tuple(arg for _, _, arg, _ in self.slots(specs, key.num_tokens, key.reqs_rows, example))

    def storages(self) -> set[int]:
        """Data pointers of the padded and fixed buffers' storages."""
        held = [*self.fixed, *(b for t in self.tiers for b in t.buffers)]
        return {b.untyped_storage().data_ptr() for b in held if b is not None}

    def changed(self, specs: Sequence[ArgSpec], key: BatchDescriptor, loaded: "Sequence | None" = None) -> list[str]:
        """Names of padded arguments whose rows for `key` no longer hold what was put there:
        only padding, or `loaded` (per buffer, a copy of those rows; None where all padding).
        A graph of `key` is handed those rows alone, so it can write no others."""
        tier = self.tiers[self.tier_of(key.num_tokens, key.reqs_rows)] if self.tiers else None
        rows = {Kind.TOKENS: key.num_tokens, Kind.REQS: key.reqs_rows}
        out = []
        for i, spec in enumerate(specs):
            if tier is None or tier.pads[i] is None:
                continue
            top = rows[spec.axis.kind]
            want = loaded[i] if loaded is not None and loaded[i] is not None else tier.pads[i][:top]
            if not torch.equal(tier.buffers[i][:top], want):
                out.append(spec.name)
        return out

    def load(self, specs: Sequence[ArgSpec], args: Sequence[Any], key: BatchDescriptor) -> tuple[list, dict]:
        """Copy a call's padded and fixed arguments into the buffers for `key` (real rows,
        then padding up to the key's rows), so a first-use capture warms up on the call's
        own data. Returns, per buffer, a copy of the key's rows it now holds (None for
        non-buffers), and the rows that now hold the call's data per (tier, slot) of a padded
        argument."""
        tier = self.tier_of(key.num_tokens, key.reqs_rows) if self.tiers else None
        loaded, written = [], {}
        for b, spec, view, top in self.slots(specs, key.num_tokens, key.reqs_rows, args):
            if top is not None:  # a padded argument: its real rows, then padding up to the key's
                real = args[b].shape[0]
                view[:real].copy_(args[b])
                view[real:top].copy_(self.tiers[tier].pads[b][real:top])
                loaded.append(view.clone())
                written[(tier, b)] = real
            elif spec.axis.kind is Kind.FIXED:
                view.copy_(args[b])
                loaded.append(None)
            else:
                loaded.append(None)
        return loaded, written
