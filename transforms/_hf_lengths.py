"""transformers' bidirectional text encoders, their sequences padded to a few lengths under first
use (`graphify.base.length_padding`): BERT and its kin mask padded keys, so the real positions'
outputs stay as they were.

Padded with the model's own pad token and an attention mask of zeros (the one the call gave,
or ones where it gave none); RoBERTa's positions skip pad tokens, so theirs stay too. The
outputs cut back: hidden states on the sequence axis, attention maps on both of theirs; the
pooled output (the first token's) is left whole. Only the model types listed, and only calls
that name nothing but the arguments padded here (or None): anything else (`inputs_embeds`, a
head mask) goes through as it is.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["encoder_padding", "ENCODERS"]

# bidirectional encoders with absolute or no position embeddings, padded keys masked
ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "electra", "camembert", "mpnet", "albert"})
# the model classes whose outputs are known here (by class-name ending), so that every output
# with a sequence axis is cut back: the bare encoder and its per-sequence and per-token heads
HEADS = ("Model", "ForSequenceClassification", "ForTokenClassification", "ForMaskedLM", "ForQuestionAnswering")
PER_TOKEN = {"last_hidden_state": 1, "hidden_states": 1, "attentions": 2, "start_logits": 1, "end_logits": 1}
PADDED = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
LEFT_AS_GIVEN = frozenset({"return_dict", "output_attentions", "output_hidden_states"})


def encoder_padding(model: Any):
    """The padding of a transformers encoder of a listed type, else None."""
    from transformers import PreTrainedModel

    from graphify.extend import SequencePadding

    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or getattr(config, "model_type", None) not in ENCODERS:
        return None
    if not type(model).__name__.endswith(HEADS):
        return None
    if getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        return None
    cap = getattr(config, "max_position_embeddings", None)
    if not isinstance(cap, int):
        return None
    if config.model_type in ("roberta", "xlm-roberta", "camembert"):  # positions from padding_idx + 1 on
        cap -= (config.pad_token_id or 0) + 1
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    return SequencePadding(type(model).__name__, _length, functools.partial(_pad, pad_id), _cut, cap)


def _length(call: dict) -> int | None:
    ids = call.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    for name, value in call.items():
        if name in PADDED:
            if value is not None and (not isinstance(value, torch.Tensor) or value.shape != ids.shape):
                return None
        elif name not in LEFT_AS_GIVEN and value is not None:
            return None
    return ids.shape[1]


def _pad(pad_id: int, call: dict, to: int) -> dict:
    ids = call["input_ids"]
    if call.get("attention_mask") is None:
        call["attention_mask"] = torch.ones_like(ids)
    fill = {"input_ids": pad_id}
    for name in PADDED:
        value = call.get(name)
        if isinstance(value, torch.Tensor):
            call[name] = torch.nn.functional.pad(value, (0, to - value.shape[1]), value=fill.get(name, 0))
    return call


def _cut(out: Any, length: int, to: int) -> Any:
    """`out` with its sequence axes cut from `to` back to `length`: hidden states [B, L, H] and
    per-token logits ([B, L, C], [B, L]) on dim 1, attention maps [B, heads, L, L] on dims 2
    and 3; pooled and per-sequence outputs ([B, H], [B, C]) as they are."""
    if isinstance(out, torch.Tensor):
        return out[:, :length]
    if hasattr(out, "keys") and hasattr(out, "to_tuple"):  # a ModelOutput
        for key in list(out.keys()):
            value, dims = out[key], PER_TOKEN.get(key)
            if key == "logits" and isinstance(value, torch.Tensor) and value.dim() == 3:
                dims = 1  # a token head's ([B, L, C]); a sequence head's is [B, C]
            if dims is not None:
                out[key] = tuple(_cut_dims(v, dims, length) for v in value) if isinstance(value, tuple) else \
                    _cut_dims(value, dims, length)
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 3:  # return_dict=False
        return (out[0][:, :length], *out[1:])
    return out


def _cut_dims(t: torch.Tensor, dims: int, length: int) -> torch.Tensor:
    return t[:, :length] if dims == 1 else t[:, :, :length, :length]
