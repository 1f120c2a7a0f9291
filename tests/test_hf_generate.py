"""The one line for transformers users: `model.forward = graphify(model.forward)`, then
`model.generate(...)` as it is. Tiny random-weight models of several families, on the CPU
simulation and on CUDA: greedy tokens and seeded samples equal eager generate(), decode
steps replay graphs (stats), the cache ends as eager leaves it, later generate() calls with
other batch sizes and prompt lengths work, and sliding-window caches are refused by name."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from graphify import CaptureError, Mode, graphify  # noqa: E402

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)
FAMILIES = {  # name -> (config class, model class, extra config)
    "Llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "Mistral-full": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
}
SLIDING = {
    "Mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 16}),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "sliding_window": 16}),
}


def make(family: dict, name: str, device: str):
    cfg_cls, model_cls, extra = family[name]
    cfg = getattr(transformers, cfg_cls)(**TINY, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg).to(device).eval()


def generate(model, ids, new, **kw):
    """generate() as users call it, with a static cache: (tokens, the cache's K/V tensors
    after it). Eager means transformers' own compilation off too (on CUDA it would
    otherwise compile the decode step itself)."""
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
        cache_implementation="static", pad_token_id=0, return_dict_in_generate=True, **kw,
    )
    cache = [t.clone() for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
    return out.sequences, cache


def prompt(batch: int, length: int, device: str, seed: int = 5) -> torch.Tensor:
    return torch.randint(1, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_one_line_greedy_equals_eager_generate_for_batches_1_3_8(backend, name):
    _, device = backend
    model = make(FAMILIES, name, device)
    runs = [(1, 7), (3, 7), (8, 5), (3, 9)]  # a new batch size or prompt length each time
    want, caches = [], []
    for batch, length in runs:
        tokens, cache = generate(model, prompt(batch, length, device), 10, do_sample=False, disable_compile=True)
        want.append(tokens)
        caches.append(cache)
    model.forward = graphify(model.forward)  # the one line
    g = model.forward
    for (batch, length), tokens, cache in zip(runs, want, caches):
        before = g.stats.by_mode()[2].calls
        got, state = generate(model, prompt(batch, length, device), 10, do_sample=False)
        assert torch.equal(got, tokens), (batch, length)
        filled = length + 9  # the prompt and 9 decode steps (generate() may size the cache longer)
        for a, b in zip(cache, state):  # as eager leaves it (the simulation's replayed ops may round the last bit)
            torch.testing.assert_close(a[:, :, :filled], b[:, :, :filled], rtol=1e-5, atol=1e-6)
        assert all(not b[:, :, filled:].any() for b in state)
        replayed = g.stats.by_mode()[2].calls - before
        assert replayed >= 8, replayed  # 9 decode steps: at most the first runs eagerly (a new cache)
    assert g.stats.padding_waste() == 0.0  # a fixed-batch cache is never padded across
    assert {r.padded_to for r in g.stats.rows() if r.mode is Mode.FULL} == {1, 3, 8}
    assert "first use" in g.summary()


def test_seeded_sampling_equals_eager_sampling(backend):
    _, device = backend
    model = make(FAMILIES, "Llama", device)
    ids = prompt(3, 6, device)
    torch.manual_seed(11)
    want, _ = generate(model, ids, 12, do_sample=True, top_k=20, temperature=0.9, disable_compile=True)
    model.forward = graphify(model.forward)
    torch.manual_seed(11)
    got, _ = generate(model, ids, 12, do_sample=True, top_k=20, temperature=0.9)
    assert torch.equal(got, want)
    assert model.forward.stats.by_mode()[2].calls == 10  # 11 decode steps, the first eager


def test_the_prefill_runs_eagerly_and_decode_replays(backend):
    _, device = backend
    model = make(FAMILIES, "Llama", device)
    model.forward = graphify(model.forward)
    caches = []
    for _ in range(2):  # the same prompt length twice: a prefill never repeats back to back
        out = model.generate(
            input_ids=prompt(2, 7, device), max_new_tokens=6, min_new_tokens=6, cache_implementation="static",
            do_sample=False, pad_token_id=0, return_dict_in_generate=True,
        )
        caches.append(out.past_key_values)
    new_caches = len({id(c) for c in caches})  # transformers may reuse its cache, or make one per call
    modes = {r.mode: r for r in model.forward.stats.by_mode()}
    # the prefills, and the first decode step of the first cache; a later cache of the same shapes
    # (kept alive here, so not taken over) is captured by its own first decode step, without warm-up
    assert modes[Mode.NONE].calls == 2 + 1
    assert modes[Mode.FULL].calls == 2 * 5 - 1  # every other decode step replays
    assert len(model.forward._first_use.structures) == new_caches  # decode structures only, no prefill


def test_a_dropped_cache_frees_its_graphs():
    model = make(FAMILIES, "Llama", "cpu")
    model.forward = graphify(model.forward)
    for length in (5, 6, 7):
        generate(model, prompt(2, length, "cpu"), 4, do_sample=False)
    structures = model.forward._first_use.structures
    assert sum(s.session.statics_alive() for s in structures) <= 1  # nothing graphify holds keeps a cache


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_window_caches_are_refused_naming_the_layer(name):
    model = make(SLIDING, name, "cpu")
    model.forward = graphify(model.forward)
    with pytest.raises(CaptureError, match=r"layers\[\d+\]\.cumulative_length_int.*without sliding windows"):
        generate(model, prompt(2, 5, "cpu"), 8, do_sample=False)


def test_one_line_over_a_compiled_forward_does_not_recompile_per_call():
    """graphify(torch.compile(model.forward, fullgraph=True)): transformers slices its layers
    into a new ModuleList on every forward; graphify's registration hook must not turn that
    into a guard that fails on every call (it did: a recompile storm, then fullgraph's error)."""
    from torch._dynamo.utils import counters

    model = make(FAMILIES, "Llama", "cpu")
    ids = prompt(2, 5, "cpu")
    want, _ = generate(model, ids, 5, do_sample=False, disable_compile=True)
    counters.clear()
    model.forward = graphify(torch.compile(model.forward, fullgraph=True))
    for _ in range(3):
        got, _ = generate(model, ids, 5, do_sample=False)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] <= 6  # prefill and decode shapes, and each new cache object
    assert model.forward.stats.by_mode()[2].calls >= 6  # decode steps replayed


def test_registrations_elsewhere_do_not_trigger_the_full_parameter_check(monkeypatch):
    from graphify._params import ModuleWatch

    full = []
    real = ModuleWatch._check_all
    monkeypatch.setattr(ModuleWatch, "_check_all", lambda self: (full.append(1), real(self))[1])
    model = make(FAMILIES, "Llama", "cpu")
    model.forward = graphify(model.forward)
    generate(model, prompt(2, 5, "cpu"), 8, do_sample=False)  # each forward slices its layers: a new ModuleList
    torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # a registration on a module nobody watches
    watch = model.forward._first_use.current().runtime.watch
    watch.check()
    assert full == []
    model.model.extra = torch.nn.Linear(2, 2)  # a registration on the watched model does count
    with pytest.raises(Exception, match="was added since capture"):
        watch.check()
    assert full == [1]
