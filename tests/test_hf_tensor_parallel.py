"""A transformers model run tensor-parallel as its users run it: `from_pretrained(path,
tp_plan="auto")` in torchrun's environment, two ranks (gloo and the simulation backend on
the CPU; NCCL and CUDA graphs on two GPUs), random weights saved from a config. Each rank
compares eager `generate(..., cache_implementation="static")` with graphify's one line
(`model.forward = graphify(model.forward)`): the tokens must be equal, or the first
capture must refuse with an error that says why and what works instead. Also the decode
step captured ahead of time with `group=` (tests/hf_tp_worker.py does the work)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads tp_plan models through accelerate")

from test_distributed import run_ranks  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# What graphify lacks today (tests/hf_tp_worker.py, transformers 5.17 and 5.23): its state
# recorder (graphify/_state.py, _Recorder.__torch_dispatch__) reads untyped_storage() of
# every op's output, and the DTensors of a tp_plan model have none, so the first capture
# fails with "Attempted to access the data pointer on an invalid python storage", naming
# neither the cause nor a remedy. Skipping storage-less tensor subclasses there makes both
# paths equal eager on the CPU.
NEEDS_GRAPHIFY = ("graphify/_state.py's recorder reads the storage of DTensor outputs (none): the first capture fails "
                  "without saying why; see the module's note")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama saved as a checkpoint: what `from_pretrained` loads on each rank."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(path)
    return str(path)


def ranks(model_dir: str, scenario: str, device: str) -> list[dict]:
    """Both ranks' results of `scenario` on `device` ("cpu" or "cuda"), each rank checked to
    hold its shards of the model as transformers loaded them."""
    results = run_ranks(scenario, timeout=240, worker="hf_tp_worker.py", args=(model_dir, device), cpu=device == "cpu")
    for rank in results:
        assert rank["weight_type"] == "DTensor", rank  # transformers sharded the weights itself
        assert rank["local_shape"] == [TINY["hidden_size"] // 2, TINY["hidden_size"]], rank  # half of q_proj's rows
    return results


def equal_or_clearly_refused(outcome: dict) -> None:
    """The contract: tokens equal to eager with graphs replayed, or a CaptureError that names
    the cause (tensor parallelism, its DTensors or collectives) and says what works (`group=`)."""
    error = outcome["error"]
    if error is None:
        assert outcome["equal"], (outcome["eager"], outcome["graphified"])
        assert outcome["full_calls"] > 0, outcome  # decode steps replayed graphs
        return
    assert error.startswith("CaptureError"), error
    assert any(w in error for w in ("tensor parallel", "DTensor", "collective")), f"says not why: {error}"
    assert "group=" in error, f"says not what works instead: {error}"


def equal_with_graphs(outcome: dict) -> None:
    assert outcome["error"] is None, outcome["error"]
    assert outcome["equal"], (outcome["eager"], outcome["graphified"])
    assert outcome["full_calls"] == 7, outcome  # every decode step after the prompt replayed a graph


def needs_graphify(ranks_of) -> None:
    """xfail while graphify fails in its state recorder (see NEEDS_GRAPHIFY); any other
    failure (a crash, a hang, wrong tokens) fails the test."""
    errors = [rank["outcome"]["error"] or "" for rank in ranks_of]
    if any("invalid python storage" in e for e in errors):
        pytest.xfail(NEEDS_GRAPHIFY)


DEVICES = [  # gloo and the simulation backend everywhere; NCCL and CUDA graphs on two GPUs
    pytest.param("cpu", id="gloo"),
    pytest.param("cuda", id="nccl", marks=[pytest.mark.cuda, two_gpus]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_on_a_tensor_parallel_transformers_model_equals_eager_or_is_refused_clearly(model_dir, device):
    results = ranks(model_dir, "one_line", device)
    needs_graphify(results)
    for rank in results:
        equal_or_clearly_refused(rank["outcome"])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graphs_captured_ahead_of_time_with_group_equal_eager(model_dir, device):
    results = ranks(model_dir, "ahead_of_time", device)
    needs_graphify(results)
    for rank in results:
        equal_with_graphs(rank["outcome"])
