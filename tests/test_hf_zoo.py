"""The one line across the transformers families people run, unmodified, with their own
`generate()`: a tiny random-weight config of each, both cache kinds, both lines (plain, and
`Options(compile=...)`). Every case gives eager's tokens with no exception; with the static
cache every family replays graphs, as transformers' own compile makes graphs for it.

Sliding-window families (Mistral, Qwen2 with sliding layers, Phi-3, Gemma 2 and 3, Cohere2,
gpt-oss) run with a window of 4 and a prompt of 2, so decode fills the window, crosses it
and rolls. The compile line uses dynamo's "aot_eager" backend here (AOTAutograd's trace
without inductor's compile time); the GPU benchmarks run inductor. (Dynamo's "eager" debug
backend runs a sliding window's `torch.tensor([-1], device="cuda")` at every call, a copy
from pageable memory that stream capture refuses: those steps run eagerly with a warning.
AOTAutograd and inductor make it a constant at compile time.)

On a GPU every family runs every case; on the CPU (the suite's time) the static cache and
the plain line take every family, the default cache and the compile line one family of each
kind.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import calls_by_mode, replayed, requires_cuda  # noqa: E402
from graphify import Mode, Options, graphify  # noqa: E402

TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)
WINDOW = 4
MOE = {"num_experts_per_tok": 2}
ZOO = {  # family -> (config class, model class, config)
    "Llama": ("LlamaConfig", "LlamaForCausalLM", TINY),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", TINY),
    "Qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      {**TINY, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**TINY, "head_dim": 8}),
    "Mistral-window": ("MistralConfig", "MistralForCausalLM", {**TINY, "sliding_window": WINDOW}),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**TINY, "head_dim": 8, "sliding_window": WINDOW}),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **TINY, "head_dim": 8, "sliding_window": WINDOW, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "Phi3-window": ("Phi3Config", "Phi3ForCausalLM", {**TINY, "sliding_window": WINDOW, "pad_token_id": 0}),
    "Cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {**TINY, "sliding_window": WINDOW, "pad_token_id": 0}),
    "OLMo2": ("Olmo2Config", "Olmo2ForCausalLM", {**TINY, "pad_token_id": 0}),
    "GPT2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=256)),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", {**TINY, **MOE, "num_local_experts": 4}),
    "Qwen3-MoE": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**TINY, **MOE, "head_dim": 8, "num_experts": 4, "moe_intermediate_size": 32}),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                {**TINY, **MOE, "head_dim": 8, "num_local_experts": 4, "sliding_window": WINDOW}),
    "Mamba": ("MambaConfig", "MambaForCausalLM", dict(hidden_size=32, num_hidden_layers=2, vocab_size=96, state_size=8)),
    "T5": ("T5Config", "T5ForConditionalGeneration", dict(
        d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=96, decoder_start_token_id=0, pad_token_id=0)),
    "Whisper": ("WhisperConfig", "WhisperForConditionalGeneration", dict(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=64,
        vocab_size=96, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
}
# with the default cache (DynamicCache: new tensors every step) calls run eagerly; these update
# their cache in place whatever its kind, so their decode steps replay graphs with it too
IN_PLACE_DEFAULT_CACHE = {"Mamba"}
NEW_TOKENS = 8


def fresh(family: str, device: str):
    cfg_cls, model_cls, config = ZOO[family]
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**config)).to(device).eval()


def inputs_for(model, device: str, rows: int = 2, dtype=None) -> dict:
    """A seeded prompt of `rows` rows for `model` (log-mel features in `dtype` for speech)."""
    seeded = torch.Generator().manual_seed(7)
    if isinstance(model, transformers.WhisperForConditionalGeneration):  # speech: log-mel features in
        return {"input_features": torch.randn(rows, 8, 32, generator=seeded).to(device, dtype)}
    ids = torch.randint(1, 96, (rows, 2), generator=seeded).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pad_token_id": 0}


def generate(model, cache: str | None, device: str, rows: int = 2, dtype=None, **kw):
    return model.generate(
        **inputs_for(model, device, rows, dtype), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
        do_sample=False, cache_implementation=cache, **kw,
    )


# with the default cache every family runs eagerly but the in-place ones: on the CPU one family of
# each kind (the CPU suite's time), on a GPU every family
CPU_DEFAULT_CACHE = {"Llama", "Gemma3", "T5", "Mamba"}


@pytest.mark.parametrize("cache", ["static", None], ids=["static", "default"])
@pytest.mark.parametrize("family", sorted(ZOO))
def test_the_one_line_equals_eager_generate_and_replays_graphs(backend, family, cache):
    _, device = backend
    if device == "cpu" and cache is None and family not in CPU_DEFAULT_CACHE:
        pytest.skip("the default cache on the CPU: one family of each kind (all of them on a GPU)")
    want = generate(fresh(family, device), cache, device, disable_compile=True)
    model = fresh(family, device)
    model.forward = graphify(model.forward)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = generate(model, cache, device)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if cache == "static" or family in IN_PLACE_DEFAULT_CACHE:
        # decode steps: the first a warm-up, then graphs (a branch of a window captured by its first step)
        assert calls_by_mode(model.forward)[Mode.FULL] >= NEW_TOKENS - 3, calls_by_mode(model.forward)
        assert not [w for w in seen if "run eagerly" in str(w.message) or "runs eagerly" in str(w.message)]
    else:
        assert replayed(model.forward) == 0  # new tensors every step: eagerly, with one warning naming the fix
        assert len(naming_the_static_cache(seen)) == 1, [str(w.message) for w in seen]


def naming_the_static_cache(seen) -> list:
    return [w for w in seen if 'cache_implementation="static"' in str(w.message)]


@pytest.mark.parametrize("family", ["Llama", "GPT2"])
def test_the_default_cache_with_a_padded_prompt_says_once_why_it_runs_eagerly(backend, family):
    """With padding the default cache's mask grows with its cache on every step, so no two
    decode steps share a structure: they run eagerly, and one warning names the fix."""
    _, device = backend
    model = fresh(family, device)
    inputs = inputs_for(model, device)
    inputs["attention_mask"][0, 0] = 0  # a left-padded row
    want = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          disable_compile=True)
    model.forward = graphify(model.forward)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert replayed(model.forward) == 0
    assert len(naming_the_static_cache(seen)) == 1, [str(w.message) for w in seen]


# on the CPU the compile line takes a family of each kind (a dynamo trace of each costs more
# than the rest of its case): a window, full attention with experts, encoder-decoder, a state
# space model; on a GPU every family
CPU_COMPILE_LINE = {"Gemma3", "Mixtral", "T5", "Mamba"}


@pytest.mark.parametrize("family", sorted(ZOO))
def test_the_compile_line_equals_eager_generate_and_replays_graphs(backend, family):
    _, device = backend
    if device == "cpu" and family not in CPU_COMPILE_LINE:
        pytest.skip("the compile line on the CPU: one family of each kind (all of them on a GPU)")
    want = generate(fresh(family, device), "static", device, disable_compile=True)
    model = fresh(family, device)
    model.forward = graphify(model.forward, options=Options(compile={"backend": "aot_eager"}))
    got = generate(model, "static", device)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert calls_by_mode(model.forward)[Mode.FULL] >= NEW_TOKENS - 3, calls_by_mode(model.forward)


CPU_GEMV_LINE = {"Mixtral", "T5"}  # experts' linears; an encoder-decoder's


@pytest.mark.parametrize("family", sorted(ZOO))
def test_the_compile_line_with_the_one_row_gemv_equals_eager_generate(backend, family):
    """`"gemv": True` rewrites every family's linears into graphify's op; at these fp32 weights
    the op runs `F.linear` (the GEMV takes bf16/fp16 only), so what is checked is that the
    rewrite traces, compiles and replays each family as written."""
    from graphify.compile.compiled import _BACKENDS

    _, device = backend
    if device == "cpu" and family not in CPU_GEMV_LINE:
        pytest.skip("the compile line with the GEMV on the CPU: two families (all of them on a GPU)")
    routed = lambda: sum(b.counts["gemv"] for b in list(_BACKENDS.values()) if "gemv" in b.rewrites)  # noqa: E731 - shared backends
    torch._dynamo.reset()  # another family's entry for a shared forward would spare this one its compile
    want = generate(fresh(family, device), "static", device, disable_compile=True)
    model = fresh(family, device)
    model.forward = graphify(model.forward, options=Options(compile={"backend": "aot_eager", "gemv": True}))
    before = routed()
    got = generate(model, "static", device)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert calls_by_mode(model.forward)[Mode.FULL] >= NEW_TOKENS - 3, calls_by_mode(model.forward)
    if family != "GPT2":  # GPT-2's Conv1D is an addmm, not a linear
        assert routed() > before


TIE = 0.05  # logits this close are a near-tie in bf16: either token may be the greedy one


def scored(model, device: str, **kw):
    """One bf16 row's greedy `generate()` with its logits."""
    return generate(model, "static", device, rows=1, dtype=torch.bfloat16, output_logits=True,
                    return_dict_in_generate=True, **kw)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("family", sorted(ZOO))
def test_the_gemv_itself_in_every_family_gives_eagers_tokens_up_to_near_ties(family):
    """bf16 at batch 1, where the op runs the Triton GEMV: each step's logits within bf16's
    rounding of eager's while the tokens agree, and a parting only at a near-tie of eager's."""
    from graphify.models import _triton_gemv

    if not _triton_gemv.available():
        pytest.skip("no Triton")
    torch._dynamo.reset()
    want = scored(fresh(family, "cuda").to(torch.bfloat16), "cuda", disable_compile=True)
    model = fresh(family, "cuda").to(torch.bfloat16)
    model.forward = graphify(model.forward, options=Options(compile={"backend": "aot_eager", "gemv": True}))
    for _ in range(2):  # the first captures, the second replays
        got = scored(model, "cuda")
        for step, (g, w) in enumerate(zip(got.logits, want.logits)):
            g, w = g.float(), w.float()
            torch.testing.assert_close(g, w, atol=0.1, rtol=0.05, msg=f"step {step}")
            mine, theirs = g.argmax(-1), w.argmax(-1)
            if not torch.equal(mine, theirs):  # the only parting allowed: a near-tie, then stop comparing
                assert (w.gather(-1, theirs[:, None]) - w.gather(-1, mine[:, None])).max() <= TIE, f"step {step}"
                break
    assert calls_by_mode(model.forward)[Mode.FULL] >= NEW_TOKENS - 3, calls_by_mode(model.forward)


# caches whose layers are made on their first use: a second generate()'s new cache is captured at
# once (its kin had graphs), and that capture's warm-up makes the layers; the next call captures
LAZY_CACHES = ("T5", "Whisper", "Mamba")


@pytest.mark.parametrize("family", LAZY_CACHES)
def test_a_second_generate_replays_graphs_too(backend, family):
    _, device = backend
    want = generate(fresh(family, device), "static", device, disable_compile=True)
    model = fresh(family, device)
    model.forward = graphify(model.forward)
    torch.testing.assert_close(generate(model, "static", device), want, rtol=0, atol=0)
    first = calls_by_mode(model.forward)[Mode.FULL]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.testing.assert_close(generate(model, "static", device), want, rtol=0, atol=0)
    assert calls_by_mode(model.forward)[Mode.FULL] - first >= NEW_TOKENS - 3, calls_by_mode(model.forward)
    assert not [w for w in seen if "eager" in str(w.message)], [str(w.message) for w in seen]


# families whose decode step reads a device value on the host (JetMoe's router splits its tokens
# by `expert_size.tolist()`): eager's tokens, every step eagerly, one warning naming the line
HOST_READS = {
    "JetMoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
        intermediate_size=64, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("line", ["plain", "compiled"])
@pytest.mark.parametrize("family", sorted(HOST_READS))
def test_a_decode_step_that_reads_on_the_host_runs_eagerly_with_one_warning_naming_the_line(backend, family, line):
    _, device = backend
    cfg_cls, model_cls, config = HOST_READS[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"this transformers has no {model_cls}")

    def fresh_one():
        torch.manual_seed(0)
        return getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**config)).to(device).eval()

    want = generate(fresh_one(), "static", device, disable_compile=True)
    model = fresh_one()
    options = Options(compile={"backend": "aot_eager"}) if line == "compiled" else Options()
    model.forward = graphify(model.forward, options=options)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = generate(model, "static", device)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert replayed(model.forward) == 0
    named = [w for w in seen if f"modeling_{family.lower()}.py" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in seen]
