"""Decode masks over sliding-window and hybrid static caches made from slices of the 2D mask
(`graphify.transforms._hf_hybrid_masks`): at every decode step they equal transformers' own,
while the window fills, as decode crosses it and once full, with padded prompts and without,
sdpa and eager attention; tokens equal eager and graphs replay; a disagreement found by the
once-a-kind check hands the model back to transformers' masks."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import calls_by_mode  # noqa: E402
from graphify import Mode, graphify  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
WINDOW = 6


def gemma3(device: str, attention: str = "sdpa"):
    """A hybrid cache: sliding layers around a full one."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        **TINY, head_dim=8, num_hidden_layers=3, sliding_window=WINDOW, attn_implementation=attention,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return transformers.Gemma3ForCausalLM(config).to(device).eval()


def mistral(device: str, attention: str = "sdpa"):
    """Every layer sliding, a config without layer types: one mask, not a dict."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=WINDOW,
                                        attn_implementation=attention)
    return transformers.MistralForCausalLM(config).to(device).eval()


def prompt(device: str, length: int, padded: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(1, TINY["vocab_size"], (3, length), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, : length // 2], mask[1, :1] = 0, 0
    return ids.to(device), mask.to(device)


def generate(model, ids, mask, new: int, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, cache_implementation="static", pad_token_id=0, **kw)


def padding_of(model):
    padding = vars(model)["create_masks_for_generate"]
    assert type(padding).__name__ == "MaskPadding"
    return padding


def masks_module(model):
    import sys

    return sys.modules[type(padding_of(model)).__module__]


def compared_at_every_step(model, monkeypatch) -> list:
    """Wrap the model's mask function so that every decode step's masks it makes are compared
    with transformers' own; returns the list of (kind, equal) it fills."""
    padding, module = padding_of(model), masks_module(model)
    seen, made = [], padding.padded

    def checked(kwargs):
        out = made(kwargs)
        if out is not module._KEEP:
            seen.append((out[1], module._equal(out[0], module._transformers_masks(**kwargs))))
        return out

    monkeypatch.setattr(padding, "padded", checked)
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", [gemma3, mistral], ids=["gemma3-hybrid", "mistral-all-sliding"])
def test_every_decode_steps_masks_equal_transformers_and_tokens_equal_eager(backend, monkeypatch, family, attention):
    """Prompts shorter than the window (decode fills it, then crosses) and longer;
    left-padded rows and none: at every step the masks equal transformers', and the tokens
    eager's; decode steps replay graphs."""
    _, device = backend
    model = family(device, attention)
    cases = [(length, padded) for length in (2, WINDOW + 5) for padded in (True, False)]
    eager = [generate(model, *prompt(device, n, p), 2 * WINDOW + 3, disable_compile=True) for n, p in cases]
    model.forward = graphify(model.forward)
    seen = compared_at_every_step(model, monkeypatch)
    for (n, p), want in zip(cases, eager):
        torch.testing.assert_close(generate(model, *prompt(device, n, p), 2 * WINDOW + 3), want, rtol=0, atol=0)
    assert seen and all(equal for _, equal in seen), seen
    assert {kind for kind, _ in seen} == {"filling", "full"}, seen
    assert not padding_of(model).off
    assert calls_by_mode(model.forward)[Mode.FULL] >= len(cases) * (2 * WINDOW)


def test_transformers_mask_function_runs_only_for_prompts_and_checks(monkeypatch):
    """The host work the change removes: once the kinds are checked, a decode step calls none
    of transformers' mask functions."""
    model = gemma3("cpu")
    model.forward = graphify(model.forward)
    module = masks_module(model)
    ids, mask = prompt("cpu", 3, True)
    generate(model, ids, mask, 2 * WINDOW)  # checks both kinds (filling, full)
    calls = []
    real = module._transformers_masks
    monkeypatch.setattr(module, "_transformers_masks", lambda **kw: calls.append(1) or real(**kw))
    out = generate(model, ids, mask, 2 * WINDOW)
    assert len(calls) == 1, calls  # the prompt's
    monkeypatch.undo()
    model.forward = model.forward.fn
    torch.testing.assert_close(out, generate(model, ids, mask, 2 * WINDOW, disable_compile=True), rtol=0, atol=0)


def test_masks_that_differ_from_transformers_turn_the_change_off(monkeypatch):
    """A builder that got the window wrong (here: every key visible) is caught by the first
    check of its kind: the model gets transformers' masks from then on, tokens stay eager's."""
    model = gemma3("cpu")
    ids, mask = prompt("cpu", WINDOW + 2, True)
    eager = generate(model, ids, mask, 10, disable_compile=True)
    model.forward = graphify(model.forward)
    module = masks_module(model)
    real = module.hybrid_masks

    def wrong(*args, **kwargs):
        made = real(*args, **kwargs)
        return {k: torch.ones_like(v) for k, v in made.items()}

    monkeypatch.setattr(module, "hybrid_masks", wrong)
    torch.testing.assert_close(generate(model, ids, mask, 10), eager, rtol=0, atol=0)
    assert padding_of(model).off


def test_caches_the_slices_do_not_describe_keep_transformers_masks():
    """A layer of a type the config does not give it, counters that disagree, a mask that
    does not end at the step, and attention other than sdpa and eager: transformers' masks."""
    import copy

    from transformers import cache_utils

    model = gemma3("cpu")
    model.forward = graphify(model.forward)
    padding, module = padding_of(model), masks_module(model)
    cache = transformers.StaticCache(config=model.config, max_cache_len=24)
    for layer in cache.layers:
        if isinstance(layer, cache_utils.StaticSlidingWindowLayer):
            layer.cumulative_length_int = 4
    embeds = torch.randn(3, 1, 32)
    kwargs = dict(config=model.config, inputs_embeds=embeds, attention_mask=torch.ones(3, 5, dtype=torch.long),
                  cache=cache, position_ids=None)
    made = padding.padded(kwargs)
    assert made is not module._KEEP and made[1] == "filling"  # the control: this one is served
    assert padding.padded({**kwargs, "attention_mask": torch.ones(3, 7, dtype=torch.long)}) is module._KEEP
    flex = copy.deepcopy(model.config)
    flex._attn_implementation = "flex_attention"
    assert padding.padded({**kwargs, "config": flex}) is module._KEEP
    cache.layers[2].cumulative_length_int = 5
    assert padding.padded(kwargs) is module._KEEP
    cache.layers[2].cumulative_length_int = 4
    cache.layers[1] = cache_utils.StaticSlidingWindowLayer(max_cache_len=24, sliding_window=WINDOW)
    assert padding.padded(kwargs) is module._KEEP


def test_a_forward_that_asks_the_sliding_counter_runs_eagerly(backend):
    """T5Gemma's decoder builds its own masks inside its forward, asking the sliding layer for
    its length (a Python int): a graph would keep the position it was captured at (under
    transformers 5.17 its tokens drifted from step 3). Its calls run eagerly, one warning that
    names the cause; tokens equal eager."""
    _, device = backend
    if not hasattr(transformers, "T5GemmaConfig"):
        pytest.skip("this transformers has no T5Gemma")
    sub = dict(**TINY, head_dim=8, num_hidden_layers=2, sliding_window=WINDOW,
               layer_types=["sliding_attention", "full_attention"])
    config = transformers.T5GemmaConfig(
        encoder=transformers.T5GemmaModuleConfig(**sub), decoder=transformers.T5GemmaModuleConfig(**sub),
        vocab_size=TINY["vocab_size"], pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = transformers.T5GemmaForConditionalGeneration(config).to(device).eval()
    ids, mask = prompt(device, 5, True)
    eager = generate(model, ids, mask, 2 * WINDOW + 2, disable_compile=True)
    model.forward = graphify(model.forward)
    with pytest.warns(UserWarning, match="sliding-window cache layer"):
        ours = generate(model, ids, mask, 2 * WINDOW + 2)
    torch.testing.assert_close(ours, eager, rtol=0, atol=0)
