"""The tensor-parallel benchmark's pure parts: weights drawn sharded for a model too large
for one GPU, the per-GPU weight-read floor, the targets read from a run's rows, result
names. And the benchmark over four gloo ranks, TP=2 in pairs beside TP=4 (subgroups)."""

from __future__ import annotations

import json
import sys

import attrs
import pytest
import torch

from benchmarks._report import peak_bandwidth
from benchmarks._tp_decode import weight_bytes
from benchmarks._tp_report import TARGET_8B, targets
from benchmarks._tp_decode import LEVERS
from benchmarks.tensor_parallel import serving_build, serving_name
from graphify.models import Decoder, DecoderConfig, init_params, init_shard_params, shard_config, shard_params

from test_distributed import base_env, launch


def test_shards_drawn_on_each_rank_keep_replicated_weights_equal_and_shards_apart():
    cfg = DecoderConfig.tiny(heads=4, kv_heads=2, ffn=96, tp=2)
    ranks = [init_shard_params(cfg, r, seed=3) for r in range(2)]
    shapes = {n: tuple(p.shape) for n, p in Decoder(cfg).to("meta").named_parameters()}
    for name, shape in shapes.items():
        assert tuple(ranks[0][name].shape) == shape == tuple(ranks[1][name].shape), name
        same = torch.equal(ranks[0][name], ranks[1][name])
        sharded = name.rsplit(".", 1)[-1] in ("qkv_weight", "qkv_bias", "o_weight", "gate_up_weight", "down_weight")
        assert same != sharded, name  # replicated alike on every rank, shards drawn apart
    assert torch.equal(ranks[0]["rope_cos"], init_params(attrs.evolve(cfg, tp=1))["rope_cos"])
    again = init_shard_params(cfg, 1, seed=3)
    assert all(torch.equal(again[n], ranks[1][n]) for n in again)  # seeded: the same draw each time
    assert not torch.equal(init_shard_params(cfg, 1, seed=4)["layers.0.o_weight"], ranks[1]["layers.0.o_weight"])


@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_the_serving_trace_builds_what_each_lever_names(lever):
    # every pieces lever compiles the pieces: "pieces+splitkv" alone once ran the step as written
    inductor, fused = serving_build([lever])
    assert inductor == (lever != "plain")
    assert fused == (lever == "pieces+fused+splitkv")
    assert serving_build(["plain", lever]) == (inductor, fused)  # several levers: the one build has each part asked


def test_sharded_draws_keep_the_whole_models_scale():
    # a row-parallel shard's columns are a slice of the whole layer's: the same 1/sqrt(fan-in)
    whole = init_params(DecoderConfig.tiny(hidden=128, heads=8, kv_heads=4, ffn=256), seed=0)
    shard = init_shard_params(DecoderConfig.tiny(hidden=128, heads=8, kv_heads=4, ffn=256, tp=4), 2, seed=0)
    for name in ("layers.0.o_weight", "layers.0.down_weight", "layers.0.qkv_weight"):
        assert shard[name].std().item() == pytest.approx(whole[name].std().item(), rel=0.15), name


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        init_shard_params(DecoderConfig.tiny(tp=2), 2)


def test_the_70b_shape_splits_over_four_and_eight_gpus_at_its_weight_size():
    cfg = DecoderConfig.llama3_70b()
    for tp in (4, 8):
        shard_config(cfg, tp)
    whole = weight_bytes(cfg)
    assert 138e9 < whole < 143e9  # ~70.6B bf16 parameters (its LM head tied to the embedding)
    embed = cfg.vocab_size * cfg.hidden * 2
    assert weight_bytes(shard_config(cfg, 4)) == pytest.approx((whole - embed) / 4 + embed, rel=1e-3)


def test_weight_bytes_count_every_weight_of_one_rank():
    cfg = DecoderConfig.tiny(hidden=64, heads=4, kv_heads=2, ffn=96)
    full = init_params(cfg)
    want = sum(t.numel() * t.element_size() for n, t in full.items() if not n.startswith("rope_"))
    assert weight_bytes(cfg) == want
    tcfg = shard_config(cfg, 2)
    rank0 = shard_params(tcfg, full, 0)
    assert weight_bytes(tcfg) == sum(t.numel() * t.element_size() for n, t in rank0.items() if not n.startswith("rope_"))
    assert peak_bandwidth(torch.device("cpu")) is None


def test_a_vocab_parallel_head_reads_its_rows_of_the_lm_head_alone():
    cfg = shard_config(DecoderConfig.llama3_8b(), 2)
    embed = cfg.vocab_size * cfg.hidden * 2
    assert weight_bytes(cfg) - weight_bytes(cfg, vocab_parallel=True) == embed // 2


def test_an_unknown_lm_head_is_refused():
    from graphify.models import tp_varlen_step

    with pytest.raises(ValueError, match="lm_head 'rows' is not one of"):
        tp_varlen_step(DecoderConfig.tiny(tp=2), init_params(DecoderConfig.tiny()), 0, lm_head="rows")


def _row(tp, batch, lever, ratio, model="llama-3-8b-shape", kind="symm_mem", hand=1.01, floor=None):
    return {"model": model, "tp": tp, "batch": batch, "lever": lever, "all_reduce_label": kind, "tp_vs_tp1": ratio,
            "tp_vs_tp1_plain": ratio, "graphify_vs_hand": hand, "vs_weight_floor": floor}


def test_targets_take_the_best_lever_per_batch_and_need_both_batches():
    rows = [_row(2, 1, "plain", 0.81), _row(2, 1, "pieces", 0.58), _row(2, 8, "plain", 0.83),
            _row(2, 8, "pieces", 0.62, hand=1.07)]
    t = targets(rows)
    assert t["8b_tp2"][1]["at"] == "pieces symm_mem"
    assert t["8b_tp2"][1]["tp_vs_tp1"] == 0.58 and t["8b_tp2"][8]["tp_vs_tp1"] == 0.62
    assert t["8b_tp2_met"] is False  # B=8 misses 0.6
    assert t["graphify_vs_hand_met"] is False and t["graphify_vs_hand_worst"] == 1.07
    assert t["8b_tp4_met"] is None and t["70b_tp4_b1_met"] is None  # not measured
    rows[-1]["tp_vs_tp1"] = 0.59
    assert targets(rows)["8b_tp2_met"] is True
    assert targets(rows[:2])["8b_tp2_met"] is None  # B=8 not measured: no verdict
    big = [_row(4, 1, "pieces", None, model="llama-3-70b-shape", floor=1.8), _row(4, 1, "plain", None,
                                                                                   model="llama-3-70b-shape", floor=2.6)]
    t = targets(big)
    assert t["70b_tp4_b1_met"] is True and t["70b_tp4_b1_vs_floor"] == 1.8 and t["70b_tp4_b1_at"] == "pieces symm_mem"
    assert TARGET_8B == {2: 0.6, 4: 0.4}


def test_serving_results_are_named_for_the_serving_table():
    assert serving_name("tensor-parallel") == "tensor-parallel-serving"
    assert serving_name("tensor-parallel-x4-again") == "tensor-parallel-serving-x4-again"
    assert serving_name("mine") == "mine-serving"


def test_the_benchmark_on_four_ranks_runs_tp2_in_pairs_beside_tp4(tmp_path):
    # four gloo processes: TP=2 in two subgroups at once (rank 0's reported), TP=4 over all,
    # TP=1 each its own, three levers; every rank ends by itself. The fused all-reduce + norm
    # cannot run on gloo: its rows say why and run the three ops, equal to the single model.
    out = tmp_path / "tp4.json"
    levers = ("plain", "pieces+vocab", "pieces+fused+splitkv")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
           "benchmarks.tensor_parallel", "--smoke", "--cpu", "--tp", "1", "2", "4", "--lever", *levers,
           "--batches", "1", "8", "--out", str(out)]
    done = launch([cmd], [base_env(cpu=True)], timeout=240)[0]
    assert done["returncode"] == 0, done["stderr"][-3000:]
    result = json.loads(out.read_text())["decode"]
    got = [(r["tp"], r["lever"], r["batch"]) for r in result["rows"]]
    assert got == [(tp, lever, b) for tp in (2, 4) for lever in levers for b in (1, 8)]
    for r in result["rows"]:  # the vocab-parallel head's gathered logits too
        assert r["max_err_vs_single_gpu"] < 1e-4 and r["graphify_ms"] > 0 and r["tp1_ms"] > 0, r
        if "+fused" in r["lever"]:
            assert r["fused_norm"] is False and "not symmetric memory's" in r["fused_norm_reason"], r
    assert [(r["lever"], r["batch"]) for r in result["tp1_rows"]] == [
        (lever, b) for lever in ("plain", "pieces", "pieces+splitkv") for b in (1, 8)]


def test_a_profile_sums_kernels_per_step_and_ranks_them_by_time():
    from benchmarks._report import summarise

    # two steps: a GEMM (10 µs) and an all-reduce (4 µs) each, 1 µs apart
    spans = [(0.0, 10.0, "gemm"), (11.0, 15.0, "one_shot_all_reduce"), (16.0, 26.0, "gemm"),
             (27.0, 31.0, "one_shot_all_reduce")]
    count, gpu_ms, idle_us, top = summarise(spans, 2, top=1, width=3)
    assert (count, gpu_ms, idle_us) == (2.0, 0.014, 1.5) and top == [("gem", 1.0, 10.0)]


def test_a_tp_degree_that_does_not_divide_the_ranks_is_refused_on_every_rank():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "benchmarks.tensor_parallel", "--smoke", "--cpu", "--tp", "3"]
    done = launch([cmd], [base_env(cpu=True)], timeout=120)[0]
    assert done["returncode"] != 0
    assert "--tp [3]: each TP degree must divide the world size 2" in done["stderr"], done["stderr"][-2000:]


def test_a_crossover_other_than_the_default_is_named_in_the_rows_and_reaches_the_reduce():
    """`--one-shot-max-bytes/--two-shot-max-bytes` (the crossover `benchmarks.all_reduce_crossover`
    suggests) go to the symm_mem reduce of every TP step, and label its rows apart from the
    default's, so the two are never aggregated; a fallback to NCCL keeps its plain label."""
    from benchmarks._tp_decode import all_reduce_label
    from benchmarks.tensor_parallel import crossover, parse
    from graphify.models import tp_varlen_step

    assert parse([]).crossover is None and crossover(None, None) is None
    no_two_shot = parse(["--two-shot-max-bytes", "0"]).crossover  # the rule before two-shot
    assert no_two_shot == {"one_shot_max_bytes": None, "two_shot_max_bytes": 0}
    assert all_reduce_label("symm_mem", "symm_mem", no_two_shot) == "symm_mem (one-shot ≤ default, two-shot ≤ 0 KiB)"
    chosen = parse(["--one-shot-max-bytes", str(512 << 10), "--two-shot-max-bytes", str(8 << 20)]).crossover
    assert chosen == {"one_shot_max_bytes": 512 << 10, "two_shot_max_bytes": 8 << 20}
    assert all_reduce_label("symm_mem", "symm_mem", None) == "symm_mem"
    assert all_reduce_label("symm_mem", "symm_mem", chosen) == "symm_mem (one-shot ≤ 512 KiB, two-shot ≤ 8192 KiB)"
    assert all_reduce_label("symm_mem", "nccl", chosen) == "symm_mem→nccl"
    with pytest.raises(ValueError, match="one_shot_max_bytes must be a non-negative int"):
        crossover(-1, 0)
    with pytest.raises(ValueError, match="two_shot_max_bytes must be a non-negative int"):  # forwarded to the reduce
        tp_varlen_step(DecoderConfig.tiny(tp=2), init_params(DecoderConfig.tiny()), 0, all_reduce="symm_mem",
                       crossover={"one_shot_max_bytes": None, "two_shot_max_bytes": -5})
