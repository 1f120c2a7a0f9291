"""CUDA graph modes: what the user asks for, and the three modes a call can run in."""

from __future__ import annotations

import enum

__all__ = ["Mode", "RUNTIME_MODES"]


class Mode(enum.Enum):
    """How graphify runs a function.

    `NONE`, `PIECEWISE` and `FULL` are single modes and also the *runtime* modes one call
    runs in. `FULL_DECODE_ONLY` and `FULL_AND_PIECEWISE` are dual modes: a decode mode for
    uniform batches (every request with the same query length) and a mixed mode for
    everything else.

    !!! example
        >>> Mode.parse("full_and_piecewise").decode_mode(), Mode.FULL_AND_PIECEWISE.mixed_mode()
        (<Mode.FULL: 'FULL'>, <Mode.PIECEWISE: 'PIECEWISE'>)
    """

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    # Members are singletons compared by identity: hash them in C, not through the
    # Python-level Enum.__hash__ (dispatch statistics hash a mode on every call).
    __hash__ = object.__hash__

    @classmethod
    def parse(cls, value: "Mode | str") -> "Mode":
        """A `Mode` from itself or its name (any case); `ValueError` lists the valid names."""
        if isinstance(value, Mode):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                pass
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown graph mode {value!r}; valid modes are {valid}") from None

    def decode_mode(self) -> "Mode":
        """The runtime mode for uniform-decode batches."""
        return Mode.FULL if self in _DUAL else self

    def mixed_mode(self) -> "Mode":
        """The runtime mode for prefill and mixed batches."""
        if self is Mode.FULL_DECODE_ONLY:
            return Mode.NONE
        if self is Mode.FULL_AND_PIECEWISE:
            return Mode.PIECEWISE
        return self

    @property
    def is_dual(self) -> bool:
        """Whether decode batches get their own graphs, separate from mixed ones."""
        return self in _DUAL

    @property
    def has_full(self) -> bool:
        return Mode.FULL in (self.decode_mode(), self.mixed_mode())

    @property
    def has_piecewise(self) -> bool:
        return Mode.PIECEWISE in (self.decode_mode(), self.mixed_mode())


_DUAL = frozenset({Mode.FULL_DECODE_ONLY, Mode.FULL_AND_PIECEWISE})
RUNTIME_MODES = (Mode.NONE, Mode.PIECEWISE, Mode.FULL)
