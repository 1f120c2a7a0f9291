"""An encoder's sequence padded to a few lengths under first use (`graphify.base.length_padding`,
transformers' encoders in `transforms/_hf_lengths.py`): calls of every length replay a handful
of graphs and answer as the model does; a model that reads its padded positions is caught by
the one comparison and left unpadded; calls the padding cannot name go through as they are."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import replayed, requires_cuda
from graphify import Options, graphify, tokens
from graphify.base.length_padding import BUCKETS, SequencePadding, bucket, register_sequence_padding

transformers = pytest.importorskip("transformers")

LINES = pytest.mark.parametrize("device", [
    pytest.param("cpu", id="sim"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, requires_cuda]),
])
TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128)
ENCODERS = {
    "bert": ("BertConfig", "BertModel", TINY),
    "roberta": ("RobertaConfig", "RobertaModel", {**TINY, "max_position_embeddings": 130, "pad_token_id": 1}),
    "distilbert": ("DistilBertConfig", "DistilBertModel",
                   dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128)),
}


@given(st.integers(1, 5000), st.integers(1, 5000))
def test_a_length_pads_to_the_smallest_bucket_that_holds_it_or_the_models_longest(length, cap):
    to = bucket(length, cap)
    if length > cap:
        assert to is None
        return
    assert length <= to <= cap
    assert to == cap or to in BUCKETS
    assert not any(length <= b < to for b in BUCKETS)  # no smaller bucket would do


def build(kind: str, device: str):
    cfg, cls, config = ENCODERS[kind]
    torch.manual_seed(0)
    return getattr(transformers, cls)(getattr(transformers, cfg)(**config)).to(device).eval()


def requests(n: int, seed: int, device: str, longest: int = 100):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        rows, length = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(2, longest, (1,), generator=g))
        ids = torch.randint(3, 90, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, length // 2:] = int(torch.randint(0, 2, (1,), generator=g))  # a padded request among real ones
        yield {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def close(got, want, device):
    tol = dict(rtol=1e-4, atol=1e-5) if device == "cpu" else dict(rtol=1e-3, atol=1e-4)
    for a, b in zip(got.to_tuple(), want.to_tuple()):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, **tol)
        else:
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, **tol)


@LINES
@pytest.mark.parametrize("kind", list(ENCODERS))
def test_calls_of_every_length_replay_a_few_graphs_and_answer_as_the_model(kind, device):
    model, eager = build(kind, device), build(kind, device)
    g = graphify(model, options=Options(backend="sim" if device == "cpu" else "cuda"))
    calls = list(requests(40, 0, device))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: every padded call agreed
        for round in range(3):
            if round == 2:
                g.stats.reset()
            for call in calls:
                close(g(**call), eager(**call), device)
    lengths = {bucket(c["input_ids"].shape[1], g._padded.padding.cap) for c in calls}
    assert len(lengths) <= 4  # 2-99 tokens: 16, 32, 64, 128 at most
    graphs = sum(s.graphs for s in g._first_use.structures)
    assert graphs <= 3 * len(lengths)  # a graph per batch size and padded length, not per length
    assert replayed(g) == len(calls)  # by the third pass, every call replays a graph
    assert g._padded.checked and not g._padded.off


@LINES
def test_hidden_states_and_attention_maps_are_cut_back_to_the_calls_length(device):
    model, eager = build("bert", device), build("bert", device)
    for m in (model, eager):  # sdpa returns no attention maps
        m.set_attn_implementation("eager")
    model.forward = graphify(model.forward, options=Options(backend="sim" if device == "cpu" else "cuda"))
    with torch.no_grad():
        for call in list(requests(6, 1, device, longest=40)) * 2:
            got = model(**call, output_hidden_states=True, output_attentions=True)
            want = eager(**call, output_hidden_states=True, output_attentions=True)
            assert got.attentions[0].shape == want.attentions[0].shape == (*call["input_ids"].shape[:1], 4,
                                                                          *call["input_ids"].shape[1:] * 2)
            close(got, want, device)


class MeanOfAll(torch.nn.Module):
    """Reads its padded positions: the mean over every position, mask or not."""

    def forward(self, input_ids, attention_mask=None):
        return (input_ids.float().mean(1, keepdim=True) + attention_mask.float()).unsqueeze(-1)


def _mean_padding(model):
    if not isinstance(model, MeanOfAll):
        return None

    def pad(call, to):
        ids, mask = call["input_ids"], call["attention_mask"]
        call["input_ids"] = torch.nn.functional.pad(ids, (0, to - ids.shape[1]))
        call["attention_mask"] = torch.nn.functional.pad(mask, (0, to - mask.shape[1]))
        return call

    return SequencePadding("MeanOfAll", lambda call: call["input_ids"].shape[1], pad,
                           lambda out, n, to: out[:, :n], 64)


def test_a_model_that_reads_its_padded_positions_is_caught_once_and_left_unpadded():
    register_sequence_padding(_mean_padding)
    model = MeanOfAll()
    g = graphify(model, options=Options(backend="sim"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length in (5, 5, 7, 5, 7, 7):
            ids = torch.randint(1, 50, (2, length))
            mask = torch.ones(2, length, dtype=torch.long)
            torch.testing.assert_close(g(ids, mask), model(ids, mask))
    said = [str(w.message) for w in caught if "padded" in str(w.message)]
    assert len(said) == 1 and "MeanOfAll's outputs changed when its sequence of 5 was padded to 16" in said[0]
    assert g._padded.off


def test_calls_the_padding_cannot_name_and_functions_given_axes_are_not_padded():
    model, eager = build("bert", "cpu"), build("bert", "cpu")
    g = graphify(model, options=Options(backend="sim"))
    embeds = torch.randn(2, 7, 32)
    with torch.no_grad():
        for _ in range(3):  # inputs_embeds: not a call this padding names
            close(g(inputs_embeds=embeds), eager(inputs_embeds=embeds), "cpu")
    assert not g._padded.checked
    assert graphify(model, axes={"input_ids": tokens()})._padded is None
    assert graphify(model, sizes=[1, 2])._padded is None
    assert graphify(lambda x: x * 2)._padded is None


def test_requests_of_8_to_512_tokens_take_six_structures_and_then_all_replay():
    """What an encoder service is sent: batches of 1-8 rows at any length from 8 to 512. Within
    first use's bound on call structures, so no length is left eager, and no capture storm:
    a graph per batch size and padded length."""
    import random

    config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    g = graphify(model, options=Options(backend="sim"))
    rng = random.Random(0)
    calls = [(rng.randint(1, 8), rng.randint(8, 512)) for _ in range(60)]
    with torch.no_grad():
        for round in range(3):
            if round == 2:
                g.stats.reset()
            for rows, length in calls:
                ids = torch.randint(3, 90, (rows, length))
                g(input_ids=ids, attention_mask=torch.ones_like(ids))
    structures = g._first_use.structures
    assert len(structures) <= 6 <= g.options.limits.structures
    assert sum(s.graphs for s in structures) <= len({(r, bucket(n, 512)) for r, n in calls})
    assert replayed(g) == len(calls)


@pytest.mark.parametrize("head", ["BertForTokenClassification", "BertForSequenceClassification",
                                  "BertForQuestionAnswering", "BertForMaskedLM"])
def test_a_heads_per_token_outputs_are_cut_back_and_its_per_sequence_ones_kept(head):
    """Token logits [B, L, C] and span logits [B, L] cut to the call's length; a sequence
    head's logits [B, C] as they are, even where C happens to equal a padded length."""
    labels = 2 if "Question" in head else 16  # 16: a padded length too
    config = transformers.BertConfig(**{**TINY, "num_labels": labels})
    torch.manual_seed(0)
    model, eager = getattr(transformers, head)(config).eval(), getattr(transformers, head)(config).eval()
    eager.load_state_dict(model.state_dict())
    g = graphify(model, options=Options(backend="sim"))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for call in list(requests(8, 3, "cpu", longest=30)) * 2:
            close(g(**call), eager(**call), "cpu")
    assert g._padded.checked and not g._padded.off


def test_a_model_class_whose_outputs_are_not_known_here_is_not_padded():
    config = transformers.BertConfig(**TINY)
    assert graphify(transformers.BertForMultipleChoice(config).eval())._padded is None
    assert graphify(transformers.BertLMHeadModel(transformers.BertConfig(**TINY, is_decoder=True)))._padded is None
