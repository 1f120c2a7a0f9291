"""Per-call dispatch statistics: runtime mode, real and padded tokens, printable as a table."""

from __future__ import annotations

import threading

import attrs

from graphify.base.modes import RUNTIME_MODES, Mode

__all__ = ["Stats", "StatsRow"]


@attrs.frozen
class StatsRow:
    mode: Mode
    padded_to: int | None
    calls: int
    tokens: int

    @property
    def padded_tokens(self) -> int:
        return self.tokens if self.padded_to is None else self.calls * self.padded_to


@attrs.define(eq=False)
class Stats:
    """Counts of what each call dispatched to. Cheap to record; `table()` to print.

    !!! example
        >>> s = Stats(); s.record(Mode.FULL, 5, 8); s.record(Mode.NONE, 600, None)
        >>> [(r.mode.value, r.calls) for r in s.by_mode()]
        [('NONE', 1), ('PIECEWISE', 0), ('FULL', 1)]
    """

    _counts: dict = attrs.field(factory=dict, init=False, repr=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def record(self, mode: Mode, tokens: int, padded_to: int | None) -> None:
        with self._lock:
            self.tally(mode, tokens, padded_to)

    def tally(self, mode: Mode, tokens: int, padded_to: int | None) -> None:
        """`record` for callers that already serialise their calls (graphify's runtime)."""
        row = self._counts.get((mode, padded_to))
        if row is None:
            self._counts[mode, padded_to] = [1, tokens]
        else:
            row[0] += 1
            row[1] += tokens

    def rows(self) -> tuple[StatsRow, ...]:
        """One row per (runtime mode, padded size), sorted by mode then size."""
        with self._lock:
            items = [(k, tuple(v)) for k, v in self._counts.items()]
        order = {m: i for i, m in enumerate(RUNTIME_MODES)}
        items.sort(key=lambda kv: (order[kv[0][0]], kv[0][1] or 0))
        return tuple(StatsRow(m, p, c, t) for (m, p), (c, t) in items)

    def by_mode(self) -> tuple[StatsRow, ...]:
        """One row per runtime mode (all three, zeros included)."""
        totals = {m: [0, 0, 0] for m in RUNTIME_MODES}
        for r in self.rows():
            t = totals[r.mode]
            t[0] += r.calls
            t[1] += r.tokens
            t[2] += r.padded_tokens
        return tuple(StatsRow(m, None, c, tok) for m, (c, tok, _) in totals.items())

    @property
    def calls(self) -> int:
        return sum(r.calls for r in self.rows())

    def padding_waste(self) -> float:
        """Share of replayed tokens that were padding (0.0 when nothing was padded)."""
        rows = [r for r in self.rows() if r.padded_to is not None]
        padded = sum(r.padded_tokens for r in rows)
        return 0.0 if not padded else 1.0 - sum(r.tokens for r in rows) / padded

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()

    def table(self, by_size: bool = False) -> str:
        """A fixed-width text table: calls, real tokens, padded tokens and waste per row."""
        head = f"{'mode':<10} {'padded to':>9} {'calls':>8} {'tokens':>10} {'padded':>10} {'waste':>7}"
        lines = [head, "-" * len(head)]
        source = self.rows() if by_size else self.by_mode()
        for r in source:
            padded = r.padded_tokens if r.padded_to is not None or by_size else self._padded_for(r.mode)
            waste = 0.0 if not padded else 100.0 * (1 - r.tokens / padded)
            size = "-" if r.padded_to is None else str(r.padded_to)
            lines.append(f"{r.mode.value:<10} {size:>9} {r.calls:>8} {r.tokens:>10} {padded:>10} {waste:>6.1f}%")
        return "\n".join(lines)

    def _padded_for(self, mode: Mode) -> int:
        return sum(r.padded_tokens for r in self.rows() if r.mode is mode)

    def __str__(self) -> str:
        return self.table()
