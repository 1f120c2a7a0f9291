"""The models of the zoo benchmark (`benchmarks.zoo`), as users pick them: most used first.

Three libraries, built as a user builds them, with random weights (the lent GPU machines reach
no hub): timm's CNNs, ViTs and hybrids (`timm.create_model(name, pretrained=False)`),
torchvision's classifiers (`weights=None`), and transformers' encoders and decoders from
their default configurations (BERT-base, RoBERTa-base, DistilBERT, ViT-base, CLIP's vision
tower, Whisper's encoder; GPT-2 and a Llama shape over a whole prompt, no cache). Images come at
the model's own input size; encoders at the lengths they are served at.

A model whose library is not installed is left out (the CPU machines have neither timm nor
torchvision); `available()` lists those that can be built here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import attrs
import torch

__all__ = ["ZooModel", "MODELS", "available", "by_name", "TINY"]


@attrs.frozen
class ZooModel:
    """`build()` makes the model (random weights, eval); `inputs(batch, length, device, dtype,
    generator)` one call's keyword arguments; `lengths`: the sequence lengths an encoder is
    served at (None for a fixed-size input such as an image)."""

    name: str
    library: str
    kind: str  # "cnn", "vit", "hybrid", "encoder", "decoder", "speech"
    build: Callable[[], torch.nn.Module]
    inputs: Callable
    lengths: tuple = (None,)


def _image(size: int = 224) -> Callable:
    def make(batch, length, device, dtype, generator):
        x = torch.randn(batch, 3, size, size, generator=generator)
        return {"x": x.to(device, dtype)}
    return make


def _pixels(size: int = 224) -> Callable:
    def make(batch, length, device, dtype, generator):
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=generator).to(device, dtype)}
    return make


def _tokens(vocab: int) -> Callable:
    def make(batch, length, device, dtype, generator):
        ids = torch.randint(1, vocab, (batch, length), generator=generator)
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    return make


def _features(mels: int, frames: int) -> Callable:
    def make(batch, length, device, dtype, generator):
        return {"input_features": torch.randn(batch, mels, frames, generator=generator).to(device, dtype)}
    return make


def _timm(name: str, kind: str) -> ZooModel:
    def build():
        import timm

        return timm.create_model(name, pretrained=False).eval()

    size = 224
    return ZooModel(f"timm/{name}", "timm", kind, build, _image(size))


def _torchvision(name: str, kind: str) -> ZooModel:
    def build():
        import torchvision

        return getattr(torchvision.models, name)(weights=None).eval()

    return ZooModel(f"torchvision/{name}", "torchvision", kind, build, _image())


def _transformers(name: str, kind: str, model: str, config: str, inputs: Callable, lengths=(None,),
                  **overrides) -> ZooModel:
    def build():
        import transformers

        cfg = getattr(transformers, config)(**overrides)
        return getattr(transformers, model)(cfg).eval()

    return ZooModel(f"transformers/{name}", "transformers", kind, build, inputs, lengths)


def _whisper_encoder() -> ZooModel:
    def build():
        import transformers

        return transformers.WhisperModel(transformers.WhisperConfig()).get_encoder().eval()

    return ZooModel("transformers/whisper-encoder", "transformers", "speech", build, _features(80, 3000))


SERVED_LENGTHS = (32, 128, 512)  # an encoder's requests: short queries, sentences, passages

MODELS: tuple[ZooModel, ...] = (
    # timm, by downloads: CNNs, then ViTs, then hybrids
    _timm("resnet50", "cnn"), _timm("efficientnet_b0", "cnn"), _timm("resnet18", "cnn"),
    _timm("mobilenetv3_large_100", "cnn"), _timm("convnext_tiny", "cnn"), _timm("resnext50_32x4d", "cnn"),
    _timm("regnety_016", "cnn"), _timm("densenet121", "cnn"), _timm("efficientnet_b3", "cnn"),
    _timm("mobilenetv2_100", "cnn"), _timm("convnext_small", "cnn"),
    _timm("vit_base_patch16_224", "vit"), _timm("vit_small_patch16_224", "vit"), _timm("deit_small_patch16_224", "vit"),
    _timm("swin_tiny_patch4_window7_224", "vit"), _timm("beit_base_patch16_224", "vit"),
    _timm("levit_128s", "hybrid"), _timm("edgenext_small", "hybrid"), _timm("maxvit_tiny_tf_224", "hybrid"),
    # torchvision
    _torchvision("resnet50", "cnn"), _torchvision("mobilenet_v3_large", "cnn"), _torchvision("efficientnet_b0", "cnn"),
    _torchvision("convnext_tiny", "cnn"), _torchvision("regnet_y_800mf", "cnn"), _torchvision("vit_b_16", "vit"),
    # transformers: encoders at their served lengths, vision and speech towers, decoders over a prompt
    _transformers("bert-base", "encoder", "BertModel", "BertConfig", _tokens(30522), SERVED_LENGTHS),
    _transformers("roberta-base", "encoder", "RobertaModel", "RobertaConfig", _tokens(50265), SERVED_LENGTHS,
                  vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1),
    _transformers("distilbert", "encoder", "DistilBertModel", "DistilBertConfig", _tokens(30522), SERVED_LENGTHS),
    _transformers("vit-base", "vit", "ViTModel", "ViTConfig", _pixels()),
    _transformers("clip-vision-b32", "vit", "CLIPVisionModel", "CLIPVisionConfig", _pixels()),
    _whisper_encoder(),
    _transformers("gpt2", "decoder", "GPT2Model", "GPT2Config", _tokens(50257), (128,)),
    _transformers("llama-1b-shape", "decoder", "LlamaModel", "LlamaConfig", _tokens(32000), (128,),
                  hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000),
)

# the CPU smoke run: a tiny BERT, its lengths the served ones cut short
TINY = _transformers("bert-tiny", "encoder", "BertModel", "BertConfig", _tokens(96), (8, 16), vocab_size=96,
                     hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def available(models=MODELS) -> tuple[ZooModel, ...]:
    """The models whose library is installed here."""
    return tuple(m for m in models if importlib.util.find_spec(m.library) is not None)


def by_name(names) -> tuple[ZooModel, ...]:
    """The models named (a full name, or a library: "timm") among `MODELS` and `TINY`."""
    pool = MODELS + (TINY,)
    picked = tuple(m for m in pool if m.name in names or m.library in names or m.kind in names)
    missing = [n for n in names if not any(n in (m.name, m.library, m.kind) for m in pool)]
    if missing:
        raise ValueError(f"no zoo model {missing}; the zoo: {[m.name for m in pool]}")
    return picked
