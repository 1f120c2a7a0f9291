import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphify import pad_to, sglang_decode_sizes, sglang_piecewise_sizes, vllm_sizes
from graphify.plan.sizes import normalize_sizes, padding_table, round_to_multiple

size_lists = st.lists(st.integers(1, 2048), min_size=1, max_size=40).map(normalize_sizes)


def test_vllm_default_schedule():
    sizes = vllm_sizes(512)
    assert len(sizes) == 51 and sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]) if b < 256)
    assert all(b - a == 16 for a, b in zip(sizes, sizes[1:]) if a >= 256)


def test_sglang_schedules():
    assert len(sglang_piecewise_sizes(2048)) == 42 and len(sglang_piecewise_sizes(8192)) == 58
    s = sglang_piecewise_sizes(4096)
    assert s[:3] == (4, 8, 12) and 48 in s and 44 not in s and s[-1] == 4096
    d = sglang_decode_sizes(512)
    assert d[:6] == (1, 2, 4, 8, 12, 16) and 272 in d and 264 not in d and d[-1] == 512


@given(size_lists, st.integers(1, 4096))
def test_pad_never_shrinks_is_idempotent_and_lands_on_a_size(sizes, n):
    p = pad_to(sizes, n)
    if n > sizes[-1]:
        assert p is None
        return
    assert p >= n and p in sizes and pad_to(sizes, p) == p
    assert not [s for s in sizes if n <= s < p]  # the smallest size that fits


@given(size_lists)
def test_padding_table_equals_pad_to(sizes):
    table = padding_table(sizes)
    assert all(table[n] == pad_to(sizes, n) for n in range(1, sizes[-1] + 1))


@given(size_lists, st.integers(1, 8))
def test_round_to_multiple(sizes, k):
    rounded = round_to_multiple(sizes, k)
    assert all(s % k == 0 for s in rounded)
    assert all(pad_to(rounded, s) is not None and pad_to(rounded, s) - s < k for s in sizes)


@pytest.mark.parametrize("bad", [[], [0], [3, -1], [2.5], [True]])
def test_bad_sizes_are_named(bad):
    with pytest.raises(ValueError, match="sizes"):
        normalize_sizes(bad)
    with pytest.raises(ValueError):
        vllm_sizes(-1)


def test_vllm_sizes_zero_is_no_capture():
    # vLLM accepts max_cudagraph_capture_size = 0 (mode NONE, no capture sizes)
    assert vllm_sizes(0) == ()
    assert normalize_sizes(vllm_sizes(0), allow_empty=True) == ()
    for bad in (-1, -16, 2.5):
        with pytest.raises(ValueError, match="vllm_sizes"):
            vllm_sizes(bad)
