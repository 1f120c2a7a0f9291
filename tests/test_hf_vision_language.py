"""Vision-language decoders with the one line: their own `generate()`, unmodified. Their
multimodal rotary `position_ids` are [3 or 4, batch, length] (a row per axis of time, height
and width), so by default that argument keeps its shape (`fixed()`) while the tokens' first
dimension is the batch (`graphify.base.axes.default_axis`); decode steps replay graphs and
give eager's tokens, for text-only prompts and prompts with images of several sizes (each
image size moves the rotary offsets the decode steps read).

Tiny random-weight configurations of each family; the CPU simulation and, on a GPU, CUDA.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import replayed, requires_cuda  # noqa: E402
from graphify import Options, graphify  # noqa: E402

TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, head_dim=8)
VISION = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, in_chans=3, in_channels=3, spatial_merge_size=2,
              patch_size=2, temporal_patch_size=1, out_hidden_size=32, intermediate_size=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
           first_k_dense_replace=0)
MROPE = {"mrope_section": [1, 1, 2]}
FAMILIES = {  # family -> (config class, model class, text config beyond TEXT)
    "Qwen2-VL": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {"rope_scaling": {"type": "mrope", **MROPE}}),
    "Qwen2.5-VL": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", {"rope_scaling": {"type": "mrope", **MROPE}}),
    "Qwen3-VL": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 {"rope_scaling": {"rope_type": "default", **MROPE, "mrope_interleaved": True}}),
    "Qwen3-VL-MoE": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                     {**MOE, "rope_scaling": {"rope_type": "default", **MROPE, "mrope_interleaved": True}}),
    "GLM-4V": ("Glm4vConfig", "Glm4vForConditionalGeneration", {"rope_scaling": {"rope_type": "default", **MROPE}}),
    "GLM-4V-MoE": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration",
                   {**MOE, "partial_rotary_factor": 1.0, "rope_scaling": {"rope_type": "default", **MROPE}}),
}
IMAGE, VIDEO, VISION_START = 120, 121, 122
NEW_TOKENS = 6
LINES = pytest.mark.parametrize("device", [
    pytest.param("cpu", id="sim"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
])


def build(family: str, device: str):
    cfg_cls, model_cls, text = FAMILIES[family]
    if not hasattr(transformers, cfg_cls):
        pytest.skip(f"this transformers ({transformers.__version__}) has no {cfg_cls}")
    config = getattr(transformers, cfg_cls)(text_config={**TEXT, **text}, vision_config=VISION, image_token_id=IMAGE,
                                            video_token_id=VIDEO, vision_start_token_id=VISION_START)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(device).eval()


def prompt(seed: int, device: str, width: int | None) -> dict:
    """Two rows of text, with an image of 4 x `width` patches after the first token (None: text only)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 100, (2, 4), generator=g)
    if width is None:
        call = {"input_ids": text}
    else:
        image = torch.tensor([[VISION_START] + [IMAGE] * width] * 2)  # 4 x width patches, merged 2 x 2
        call = {"input_ids": torch.cat([text[:, :1], image, text[:, 1:]], 1),
                "pixel_values": torch.randn(2 * 4 * width, 3 * 2 * 2, generator=g),
                "image_grid_thw": torch.tensor([[1, 4, width]] * 2)}
    call["attention_mask"] = torch.ones_like(call["input_ids"])
    return {k: v.to(device) for k, v in call.items()}


def generate_both(model, calls: list[dict], options: Options) -> tuple[list, list, list[str]]:
    """Eager `generate()` over `calls`, then the same with the one line: (eager's, ours, graphify's warnings)."""
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        want = [model.generate(**c, **kw) for c in calls]
        model.forward = graphify(model.forward, options=options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [model.generate(**c, **kw) for c in calls]
    return want, got, [str(w.message) for w in caught if "graphify" in str(w.message)]


@LINES
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_steps_of_text_prompts_replay_graphs_with_eagers_tokens(family, device):
    model = build(family, device)
    calls = [prompt(seed, device, None) for seed in (1, 2)]
    want, got, warned = generate_both(model, calls, Options(backend="sim" if device == "cpu" else "cuda"))
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
    assert not warned, warned
    assert replayed(model.forward) >= 2 * (NEW_TOKENS - 2)  # each generate(): every decode step after the first


@LINES
@pytest.mark.parametrize("family", ["Qwen2-VL", "Qwen3-VL", "GLM-4V"])
def test_decode_steps_after_images_of_several_sizes_replay_graphs_with_eagers_tokens(family, device):
    """An image's size moves the rotary offsets of the tokens after it (the model keeps them
    between prefill and decode): a replay must read the new ones."""
    model = build(family, device)
    calls = [prompt(seed, device, width) for seed, width in ((1, 4), (2, 8), (3, 4), (4, 8))]
    want, got, warned = generate_both(model, calls, Options(backend="sim" if device == "cpu" else "cuda"))
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
    assert not warned, warned
    assert replayed(model.forward) >= 4 * (NEW_TOKENS - 2)


@LINES
def test_the_compile_line_gives_a_vision_language_decoder_eagers_tokens(device):
    model = build("Qwen2-VL", device)
    calls = [prompt(1, device, 4), prompt(2, device, None)]
    backend = "aot_eager" if device == "cpu" else "inductor"
    want, got, warned = generate_both(model, calls, Options(backend="sim" if device == "cpu" else "cuda",
                                                            compile={"backend": backend}))
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
    assert not warned, warned
    assert replayed(model.forward) >= 2 * (NEW_TOKENS - 2)
