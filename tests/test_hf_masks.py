"""A graphified transformers model builds its decode masks inside its graphs
(`graphify.transforms._hf_masks`): generate()'s mask step hands the forward a 2D mask padded
to the cache's length, tokens equal eager with padded prompts and without, graphs replay,
and everything the padding does not cover keeps transformers' own mask."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import calls_by_mode  # noqa: E402
from graphify import Mode, graphify  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def qwen2(device: str, **extra):
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, **extra)).to(device).eval()


def padded_prompt(device: str, seed: int):
    """Three rows, two of them left-padded: a mask that is not all ones, so generate() keeps it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY["vocab_size"], (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, :2] = 0, 0
    return ids.to(device), mask.to(device)


def generate(model, ids, mask, new: int, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, cache_implementation="static", pad_token_id=0, **kw)


def masks_module(model):
    """The module of the mask padding `model` got (tests import `transforms` under its own
    name too, so it may be either copy)."""
    import sys

    padding = vars(model)["create_masks_for_generate"]
    assert type(padding).__name__ == "MaskPadding"
    return sys.modules[type(padding).__module__]


def forward_masks(g) -> list:
    """Record the attention mask each call of `g` (a Graphified) gets: its shape, or None."""
    seen, cls = [], type(g)
    call = cls.__call__

    def spy(self, *args, **kwargs):
        if self is g:
            m = kwargs.get("attention_mask")
            seen.append(None if m is None else "dict" if isinstance(m, dict) else tuple(m.shape))
        return call(self, *args, **kwargs)

    return seen, spy


@pytest.mark.parametrize("all_ones", [False, True], ids=["padded-prompt", "no-padding"])
def test_decode_steps_get_the_mask_padded_to_the_cache_and_equal_eager(backend, monkeypatch, all_ones):
    _, device = backend
    model = qwen2(device)
    for seed in (1, 2):
        ids, mask = padded_prompt(device, seed)
        if all_ones:
            mask = torch.ones_like(mask)
        eager = generate(model, ids, mask, 12, disable_compile=True)
        if seed == 1:
            model.forward = graphify(model.forward)
            masks_module(model)
        seen, spy = forward_masks(model.forward)
        monkeypatch.setattr(type(model.forward), "__call__", spy)
        ours = generate(model, ids, mask, 12)
        monkeypatch.undo()
        torch.testing.assert_close(ours, eager, rtol=0, atol=0)
        assert seen[0] in ("dict", None), seen  # the prompt: transformers' own masks (none where it drops them)
        decode = set(seen[1:])  # decode steps: 2D at one length (the cache's), past the longest mask
        assert len(decode) == 1 and next(iter(decode))[0] == 3 and next(iter(decode))[1] >= ids.shape[1] + 11, seen
    assert calls_by_mode(model.forward)[Mode.FULL] >= 18  # decode steps replay graphs, the mask built in them
    assert not model.create_masks_for_generate.off


def test_a_padding_transformers_would_read_otherwise_turns_it_off_for_the_model(monkeypatch):
    """The once-a-cache check: where transformers' masks from the padded and the given 2D mask
    differ, the model gets transformers' masks from then on, and tokens stay eager's."""
    model = qwen2("cpu")
    ids, mask = padded_prompt("cpu", 3)
    eager = generate(model, ids, mask, 8, disable_compile=True)
    model.forward = graphify(model.forward)
    _hf_masks = masks_module(model)
    real = _hf_masks._transformers_masks

    def differs(**kwargs):  # as if transformers padded with ones (the cache's keyword differs by version)
        m = kwargs["attention_mask"]
        if isinstance(m, torch.Tensor) and m.dim() == 2 and m.shape[-1] == _hf_masks._cache_of(kwargs).layers[0].max_cache_len:
            return real(**{**kwargs, "attention_mask": torch.ones_like(m)})
        return real(**kwargs)

    monkeypatch.setattr(_hf_masks, "_transformers_masks", differs)
    torch.testing.assert_close(generate(model, ids, mask, 8), eager, rtol=0, atol=0)
    assert model.create_masks_for_generate.off
    seen, spy = forward_masks(model.forward)
    monkeypatch.setattr(type(model.forward), "__call__", spy)
    torch.testing.assert_close(generate(model, ids, mask, 8), eager, rtol=0, atol=0)
    assert seen and all(s == "dict" for s in seen), seen  # every step: transformers' 4D masks


def test_calls_the_padding_does_not_cover_keep_transformers_masks():
    """A forward no longer graphified, a model class with its own mask function and a class
    transformers does not define: transformers' masks (sliding and hybrid caches:
    tests/test_hf_hybrid_masks.py)."""
    ids, mask = padded_prompt("cpu", 4)
    plain = qwen2("cpu")
    plain.forward = graphify(plain.forward)
    plain.forward = plain.forward.fn  # back to the model's own forward
    padding, _hf_masks = plain.create_masks_for_generate, masks_module(plain)
    kwargs = dict(config=plain.config, inputs_embeds=torch.empty(3, 1, 0), attention_mask=mask,
                  cache=transformers.StaticCache(config=plain.config, max_cache_len=32), position_ids=None)
    assert padding.padded(kwargs) is _hf_masks._KEEP

    class OwnMasks(transformers.Qwen2ForCausalLM):
        @staticmethod
        def create_masks_for_generate(**kwargs):
            return None

    class Subclass(transformers.Qwen2ForCausalLM):  # its forward may build masks its own way
        pass

    for cls in (OwnMasks, Subclass):
        own = cls(transformers.Qwen2Config(**TINY)).eval()
        own.forward = graphify(own.forward)
        assert "create_masks_for_generate" not in vars(own)


def test_what_the_padding_works_out_once_per_cache_follows_a_new_cache_and_a_switched_attention():
    """The padding reads the config and the cache's layers once per (config, cache) pair, not
    every step; a new cache (another length) and an attention switched on the same config
    (one the padding does not cover, then back) are each seen at the very next call."""
    ids, mask = padded_prompt("cpu", 5)
    model = qwen2("cpu")
    model.forward = graphify(model.forward)
    padding, _hf_masks = model.create_masks_for_generate, masks_module(model)

    def step(cache):
        kwargs = dict(config=model.config, inputs_embeds=torch.empty(3, 1, 0), attention_mask=mask, cache=cache,
                      position_ids=None)
        made = padding.padded(kwargs)
        return made if made is _hf_masks._KEEP else made[0].shape[-1]

    short, long = (transformers.StaticCache(config=model.config, max_cache_len=n) for n in (32, 48))
    assert [step(short), step(short), step(long), step(short)] == [32, 32, 48, 32]
    model.config._attn_implementation = "flex_attention"  # the same config object
    assert step(short) is _hf_masks._KEEP
    model.config._attn_implementation = "sdpa"
    assert step(short) == 32


def test_a_forward_adapter_loaded_under_two_module_names_runs_once():
    """`transforms.hf` imported as itself and as `graphify.transforms.hf` registers its
    adapter twice: one function's source in two modules counts once; two functions of one
    module (closures of one factory) both run."""
    import types

    from graphify.reads.stateful_types import _FORWARD_ADAPTERS, adapt_forward_owner, register_forward_adapter

    seen = []

    def factory(tag):
        def adapt(model):
            seen.append(tag)
        return adapt

    first, second = factory("first"), factory("second")
    twin = types.FunctionType(first.__code__, {"__name__": "elsewhere"}, "adapt", None, first.__closure__)
    twin.__qualname__, twin.__module__ = first.__qualname__, "elsewhere"
    before = list(_FORWARD_ADAPTERS)
    try:
        for adapt in (first, twin, second):
            register_forward_adapter(adapt)
        adapt_forward_owner(object())
    finally:
        _FORWARD_ADAPTERS[:] = before
    assert seen == ["first", "second"]


def test_a_graphified_model_still_pickles_and_copies():
    """The padding a model gets travels with it: pickled or deep-copied, the copy has its own,
    pointing at the copy."""
    import copy
    import pickle

    model = qwen2("cpu")
    model.forward = graphify(model.forward)
    model.forward = model.forward.fn
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        padding = vars(twin)["create_masks_for_generate"]
        assert padding.model() is twin
