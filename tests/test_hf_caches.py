"""The one line over every transformers cache kind, and new caches of known shapes.

Each cache kind gives eager generate()'s tokens or is refused by name, pinned per kind,
with what its calls ran as: the default DynamicCache (grows by making new tensors: eager,
one warning naming cache_implementation="static"), static and sliding-window (decode steps
replay graphs), hybrid (a DynamicCache: eager), offloaded (CUDA only: the first capture
stops at the copy to the host: eager, one warning naming it), quantized (new tensors every
step: eager, as a DynamicCache; fp8 ships with transformers, quanto when installed),
encoder-decoder models (refused at the first capture, naming the host read and where it
is). Then the cost users pay per generate():
a new StaticCache of shapes seen before takes over the memory the graphs read (no capture,
every decode step replays), while a cache the user kept, or a tensor of one, is never
written to; a cache changed between calls is never replayed wrongly."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import calls_by_mode, counted  # noqa: E402
from graphify import graphify  # noqa: E402
from graphify.transforms.hf import cache_keyword  # noqa: E402

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
    return calls_by_mode(g)


def since(g, before: dict) -> dict:
    """What `g`'s calls ran as since `before` (a `modes(g)` taken earlier)."""
    return {m: n - before[m] for m, n in modes(g).items()}


# transformers 5.23 made a decode step's 2-D attention mask the same each step: before it no
# call of a DynamicCache generate() repeats its structure, so none is ever tried for capture
REPEATING_DECODE_STEPS = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 23)


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
    assert modes(model.forward) == counted(none=2 * 16)  # every call eager: never a graph over an old cache tensor
    said = [str(w.message) for w in caught if "replaces a tensor" in str(w.message)]
    first_use = model.forward._first_use
    assert not first_use.structures  # no graphs kept
    if REPEATING_DECODE_STEPS:  # the decode step repeated its structure: a capture was tried and refused
        assert len(first_use.refused_families) == 1
        assert len(said) == 1 and 'cache_implementation="static"' in said[0]
    else:  # a longer 2-D mask each step: no call ever repeats, none is tried
        assert said == [] and not first_use.refused_families


def test_capture_leaves_a_dynamic_cache_as_eager_leaves_it():
    model = llama("cpu")
    ids = prompt(2, 8, "cpu")
    want = generate(model, ids, 16, return_dict_in_generate=True, disable_compile=True).past_key_values
    model.forward = graphify(model.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = generate(model, ids, 16, return_dict_in_generate=True).past_key_values
    assert modes(model.forward) == counted(none=16)  # eager, as a DynamicCache runs
    for a, b in zip(want.layers, got.layers):
        assert a.keys.shape == b.keys.shape == (2, 2, 8 + 15, 8)  # not longer: capture's appends undone
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


# what the 8 forward calls of generate(new=8) run as: the prefill and the first decode step
# eagerly, the 6 decode steps after them replaying the graph the second one captured; "hybrid"
# is a DynamicCache (transformers unsets it, PR 40039): eager throughout
CACHE_RUNS = {"static": counted(none=2, full=6), "sliding_window": counted(none=2, full=6), "hybrid": counted(none=8)}


@pytest.mark.parametrize("impl", sorted(CACHE_RUNS))
def test_static_sliding_and_hybrid_cache_implementations_equal_eager(backend, impl):
    _, device = backend
    model = llama(device)
    ids = prompt(2, 7, device)
    want = generate(model, ids, cache_implementation=impl, disable_compile=True)
    model.forward = graphify(model.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hybrid one's DynamicCache is warned about (tested above)
        got = generate(model, ids, cache_implementation=impl)
    assert torch.equal(got, want)
    assert modes(model.forward) == CACHE_RUNS[impl]


@pytest.mark.cuda
@pytest.mark.parametrize("impl", [
    # a DynamicCache: its decode steps repeat (and a capture is tried) from transformers 5.23 on
    "offloaded",
    "offloaded_static",
])
def test_offloaded_caches_run_eagerly_warning_of_the_copy_to_the_host(impl):
    """Offloading moves each layer's keys and values to the host after its update: the first
    capture's op guard stops at that copy, and generate() runs eagerly (eager's tokens), with
    one warning that says what and where."""
    if not torch.cuda.is_available():
        pytest.skip("offloaded caches move layers between the GPU and the host")
    model = llama("cuda")
    ids = prompt(2, 7, "cuda")
    want = generate(model, ids, cache_implementation=impl, disable_compile=True)
    model.forward = graphify(model.forward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = generate(model, ids, cache_implementation=impl)
    said = [str(w.message) for w in caught if "which a CUDA graph cannot capture" in str(w.message)]
    assert torch.equal(got, want)
    assert modes(model.forward) == counted(none=8), (modes(model.forward), said)
    if impl == "offloaded" and not REPEATING_DECODE_STEPS:  # a DynamicCache's calls never repeat: none captured
        assert said == []
    else:
        assert len(said) == 1, said
        assert re.search(r"copies a CUDA tensor to the host \(.*\) at cache_utils\.py:\d+ in \w+, which a CUDA graph "
                         r"cannot capture", said[0]), said[0]


@pytest.mark.parametrize("quant", [
    # fp8 ships with transformers (no extra package): new tensors every step, held in a tuple
    "fp8",
    "quanto",  # optimum-quanto, when installed: its residual keys and values grow by torch.cat
])
def test_quantized_caches_run_eagerly_as_a_dynamic_cache_does(quant):
    """A quantized cache grows by new tensors every step, as a DynamicCache does: eager's
    tokens, every call eager, one warning naming cache_implementation="static"."""
    model = llama("cpu")
    ids = prompt(2, 7, "cpu")
    config = {"backend": quant}
    try:
        want = generate(model, ids, cache_implementation="quantized", cache_config=config, disable_compile=True)
    except ImportError as exc:
        pytest.skip(f"quantized-cache backend {quant!r} not installed: {exc}")
    except ValueError as exc:  # transformers before the fp8 backend
        pytest.skip(f"this transformers has no quantized-cache backend {quant!r}: {exc}")
    model.forward = graphify(model.forward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = generate(model, ids, cache_implementation="quantized", cache_config=config)
    assert torch.equal(got, want)
    assert modes(model.forward) == counted(none=8)
    said = [str(w.message) for w in caught if "replaces a tensor" in str(w.message)]
    assert len(said) == (1 if REPEATING_DECODE_STEPS else 0), said


# transformers 5.17's generate() leaves Bart's decoder mask to forward, which reads the cache's
# length on the host (modeling_bart.py); 5.24's passes the mask in (between the two: untested)
BART_READS_ITS_CACHE_LENGTH = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 24)


@pytest.mark.parametrize("arch", ["Bart", "T5"])
def test_encoder_decoder_models_replay_graphs_or_run_eagerly_naming_the_host_read(backend, arch):
    """T5's and Bart's masking reads the encoder mask on the host unless a CUDA graph is
    capturing (transformers asks): warm-ups and the simulation take the capture's path, so
    decode steps replay graphs with a static cache. A host read that remains (Bart's cache
    length on transformers 5.17) runs those calls eagerly, with one warning saying where."""
    _, device = backend
    dims = {
        "Bart": dict(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=96, max_position_embeddings=64),
        "T5": dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=96, decoder_start_token_id=0,
                   pad_token_id=0),
    }[arch]
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**dims)
    model = getattr(transformers, f"{arch}ForConditionalGeneration")(config).to(device).eval()
    ids = prompt(2, 7, device)
    want = generate(model, ids, cache_implementation="static", disable_compile=True)
    model.forward = graphify(model.forward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = generate(model, ids, cache_implementation="static")
    assert torch.equal(got, want)
    said = [str(w.message) for w in caught if "which a CUDA graph cannot capture" in str(w.message)]
    if arch == "Bart" and BART_READS_ITS_CACHE_LENGTH:
        assert modes(model.forward) == counted(none=8) and len(said) == 1, said
        assert re.search(r"reads a device value on the host.* at modeling_bart\.py:\d+ in \w+", said[0]), said[0]
    else:  # the first decode step a warm-up, then graphs
        assert modes(model.forward) == counted(none=1, full=7) and said == []


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
        if i == 0:  # the prefill and the first decode step eagerly, the second captures
            assert since(g, before) == counted(none=2, full=8)
        else:  # every decode step replays: no eager first step, no capture; eagerly only the prefill
            assert since(g, before) == counted(none=1, full=9), i
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
    ran_before = modes(model.forward)
    assert torch.equal(generate(model, ids, 10, cache_implementation="static"), want)
    assert all(torch.equal(t, before) for t, before in zip(held, snapshot))
    # the new cache got graphs of its own, captured without a warm-up: every decode step replayed
    assert since(model.forward, ran_before) == counted(none=1, full=9)


def test_generate_outputs_kept_with_their_caches_keep_every_call_on_graphs(backend):
    """return_dict_in_generate=True hands each call's cache back; a caller who keeps the
    outputs keeps every cache alive, so no new one can take over an old one's memory. Past
    MAX_STRUCTURES such calls, the least recently used cache's graphs make room: every decode
    step of every call still replays (it ran eagerly from the ninth call on, which on a GPU
    also gave eager's kernels instead of the compile line's), the number of structures stays
    bounded, and every kept cache still holds what its own generate() left in it."""
    from graphify.base.limits import Limits

    MAX_STRUCTURES = Limits().structures

    _, device = backend
    model, ref = llama(device), llama(device)
    model.forward = graphify(model.forward)
    g, kept, snapshots = model.forward, [], []
    for i in range(MAX_STRUCTURES + 3):
        ids = prompt(1, 7, device, seed=10 + i)
        want = generate(ref, ids, 10, cache_implementation="static", disable_compile=True)
        before = modes(g)
        out = generate(model, ids, 10, cache_implementation="static", return_dict_in_generate=True)
        assert torch.equal(out.sequences, want), i
        assert since(g, before) == (counted(none=2, full=8) if i == 0 else counted(none=1, full=9)), i
        kept.append(out)
        snapshots.append([t.clone() for layer in out.past_key_values.layers for t in (layer.keys, layer.values)])
        assert len(g._first_use.structures) <= MAX_STRUCTURES
    for out, snapshot in zip(kept, snapshots):
        layers = out.past_key_values.layers
        assert all(torch.equal(t, s) for t, s in zip((t for l in layers for t in (l.keys, l.values)), snapshot))


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
        if i == 0:  # the prefill and the first decode step eagerly, then n - 2 replays
            assert since(g, before) == counted(none=2, full=n - 2)
        else:  # kin of the first: its first decode step is captured, not run eagerly
            assert since(g, before) == counted(none=1, full=n - 1), (p, n)


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
    ran = []
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
        before = modes(step)
        with torch.no_grad():
            kw = cache_keyword(reference)  # the cache's keyword in this transformers
            got = step(input_ids=ids, **{kw: mine}, use_cache=True).logits
            want = reference(input_ids=ids, **{kw: theirs}, use_cache=True).logits
        ran.append(next(m.value for m, n in since(step, before).items() if n))
        torch.testing.assert_close(got, want)
        for a, b in zip(mine.layers, theirs.layers):  # the cache's own tensors hold what eager wrote
            torch.testing.assert_close(a.keys, b.keys)
            torch.testing.assert_close(a.values, b.values)
    # call 0 warms up, 1 captures; each change is seen before a replay and that call runs eagerly
    # (the stale graphs dropped), the next captures again; the third change (a layer added)
    # makes these calls eager from then on
    assert ran == ["NONE", "FULL", "FULL", "NONE", "FULL", "NONE", "FULL", "NONE"]
    assert len(step._first_use.refused_families) == 1 and not step._first_use.structures
