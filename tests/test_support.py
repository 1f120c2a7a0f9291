"""vLLM's downgrade policy, one test per rule, and its invariant as a property."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphify import Options, Mode, Support, resolve_mode
from graphify.plan.support import weakest


def needed(mode: Mode, q: int) -> Support:
    """The least support a resolved mode may require of a backend."""
    if mode.mixed_mode() is Mode.FULL:
        return Support.ALWAYS
    if mode.decode_mode() is Mode.FULL:
        return Support.UNIFORM_BATCH if q > 1 else Support.UNIFORM_SINGLE_TOKEN_DECODE
    return Support.NEVER


@given(st.sampled_from(list(Mode)), st.sampled_from(list(Support)), st.booleans(), st.integers(1, 4))
def test_downgrade_never_needs_more_support_than_given(mode, support, split, q):
    try:
        res = resolve_mode(mode, support, split=split, uniform_query_len=q)
    except ValueError:
        assert mode.mixed_mode() is Mode.FULL and support is Support.NEVER
        return
    assert needed(res.mode, q) <= support
    assert res.changed == bool(res.reasons)
    if not split:
        assert not res.mode.has_piecewise


@given(st.sampled_from(list(Mode)), st.booleans(), st.integers(1, 4))
def test_always_support_with_split_changes_nothing(mode, split, q):
    res = resolve_mode(mode, Support.ALWAYS, split=True, uniform_query_len=q)
    assert res.mode is mode and not res.reasons


def test_unsplit_piecewise_becomes_none_and_dual_becomes_full():
    assert resolve_mode("PIECEWISE", split=False).mode is Mode.NONE
    res = resolve_mode("FULL_AND_PIECEWISE", split=False)
    assert res.mode is Mode.FULL and "split" in res.reasons[0]


@pytest.mark.parametrize("support", [Support.UNIFORM_BATCH, Support.UNIFORM_SINGLE_TOKEN_DECODE])
def test_rule1_full_mixed_without_always(support):
    assert resolve_mode("FULL", support, split=True).mode is Mode.FULL_AND_PIECEWISE
    res = resolve_mode("FULL", support, split=False)
    assert res.mode is Mode.FULL_DECODE_ONLY and support.name in res.reasons[0]


def test_rule1_full_with_never_is_an_error_that_suggests_piecewise():
    with pytest.raises(ValueError, match="PIECEWISE"):
        resolve_mode("FULL", Support.NEVER, split=True)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_rule2_full_decode_with_never(mode):
    assert resolve_mode(mode, Support.NEVER, split=True).mode is Mode.PIECEWISE
    assert resolve_mode(mode, Support.NEVER, split=False).mode is Mode.NONE


def test_rule3_spec_decode_needs_uniform_batch():
    res = resolve_mode("FULL_AND_PIECEWISE", Support.UNIFORM_SINGLE_TOKEN_DECODE, split=True, uniform_query_len=3)
    assert res.mode is Mode.PIECEWISE and "spec decode" in res.reasons[-1]
    ok = resolve_mode("FULL_AND_PIECEWISE", Support.UNIFORM_BATCH, split=True, uniform_query_len=3)
    assert ok.mode is Mode.FULL_AND_PIECEWISE


def test_weakest_of_many_backends():
    assert weakest([Support.ALWAYS, "uniform_batch", Support.ALWAYS]) is Support.UNIFORM_BATCH
    with pytest.raises(ValueError, match="at least one"):
        weakest([])
    with pytest.raises(ValueError, match="ALWAYS"):
        Support.parse("sometimes")


def test_graphify_warns_once_when_piecewise_of_an_unsplit_function_runs_eagerly():
    import warnings

    import torch

    from conftest import calls_by_mode, counted
    from graphify import graphify

    with pytest.warns(UserWarning, match=r"not split.*graphify\.split\(fn, ops, \*example\).*mode='FULL'") as got:
        g = graphify(lambda x: x * 2, mode="PIECEWISE", sizes=[1, 2], options=Options(backend="sim"))
    assert g.resolution.mode is Mode.NONE
    assert [w.filename for w in got if "not split" in str(w.message)] == [__file__]  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = g.capture(torch.randn(2, 3))  # not again per capture
        torch.testing.assert_close(g(torch.ones(2, 3)), torch.full((2, 3), 2.0))
        assert calls_by_mode(g) == counted(none=1)  # mode NONE: eager, as the warning said
        graphify(lambda x: x * 2, mode="FULL", sizes=[1, 2], options=Options(backend="sim"))  # nothing to warn about
