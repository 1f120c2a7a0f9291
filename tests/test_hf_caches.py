"""The one line over every transformers cache kind, and new caches of known shapes.

Each cache kind gives eager generate()'s tokens or is refused by name: the default
DynamicCache (grows by making new tensors: eager, one warning naming
cache_implementation="static"), static, sliding-window/hybrid, offloaded (CUDA only),
quantized (when its backend is installed), encoder-decoder models (refused at the first
capture, naming the host read and where it is). Then the cost users pay per generate():
a new StaticCache of shapes seen before takes over the memory the graphs read (no capture,
every decode step replays), while a cache the user kept, or a tensor of one, is never
written to; a cache changed between calls is never replayed wrongly."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from graphify import Mode, UnsupportedOpError, graphify  # noqa: E402

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)


def llama(device: str):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(device).eval()


def prompt(batch: int, length: int, device: str, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


def generate(model, ids, new: int = 8, **kw):
    return model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
        pad_token_id=0, **kw,
    )


def modes(g) -> dict:
    return {r.mode: r.calls for r in g.stats.by_mode()}


def test_the_default_dynamic_cache_gives_eagers_tokens_with_one_warning(backend):
    _, device = backend
    model = llama(device)
    runs = [prompt(2, 8, device, seed=s) for s in (1, 2)]
    want = [generate(model, ids, 16, disable_compile=True) for ids in runs]
    model.forward = graphify(model.forward)  # the one line, and generate() with no cache argument
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [generate(model, ids, 16) for ids in runs]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert modes(model.forward)[Mode.FULL] == 0  # never a replay of a graph over an old cache tensor
    said = [str(w.message) for w in caught if "replaces a tensor" in str(w.message)]
    if model.forward._first_use.refused_families:  # a decode step repeated its structure: a capture was tried
        assert len(said) == 1 and 'cache_implementation="static"' in said[0]
    else:  # transformers before 5.23 passes a longer 2-D mask each step: no call ever repeats, all eager
        assert said == [] and not model.forward._first_use.structures


def test_capture_leaves_a_dynamic_cache_as_eager_leaves_it():
    model = llama("cpu")
    ids = prompt(2, 8, "cpu")
    want = generate(model, ids, 16, return_dict_in_generate=True, disable_compile=True).past_key_values
    model.forward = graphify(model.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = generate(model, ids, 16, return_dict_in_generate=True).past_key_values
    for a, b in zip(want.layers, got.layers):
        assert a.keys.shape == b.keys.shape == (2, 2, 8 + 15, 8)  # not longer: capture's appends undone
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("impl", ["static", "sliding_window", "hybrid"])
def test_static_sliding_and_hybrid_cache_implementations_equal_eager(backend, impl):
    _, device = backend
    model = llama(device)
    ids = prompt(2, 7, device)
    want = generate(model, ids, cache_implementation=impl, disable_compile=True)
    model.forward = graphify(model.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a hybrid cache over full-attention layers may be dynamic: warned, eager
        got = generate(model, ids, cache_implementation=impl)
    assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["offloaded", "offloaded_static"])
def test_offloaded_caches_equal_eager_or_are_refused_by_name(impl):
    if not torch.cuda.is_available():
        pytest.skip("offloaded caches move layers between the GPU and the host")
    model = llama("cuda")
    ids = prompt(2, 7, "cuda")
    want = generate(model, ids, cache_implementation=impl, disable_compile=True)
    model.forward = graphify(model.forward)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = generate(model, ids, cache_implementation=impl)
    except UnsupportedOpError as exc:  # refused at the first capture, saying what and where
        assert "which a CUDA graph cannot capture" in str(exc) and " at " in str(exc)
        return
    assert torch.equal(got, want)


def test_quantized_caches_equal_eager_or_are_refused_by_name():
    model = llama("cpu")
    ids = prompt(2, 7, "cpu")
    try:
        want = generate(model, ids, cache_implementation="quantized", disable_compile=True)
    except ImportError as exc:
        pytest.skip(f"no quantized-cache backend installed: {exc}")
    model.forward = graphify(model.forward)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = generate(model, ids, cache_implementation="quantized")
    except UnsupportedOpError as exc:
        assert "which a CUDA graph cannot capture" in str(exc)
        return
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["Bart", "T5"])
def test_encoder_decoder_models_are_refused_naming_the_host_read(arch):
    dims = {
        "Bart": dict(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=96, max_position_embeddings=64),
        "T5": dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=96, decoder_start_token_id=0,
                   pad_token_id=0),
    }[arch]
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForConditionalGeneration")(getattr(transformers, f"{arch}Config")(**dims)).eval()
    ids = prompt(2, 7, "cpu")
    model.forward = graphify(model.forward)
    with pytest.raises(UnsupportedOpError, match=r"reads a device value on the host.* at \w+\.py:\d+ in \w+"):
        generate(model, ids, cache_implementation="static")


# -- new caches of known shapes ---------------------------------------------------------------
def test_a_new_cache_of_known_shapes_takes_over_the_graphs_memory(backend):
    _, device = backend
    model = llama(device)
    prompts = [prompt(2, 7, device, seed=s) for s in range(4)]  # the same shapes, new tokens each time
    want = [generate(model, ids, 10, cache_implementation="static", disable_compile=True) for ids in prompts]
    model.forward = graphify(model.forward)
    g = model.forward
    for i, (ids, tokens) in enumerate(zip(prompts, want)):
        before = modes(g)
        got = generate(model, ids, 10, cache_implementation="static")
        assert torch.equal(got, tokens), i
        after = modes(g)
        if i >= 1:  # every decode step replays: no eager first step, no capture
            assert after[Mode.FULL] - before[Mode.FULL] == 9
            assert after[Mode.NONE] - before[Mode.NONE] == 1  # the prefill
    structures = g._first_use.structures
    assert len(structures) == 1 and structures[0].graphs == 1  # one capture, ever


@pytest.mark.parametrize("kept", ["the cache", "one tensor of a dropped cache"])
def test_what_the_user_kept_of_a_cache_is_never_written_by_the_next_generate(backend, kept):
    """A new cache may take over a graph's memory only when nothing else holds it."""
    _, device = backend
    model = llama(device)
    model.forward = graphify(model.forward)
    out = generate(model, prompt(2, 7, device, seed=1), 10, cache_implementation="static",
                   return_dict_in_generate=True)
    layers = out.past_key_values.layers
    held = [t for layer in layers for t in (layer.keys, layer.values)] if kept == "the cache" else [layers[0].keys]
    if kept != "the cache":
        del out, layers  # only the tensor survives
    snapshot = [t.clone() for t in held]
    ids = prompt(2, 7, device, seed=2)
    want = generate(llama(device), ids, 10, cache_implementation="static", disable_compile=True)
    assert torch.equal(generate(model, ids, 10, cache_implementation="static"), want)
    assert all(torch.equal(t, before) for t, before in zip(held, snapshot))


def test_new_caches_of_other_lengths_are_captured_without_a_warm_up(backend):
    _, device = backend
    model = llama(device)
    runs = [(7, 10), (9, 6), (5, 14), (7, 10)]  # (prompt, new tokens): cache lengths 16, 14, 18, 16
    want = [generate(model, prompt(2, p, device, seed=p), n, cache_implementation="static", disable_compile=True)
            for p, n in runs]
    model.forward = graphify(model.forward)
    g = model.forward
    for i, ((p, n), tokens) in enumerate(zip(runs, want)):
        before = modes(g)
        assert torch.equal(generate(model, prompt(2, p, device, seed=p), n, cache_implementation="static"), tokens)
        if i >= 1:  # kin of the first: its first decode step is captured, not run eagerly
            assert modes(g)[Mode.NONE] - before[Mode.NONE] == 1


def test_a_cache_changed_between_calls_is_never_replayed_wrongly(backend):
    """A layer's tensor replaced by one of another shape, a layer added: refused or captured."""
    _, device = backend
    model = llama(device)
    reference = llama(device)
    from transformers import StaticCache

    def cache():
        c = StaticCache(config=model.config, max_cache_len=32)
        c.early_initialization(2, 2, 8, torch.float32, torch.device(device))
        return c

    step = graphify(model.forward)
    mine, theirs = cache(), cache()
    ids = prompt(2, 1, device)
    for i in range(8):
        if i == 3:  # layer 0's tensors replaced by copies (same shape): the graph would write the old ones
            for c in (mine, theirs):
                c.layers[0].keys, c.layers[0].values = c.layers[0].keys.clone(), c.layers[0].values.clone()
        if i == 5:  # every layer's tensors replaced by longer ones (another shape), contents kept
            for c in (mine, theirs):
                for layer in c.layers:
                    for name in ("keys", "values"):
                        longer = torch.zeros(2, 2, 40, 8, device=device)
                        longer[:, :, :32] = getattr(layer, name)
                        setattr(layer, name, longer)
                    layer.max_cache_len = 40
        if i == 7:  # a layer added
            for c in (mine, theirs):
                c.layers.append(c.layers[-1])
        with torch.no_grad():
            got = step(input_ids=ids, past_key_values=mine, use_cache=True).logits
            want = reference(input_ids=ids, past_key_values=theirs, use_cache=True).logits
        torch.testing.assert_close(got, want)
        for a, b in zip(mine.layers, theirs.layers):  # the cache's own tensors hold what eager wrote
            torch.testing.assert_close(a.keys, b.keys)
            torch.testing.assert_close(a.values, b.values)
