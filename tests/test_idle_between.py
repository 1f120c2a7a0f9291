"""The benchmarks' GPU idle time between kernels (benchmarks/_report.idle_between)."""

from hypothesis import given
from hypothesis import strategies as st

from benchmarks._report import idle_between


def test_gaps_between_spans_add_up_and_overlaps_hide_none():
    assert idle_between([(0, 2), (5, 6), (6, 9)]) == 3
    assert idle_between([(4, 10), (0, 5), (11, 12)]) == 1  # unsorted; (4, 10) overlaps (0, 5)
    assert idle_between([(0, 10), (2, 3), (4, 12)]) == 0  # a span inside another ends nothing early
    assert idle_between([]) == 0


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 30)), min_size=1, max_size=30))
def test_idle_is_the_uncovered_part_of_the_extent(raw):
    spans = [(s, s + d) for s, d in raw]
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    covered = sum(any(s <= t < e for s, e in spans) for t in range(lo, hi))  # unit cells
    assert idle_between(spans) == (hi - lo) - covered
