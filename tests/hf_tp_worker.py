"""One rank of tests/test_hf_tensor_parallel.py: a transformers model run tensor-parallel
as its users run it (`from_pretrained(path, tp_plan="auto")` under torchrun's environment:
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT; DTensor weights, all-reduces in the
row-parallel layers), then under graphify two ways:

- the one line: `model.forward = graphify(model.forward)`, then `generate(...,
  cache_implementation="static")`, against eager `generate()`;
- the decode step captured ahead of time with `group=` (every rank captures the same
  graphs and checks each call), driven by a greedy loop over a StaticCache.

gloo on the CPU (the simulation backend), NCCL on GPUs. Prints one `RESULT <json>` line.

    python tests/hf_tp_worker.py one_line|ahead_of_time RANK WORLD PORT MODEL_DIR cpu|cuda
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import transformers

from graphify import Options, graphify
from graphify.distributed.lockstep import ungrouped_graphs
from graphify.transforms.hf import cache_keyword

NEW = 8  # tokens each generate() adds


def prompt(device) -> torch.Tensor:
    """The same prompt on every rank (tensor parallelism: every rank sees the whole batch)."""
    return torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(5)).to(device)


def generate(model, ids: torch.Tensor, **kw) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, cache_implementation="static", pad_token_id=0, **kw)


def _modes(g) -> dict:
    """{"NONE": n, "PIECEWISE": n, "FULL": n}: what `g`'s calls ran as."""
    return {r.mode.value: r.calls for r in g.stats.by_mode()}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def one_line(model, ids: torch.Tensor) -> dict:
    """Eager `generate()` (transformers' own compilation off) against the one line."""
    want = generate(model, ids, disable_compile=True)
    model.forward = graphify(model.forward)  # the one line
    g = model.forward
    try:
        got = generate(model, ids)
    except Exception as exc:  # a refusal: the test judges its message
        return {"error": _error(exc), "eager": want.tolist()}
    finally:
        del model.forward  # the model's own forward again
    return {"error": None, "equal": torch.equal(got, want), "eager": want.tolist(), "graphified": got.tolist(),
            "modes": _modes(g)}


def greedy(model, ids: torch.Tensor, group=None) -> tuple[torch.Tensor, object]:
    """Greedy tokens over a StaticCache: the prompt eagerly (it sizes the cache: each rank
    holds its own KV heads), then the decode steps, through graphs captured ahead of time
    with `group=` when a group is given. Returns (tokens, the graphified step or None)."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=64)
    past, step = {cache_keyword(model): cache}, None
    with torch.no_grad():
        nxt = model(input_ids=ids, **past, use_cache=True).logits[:, -1:].argmax(-1)
        tokens = [nxt]
        if group is not None:
            step = graphify(model, mode="FULL", sizes=[ids.shape[0]], options=Options(group=group))
            step = step.capture(input_ids=nxt, **past, use_cache=True)
        for _ in range(NEW - 1):
            nxt = (step or model)(input_ids=nxt, **past, use_cache=True).logits[:, -1:].argmax(-1)
            tokens.append(nxt)
    return torch.cat(tokens, dim=1), step


def ahead_of_time(model, ids: torch.Tensor) -> dict:
    want, _ = greedy(model, ids)
    try:
        got, step = greedy(model, ids, dist.group.WORLD)
    except Exception as exc:
        return {"error": _error(exc), "eager": want.tolist()}
    return {"error": None, "equal": torch.equal(got, want), "eager": want.tolist(), "graphified": got.tolist(),
            "modes": _modes(step)}


SCENARIOS = {"one_line": one_line, "ahead_of_time": ahead_of_time}  # one per process: a failed capture
# can leave DTensor's own state behind (a vocab-parallel embedding's mask buffer), which
# would then break the next eager forward of the same process.


def run(scenario: str, path: str, device: torch.device) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    weight = model.model.layers[0].self_attn.q_proj.weight
    return {"weight_type": type(weight).__name__, "local_shape": list(getattr(weight, "_local_tensor", weight).shape),
            "transformers": transformers.__version__, "outcome": SCENARIOS[scenario](model, prompt(device))}


def main() -> None:
    scenario, rank, _world, _port, path, kind = sys.argv[1:7]
    rank = int(rank)
    timeout = timedelta(seconds=120)  # torchrun's environment (env://), as a user's script joins
    if kind == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    try:
        result = run(scenario, path, device)
    except Exception as exc:  # reported, so the test can show it
        result = {"crash": _error(exc)}
    result["t_result"] = time.time()
    result["ungrouped_before_destroy"] = ungrouped_graphs()
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()  # graphify releases the one line's graphs (DTensor's all-reduces inside) first
    print("AFTER_DESTROY " + json.dumps({"ungrouped_graphs": ungrouped_graphs()}), flush=True)


if __name__ == "__main__":
    main()
