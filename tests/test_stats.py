from graphify import Mode, Stats


def test_counts_and_waste():
    s = Stats()
    s.record(Mode.FULL, 5, 8)
    s.record(Mode.FULL, 7, 8)
    s.record(Mode.NONE, 600, None)
    rows = {r.mode: r for r in s.by_mode()}
    assert (rows[Mode.FULL].calls, rows[Mode.FULL].tokens) == (2, 12)
    assert rows[Mode.NONE].calls == 1 and rows[Mode.PIECEWISE].calls == 0
    assert s.calls == 3
    assert abs(s.padding_waste() - (1 - 12 / 16)) < 1e-12
    table = s.table(by_size=True)
    assert "FULL" in table and " 8 " in table and "25.0%" in table
    s.reset()
    assert s.calls == 0 and s.padding_waste() == 0.0
