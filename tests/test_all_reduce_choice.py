"""The per-message choice of all-reduce (`models._symm_mem.choose`: one-shot, two-shot or NCCL)
and the crossover benchmark that measures where each wins (`benchmarks.all_reduce_crossover`).

Properties of the pure choice: its defaults are the rule before two-shot (one-shot whenever
the buffer takes the message, NCCL otherwise), it never goes back to a smaller kind as a
message grows, and what the kernels cannot take goes to NCCL. The benchmark's summary and
suggestion on made-up timings; its run over two gloo ranks (the correctness pass). On two
GPUs (marked cuda): one-shot and two-shot equal NCCL's sum inside CUDA graphs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks._crossover import messages, render, suggest, summarise
from benchmarks._crossover_run import tolerance
from graphify.models import all_reduce_fn
from graphify.models._symm_mem import DEFAULT_MAX_BYTES, KINDS, _make_reduce, choose, thresholds, two_shot_reason

from test_distributed import WORLD, base_env, launch, run_ranks

KERNEL_DTYPES = (torch.bfloat16, torch.float32)
DTYPES = st.sampled_from((*KERNEL_DTYPES, torch.float16, torch.float64, torch.int32, torch.int8))
BYTES = st.integers(min_value=0, max_value=4 * DEFAULT_MAX_BYTES)


def old_rule(n: int, dtype: torch.dtype, buf: torch.Tensor) -> str:
    """The choice before two-shot, as models/_symm_mem.py's `_one_shot` wrote it (in elements)."""
    size = torch.empty((), dtype=dtype).element_size()
    return "nccl" if n == 0 or dtype != buf.dtype or n > buf.numel() or (n * size) % 4 else "one_shot"


def measured_rule(nbytes: int, world: int, max_bytes: int) -> str:
    """The defaults as the crossover measured them (a message the buffer takes): one-shot up to 1 MiB
    on two GPUs and 512 KiB on four or more, two-shot above it up to the buffer."""
    return "one_shot" if nbytes <= min({2: 1 << 20}.get(world, 512 << 10), max_bytes) else "two_shot"


@given(n=st.integers(min_value=0, max_value=1 << 23), dtype=DTYPES, buf_dtype=st.sampled_from(KERNEL_DTYPES),
       max_bytes=st.one_of(st.just(DEFAULT_MAX_BYTES), st.integers(min_value=0, max_value=1 << 24)),
       world=st.sampled_from((2, 4, 8)))
def test_the_defaults_are_the_measured_crossover_and_without_two_shot_the_rule_before_it(
        n, dtype, buf_dtype, max_bytes, world):
    buf = torch.empty(max_bytes // torch.empty((), dtype=buf_dtype).element_size(), dtype=buf_dtype, device="meta")
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    before = old_rule(n, dtype, buf)
    chosen = _make_reduce("g", buf, max_bytes, world=world).kind_for(nbytes, dtype)
    assert chosen == (before if before == "nccl" else measured_rule(nbytes, world, max_bytes))
    # where two-shot cannot run, the rule before it: one-shot up to the buffer
    assert _make_reduce("g", buf, max_bytes, world=world, two_shot_reason="no op").kind_for(nbytes, dtype) == before
    one, two = thresholds(max_bytes, world=world)
    assert (one, two) == (min({2: 1 << 20}.get(world, 512 << 10), max_bytes), max_bytes)


@given(a=BYTES, b=BYTES, dtype=st.sampled_from(KERNEL_DTYPES), one=BYTES, two=BYTES, max_bytes=BYTES)
def test_the_choice_never_goes_back_to_a_smaller_kind_as_messages_grow(a, b, dtype, one, two, max_bytes):
    a, b = sorted((a - a % 4, b - b % 4))
    if a == 0:
        return
    first, second = choose(a, dtype, one, two, max_bytes), choose(b, dtype, one, two, max_bytes)
    assert KINDS.index(first) <= KINDS.index(second), (a, first, b, second)


@given(nbytes=BYTES, dtype=DTYPES, one=BYTES, two=BYTES, max_bytes=BYTES)
def test_each_kind_keeps_to_its_range_and_what_the_kernels_cannot_take_goes_to_nccl(nbytes, dtype, one, two, max_bytes):
    kind = choose(nbytes, dtype, one, two, max_bytes)
    if dtype not in KERNEL_DTYPES or nbytes % 4 or nbytes == 0 or nbytes > max_bytes:
        assert kind == "nccl"
    elif kind == "one_shot":
        assert nbytes <= one
    elif kind == "two_shot":
        assert one < nbytes <= two
    else:
        assert nbytes > max(one, two)
    assert choose(nbytes, dtype, one, two, max_bytes, buffer_dtype=torch.float16) == "nccl"  # not the buffer's dtype


def test_bad_thresholds_are_refused_for_every_kind():
    for bad in ({"one_shot_max_bytes": -1}, {"two_shot_max_bytes": -4}, {"two_shot_max_bytes": 1.5}):
        with pytest.raises(ValueError, match="non-negative int"):
            all_reduce_fn(kind="nccl", **bad)


def test_without_two_shot_its_range_goes_to_one_shot():
    buf = torch.empty(1 << 20, device="meta")  # 4 MiB of float32
    reduce = _make_reduce("g", buf, 4 << 20, 1 << 10, 1 << 20, two_shot_reason="no op here")
    assert [reduce.kind_for(n, torch.float32) for n in (1 << 10, 1 << 19, 1 << 20, 2 << 20)] == [
        "one_shot", "one_shot", "one_shot", "nccl"]
    assert (reduce.one_shot_max_bytes, reduce.two_shot_max_bytes, reduce.two_shot_reason) == (1 << 20, 0, "no op here")


def test_this_torch_has_the_two_shot_op():
    assert two_shot_reason() is None, two_shot_reason()  # torch 2.13's CPU build registers its schema too


def test_a_traced_reduce_records_each_kinds_op():
    # Concrete sizes under a fake trace: one-shot's op, the registered op for two-shot (torch
    # registers no fake kernel for it; the op chooses again when it runs), NCCL's above both.
    from torch.fx.experimental.proxy_tensor import make_fx

    buf = torch.zeros(1 << 14)  # 64 KiB of float32, a stand-in: tracing runs no kernel
    reduce = _make_reduce("g", buf, buf.numel() * 4, one_shot_max=4096, two_shot_max=32768)

    def ops(x):
        gm = make_fx(reduce, tracing_mode="fake", _allow_non_fake_inputs=True)(x)
        calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return [c.split(".")[1] for c in calls if not c.startswith("aten.")]

    assert ops(torch.randn(4, 256)) == ["one_shot_all_reduce_copy"]  # 4 KiB
    assert ops(torch.randn(8, 1024)) == ["symm_mem_all_reduce"]  # 32 KiB
    assert ops(torch.randn(9, 1024)) == ["all_reduce", "wait_tensor"]  # 36 KiB


# -- the benchmark's pure parts --------------------------------------------------------------

def cells_of(times: dict, ok=lambda kind, tokens: True) -> list[dict]:
    """Cells of made-up timings: {tokens: (one-shot µs, two-shot µs, NCCL µs)} at hidden 4096."""
    out = []
    for msg in messages(sorted(times), [4096], torch.bfloat16):
        for kind, us in zip(("one_shot", "two_shot", "nccl"), times[msg["tokens"]]):
            out.append({**msg, "kind": kind, "us": us, "max_err": 0.0 if us is not None else None,
                        "ok": ok(kind, msg["tokens"]) if us is not None else None, "note": None})
    return out


TIMES = {1: (7.0, 9.0, 20.0), 16: (8.0, 9.5, 21.0), 64: (12.0, 11.0, 25.0), 256: (30.0, 20.0, 28.0),
         1024: (90.0, 60.0, 50.0)}


def test_each_size_names_its_fastest_kind_and_every_kinds_ratio_to_it():
    rows = summarise(cells_of(TIMES), torch.bfloat16, 2)
    assert [r["fastest"] for r in rows] == ["one_shot", "one_shot", "two_shot", "two_shot", "nccl"]
    assert [r["bytes"] for r in rows] == [t * 4096 * 2 for t in sorted(TIMES)]
    top = rows[-1]
    assert (top["one_shot_ratio"], top["two_shot_ratio"], top["nccl_ratio"]) == (1.8, 1.2, 1.0)
    # the defaults on two GPUs: one-shot up to 1 MiB (64 tokens of 4096 bf16 is 512 KiB), two-shot to the 8 MiB buffer
    assert [r["today"] for r in rows] == ["one_shot", "one_shot", "one_shot", "two_shot", "two_shot"]
    assert [r["today"] for r in summarise(cells_of(TIMES), torch.bfloat16, 4)] == [
        "one_shot", "one_shot", "one_shot", "two_shot", "two_shot"]
    # a kind whose sum was wrong is never the fastest, and its row says so
    wrong = summarise(cells_of(TIMES, ok=lambda kind, t: kind != "one_shot"), torch.bfloat16, 2)
    assert wrong[0]["fastest"] == "two_shot" and not wrong[0]["ok"]


def test_the_suggestion_is_the_monotone_split_that_loses_least():
    rows = summarise(cells_of(TIMES), torch.bfloat16, 2)
    s = suggest(rows, torch.bfloat16, 2)
    assert (s["one_shot_max_bytes"], s["two_shot_max_bytes"]) == (16 * 8192, 256 * 8192)
    assert s["cost"] == pytest.approx(len(rows)) and s["today_cost"] > s["cost"]
    assert s["max_bytes"] == DEFAULT_MAX_BYTES
    # one-shot fastest everywhere: one-shot throughout, no two-shot
    same = suggest(summarise(cells_of({t: (1.0, 2.0, 3.0) for t in TIMES}), torch.bfloat16, 2), torch.bfloat16, 2)
    assert (same["one_shot_max_bytes"], same["two_shot_max_bytes"]) == (1024 * 8192, 0)
    # two-shot never ran: never suggested
    none = suggest(summarise(cells_of({t: (v[0], None, v[2]) for t, v in TIMES.items()}), torch.bfloat16, 2),
                   torch.bfloat16, 2)
    assert none["two_shot_max_bytes"] == 0 and math.isfinite(none["cost"])


def test_the_markdown_has_the_table_the_missing_kinds_and_the_suggestion():
    rows = summarise(cells_of(TIMES), torch.bfloat16, 2)
    result = {"gpu": True, "dtype": "torch.bfloat16", "world": 2, "how": "graphs", "reps": 5, "reduces": 4,
              "checks": 1, "multicast_env": {"NCCL_NVLS_ENABLE": "0"}, "rows": rows,
              "unavailable": {"two_shot": "no op"}, "suggestion": suggest(rows, torch.bfloat16, 2)}
    text = render(result)
    assert "| hidden | tokens | KiB | one-shot µs | two-shot µs | NCCL µs | fastest |" in text
    assert "two_shot: not measured (no op)" in text
    assert "one_shot_max_bytes=131072, two_shot_max_bytes=2097152" in text


def test_the_tolerance_allows_a_few_roundings_and_no_more():
    assert tolerance(torch.bfloat16, 2) == pytest.approx(2 * 2**-6)  # sums below 3: units of 2^-6
    assert tolerance(torch.bfloat16, 4) < 0.5  # a rank summed twice or left out is off by 0.5 or more
    assert tolerance(torch.float32, 8) < 1e-4


# -- the benchmark under torchrun ------------------------------------------------------------

def crossover(*args: str, cpu: bool) -> list[str]:
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            "-m", "benchmarks.all_reduce_crossover", "--smoke", *(("--cpu",) if cpu else ()), *args]


def test_the_crossover_benchmark_checks_its_sums_over_two_gloo_ranks(tmp_path):
    out = tmp_path / "crossover.json"
    done = launch([crossover("--tokens", "1", "8", "64", "--out", str(out), cpu=True)], [base_env(cpu=True)],
                  timeout=180)[0]
    assert done["returncode"] == 0, done["stderr"][-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == WORLD and not result["gpu"] and result["multicast_env"]["NCCL_NVLS_ENABLE"] == "0"
    assert set(result["unavailable"]) == {"one_shot", "two_shot"}  # symmetric memory needs GPUs
    assert [r["tokens"] for r in result["rows"]] == [1, 8, 64]
    for r in result["rows"]:
        assert r["ok"] and r["nccl_us"] > 0 and r["fastest"] == "nccl" and r["max_err"] <= 1e-5, r
    assert "suggested crossover (tp2)" in done["stdout"]


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")


@pytest.mark.cuda
@two_gpus
def test_one_shot_and_two_shot_equal_nccls_sum_inside_cuda_graphs(tmp_path):
    out = tmp_path / "crossover.json"
    done = launch([crossover("--tokens", "1", "64", "1024", "--out", str(out), cpu=False)], [base_env()],
                  timeout=240)[0]
    assert done["returncode"] == 0, done["stderr"][-3000:]
    result = json.loads(out.read_text())
    assert result["gpu"] and result["unavailable"] == {}, result["unavailable"]
    for c in result["cells"]:
        assert c["ok"] and c["us"] > 0 and c["max_err"] <= tolerance(torch.bfloat16, WORLD), c
    print(result["suggestion"])


@pytest.mark.cuda
@two_gpus
def test_one_reduce_with_all_three_ranges_in_one_graph_equals_nccls_sum():
    for rank in run_ranks("mixed", worker="all_reduce_worker.py", timeout=180):
        assert "crash" not in rank, rank["crash"]
        assert rank["kind"] == "symm_mem" and rank["two_shot_reason"] is None, rank
        assert rank["taken"] == {"one_shot": "one_shot", "two_shot": "two_shot", "nccl": "nccl"}, rank
        for kind, err in rank["max_err"].items():
            assert err <= tolerance(torch.bfloat16, WORLD), (kind, err)
