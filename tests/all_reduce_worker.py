"""One rank of the symm_mem tests that need two GPUs (started two at a time, on NCCL). `mixed`
(tests/test_all_reduce_choice.py): one reduce with one-shot, two-shot and NCCL ranges, a
message in each, all three captured in one CUDA graph and replayed on fresh inputs against
NCCL's eager sum. `fused` and `stress` (tests/test_reduce_norm.py): the fused all-reduce + add +
RMSNorm against NCCL's sum, the add and the norm, eagerly and replayed, and a chain of them
replayed back to back with the ranks out of step. `one_fails` (gloo, on the CPU): the fused
kernel fails to build on one rank only, and every rank takes the three ops. Prints one `RESULT
<json>` line."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from graphify.models import all_reduce_fn

HIDDEN = 4096
TOKENS = {"one_shot": 4, "two_shot": 64, "nccl": 256}  # 32 KiB, 512 KiB, 2 MiB of bf16


def fresh(shape, device, seed: int) -> torch.Tensor:
    """Values of magnitude 0.5 to 1.5, random sign: never zero."""
    gen = torch.Generator(device=device).manual_seed(seed)
    sign = torch.randint(0, 2, shape, generator=gen, device=device) * 2 - 1
    x = (torch.rand(shape, generator=gen, device=device) + 0.5) * sign
    return x.to(torch.bfloat16)


def captured(call):
    """(graph, its outputs) of `call()` captured in a CUDA graph after one warm-up run on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def mixed(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank)
    reduce = all_reduce_fn(kind="symm_mem", dtype=torch.bfloat16, device=device, max_bytes=1 << 21,
                           one_shot_max_bytes=64 << 10, two_shot_max_bytes=1 << 20)
    statics = {k: fresh((t, HIDDEN), device, rank) for k, t in TOKENS.items()}
    taken = {k: reduce.kind_for(x.numel() * x.element_size(), x.dtype) for k, x in statics.items()}
    graph, outs = captured(lambda: {k: reduce(x) for k, x in statics.items()})
    worst = dict.fromkeys(statics, 0.0)
    for trial in range(4):
        wants = {}
        for k, x in statics.items():
            x.copy_(fresh(tuple(x.shape), device, 1000 * trial + 10 * rank + len(k)))
            wants[k] = x.clone()
            dist.all_reduce(wants[k])
        graph.replay()
        for k, out in outs.items():
            worst[k] = max(worst[k], (out.float() - wants[k].float()).abs().max().item())
    torch.cuda.synchronize()
    return {"kind": reduce.kind, "two_shot_reason": reduce.two_shot_reason, "taken": taken, "max_err": worst,
            "torch": torch.__version__}


def fused(rank: int, world: int) -> dict:
    import torch.nn.functional as F

    from graphify.models._reduce_norm import _fits, add_norm_fn
    from graphify.models._symm_mem import _BUFFERS

    device = torch.device("cuda", rank)
    reduce = all_reduce_fn(kind="symm_mem", dtype=torch.bfloat16, device=device)
    add_norm = add_norm_fn(reduce, 1e-5, fused=True, hidden=HIDDEN, group=dist.group.WORLD)
    buf = _BUFFERS[(reduce.group_name, reduce.max_bytes, torch.bfloat16, device)]
    weight = fresh((HIDDEN,), device, 7)  # the same on every rank, as a norm's weight is

    def want(partial, residual):
        summed = partial.clone()
        dist.all_reduce(summed)
        x = residual + summed
        return x, F.rms_norm(x, (HIDDEN,), weight, 1e-5)

    def err(got, ref):  # (the new residual's, the normed rows') largest difference
        return tuple((g.float() - r.float()).abs().max().item() for g, r in zip(got, ref))

    worst, taken = {}, {}
    for rows in (1, 8, 64):
        partial, residual = fresh((rows, HIDDEN), device, 10 * rank + rows), fresh((rows, HIDDEN), device, 1000 + rows)
        taken[str(rows)] = _fits(partial, residual, weight, buf, reduce.one_shot_max_bytes)
        eager = err(add_norm(partial, residual, weight), want(partial, residual))
        graph, out = captured(lambda: add_norm(partial, residual, weight))  # noqa: B023
        worst[str(rows)] = eager
        for trial in range(3):
            partial.copy_(fresh((rows, HIDDEN), device, 100 * trial + 10 * rank + rows))
            residual.copy_(fresh((rows, HIDDEN), device, 5000 + 100 * trial + rows))
            ref = want(partial, residual)
            graph.replay()
            worst[str(rows)] = tuple(map(max, worst[str(rows)], err(out, ref)))
    torch.cuda.synchronize()
    return {"fused": add_norm.fused, "reason": add_norm.reason, "taken": taken, "max_err": worst,
            "checksum": [float(t.float().sum()) for t in out]}


def stress(rank: int, world: int) -> dict:
    """A graph of 16 layer boundaries back to back: the fused step, then torch's one-shot reduce on
    the same buffer, rank 0 held back before each fused step (the ranks out of step), replayed 20
    times with no host sync between; the last replay against the same chain through NCCL."""
    import torch.nn.functional as F

    from graphify.models._reduce_norm import add_norm_fn

    device = torch.device("cuda", rank)
    reduce = all_reduce_fn(kind="symm_mem", dtype=torch.bfloat16, device=device)
    add_norm = add_norm_fn(reduce, 1e-5, fused=True, hidden=HIDDEN, group=dist.group.WORLD)
    weight, rows = fresh((HIDDEN,), device, 7), 8
    start, partial = fresh((rows, HIDDEN), device, 11), fresh((rows, HIDDEN), device, 20 + rank) * 0.25

    def chain(boundary, all_reduce, hold=False):
        x = start
        for i in range(16):
            if hold and rank == 0:
                torch.cuda._sleep(20_000)  # ~10 µs: rank 0 arrives late at every meeting
            x, y = boundary(partial * (1 + i / 16), x)
            x = x + all_reduce(y * 0.01)
        return x

    def summed(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    def unfused(p, x):
        x = x + summed(p)
        return x, F.rms_norm(x, (HIDDEN,), weight, 1e-5)

    graph, out = captured(lambda: chain(lambda p, x: add_norm(p, x, weight), reduce, hold=True))
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    want = chain(unfused, summed)
    err = (out.float() - want.float()).abs().max().item()
    return {"fused": add_norm.fused, "reason": add_norm.reason, "max_err": err,
            "scale": want.float().abs().max().item(), "checksum": float(out.float().sum())}


def one_fails(rank: int, world: int) -> dict:
    """`add_norm_fn` where the kernel builds on rank 0 and fails on the others (as a Triton or
    driver failure on one GPU would): no rank may fuse, since rank 0 launching alone would
    wait for its peers forever; each says why, and the step is the three ops over the reduce."""
    import graphify.models._reduce_norm as reduce_norm

    def summed(x):  # stands for a symm_mem reduce: what the fused launch would serve
        out = x.clone()
        dist.all_reduce(out)
        return out

    summed.kind, summed.buffer = "symm_mem", torch.empty(1)
    reduce_norm._why_not = lambda reduce: None  # as if Triton were here
    reduce_norm._compile = lambda reduce, hidden: None if rank == 0 else "the kernel failed to build (provoked)"
    add_norm = reduce_norm.add_norm_fn(summed, 1e-6, fused=True, hidden=64, group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(rank)
    partial, residual, weight = (torch.randn(shape, generator=gen) for shape in ((3, 64), (3, 64), (64,)))
    x, y = add_norm(partial, residual, weight)
    want = residual + summed(partial)
    return {"fused": add_norm.fused, "reason": add_norm.reason, "x_equal": torch.equal(x, want),
            "y_equal": torch.equal(y, torch.nn.functional.rms_norm(want, (64,), weight, 1e-6)),
            "moved": float((want - residual).abs().max())}


def main() -> None:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cpu = scenario == "one_fails"
    if not cpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = {"mixed": mixed, "fused": fused, "stress": stress, "one_fails": one_fails}[scenario](rank, world)
    except Exception as exc:  # reported, so the test can show it
        result = {"crash": f"{type(exc).__name__}: {exc}"}
    result["t_result"] = time.time()
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
