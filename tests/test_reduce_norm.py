"""The all-reduce, residual add and RMSNorm as one step (`models._reduce_norm`).

CPU: where the fused launch cannot run it is the three ops as written, bit for bit, with the
reason named; a step hands each layer boundary to it with the right norm; the registered op traces as
one node and, with no symmetric buffer, sums through NCCL's functional reduce (gloo here); a kernel
that fails to build on one of two gloo ranks keeps both on the three ops.
Two CUDA GPUs (marked cuda): the fused launch equals NCCL's sum + add + norm on fresh random
inputs, eagerly and replayed in a CUDA graph, at 1, 8 and 64 rows, the same on both ranks; and
16 of them chained with torch's one-shot reduce on the same buffer, one rank held back, replayed
20 times with no host sync, against the same chain through NCCL."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from graphify.models import BatchLayout, DecoderConfig, init_params, new_paged_cache, varlen_step
from graphify.models._reduce_norm import add_norm_fn

from test_all_reduce_choice import two_gpus
from test_distributed import run_ranks

EPS = 1e-6


def fresh(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) + 0.1).to(dtype)


def doubled(x):
    return 2 * x  # a stand-in reduce: two ranks with equal partials


doubled.kind = "nccl"


@pytest.mark.parametrize("fused", [False, True])
def test_where_the_fused_launch_cannot_run_it_is_the_three_ops_and_says_why(fused):
    add_norm = add_norm_fn(doubled, EPS, fused=fused)
    assert add_norm.fused is False
    assert add_norm.reason == ("the all-reduce is nccl's, not symmetric memory's" if fused else "not asked for")
    partial, residual, weight = fresh((5, 64), 1), fresh((5, 64), 2), fresh((64,), 3)
    x, y = add_norm(partial, residual, weight)
    want = residual + 2 * partial
    assert torch.equal(x, want) and torch.equal(y, F.rms_norm(want, (64,), weight, EPS))


def test_a_step_hands_each_layer_boundary_but_the_last_to_its_add_norm_with_the_next_norm():
    cfg = DecoderConfig.tiny(max_seq_len=64)
    params = init_params(cfg, seed=3)
    batch = BatchLayout((3, 1, 5), (4, 7, 0), block_size=4, max_blocks=16).build(cfg, seed=9)
    cache = new_paged_cache(cfg, 256, 4, seed=4)
    three, seen = add_norm_fn(lambda x: x, cfg.eps), []

    def recording(partial, residual, weight):
        seen.append(next(name for name, p in params.items() if p is weight))
        return three(partial, residual, weight)

    plain = varlen_step(cfg, params)(*batch, cache.clone())
    with_it = varlen_step(cfg, params, add_norm=recording)(*batch, cache.clone())
    # after attention: the layer's own post-attention norm; after the MLP: the next layer's input
    # norm (the last layer's MLP output goes to the final norm, which reads each request's last token)
    assert seen == ["layers.0.post_norm", "layers.1.input_norm", "layers.1.post_norm"]
    assert torch.equal(plain, with_it) and plain.abs().sum() > 0


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank (NCCL's functional reduce runs on it as the sum of one)."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_registered_op_traces_as_one_node_and_without_a_buffer_reduces_through_nccls_op(one_rank_group):
    from torch.fx.experimental.proxy_tensor import make_fx

    op = torch.ops.graphify_models.symm_mem_add_rms_norm
    partial, residual, weight = fresh((4, 32), 4), fresh((4, 32), 5), fresh((32,), 6)
    x, y = op(partial, residual, weight, EPS, one_rank_group.group_name, 1 << 20, 1 << 20, 1 << 20)
    assert torch.equal(x, residual + partial) and torch.equal(y, F.rms_norm(x, (32,), weight, EPS))
    gm = make_fx(lambda p, r, w: op(p, r, w, EPS, "g", 1 << 20, 1 << 20, 1 << 20), tracing_mode="fake")(
        partial, residual, weight)
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert [c for c in calls if "graphify_models" in c] == ["graphify_models.symm_mem_add_rms_norm.default"]
    # inside inductor's code (as in split(compile=True)'s pieces) it runs as written, with ops around it
    name = one_rank_group.group_name

    def boundary(p, r, w):
        x, y = op(p * 2, r, w, EPS, name, 1 << 20, 1 << 20, 1 << 20)
        return x + 1, y.relu()

    compiled = torch.compile(boundary, backend="inductor", fullgraph=True)(partial, residual, weight)
    for got, want in zip(compiled, boundary(partial, residual, weight)):
        torch.testing.assert_close(got, want)


def test_a_kernel_that_fails_to_build_on_one_rank_keeps_every_rank_on_the_three_ops():
    ranks = run_ranks("one_fails", worker="all_reduce_worker.py", timeout=120, cpu=True)
    assert [r["fused"] for r in ranks] == [False, False]
    assert ranks[0]["reason"] == "the fused all-reduce + norm cannot run on another rank"
    assert ranks[1]["reason"] == "the kernel failed to build (provoked)"
    for rank in ranks:  # the three ops over the reduce: the peers' partials summed, added, normed
        assert rank["x_equal"] and rank["y_equal"] and rank["moved"] > 0, rank


def fused_ranks(scenario: str) -> list[dict]:
    """The two ranks of a worker scenario: each fused, and both with the same rows."""
    ranks = run_ranks(scenario, worker="all_reduce_worker.py", timeout=180)
    for rank in ranks:
        assert rank["fused"] is True, rank["reason"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    return ranks


@pytest.mark.cuda
@two_gpus
def test_the_fused_launch_equals_nccls_sum_add_and_norm_eagerly_and_in_a_graph():
    for rank in fused_ranks("fused"):
        for rows, (x_err, y_err) in rank["max_err"].items():
            # two ranks: the sum of two bf16 partials rounded once, as NCCL's, then the add: equal;
            # the norm within two bf16 roundings (|values| < 8)
            assert x_err == 0 and y_err <= 0.0625, (rows, x_err, y_err)
        assert rank["taken"] == {"1": True, "8": True, "64": True}, rank["taken"]


@pytest.mark.cuda
@two_gpus
def test_fused_steps_back_to_back_with_the_ranks_out_of_step_keep_their_meetings():
    # a broken meeting (a rank reading a buffer before its peer wrote it, or writing it while the
    # peer still reads) gives errors of the values' own size; roundings give a few hundredths of it
    for rank in fused_ranks("stress"):
        assert rank["max_err"] <= 0.03 * rank["scale"], rank
