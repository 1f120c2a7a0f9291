"""How much CUDA-graph support a backend declares, and the pure mode-downgrade policy.

The policy follows vLLM's (`resolve_cudagraph_mode_and_sizes`): take the weakest support
over all backends, then downgrade the requested mode rule by rule, recording why.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from graphify.base.modes import Mode

__all__ = ["Support", "Resolution", "resolve_mode", "weakest"]


class Support(enum.IntEnum):
    """CUDA-graph support of an attention (or other split-op) backend, strongest first."""

    NEVER = 0
    """Never inside a graph."""
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    """Graphs only for batches where every request has query length 1."""
    UNIFORM_BATCH = 2
    """Graphs for batches where every request has the same query length (spec decode)."""
    ALWAYS = 3
    """Graphs for any batch, mixed prefill and decode included."""

    @classmethod
    def parse(cls, value: "Support | str | int") -> "Support":
        if isinstance(value, Support):
            return value
        try:
            return cls[value.strip().upper()] if isinstance(value, str) else cls(value)
        except (KeyError, ValueError):
            valid = ", ".join(s.name for s in cls)
            raise ValueError(f"unknown support level {value!r}; valid levels are {valid}") from None


def weakest(levels: "Support | str | Iterable[Support | str]") -> Support:
    """The minimum over one level or many; `ValueError` on an empty collection."""
    if isinstance(levels, (Support, str, int)):
        return Support.parse(levels)
    parsed = [Support.parse(level) for level in levels]
    if not parsed:
        raise ValueError("support: need at least one support level")
    return min(parsed)


@attrs.frozen
class Resolution:
    """The outcome of `resolve_mode`: the mode to use and the reasons it differs."""

    requested: Mode
    mode: Mode
    reasons: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.mode is not self.requested


def resolve_mode(
    requested: "Mode | str",
    support: "Support | str | Iterable[Support | str]" = Support.ALWAYS,
    *,
    split: bool = False,
    uniform_query_len: int = 1,
) -> Resolution:
    """Downgrade `requested` to the best mode the weakest backend allows.

    **Arguments:**
    - `requested`: the mode asked for.
    - `support`: one level, or the levels of every backend (the weakest counts).
    - `split`: whether the function is split at its graph-unsafe ops (so PIECEWISE exists).
    - `uniform_query_len`: query length of a uniform batch; above 1 means spec decode.

    **Returns:** a `Resolution`. Raises `ValueError` where no downgrade can help: FULL
    graphs of mixed batches asked of a backend that never allows graphs.

    !!! example
        >>> resolve_mode("FULL", Support.UNIFORM_BATCH, split=True).mode
        <Mode.FULL_AND_PIECEWISE: 'FULL_AND_PIECEWISE'>
    """
    mode = Mode.parse(requested)
    level = weakest(support)
    if uniform_query_len < 1:
        raise ValueError(f"resolve_mode: uniform_query_len must be >= 1, got {uniform_query_len}")
    reasons: list[str] = []
    for rule in _RULES:
        step = rule(mode, level, split, uniform_query_len)
        if step is not None:
            mode, reason = step
            reasons.append(reason)
    return Resolution(Mode.parse(requested), mode, tuple(reasons))


# The downgrade rules, in order: each takes (mode, weakest level, split, uniform query length)
# and returns (the mode to use, why) where it applies, else None.

def _needs_pieces(mode: Mode, level: Support, split: bool, q: int) -> "tuple[Mode, str] | None":
    """Without split points there are no pieces to capture."""
    if split or not mode.has_piecewise:
        return None
    if mode is Mode.PIECEWISE:
        new = Mode.NONE
    else:  # mixed batches can only go FULL, and only where the backend allows it
        new = Mode.FULL if level is Support.ALWAYS else Mode.FULL_DECODE_ONLY
    return new, (f"{mode.value} needs piecewise graphs but the function is not split "
                 f"(wrap it in split(fn, ops)); using {new.value}")


def _mixed_full(mode: Mode, level: Support, split: bool, q: int) -> "tuple[Mode, str] | None":
    """FULL graphs of mixed batches need a backend that handles any batch."""
    if mode.mixed_mode() is not Mode.FULL or level is Support.ALWAYS:
        return None
    if level is Support.NEVER:
        raise ValueError(
            f"resolve_mode: {mode.value} needs full graphs but the weakest backend "
            f"supports {level.name}; ask for PIECEWISE with split(fn, ops), or NONE"
        )
    new = Mode.FULL_AND_PIECEWISE if split else Mode.FULL_DECODE_ONLY
    return new, (f"{mode.value} captures mixed batches in full graphs but the weakest backend "
                 f"supports only {level.name}; using {new.value}")


def _full_decode(mode: Mode, level: Support, split: bool, q: int) -> "tuple[Mode, str] | None":
    """FULL decode graphs need at least single-token decode support."""
    if mode.decode_mode() is not Mode.FULL or level is not Support.NEVER:
        return None
    new = Mode.PIECEWISE if split else Mode.NONE
    return new, (f"{mode.value} captures decode in full graphs but the weakest backend supports "
                 f"NEVER; using {new.value}")


def _spec_decode(mode: Mode, level: Support, split: bool, q: int) -> "tuple[Mode, str] | None":
    """Spec decode (query length 1+k) needs uniform-batch support for FULL decode graphs."""
    if mode.decode_mode() is not Mode.FULL or q == 1 or level >= Support.UNIFORM_BATCH:
        return None
    new = Mode.PIECEWISE if split else Mode.NONE
    return new, (f"{mode.value} with uniform query length {q} (spec decode) needs "
                 f"UNIFORM_BATCH support but the weakest backend supports {level.name}; using {new.value}")


_RULES = (_needs_pieces, _mixed_full, _full_decode, _spec_decode)
