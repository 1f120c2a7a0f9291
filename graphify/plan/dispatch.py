"""Pure dispatch: which captured graph (if any) serves a batch.

`dispatch` is the readable reference; `Dispatcher` precomputes its answers for every
token count so the per-call cost is one list index. Neither touches a device.
"""

from __future__ import annotations

import functools

import attrs

from graphify.base.descriptor import BatchDescriptor
from graphify.plan.keys import KeySet
from graphify.base.modes import Mode
from graphify.plan.sizes import pad_to

__all__ = ["Decision", "dispatch", "explain_miss", "Dispatcher", "dispatcher_for"]


@attrs.frozen
class Decision:
    """Where a batch goes: a runtime mode, the key it replays (None for NONE), and why."""

    mode: Mode
    key: BatchDescriptor | None
    reason: str


def dispatch(
    keys: KeySet,
    num_tokens: int,
    *,
    uniform: bool = False,
    has_lora: bool = False,
    max_padding_ratio: float | None = None,
    full_ok: bool = True,
) -> Decision:
    """Pick the graph for a batch: exact FULL, then relaxed FULL, then PIECEWISE, else NONE.

    **Arguments:**
    - `keys`: the captured keys.
    - `num_tokens`: real (unpadded) tokens in the batch, >= 1.
    - `uniform`: every request has `keys.uniform_query_len` tokens.
    - `has_lora`: the batch runs LoRA adapters.
    - `max_padding_ratio`: run eagerly rather than pad to more than this many times the
      real size (SGLang's guard against padding waste); None means no limit.
    - `full_ok`: False for a batch that may not run in a FULL graph (vLLM's cascade
      attention, say): it gets PIECEWISE graphs if captured, else runs eagerly.

    **Returns:** a `Decision`. A batch above every captured size gets NONE, never an error.

    !!! example
        >>> from graphify import plan_keys
        >>> dispatch(plan_keys("FULL", [1, 2, 4, 8]), 5).key.num_tokens
        8
    """
    if num_tokens < 1:
        raise ValueError(f"dispatch: num_tokens must be >= 1, got {num_tokens}")
    q = keys.uniform_query_len

    def acceptable(size: int | None) -> bool:
        return size is not None and (max_padding_ratio is None or size <= max_padding_ratio * num_tokens)

    if uniform and full_ok:
        size = pad_to(keys.sizes(Mode.FULL, uniform=True, has_lora=has_lora), num_tokens)
        if acceptable(size):
            key = BatchDescriptor(size, size // q, True, has_lora)
            return Decision(Mode.FULL, key, "exact uniform FULL graph")
    for mode, label in ((Mode.FULL, "relaxed FULL graph"), (Mode.PIECEWISE, "PIECEWISE graphs")):
        if mode is Mode.FULL and not full_ok:
            continue
        size = pad_to(keys.sizes(mode, uniform=False, has_lora=has_lora), num_tokens)
        if acceptable(size):
            return Decision(mode, BatchDescriptor(size, None, False, has_lora), label)
    if not full_ok and keys.full and not keys.piecewise:
        return Decision(Mode.NONE, None, "the batch may not use FULL graphs and no PIECEWISE graphs were captured")
    return Decision(Mode.NONE, None, _why_none(keys, num_tokens, has_lora, max_padding_ratio))


def _why_none(keys: KeySet, num_tokens: int, has_lora: bool, ratio: float | None) -> str:
    """Why a batch runs eagerly."""
    if not len(keys):
        return "no graphs captured"
    sizes = keys.sizes(has_lora=has_lora)
    if not sizes:
        return f"no graphs captured with has_lora={has_lora}"
    if num_tokens > sizes[-1]:
        return f"num_tokens={num_tokens} is above the largest captured size {sizes[-1]}"
    if ratio is not None:
        return f"padding num_tokens={num_tokens} would exceed max_padding_ratio={ratio}"
    return f"no graph serves num_tokens={num_tokens}"  # pragma: no cover - sizes cover 1..max


def explain_miss(keys: KeySet, key: BatchDescriptor) -> str:
    """Why `key` has no graph, naming the nearest captured keys below and above it.

    !!! example
        >>> from graphify import plan_keys
        >>> explain_miss(plan_keys("FULL", [8, 16]), BatchDescriptor(12))
        'no graph for (tokens=12); closest captured: (tokens=8), (tokens=16)'
    """
    pool = sorted(keys.full | keys.piecewise, key=BatchDescriptor.sort_key)
    if key in pool:
        return f"{key} is captured"
    same_kind = [k for k in pool if (k.uniform, k.has_lora) == (key.uniform, key.has_lora)] or pool
    below = [k for k in same_kind if k.num_tokens <= key.num_tokens]
    above = [k for k in same_kind if k.num_tokens > key.num_tokens]
    near = ([below[-1]] if below else []) + ([above[0]] if above else [])
    if not near:
        return f"no graph for {key}; no graphs captured"
    return f"no graph for {key}; closest captured: " + ", ".join(str(k) for k in near)


@attrs.frozen(eq=False)
class Dispatcher:
    """`dispatch` precomputed for every token count: `lookup` is one list index.

    Each (uniform, LoRA, full_ok) row is built at its first lookup, by calling `dispatch` for
    every token count up to the largest captured size, so the two agree by construction (a
    property test checks it); a call pattern builds only the row it uses. Each distinct
    decision is one object, shared by every token count it serves: the runtime keys its
    per-call plans by the decision's identity. `dispatcher_for` shares one dispatcher among
    the runtimes of equal key sets (a structure's compiled kin opens over the keys of the
    plain one it replaces).
    """

    keys: KeySet
    max_padding_ratio: float | None = None
    _tables: dict = attrs.field(init=False, repr=False, factory=dict)
    _made: dict = attrs.field(init=False, repr=False, factory=dict)  # decision -> its one object
    _above: Decision = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        top = self.keys.max_tokens()
        object.__setattr__(self, "_above", Decision(Mode.NONE, None, f"num_tokens is above the largest captured size {top}"))

    def _row(self, uniform: bool, has_lora: bool, full_ok: bool) -> list:
        """The decisions for token counts 0 (None) to the largest captured size. Two threads
        may build a row at once: both rows hold the same decision objects."""
        made, keys = self._made, self.keys
        row: list = [None]
        for n in range(1, keys.max_tokens() + 1):
            decision = dispatch(keys, n, uniform=uniform, has_lora=has_lora,
                                max_padding_ratio=self.max_padding_ratio, full_ok=full_ok)
            row.append(made.setdefault(decision, decision))
        self._tables[uniform, has_lora, full_ok] = row
        return row

    def lookup(self, num_tokens: int, uniform: bool = False, has_lora: bool = False, full_ok: bool = True) -> Decision:
        table = self._tables.get((uniform, has_lora, full_ok))
        if table is None:
            table = self._row(uniform, has_lora, full_ok)
        if 0 < num_tokens < len(table):
            return table[num_tokens]
        if num_tokens < 1:
            raise ValueError(f"dispatch: num_tokens must be >= 1, got {num_tokens}")
        return self._above if len(self.keys) else Decision(Mode.NONE, None, "no graphs captured")


@functools.lru_cache(maxsize=64)
def dispatcher_for(keys: KeySet, max_padding_ratio: float | None = None) -> Dispatcher:
    """One `Dispatcher` for equal key sets (it is plain data, never changed after its rows are
    built), so that a new runtime over keys already seen builds no rows again."""
    return Dispatcher(keys, max_padding_ratio)
