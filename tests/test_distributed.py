"""Tensor parallelism on torch.distributed (gloo, two CPU processes, simulation backend):
TP graphs equal the single-process model, capture plans and per-call graphs are agreed
across ranks, and a disagreement is an error on every rank instead of a hang. Also the
tensor-parallel benchmark's own code paths, and that its ranks all end when one fails.
On two GPUs (marked cuda) the same over NCCL and CUDA graphs."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import expected_calls
from graphify import Options

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
ROOT = Path(__file__).resolve().parent.parent
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(cpu: bool = False) -> dict:
    """This environment with NVLink multicast off (as the lent machines require), the repo
    importable, one thread per process; `cpu` hides the GPUs."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def rank_env(rank: int, port: int, cpu: bool = False) -> dict:
    """`base_env` plus one rank's variables as torchrun sets them (RANK, WORLD_SIZE, MASTER_*)."""
    return {**base_env(cpu), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def launch(commands: list[list[str]], envs: list[dict], timeout: float) -> list[dict]:
    """Start one process per rank and wait for all of them (at most `timeout` s): each one's
    returncode, stdout, stderr and when it ended. A process still running then is killed
    and the call fails: ranks must end by themselves."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for cmd, env in zip(commands, envs)]
    outs: list = [("", "")] * len(procs)
    ended = [0.0] * len(procs)

    def wait(r: int) -> None:
        try:
            outs[r] = procs[r].communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        ended[r] = time.time()

    threads = [threading.Thread(target=wait, args=(r,), daemon=True) for r in range(len(procs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    alive = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in alive:  # killed, then read: what it wrote, the stacks rank_launcher.py dumped included
        procs[r].kill()
        outs[r] = procs[r].communicate()
    assert not alive, f"rank(s) {alive} still running after {timeout} s; their stderr, last lines:\n" + "\n".join(
        f"--- rank {r}:\n{outs[r][1][-4000:]}" for r in alive)
    return [{"returncode": p.returncode, "stdout": out, "stderr": err, "ended": t}
            for p, (out, err), t in zip(procs, outs, ended)]


def run_ranks(scenario: str, timeout: float = 240, worker: str = "tp_worker.py", args: tuple = (),
              cpu: bool = False, raw: bool = False) -> list[dict]:
    """Start the ranks of `scenario` (`tests/<worker> scenario rank world port *args`, in
    torchrun's environment, through tests/rank_launcher.py so a rank still running near
    `timeout` dumps its stacks; `cpu` hides the GPUs); each rank's RESULT, plus
    `exit_after_result_s`: how long the process lived after printing it (its teardown).
    `raw`: scenarios joined by "+", each one's crash left to its test."""
    port = free_port()
    dump_after = str(max(timeout - 20, timeout / 2))  # stacks to stderr before the harness kills a rank
    commands = [[sys.executable, str(ROOT / "tests" / "rank_launcher.py"), dump_after, str(ROOT / "tests" / worker),
                 scenario, str(r), str(WORLD), str(port), *args] for r in range(WORLD)]
    results = []
    for done in launch(commands, [rank_env(r, port, cpu) for r in range(WORLD)], timeout):
        out, err = done["stdout"], done["stderr"]
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        assert line is not None, f"rank exited {done['returncode']} without a result:\n{err[-3000:]}"
        results.append(json.loads(line[len("RESULT "):]))
        results[-1]["exit_after_result_s"] = done["ended"] - results[-1].pop("t_result", done["ended"])
        results[-1]["returncode"], results[-1]["stderr_tail"] = done["returncode"], err[-2000:]
        after = next((ln for ln in out.splitlines() if ln.startswith("AFTER_DESTROY ")), None)
        if after is not None:
            results[-1]["after_destroy"] = json.loads(after[len("AFTER_DESTROY "):])
    for r in results:
        assert raw or "crash" not in r, r["crash"]
    return results


# The gloo scenarios whose ranks can go on in one process group: started once (a group's
# start-up, two processes importing torch, is most of each scenario's time on 2 cores).
TOGETHER = ("equal", "plan_mismatch", "prepare_fails_on_one_rank", "call_mismatch", "call_mismatch_host",
            "symm_fallback")


@functools.cache
def _together() -> tuple:
    return tuple(run_ranks("+".join(TOGETHER), raw=True))


def ranks_of(scenario: str) -> list[dict]:
    """Each rank's result of one of the scenarios run `TOGETHER`."""
    results = [rank[scenario] for rank in _together()]
    for r in results:
        assert "crash" not in r, r["crash"]
    return results


def ran_as_dispatched(got: dict) -> bool:
    """A rank's calls ran as vLLM would dispatch its batches (`got`: the worker's "modes",
    "seen" (tokens, uniform) per call, "resolved" mode and "largest" size): graphs, not
    eager calls, were compared."""
    want = expected_calls(got["resolved"], [tuple(b) for b in got["seen"]], got["largest"])
    return got["modes"] == {m.value: n for m, n in want.items()}


def test_tensor_parallel_graphs_equal_the_single_process_model():
    for rank in ranks_of("equal"):
        for mode in ("FULL", "FULL_AND_PIECEWISE"):
            got = rank[mode]
            assert got["max_err"] < 1e-4, (mode, got)
            assert ran_as_dispatched(got), (mode, got)
        assert rank["FULL_AND_PIECEWISE"]["modes"]["PIECEWISE"] > 0  # collectives inside pieces too
        assert rank["FULL_AND_PIECEWISE"]["modes"]["FULL"] > 0


def test_ranks_planning_different_graphs_fail_together():
    for rank in ranks_of("plan_mismatch"):
        assert rank["error"] == "CaptureError"
        assert "ranks disagree on what to capture" in rank["message"] and "same mode, sizes" in rank["message"]


def test_a_rank_whose_capture_is_rejected_early_does_not_leave_the_others_waiting():
    rank0, rank1 = ranks_of("prepare_fails_on_one_rank")
    assert rank1["error"] == "ValueError" and "axes has 6 entries" in rank1["message"]
    assert rank0["error"] == "CaptureError" and "rank 1 could not prepare its capture" in rank0["message"]


def test_ranks_choosing_different_graphs_fail_together_through_the_check_their_graphs_carry():
    # lockstep="graph" (the default): FULL graphs record one all-reduce of the graph's code
    # and compare; no host round trip per call. On the CPU a mismatch raises on every rank.
    for rank in ranks_of("call_mismatch"):
        assert rank["mismatch"] is not None and "ranks chose different graphs" in rank["mismatch"]
        assert "from FULL graph for 4 tokens, 4 requests to FULL graph for 8 tokens, 8 requests" in rank["mismatch"]
        assert rank["after_ok"]  # the collectives paired up, so the ranks carry on


def test_ranks_choosing_different_graphs_for_a_call_fail_together_and_recover_with_the_host_check():
    for rank in ranks_of("call_mismatch_host"):
        assert rank["mismatch"] is not None
        assert "rank 0: FULL graph for 4 tokens" in rank["mismatch"]  # 2 requests padded to 4
        assert "rank 1: FULL graph for 8 tokens" in rank["mismatch"]  # 5 requests padded to 8
        assert rank["after_ok"]


def test_graphs_holding_collectives_are_released_before_teardown_and_ranks_exit_promptly():
    start = time.monotonic()
    rank0, rank1 = run_ranks("exits_cleanly")
    assert time.monotonic() - start < 120  # both processes ended (run_ranks waits for them)
    assert rank0["graphs"] > 0 and rank0["released_by_hand"] == rank0["graphs"]
    assert "released" in rank0["call_after_release"]  # a released callable says so, it does not hang
    # rank 1 never released by hand: destroy_process_group (wrapped by graphify) did it
    assert rank1["graphs"] > 0 and rank1["after_destroy"]["graphs_left"] == [0]


def test_a_symm_mem_all_reduce_on_gloo_falls_back_to_the_functional_collective_with_a_logged_reason():
    for rank in ranks_of("symm_fallback"):
        assert rank["kind"] == "nccl" and "cpu, not a CUDA GPU" in rank["reason"], rank
        assert any("using NCCL's functional all-reduce instead" in m and rank["reason"] in m for m in rank["logged"])
        assert rank["reduce_diff"] == 0 and rank["reduce_vs_sum"] < 1e-5, rank
        for mode in ("FULL", "FULL_AND_PIECEWISE"):
            got = rank[mode]
            assert got["vs_nccl"] == 0 and got["max_err"] < 1e-4, (mode, got)
            assert ran_as_dispatched(got), (mode, got)


def test_the_symm_mem_reduce_decides_per_call_what_a_trace_cannot_know():
    # Concrete sizes (eager, or a graph captured for one size): the one-shot op within the
    # buffer, NCCL's functional all-reduce above it or for what the kernel cannot take.
    # Under split's symbolic trace: one registered op that decides when it runs.
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphify.models import BatchLayout, DecoderConfig, init_params, new_paged_cache, split_ops, varlen_axes, varlen_step
    from graphify.models._symm_mem import _make_reduce
    from graphify.transforms import split

    buf = torch.zeros(4096)  # a stand-in for the rendezvoused buffer: tracing runs no kernel
    reduce = _make_reduce("g", buf, buf.numel() * 4)

    def ops(x):
        gm = make_fx(reduce, tracing_mode="fake", _allow_non_fake_inputs=True)(x)
        calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return [c.split(".")[1] for c in calls if not c.startswith("aten.")]

    assert ops(torch.randn(4, 1024)) == ["one_shot_all_reduce_copy"]
    for x in (torch.randn(5, 1024), torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(0, 8)):
        assert ops(x) == ["all_reduce", "wait_tensor"], x.shape
    cfg = DecoderConfig.tiny(max_seq_len=128, heads=4, kv_heads=2, ffn=96)
    example = BatchLayout((3, 1, 5), (4, 7, 0), 16, 8).build(cfg)
    step = varlen_step(cfg, init_params(cfg, seed=0), reduce=reduce)
    fn = split(step, split_ops("unified"), *example, new_paged_cache(cfg, 80, 16, seed=1), axes=varlen_axes())
    assert {n for n in fn.op_names if "reduce" in n} == {"graphify_models::symm_mem_all_reduce"}


def test_an_unknown_all_reduce_kind_is_refused():
    from graphify.models import all_reduce_fn

    with pytest.raises(ValueError, match="'nvls' is not one of"):
        all_reduce_fn(kind="nvls")


def test_lockstep_codes_round_trip_and_name_the_choice():
    from graphify.distributed.lockstep import decode_code, describe_choice, graph_code

    for choice in [(0, 1, -1), (2, 8, 8), (1, 8192, 512), (2, 16_000_000, 16_000_000)]:
        assert decode_code(graph_code(*choice)) == choice
    assert graph_code(2, 4, 4) != graph_code(2, 4, 3) != graph_code(1, 4, 3)
    assert describe_choice(2, 8, 8) == "FULL graph for 8 tokens, 8 requests"
    assert describe_choice(0, 300, -1) == "eager for 300 tokens"


def test_an_unknown_lockstep_policy_is_refused():
    with pytest.raises(ValueError, match="lockstep"):
        Options(lockstep="sometimes")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")
def test_tensor_parallel_cuda_graphs_with_nccl_equal_the_single_gpu_model():
    for rank in run_ranks("equal_cuda"):
        for mode in ("FULL", "FULL_AND_PIECEWISE"):
            assert rank[mode]["max_err"] < 0.1, (mode, rank[mode])  # bf16 rounding, two partial sums
            assert ran_as_dispatched(rank[mode]), (mode, rank[mode])
        assert rank["FULL_AND_PIECEWISE"]["modes"]["PIECEWISE"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")
def test_symm_mem_all_reduces_captured_in_graphs_equal_the_single_gpu_model():
    # one-shot all-reduces through symmetric memory (NVLink P2P, multicast off) inside FULL
    # graphs (the symm_mem op captured per size) and FULL_AND_PIECEWISE (split's registered op)
    for rank in run_ranks("symm_mem_cuda"):
        assert rank["kinds"] == ["symm_mem", "symm_mem"], rank
        for mode in ("FULL", "FULL_AND_PIECEWISE"):
            assert rank[mode]["max_err"] < 0.1, (mode, rank[mode])  # bf16 rounding, two partial sums
            assert ran_as_dispatched(rank[mode]), (mode, rank[mode])
        assert rank["FULL_AND_PIECEWISE"]["modes"]["PIECEWISE"] > 0
        for case, err in rank["direct"].items():  # eager, against NCCL's sum of the same tensors
            assert err <= 1e-2, (case, err)
        assert rank["graph_replay"] <= 1e-2, rank["graph_replay"]  # one graph replayed on fresh inputs


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")
def test_nccl_ranks_with_live_graphs_exit_within_30_s_of_their_last_call():
    # The reported hang: TP jobs printed their results and never exited. Each rank here
    # keeps a captured FULL_AND_PIECEWISE callable (NCCL collectives inside its graphs)
    # alive into teardown; graphify releases it before destroy_process_group.
    for rank in run_ranks("exits_cleanly_cuda", timeout=180):
        assert rank["returncode"] == 0, rank["stderr_tail"]
        assert rank["exit_after_result_s"] < 30, rank
        assert rank["after_destroy"]["graphs_left"] == [0]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")
def test_nccl_ranks_replaying_different_graphs_stop_instead_of_hanging():
    # lockstep="graph": the check recorded at the start of each FULL graph trips a
    # device-side assert on both ranks; the processes end (CUDA context lost), no hang.
    start = time.monotonic()
    with pytest.raises(AssertionError, match="without a result|crash"):
        run_ranks("call_mismatch_cuda", timeout=120)
    assert time.monotonic() - start < 120


# -- benchmarks/tensor_parallel.py: its code paths on the tiny model, and how its ranks end --

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (device kind nvidia-h200-x2)")


def torchrun(*args: str, cpu: bool) -> list[str]:
    """The benchmark under torchrun (its own free rendezvous port), as the README runs it."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
            "-m", "benchmarks.tensor_parallel", "--smoke", *(("--cpu",) if cpu else ()), *args]


def test_the_tensor_parallel_benchmark_runs_under_torchrun_and_exits(tmp_path):
    # decode at TP=1 and TP=2 and the serving trace under FULL_AND_PIECEWISE (all-reduces
    # inside FULL graphs and inside PIECEWISE pieces), gloo and the simulation backend
    out = tmp_path / "tp.json"
    cmd = torchrun("--what", "all", "--batches", "1", "8", "--requests", "6", "--out", str(out), cpu=True)
    done = launch([cmd], [base_env(cpu=True)], timeout=180)[0]
    assert done["returncode"] == 0, done["stderr"][-3000:]
    result = json.loads(out.read_text())
    rows = result["decode"]["rows"]
    assert [r["batch"] for r in rows] == [1, 8]
    for r in rows:
        assert r["max_err_vs_single_gpu"] < 1e-4 and r["tp1_ms"] > 0 and r["graphify_ms"] > 0, r
        assert r.get("hand_ms") is None  # the hand-written floor is CUDA graphs only
    one, tp = result["serving"]["rows"]
    assert (one["tp"], tp["tp"]) == (1, WORLD)
    for r in (one, tp):
        assert r["max_err_vs_single_gpu"] < 1e-4 and r["tokens_per_s"] > 0, r
        assert r["steps_full_pct"] > 0 and r["steps_piecewise_pct"] > 0 and r["steps_none_pct"] == 0, r
        # every step's ms, and their sums per step kind, so a TP degree's loss can be placed
        assert len(r["step_ms"]) == len(one["step_ms"]) > 0 and min(r["step_ms"]) > 0, r
        assert abs(sum(r["ms_by_kind"].values()) - sum(r["step_ms"])) < 1e-2 * len(r["step_ms"]), r
        assert set(r["ms_by_kind"]) <= {"prefill", "mixed", "decode", "spec"} and len(r["ms_by_kind"]) >= 2, r
    assert set(result["serving"]["ratios"][next(iter(result["serving"]["ratios"]))]["ms_by_kind"]) == set(one["ms_by_kind"])


@pytest.mark.parametrize("failing", [1, 0], ids=["a-rank-fails", "the-store-host-fails"])
def test_a_failure_on_one_rank_ends_every_rank_even_one_that_would_wait_forever(failing):
    # Plain processes (no torchrun to end the others): the failing rank prints its
    # traceback and leaves; the other, stuck as on a device waiting for a collective whose
    # peer is gone, hears of it through the store (or finds the store's host gone) and leaves.
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--smoke", "--cpu", "--fail-rank", str(failing),
           "--fail-at", "stuck"]
    start = time.monotonic()
    done = launch([cmd] * WORLD, [rank_env(r, port, cpu=True) for r in range(WORLD)], timeout=90)
    assert time.monotonic() - start < 60
    assert done[failing]["returncode"] == 1 and "injected failure on rank" in done[failing]["stderr"]
    other = done[1 - failing]
    assert other["returncode"] == 1 and "stopping:" in other["stderr"], other["stderr"][-2000:]


def test_a_rank_whose_peer_left_before_the_group_formed_ends_with_the_reason():
    # the race behind "the-store-host-fails" under load: rank 0 failed and left while rank 1
    # was still joining, and rank 1's join raised a bare connection error. A lone rank 1 whose
    # store host never comes is the same case, deterministically.
    cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--smoke", "--cpu", "--timeout", "1"]
    (done,) = launch([cmd], [rank_env(1, free_port(), cpu=True)], timeout=60)
    assert done["returncode"] == 1 and "stopping: the group could not form" in done["stderr"], done["stderr"][-2000:]


@pytest.mark.cuda
@two_gpus
def test_the_tensor_parallel_benchmark_on_two_gpus_with_its_hand_written_floor(tmp_path):
    out = tmp_path / "tp.json"
    done = launch([torchrun("--batches", "1", "8", "--out", str(out), cpu=False)], [base_env()], timeout=240)[0]
    assert done["returncode"] == 0, done["stderr"][-3000:]
    rows = json.loads(out.read_text())["decode"]["rows"]
    assert [(r["batch"], r["all_reduce_label"]) for r in rows] == [(1, "nccl"), (8, "nccl"), (1, "symm_mem"),
                                                                   (8, "symm_mem")]  # both kinds by default
    for r in rows:
        assert r["max_err_vs_single_gpu"] < 0.1 and r["hand_max_err"] < 0.1, r  # bf16, partial sums over 2 GPUs
        assert r["graphify_ms"] > 0 and r["hand_ms"] > 0 and r["tp1_ms"] > 0 and r["tp_vs_tp1"] > 0, r


@pytest.mark.cuda
@two_gpus
def test_a_failure_on_one_nccl_rank_ends_the_rank_replaying_graphs_that_wait_for_it():
    # Rank 1 fails just before graphify's TP graphs are timed; rank 0 replays them: the
    # all-reduce in the graph waits on the device for a peer that is gone (no NCCL timeout
    # sees collectives inside graphs), so only the store can end rank 0.
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--smoke", "--batches", "1", "--fail-rank", "1",
           "--fail-at", "timing"]
    start = time.monotonic()
    rank0, rank1 = launch([cmd] * WORLD, [rank_env(r, port) for r in range(WORLD)], timeout=180)
    assert time.monotonic() - start < 150
    assert rank1["returncode"] == 1, rank1["stderr"][-2000:]
    assert "injected failure on rank 1 at timing" in rank1["stderr"], rank1["stderr"][-2000:]
    # ended by itself (launch fails the test otherwise): through the store ("stopping: rank 1
    # failed") or, should NCCL notice the lost peer first, through its own error handling
    assert rank0["returncode"] != 0, rank0["stderr"][-2000:]


def test_a_rank_that_does_not_end_is_killed_and_shows_where_it_was(tmp_path):
    """The harness's own contract: a rank still running at the timeout fails the test, and
    the failure carries the rank's stacks (dumped by tests/rank_launcher.py before the kill)."""
    stuck = ROOT / "tests" / "rank_launcher.py"
    script = "import time\ndef waiting_for_a_peer():\n    time.sleep(60)\nwaiting_for_a_peer()\n"
    path = tmp_path / "stuck_rank.py"
    path.write_text(script)
    with pytest.raises(AssertionError) as info:
        launch([[sys.executable, str(stuck), "1", str(path)]], [base_env(cpu=True)], timeout=4)
    message = str(info.value)
    assert "still running after 4 s" in message and "waiting_for_a_peer" in message, message


# -- a rank killed outright (SIGKILL, the OOM killer) posts nothing: the heartbeats end the others --


def _ended_after(done: list[dict], killed: int) -> dict:
    """Seconds from the killed rank's end (its pipes close as it dies) to each other rank's."""
    return {r: d["ended"] - done[killed]["ended"] for r, d in enumerate(done) if r != killed}


@pytest.mark.parametrize("killed", [1, 0], ids=["a-rank-is-killed", "the-store-host-is-killed"])
def test_a_rank_killed_mid_run_ends_every_rank_within_30_s_with_the_reason(killed):
    # Plain processes; the killed rank posts nothing. The other, stuck as on a device waiting
    # for a collective, finds its peer's heartbeat silent (or the store gone with its host).
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--smoke", "--cpu", "--batches", "1", "--fail-rank",
           str(killed), "--fail-at", "stuck", "--fail-how", "kill"]
    done = launch([cmd] * WORLD, [rank_env(r, port, cpu=True) for r in range(WORLD)], timeout=90)
    assert done[killed]["returncode"] == -9, done[killed]["stderr"][-2000:]  # SIGKILL, nothing posted
    assert f"injected kill on rank {killed} at stuck" in done[killed]["stderr"]
    other = done[1 - killed]
    assert other["returncode"] == 1, other["stderr"][-2000:]
    reason = (f"stopping: rank {killed} stopped answering for" if killed else "stopping: the store is unreachable")
    assert reason in other["stderr"], other["stderr"][-2000:]
    assert _ended_after(done, killed)[1 - killed] < 30, _ended_after(done, killed)


def test_a_rank_that_finished_is_not_taken_for_dead_by_a_slower_one(tmp_path):
    # After the last barrier ranks stop at different times. A rank that stopped beating
    # because it finished said so (`stop`); and the store's host waits for the others' word
    # before it leaves, taking the store along, so a peer still polling does not see it gone.
    script = tmp_path / "finish.py"
    script.write_text(
        "import sys, time\n"
        "import torch.distributed as dist\n"
        "from benchmarks._ranks import ExitTogether\n"
        "slow = int(sys.argv[1])\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "together = ExitTogether(rank, poll_s=0.1, dead_after_s=1.0)\n"
        "dist.barrier()\n"
        "if rank == slow:\n"
        "    time.sleep(0.5 if slow else 3.0)  # rank 1: within the host's wait; rank 0: past dead_after_s\n"
        "together.stop()\n"
        "dist.destroy_process_group()\n"
        "print('finished', flush=True)\n")
    for slow in (0, 1):
        port = free_port()
        done = launch([[sys.executable, str(script), str(slow)]] * WORLD,
                      [rank_env(r, port, cpu=True) for r in range(WORLD)], timeout=60)
        for r, d in enumerate(done):
            assert d["returncode"] == 0 and "finished" in d["stdout"], (slow, r, d["stderr"][-2000:])


@pytest.mark.cuda
@two_gpus
def test_a_nccl_rank_killed_mid_run_ends_the_rank_replaying_graphs_that_wait_for_it_within_30_s():
    # Rank 1 is killed (posts nothing) just before graphify's TP graphs are timed; rank 0
    # replays them, its all-reduce waiting on the device for the dead peer: its heartbeat
    # check ends it, or NCCL's own error handling if that notices the lost peer first.
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--smoke", "--batches", "1", "--fail-rank", "1",
           "--fail-at", "timing", "--fail-how", "kill"]
    done = launch([cmd] * WORLD, [rank_env(r, port) for r in range(WORLD)], timeout=180)
    rank0, rank1 = done
    assert rank1["returncode"] == -9, rank1["stderr"][-2000:]
    assert "injected kill on rank 1 at timing" in rank1["stderr"], rank1["stderr"][-2000:]
    assert rank0["returncode"] != 0, rank0["stderr"][-2000:]
    assert _ended_after(done, 1)[0] < 30, (_ended_after(done, 1), rank0["stderr"][-2000:])
    reasons = [ln for ln in rank0["stderr"].splitlines()
               if "stopping: rank 1 stopped answering" in ln or ("NCCL" in ln and ("rror" in ln or "abort" in ln))]
    assert reasons, rank0["stderr"][-3000:]
    print(f"rank 0 ended {_ended_after(done, 1)[0]:.1f} s after rank 1 was killed: {reasons[0]}")


TEARDOWN_SCRIPT = """
import json, os, torch, torch.distributed as dist
from graphify import graphify
from graphify.distributed.lockstep import ungrouped_graphs
dist.init_process_group("gloo")
w = torch.randn(8, 8)
f = lambda x: (x @ w).relu()  # noqa: E731
g, x = graphify(f), torch.randn(4, 8)
for _ in range(3):
    g(x)
held = ungrouped_graphs()
dist.destroy_process_group()
after = ungrouped_graphs()
same = [torch.equal(g(x), f(x)) for _ in range(3)]  # no group now: captured anew, never an error
print(json.dumps({"held": held, "after": after, "same": same,
                  "modes": {r.mode.value: r.calls for r in g.stats.by_mode()}}))
"""


def test_first_use_graphs_captured_under_a_process_group_go_with_its_teardown_and_calls_capture_anew(tmp_path):
    # without group= graphify cannot know whether the graphs launch the group's collectives
    # (DTensor's all-reduces under transformers' tp_plan do): on NCCL a teardown under such
    # a graph never returns, so they are released, and first use captures the next calls anew
    script = tmp_path / "teardown.py"
    script.write_text(TEARDOWN_SCRIPT)
    (done,) = launch([[sys.executable, str(script)]], [rank_env(0, free_port(), cpu=True) | {"WORLD_SIZE": "1"}],
                     timeout=120)
    assert done["returncode"] == 0, done["stderr"][-3000:]
    got = json.loads(done["stdout"].strip().splitlines()[-1])
    assert got["held"] > 0 and got["after"] == 0, got
    assert got["same"] == [True, True, True], got
    # 1 warm-up + 2 replays before the teardown; after it 1 warm-up eagerly, then captured and replayed
    assert got["modes"] == {"NONE": 2, "PIECEWISE": 0, "FULL": 4}, got
