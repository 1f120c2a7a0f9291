"""Which graphs exist: the key set, and the pure plan of keys to capture for a mode."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ._descriptor import BatchDescriptor
from ._mode import Mode
from ._sizes import normalize_sizes

__all__ = ["KeySet", "plan_keys"]


def _frozen_keys(keys: Iterable[BatchDescriptor]) -> frozenset[BatchDescriptor]:
    return frozenset(keys)


@attrs.frozen
class KeySet:
    """The single source of truth of which graphs exist, one set per runtime mode.

    `full` holds exact uniform keys `(tokens, reqs, uniform)` and relaxed mixed keys;
    `piecewise` holds relaxed keys only. Plain data: `dispatch` is a function of it.
    """

    full: frozenset[BatchDescriptor] = attrs.field(default=frozenset(), converter=_frozen_keys)
    piecewise: frozenset[BatchDescriptor] = attrs.field(default=frozenset(), converter=_frozen_keys)
    uniform_query_len: int = 1

    def __attrs_post_init__(self):
        if self.uniform_query_len < 1:
            raise ValueError(f"KeySet: uniform_query_len must be >= 1, got {self.uniform_query_len}")
        bad = [k for k in self.piecewise if not k.is_relaxed]
        if bad:
            raise ValueError(f"KeySet: piecewise keys must be relaxed (num_reqs=None), got {bad[0]}")

    def of(self, mode: Mode) -> frozenset[BatchDescriptor]:
        return {Mode.FULL: self.full, Mode.PIECEWISE: self.piecewise}.get(mode, frozenset())

    def pairs(self, largest_first: bool = True) -> tuple[tuple[Mode, BatchDescriptor], ...]:
        """Every (runtime mode, key) in capture order: mixed keys largest first, then
        uniform FULL keys largest first (as vLLM captures them). Largest first lets each
        smaller graph reuse the pool memory the larger ones freed; `largest_first=False`
        exists to measure that."""
        mixed = [(Mode.FULL, k) for k in self.full if k.is_relaxed]
        mixed += [(Mode.PIECEWISE, k) for k in self.piecewise]
        uniform = [(Mode.FULL, k) for k in self.full if not k.is_relaxed]
        sign = -1 if largest_first else 1
        order = lambda mk: (sign * mk[1].num_tokens, mk[0] is Mode.PIECEWISE, mk[1].sort_key())  # noqa: E731
        return tuple(sorted(mixed, key=order)) + tuple(sorted(uniform, key=order))

    def __len__(self) -> int:
        return len(self.full) + len(self.piecewise)

    def max_tokens(self) -> int:
        return max((k.num_tokens for k in self.full | self.piecewise), default=0)


def plan_keys(
    mode: "Mode | str",
    sizes: Iterable[int],
    *,
    uniform_query_len: int = 1,
    max_num_reqs: int | None = None,
    lora: bool = False,
) -> KeySet:
    """The keys to capture for a (resolved) mode, following vLLM's dispatcher.

    **Arguments:**
    - `mode`: the resolved mode.
    - `sizes`: token counts to capture.
    - `uniform_query_len`: query length of a uniform batch (1, or 1+k with spec decode).
    - `max_num_reqs`: the most requests in a batch; caps the uniform FULL keys.
    - `lora`: also capture LoRA variants of every key.

    **Returns:** a `KeySet`. Mixed keys: one relaxed key per size in the mixed mode.
    Uniform keys (dual modes only): each size read as a request count `r`, a key of `r * q`
    tokens (q = `uniform_query_len`), up to the largest size in tokens and `max_num_reqs`
    requests. So a uniform batch pads its requests exactly as a q = 1 decode does (with two
    speculative tokens, 1 request runs a 3-token graph, 2 a 6-token graph; vLLM also rounds
    decode sizes up to multiples of q), instead of keeping only sizes divisible by q.

    !!! example
        >>> ks = plan_keys("FULL_AND_PIECEWISE", [1, 2, 4])
        >>> sorted(k.num_tokens for k in ks.full), len(ks.piecewise)
        ([1, 2, 4], 3)
    """
    mode = Mode.parse(mode)
    sizes = normalize_sizes(sizes)
    q = uniform_query_len
    lora_cases = (False, True) if lora else (False,)
    full: set[BatchDescriptor] = set()
    piecewise: set[BatchDescriptor] = set()
    mixed = mode.mixed_mode()
    if mixed is not Mode.NONE:
        target = full if mixed is Mode.FULL else piecewise
        target.update(BatchDescriptor(s, None, False, has) for s in sizes for has in lora_cases)
    if mode.is_dual:  # sizes read as request counts: r requests of q tokens each
        top = sizes[-1]
        full.update(
            BatchDescriptor(r * q, r, True, has)
            for r in sizes
            if r * q <= top and (max_num_reqs is None or r <= max_num_reqs)
            for has in lora_cases
        )
    return KeySet(full, piecewise, q)
