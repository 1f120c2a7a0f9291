"""Hugging Face transformers models as they are: tiny random configs of several
architectures, graphified whole and called with keywords over a StaticCache; greedy decode
equals eager token for token, and capture leaves the cache as it found it."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import calls_by_mode, counted  # noqa: E402
from graphify import Options, CaptureError, InputMismatchError, graphify  # noqa: E402
from graphify.transforms.hf import cache_keyword, decode_graphs, greedy_generate, static_cache  # noqa: E402

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)
ARCHITECTURES = {  # name -> extra config
    "Llama": {},
    "Qwen2": {},
    "Qwen3": {"head_dim": 8},
    "Olmo2": {"pad_token_id": 0, "eos_token_id": 1},
}


def tiny_model(arch: str, device: str):
    cfg = getattr(transformers, f"{arch}Config")(**TINY, **ARCHITECTURES[arch])
    torch.manual_seed(0)
    return getattr(transformers, f"{arch}ForCausalLM")(cfg).to(device).eval()


def cache_state(cache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_decode_equals_eager_and_capture_leaves_the_cache_alone(backend, arch):
    name, device = backend
    model = tiny_model(arch, device)
    batch = 3
    prompt = torch.randint(0, TINY["vocab_size"], (batch, 7), generator=torch.Generator().manual_seed(5)).to(device)
    want = greedy_generate(model, prompt, static_cache(model, batch, 64), 33)

    cache, kw = static_cache(model, batch, 64), cache_keyword(model)
    with torch.no_grad():
        out = model(input_ids=prompt, **{kw: cache}, use_cache=True)  # the prompt, eagerly
        nxt = out.logits[:, -1:].argmax(-1)
        before = cache_state(cache)
        step = graphify(model, mode="FULL", sizes=[batch], options=Options(backend=name)).capture(
            input_ids=nxt, **{kw: cache}, use_cache=True
        )
        for a, b in zip(before, cache_state(cache)):
            assert torch.equal(a, b)  # K/V rows and position counters untouched
        assert step.table.state_tensors == 3 * TINY["num_hidden_layers"]
        tokens = [nxt]
        for _ in range(32):
            out = step(input_ids=nxt, **{kw: cache}, use_cache=True)
            assert type(out).__name__ == "CausalLMOutputWithPast" and out.logits.shape[:2] == (batch, 1)
            assert out.past_key_values is cache
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
    assert torch.equal(torch.cat(tokens, 1), want)
    assert calls_by_mode(step) == counted(full=32)  # every decode step replayed the graph


def test_decode_graphs_helper_and_a_captured_cache_only(backend):
    name, device = backend
    model = tiny_model("Llama", device)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(2)).to(device)
    want = greedy_generate(model, prompt, static_cache(model, 2, 48), 16)
    cache = static_cache(model, 2, 48)
    step = decode_graphs(model, cache, options=Options(backend=name))  # captured before the prompt ran
    assert torch.equal(greedy_generate(model, prompt, cache, 16, decode=step), want)
    cache.reset()
    assert torch.equal(greedy_generate(model, prompt, cache, 16, decode=step), want)  # reset in place: still ours
    assert calls_by_mode(step) == counted(full=2 * 15)  # every decode step of both replayed
    state = cache_state(cache)
    report = step.check(sizes=[2], atol=1e-4, rtol=1e-4)  # the cache's batch is fixed: its size only
    assert report.ok, report
    assert all(torch.equal(a, b) for a, b in zip(state, cache_state(cache)))
    other, kw = static_cache(model, 2, 48), cache_keyword(model)  # the helper's keyword for the cache
    with torch.no_grad():  # a generation loop's mode
        with pytest.raises(InputMismatchError, match=f"'{kw}' is a different StaticCache object"):
            step(input_ids=prompt[:, :1], **{kw: other}, use_cache=True)
        with pytest.raises(InputMismatchError, match="keyword 'output_attentions' was not passed at capture"):
            step(input_ids=prompt[:, :1], **{kw: cache}, use_cache=True, output_attentions=True)
        with pytest.raises(InputMismatchError, match="argument 'use_cache' was passed at capture but left out of this call"):
            step(input_ids=prompt[:, :1], **{kw: cache})


def test_sliding_window_caches_are_refused_ahead_of_time_naming_first_use():
    """Graphs captured ahead of time serve one branch of a sliding-window layer's counter and
    cannot advance it: capture() refuses, naming the way that follows it (first use)."""
    cfg = transformers.MistralConfig(**TINY, sliding_window=16)
    model = transformers.MistralForCausalLM(cfg).eval()
    cache = static_cache(model, 2, 32)
    counters = [getattr(layer, "cumulative_length_int", None) for layer in cache.layers]
    with pytest.raises(CaptureError, match=r"layers\[0\] \(StaticSlidingWindowLayer\).*without capture\(\)"):
        decode_graphs(model, cache, options=Options(backend="sim"))
    assert [getattr(layer, "cumulative_length_int", None) for layer in cache.layers] == counters


def test_the_readme_examples_run_as_written():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, ran = text.find("import torch, transformers"), 0
    while start >= 0:  # every transformers example: the one line, then the hand-built loop
        exec(compile(text[start:text.index("```", start)], "README.md", "exec"), {})
        ran += 1
        start = text.find("import torch, transformers", start + 1)
    assert ran == 2


def test_the_helpers_pass_the_cache_by_the_keyword_the_model_takes():
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name goes in
    5.40): the helpers name the cache as the model's forward does, either way."""

    class Renamed(torch.nn.Module):  # a forward of transformers 5.24 on, and one of before
        def forward(self, input_ids, cache=None, use_cache=False):
            return cache

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            return past_key_values

    assert cache_keyword(Renamed()) == "cache" and cache_keyword(Older()) == "past_key_values"
    model = tiny_model("Llama", "cpu")
    assert cache_keyword(model) in inspect.signature(model.forward).parameters
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        cache = static_cache(model, 2, 32)
        step = decode_graphs(model, cache, options=Options(backend="sim"))
        tokens = greedy_generate(model, prompt, cache, 4, decode=step)
    assert tokens.shape == (2, 4)
