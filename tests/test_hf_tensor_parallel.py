"""A transformers model run tensor-parallel as its users run it: `from_pretrained(path,
tp_plan="auto")` in torchrun's environment, two ranks (gloo and the simulation backend on
the CPU; NCCL and CUDA graphs on two GPUs), random weights saved from a config. Each rank
compares eager `generate(..., cache_implementation="static")` with graphify's one line
(`model.forward = graphify(model.forward)`): the tokens are equal and the decode steps
replay graphs (counted). Also the decode step captured ahead of time with `group=`
(tests/hf_tp_worker.py does the work)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads tp_plan models through accelerate")

from test_distributed import run_ranks  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
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


def equal_with_graphs(outcome: dict, ran: dict) -> None:
    """Tokens equal to eager, the calls run as `ran` ({"NONE": n, "PIECEWISE": n, "FULL": n})."""
    assert outcome["error"] is None, outcome["error"]
    assert outcome["equal"], (outcome["eager"], outcome["graphified"])
    assert outcome["modes"] == ran, outcome["modes"]


DEVICES = [  # gloo and the simulation backend everywhere; NCCL and CUDA graphs on two GPUs
    pytest.param("cpu", id="gloo"),
    pytest.param("cuda", id="nccl", marks=[pytest.mark.cuda, two_gpus]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_one_line_on_a_tensor_parallel_transformers_model_equals_eager_with_graphs(model_dir, device):
    for rank in ranks(model_dir, "one_line", device):
        # generate(new=8): the prefill and the first decode step eagerly, the 6 after them replayed
        equal_with_graphs(rank["outcome"], {"NONE": 2, "PIECEWISE": 0, "FULL": 6})
        # its graphs hold DTensor's all-reduces without group=: released before the group's
        # teardown, which on NCCL never returned under them (the ranks hung at exit)
        assert rank["ungrouped_before_destroy"] > 0 and rank["after_destroy"] == {"ungrouped_graphs": 0}, rank
        assert rank["returncode"] == 0 and rank["exit_after_result_s"] < 30, rank


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graphs_captured_ahead_of_time_with_group_equal_eager(model_dir, device):
    for rank in ranks(model_dir, "ahead_of_time", device):
        equal_with_graphs(rank["outcome"], {"NONE": 0, "PIECEWISE": 0, "FULL": 7})  # every decode step after the prompt
