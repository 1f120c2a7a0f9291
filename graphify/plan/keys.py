"""Which graphs exist: the key set, and the pure plan of keys to capture for a mode."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from graphify.base.descriptor import BatchDescriptor
from graphify.base.modes import Mode
from graphify.plan.sizes import normalize_sizes

__all__ = ["KeySet", "plan_keys", "exact_keys", "uniform_request_counts", "specialised_sizes"]


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
    # `sizes` worked out once per question: dispatch asks them of every call it decides
    _sizes: dict = attrs.field(init=False, factory=dict, eq=False, repr=False)

    def __attrs_post_init__(self):
        if self.uniform_query_len < 1:
            raise ValueError(f"KeySet: uniform_query_len must be >= 1, got {self.uniform_query_len}")
        bad = [k for k in self.piecewise if not k.is_relaxed]
        if bad:
            raise ValueError(f"KeySet: piecewise keys must be relaxed (num_reqs=None), got {bad[0]}")

    def of(self, mode: Mode) -> frozenset[BatchDescriptor]:
        return {Mode.FULL: self.full, Mode.PIECEWISE: self.piecewise}.get(mode, frozenset())

    def sizes(self, mode: Mode | None = None, *, uniform: bool | None = None, has_lora: bool = False) -> tuple[int, ...]:
        """Token counts of the keys with this LoRA flag, ascending: of `mode` (both runtime
        modes when None), of this `uniform` flag (either when None). A FULL or PIECEWISE
        ladder of `dispatch`, or every captured size.

        !!! example
            >>> plan_keys("FULL_AND_PIECEWISE", [1, 2, 4]).sizes(Mode.FULL, uniform=True)
            (1, 2, 4)
        """
        question = (mode, uniform, has_lora)
        found = self._sizes.get(question)
        if found is None:
            pool = self.full | self.piecewise if mode is None else self.of(mode)
            found = self._sizes[question] = tuple(sorted({
                k.num_tokens for k in pool if k.has_lora == has_lora and (uniform is None or k.uniform == uniform)
            }))
        return found

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


def uniform_request_counts(sizes: Iterable[int], q: int, max_num_reqs: int | None = None) -> tuple[int, ...]:
    """Request counts r that get a uniform FULL graph of r * q tokens: every size read as
    a request count (while r * q stays within the largest size) and every size rounded up
    to a multiple of q, read as tokens (vLLM's rule); at most `max_num_reqs`. Pure.

    !!! example
        >>> uniform_request_counts((1, 2, 4, 8, 16, 24), 3)
        (1, 2, 3, 4, 6, 8)
    """
    sizes = normalize_sizes(sizes, allow_empty=True)
    if not sizes:
        return ()
    top = sizes[-1]
    counts = {r for r in sizes if r * q <= top} | {-(-s // q) for s in sizes}
    return tuple(sorted(r for r in counts if max_num_reqs is None or r <= max_num_reqs))


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
    Uniform keys (dual modes only), r requests of q tokens each (q = `uniform_query_len`),
    are the union of two ladders, so a uniform batch never pads further than either:
    - each size read as a request count r: a key of r * q tokens (up to the largest size
      in tokens), so requests pad exactly as a q = 1 decode pads them;
    - each size rounded up to a multiple of q (vLLM's rule), so a user's token sizes keep
      their meaning (1 request of 8 tokens with sizes 8, 16, 32, 64 runs an 8-token graph).
    Both are capped at `max_num_reqs` requests. The union holds at most one key per size
    more than either ladder alone (`len(sizes)` extra graphs at most, fewer where the
    ladders share keys: with q = 1 they are the same keys).

    !!! example
        >>> ks = plan_keys("FULL_AND_PIECEWISE", [1, 2, 4])
        >>> sorted(k.num_tokens for k in ks.full), len(ks.piecewise)
        ([1, 2, 4], 3)
        >>> ks = plan_keys("FULL_DECODE_ONLY", [8, 16, 32, 64], uniform_query_len=8)
        >>> sorted(k.num_tokens for k in ks.full)
        [8, 16, 32, 64]
    """
    mode = Mode.parse(mode)
    sizes = normalize_sizes(sizes, allow_empty=mode is Mode.NONE)
    q = uniform_query_len
    lora_cases = (False, True) if lora else (False,)
    full: set[BatchDescriptor] = set()
    piecewise: set[BatchDescriptor] = set()
    mixed = mode.mixed_mode()
    if mixed is not Mode.NONE:
        target = full if mixed is Mode.FULL else piecewise
        target.update(BatchDescriptor(s, None, False, has) for s in sizes for has in lora_cases)
    if mode.is_dual:
        full.update(
            BatchDescriptor(r * q, r, True, has) for r in uniform_request_counts(sizes, q, max_num_reqs)
            for has in lora_cases
        )
    return KeySet(full, piecewise, q)


def specialised_sizes(rule: "str | tuple[int, ...]", keys: KeySet) -> frozenset[int]:
    """The token counts whose graphs record shape-specialised compiled pieces
    (`Options(compile_sizes=rule)`) among the sizes `keys` captures: "all", "none", or the
    given counts. Pure.

    !!! example
        >>> sorted(specialised_sizes((8, 9, 64), plan_keys("FULL_AND_PIECEWISE", [1, 2, 4, 8, 64])))
        [8, 64]
    """
    sizes = {k.num_tokens for k in keys.full | keys.piecewise}
    if rule == "all":
        return frozenset(sizes)
    if rule == "none":
        return frozenset()
    return frozenset(sizes & set(rule))


def exact_keys(mode: "Mode | str", batching, up_to: int) -> KeySet:
    """Every batch size up to `up_to` tokens as its own (unpadded) key, under `batching`
    (`graphify.Batching`): what first use captures when no sizes are given."""
    return plan_keys(
        mode, range(1, up_to + 1), uniform_query_len=batching.uniform_query_len,
        max_num_reqs=batching.max_num_reqs, lora=batching.lora,
    )
