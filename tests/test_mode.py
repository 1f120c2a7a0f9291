import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphify import Mode
from graphify.base.modes import RUNTIME_MODES


@pytest.mark.parametrize(
    "mode, decode, mixed",
    [
        (Mode.NONE, Mode.NONE, Mode.NONE),
        (Mode.PIECEWISE, Mode.PIECEWISE, Mode.PIECEWISE),
        (Mode.FULL, Mode.FULL, Mode.FULL),
        (Mode.FULL_DECODE_ONLY, Mode.FULL, Mode.NONE),
        (Mode.FULL_AND_PIECEWISE, Mode.FULL, Mode.PIECEWISE),
    ],
)
def test_decode_and_mixed_parts(mode, decode, mixed):
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.is_dual == (mode in (Mode.FULL_DECODE_ONLY, Mode.FULL_AND_PIECEWISE))


@given(st.sampled_from(list(Mode)))
def test_parts_are_runtime_modes(mode):
    assert mode.decode_mode() in RUNTIME_MODES and mode.mixed_mode() in RUNTIME_MODES


@pytest.mark.parametrize("text", ["full", "FULL", " Full_And_Piecewise ", "none"])
def test_parse_is_case_insensitive(text):
    assert Mode.parse(text).value == text.strip().upper()


@pytest.mark.parametrize("bad", ["fulll", "", "PIECE", 3, None])
def test_unknown_mode_lists_valid_ones(bad):
    with pytest.raises(ValueError) as info:
        Mode.parse(bad)
    for m in Mode:
        assert m.value in str(info.value)
