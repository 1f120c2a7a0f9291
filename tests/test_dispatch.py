"""Dispatch is a pure function of the key set; these tests never touch a device."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphify import BatchDescriptor, KeySet, Mode, dispatch, explain_miss, vllm_sizes
from graphify.plan.dispatch import Dispatcher
from graphify.plan.keys import plan_keys
from graphify.plan.dispatch import dispatcher_for
from graphify.plan.sizes import normalize_sizes

sizes_st = st.lists(st.integers(1, 300), min_size=1, max_size=20).map(normalize_sizes)
modes_st = st.sampled_from(list(Mode))


@st.composite
def keysets(draw):
    mode = draw(modes_st)
    q = draw(st.integers(1, 3))
    return plan_keys(
        mode, draw(sizes_st), uniform_query_len=q, max_num_reqs=draw(st.one_of(st.none(), st.integers(1, 100))),
        lora=draw(st.booleans()),
    )


@given(keysets(), st.integers(1, 400), st.booleans(), st.booleans())
def test_dispatch_only_returns_captured_keys(keys, n, uniform, lora):
    d = dispatch(keys, n, uniform=uniform, has_lora=lora)
    if d.mode is Mode.NONE:
        assert d.key is None
        return
    assert d.key in keys.of(d.mode)
    assert d.key.num_tokens >= n and d.key.has_lora == lora
    if d.key.uniform:
        assert uniform and d.mode is Mode.FULL


@given(keysets(), st.integers(1, 400), st.booleans(), st.booleans())
def test_above_the_largest_size_is_none(keys, n, uniform, lora):
    if n > keys.max_tokens():
        assert dispatch(keys, n, uniform=uniform, has_lora=lora).mode is Mode.NONE


@given(keysets(), st.booleans(), st.booleans(), st.one_of(st.none(), st.floats(1.0, 4.0)), st.booleans())
def test_precomputed_dispatcher_equals_dispatch(keys, uniform, lora, ratio, full_ok):
    fast = Dispatcher(keys, ratio)
    for n in range(1, keys.max_tokens() + 3):
        slow = dispatch(keys, n, uniform=uniform, has_lora=lora, max_padding_ratio=ratio, full_ok=full_ok)
        got = fast.lookup(n, uniform, lora, full_ok)
        assert (got.mode, got.key) == (slow.mode, slow.key)
        if n <= keys.max_tokens():
            assert got == slow  # the reason too


@given(keysets(), st.one_of(st.none(), st.floats(1.0, 4.0)))
def test_a_dispatcher_hands_out_one_decision_object_per_mode_and_key(keys, ratio):
    """The runtime keys its per-call plans by the decision's identity."""
    fast = Dispatcher(keys, ratio)
    seen: dict = {}
    for n in range(1, keys.max_tokens() + 1):
        for uniform, lora, full_ok in itertools.product((False, True), repeat=3):
            d = fast.lookup(n, uniform, lora, full_ok)
            if d.mode is not Mode.NONE:
                assert seen.setdefault((d.mode, d.key), d) is d


@given(keysets(), st.one_of(st.none(), st.floats(1.0, 4.0)))
def test_equal_key_sets_share_one_dispatcher_whose_rows_are_built_as_used(keys, ratio):
    """A structure's compiled kin opens over the keys of the plain one it replaces: its
    runtime builds no rows again; and a call pattern builds only the row it asks of."""
    again = KeySet(keys.full, keys.piecewise, keys.uniform_query_len)
    assert again == keys and dispatcher_for(again, ratio) is dispatcher_for(keys, ratio)
    fresh = Dispatcher(keys, ratio)
    fresh.lookup(1, False, False, True)
    assert list(fresh._tables) == [(False, False, True)]


@given(keysets(), st.integers(1, 400), st.booleans(), st.booleans())
def test_a_batch_excluded_from_full_graphs_never_gets_one(keys, n, uniform, lora):
    excluded = dispatch(keys, n, uniform=uniform, has_lora=lora, full_ok=False)
    assert excluded.mode is not Mode.FULL
    allowed = dispatch(keys, n, uniform=uniform, has_lora=lora)
    if allowed.mode is Mode.PIECEWISE:
        assert excluded == allowed  # only FULL choices change
    if excluded.mode is Mode.PIECEWISE:
        assert excluded.key == dispatch(KeySet(piecewise=keys.piecewise), n, has_lora=lora).key


def test_priority_exact_full_then_relaxed_full_then_piecewise():
    exact = BatchDescriptor(8, 8, True)
    keys = KeySet(full={exact, BatchDescriptor(16)}, piecewise={BatchDescriptor(8), BatchDescriptor(32)})
    assert dispatch(keys, 7, uniform=True).key == exact
    assert dispatch(keys, 7, uniform=False) == dispatch(keys, 9, uniform=True)
    assert dispatch(keys, 9, uniform=True).mode is Mode.FULL and dispatch(keys, 9).key == BatchDescriptor(16)
    assert dispatch(keys, 20).mode is Mode.PIECEWISE and dispatch(keys, 20).key == BatchDescriptor(32)
    assert dispatch(keys, 33).mode is Mode.NONE and "above the largest" in dispatch(keys, 33).reason


def test_full_and_piecewise_picks_full_for_decode_and_piecewise_for_mixed():
    keys = plan_keys("FULL_AND_PIECEWISE", vllm_sizes(64), max_num_reqs=32)
    assert dispatch(keys, 5, uniform=True).key == BatchDescriptor(8, 8, True)
    assert dispatch(keys, 5).mode is Mode.PIECEWISE
    assert dispatch(keys, 40, uniform=True).mode is Mode.PIECEWISE  # above max_num_reqs
    spec = plan_keys("FULL_AND_PIECEWISE", vllm_sizes(64), uniform_query_len=4)
    assert dispatch(spec, 12, uniform=True).key == BatchDescriptor(16, 4, True)


def test_full_decode_only_runs_mixed_batches_eagerly():
    keys = plan_keys("FULL_DECODE_ONLY", [1, 2, 4, 8])
    assert dispatch(keys, 3, uniform=True).mode is Mode.FULL
    assert dispatch(keys, 3).mode is Mode.NONE


def test_max_padding_ratio_runs_wasteful_batches_eagerly():
    keys = plan_keys("FULL", [4, 64])
    assert dispatch(keys, 5).key.num_tokens == 64
    d = dispatch(keys, 5, max_padding_ratio=2.0)
    assert d.mode is Mode.NONE and "max_padding_ratio" in d.reason
    assert dispatch(keys, 40, max_padding_ratio=2.0).mode is Mode.FULL


def test_lora_keys_are_separate():
    keys = plan_keys("FULL", [8])
    assert dispatch(keys, 3, has_lora=True).mode is Mode.NONE
    assert dispatch(plan_keys("FULL", [8], lora=True), 3, has_lora=True).key.has_lora


def test_bad_token_counts():
    keys = plan_keys("FULL", [8])
    with pytest.raises(ValueError, match="num_tokens"):
        dispatch(keys, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        Dispatcher(keys).lookup(0)
    assert Dispatcher(KeySet()).lookup(3).reason == "no graphs captured"


def test_explain_miss_names_nearest_keys():
    keys = plan_keys("FULL", [8, 16, 64])
    assert explain_miss(keys, BatchDescriptor(20)).endswith("(tokens=16), (tokens=64)")
    assert explain_miss(keys, BatchDescriptor(100)).endswith("closest captured: (tokens=64)")
    assert "no graphs captured" in explain_miss(KeySet(), BatchDescriptor(3))


def test_capture_order_is_mixed_largest_first_then_uniform():
    keys = plan_keys("FULL_AND_PIECEWISE", [1, 2, 4])
    order = [(m, k.num_tokens, k.uniform) for m, k in keys.pairs()]
    assert order == [
        (Mode.PIECEWISE, 4, False), (Mode.PIECEWISE, 2, False), (Mode.PIECEWISE, 1, False),
        (Mode.FULL, 4, True), (Mode.FULL, 2, True), (Mode.FULL, 1, True),
    ]


def test_keyset_rejects_strict_piecewise_keys():
    with pytest.raises(ValueError, match="relaxed"):
        KeySet(piecewise={BatchDescriptor(4, 4, True)})
