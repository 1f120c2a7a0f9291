"""The one line for transformers users: `model.forward = graphify(model.forward)`, then
`model.generate(...)` as it is. Tiny random-weight models of several families, on the CPU
simulation and on CUDA: greedy tokens and seeded samples equal eager generate(), decode
steps replay graphs (stats), the cache ends as eager leaves it, later generate() calls with
other batch sizes and prompt lengths work, and sliding-window caches replay a graph per branch."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import calls_by_mode, counted  # noqa: E402
from graphify import Mode, graphify  # noqa: E402

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
    for i, ((batch, length), tokens, cache) in enumerate(zip(runs, want, caches)):
        before = calls_by_mode(g)
        got, state = generate(model, prompt(batch, length, device), 10, do_sample=False)
        assert torch.equal(got, tokens), (batch, length)
        filled = length + 9  # the prompt and 9 decode steps (generate() may size the cache longer)
        for a, b in zip(cache, state):  # as eager leaves it (the simulation's replayed ops may round the last bit)
            torch.testing.assert_close(a[:, :, :filled], b[:, :, :filled], rtol=1e-5, atol=1e-6)
        assert all(not b[:, :, filled:].any() for b in state)
        ran = {m: n - before[m] for m, n in calls_by_mode(g).items()}
        # the prefill eagerly, and of the 9 decode steps: the first generate()'s first one as the
        # warm-up, then every one (a new cache of other shapes is kin: captured without a warm-up)
        assert ran == (counted(none=2, full=8) if i == 0 else counted(none=1, full=9)), (batch, length, ran)
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
    assert calls_by_mode(model.forward) == counted(none=2, full=10)  # the prefill and 11 decode steps, the first eager


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
    assert caches[0] is not caches[1]  # a StaticCache per generate()
    # the prefills, and the first decode step of the first cache; the second cache, of the same
    # shapes (kept alive here, so not taken over), is captured by its own first decode step,
    # without warm-up
    assert calls_by_mode(model.forward) == counted(none=2 + 1, full=2 * 5 - 1)
    assert len(model.forward._first_use.structures) == 2  # a decode structure per cache, no prefill


def test_a_dropped_cache_frees_its_graphs():
    model = make(FAMILIES, "Llama", "cpu")
    model.forward = graphify(model.forward)
    for length in (5, 6, 7):
        generate(model, prompt(2, length, "cpu"), 4, do_sample=False)
    structures = model.forward._first_use.structures
    assert sum(s.alive() for s in structures) <= 1  # nothing graphify holds keeps a cache


WINDOWED = {  # window 4: decode fills it, crosses it and rolls within a few tokens
    "Mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "sliding_window": 4}),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "sliding_window": 4, "num_hidden_layers": 3,
                                                         "layer_types": ["sliding_attention", "full_attention",
                                                                         "sliding_attention"]}),
}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_sliding_window_caches_replay_graphs_per_branch_and_equal_eager(backend, name):
    """A sliding-window layer keeps a Python counter that picks its update's branch: the
    window filling (prompt shorter than it), then full (roll); or full from the prompt on.
    First use captures a graph per branch and advances the counter after each replay:
    tokens equal eager's for B = 1 and 8 and prompts on both sides of the window, later
    generate() calls reuse the graphs, and nothing warns."""
    _, device = backend
    cfg_cls, model_cls, extra = WINDOWED[name]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra})

    def fresh():  # generate() reuses a model's last cache where it can: each side gets the same history
        torch.manual_seed(0)
        return getattr(transformers, model_cls)(cfg).to(device).eval()

    model, reference = fresh(), fresh()
    runs = [(1, 2), (8, 7), (1, 2), (8, 3)]  # (batch, prompt length): window 4
    want = [generate(reference, prompt(b, n, device, seed=b + n), 12, do_sample=False, disable_compile=True)
            for b, n in runs]
    model.forward = graphify(model.forward)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "runs eagerly" warning
        for (b, n), (tokens, cache) in zip(runs, want):
            got, got_cache = generate(model, prompt(b, n, device, seed=b + n), 12, do_sample=False)
            torch.testing.assert_close(got, tokens, rtol=0, atol=0)
            for x, y in zip(got_cache, cache):
                torch.testing.assert_close(x, y)
    by_mode = calls_by_mode(model.forward)
    # per generate(): the prefill eagerly, then 11 decode steps that replay, a new branch or batch size
    # captured by its first call; only the very first decode step is a warm-up (later caches are kin)
    assert by_mode[Mode.NONE] == len(runs) + 1 and by_mode[Mode.FULL] == 11 * len(runs) - 1
    branches = {key for s in model.forward._first_use.structures for key in s.branches}
    assert any("fill" in key for key in branches) and any("full" in key for key in branches)


def test_a_256_token_generation_through_a_sliding_window_equals_eager(backend):
    """Gemma 3's hybrid cache, window 4, 256 new tokens: the window rolls 250 times in a
    replayed graph, the Python counter advanced after each replay, for B = 1 and 8."""
    _, device = backend
    cfg_cls, model_cls, extra = WINDOWED["Gemma3"]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra})

    def fresh():
        torch.manual_seed(0)
        return getattr(transformers, model_cls)(cfg).to(device).eval()

    model, reference = fresh(), fresh()
    model.forward = graphify(model.forward)
    for b, n in ((1, 2), (8, 7)):
        ids = prompt(b, n, device, seed=b)
        want, _ = generate(reference, ids, 256, do_sample=False, disable_compile=True)
        got, _ = generate(model, ids, 256, do_sample=False)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert calls_by_mode(model.forward)[Mode.FULL] >= 2 * 255 - 2


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
    # 4 decode steps each: the first generate()'s first one warms up, every other one replays
    assert calls_by_mode(model.forward) == counted(none=3 + 1, full=3 * 4 - 1)


def test_a_chat_like_loop_under_the_compile_line_compiles_twice_and_equals_eager():
    """`Options(compile=...)` over generate() calls of new prompt lengths, token counts and batch
    sizes: the decode step carries its cache, so it compiles with dynamic shapes from the start
    (not its first shape static and then again): one compile for batch 1, one for larger
    batches, whatever the lengths; every call's tokens are eager's."""
    import copy

    from graphify import Options

    symbolic = []

    def counting(gm, example_inputs):
        from torch.fx.experimental.symbolic_shapes import free_symbols

        values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        symbolic.append(any(bool(free_symbols(v)) for v in values if isinstance(v, torch.Tensor)))
        return gm.forward

    model = make(FAMILIES, "Llama", "cpu")
    twin = copy.deepcopy(model)
    model.forward = graphify(model.forward, options=Options(backend="sim", compile={"backend": counting}))
    with torch.no_grad():
        for seed, (batch, length, new) in enumerate([(1, 5, 6), (1, 9, 4), (1, 14, 8), (2, 7, 5), (1, 20, 6),
                                                     (2, 11, 7), (1, 6, 9)]):
            ids = prompt(batch, length, "cpu", seed=seed)
            torch.testing.assert_close(generate(model, ids, new)[0], generate(twin, ids, new)[0], rtol=0, atol=0)
    assert symbolic == [True, True]


def test_registrations_elsewhere_do_not_trigger_the_full_comparison():
    """The per-call check compares every edge only when something it watches moved: a
    generate() (whose forward slices the layers into a new ModuleList every step) and a
    module made elsewhere move nothing; a module added to the watched model does."""
    from graphify import StateChangedError

    model = make(FAMILIES, "Llama", "cpu")
    model.forward = graphify(model.forward)
    generate(model, prompt(2, 5, "cpu"), 8, do_sample=False)  # each forward slices its layers: a new ModuleList
    torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # a registration on a module nobody watches
    watch = model.forward._first_use.current().runtime.table.reads.watch
    watch.guard()
    assert watch.verified == 0 and calls_by_mode(model.forward)[Mode.FULL] >= 6
    model.model.extra = torch.nn.Linear(2, 2)  # a registration on the watched model does count
    with pytest.raises(StateChangedError, match=r"model\.model\.__dict__|_modules"):
        watch.guard()
    assert watch.verified == 1
