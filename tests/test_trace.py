"""The synthetic serving trace is plain data: properties of the schedule, on any seed."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.trace import Request, Step, schedule, synthetic_requests

budgets = st.fixed_dictionaries({
    "max_tokens": st.integers(8, 600),
    "max_reqs": st.integers(1, 64),
    "chunk": st.integers(1, 300),
    "spec_tokens": st.integers(0, 3),
    "spec_every": st.integers(0, 4),
})


@given(st.integers(0, 10_000), st.integers(1, 30), budgets)
def test_steps_respect_budgets_and_account_for_every_token(seed, n, budget):
    requests = synthetic_requests(seed, n, prompt_range=(1, 300), output_range=(1, 40))
    steps = schedule(requests, **budget)
    seen = {r.id: 0 for r in requests}
    for s in steps:
        assert 1 <= s.num_tokens <= budget["max_tokens"] and len(s.request_ids) <= budget["max_reqs"]
        assert len(set(s.request_ids)) == len(s.request_ids) and min(s.query_lens) >= 1
        for rid, q, ctx in zip(s.request_ids, s.query_lens, s.context_lens):
            assert ctx == seen[rid]  # the cache holds exactly what earlier steps computed
            seen[rid] += q
    for r in requests:  # every prompt prefilled, every output decoded, nothing more
        assert seen[r.id] == r.prompt_len + r.output_len


def test_same_seed_same_trace_and_every_kind_appears():
    a = schedule(synthetic_requests(7, 48), max_tokens=512, chunk=128, spec_tokens=2, spec_every=3)
    b = schedule(synthetic_requests(7, 48), max_tokens=512, chunk=128, spec_tokens=2, spec_every=3)
    assert a == b
    kinds = {s.kind for s in a}
    assert {"decode", "spec", "mixed", "prefill"} <= kinds
    assert max(s.num_tokens for s in a) <= 512 and min(len(s.request_ids) for s in a) >= 1


def test_step_kinds():
    assert Step((1, 2), (1, 1), (5, 9)).kind == "decode"
    assert Step((1, 2), (3, 3), (5, 9)).kind == "spec"
    assert Step((1,), (40,), (0,)).kind == "prefill"
    assert Step((1, 2), (40, 1), (0, 9)).kind == "mixed"


def test_bad_parameters():
    with pytest.raises(ValueError):
        synthetic_requests(0, 0)
    with pytest.raises(ValueError):
        schedule([Request(0, 0, 4, 4)], max_tokens=0)
