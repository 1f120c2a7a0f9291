import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphify import BatchDescriptor


def test_frozen_and_hashable():
    d = BatchDescriptor(8, 8, True)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        d.num_tokens = 4
    assert {d: 1}[BatchDescriptor(8, 8, True, False)] == 1
    assert attrs.evolve(d, num_tokens=16) == BatchDescriptor(16, 8, True)


@pytest.mark.parametrize("kwargs", [dict(num_tokens=0), dict(num_tokens=4, num_reqs=0), dict(num_tokens=4, num_reqs=5)])
def test_invalid_values_are_named(kwargs):
    with pytest.raises(ValueError, match="num_"):
        BatchDescriptor(**kwargs)


@given(st.integers(1, 4096), st.booleans(), st.booleans(), st.data())
def test_relaxed_drops_reqs_and_uniform_keeps_lora(tokens, uniform, lora, data):
    reqs = data.draw(st.one_of(st.none(), st.integers(1, tokens)))
    relaxed = BatchDescriptor(tokens, reqs, uniform, lora).relaxed()
    assert relaxed == BatchDescriptor(tokens, None, False, lora)
    assert relaxed.is_relaxed and relaxed.relaxed() == relaxed
    assert relaxed.reqs_rows == tokens


def test_str_is_readable():
    assert str(BatchDescriptor(8, 4, True, True)) == "(tokens=8, reqs=4, uniform, lora)"
