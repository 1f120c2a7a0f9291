"""The transformers benchmarks run end to end (CPU: tiny config, simulation)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")


@pytest.mark.parametrize("shape", ["tiny-gemma3", "tiny-qwen", "tiny-moe"])
def test_hf_generate_runs_every_measure_equal_to_eager(tmp_path, monkeypatch, shape):
    """Every measure of the benchmark, a restarted process's and the chat-like workload's
    included. The Gemma 3 shape's window (8 here) is crossed by the generation, the MoE
    shape routes to 2 of 4 experts: each equals eager's logits and replays its decode steps."""
    from benchmarks import _report, hf_generate

    if shape != "tiny-gemma3" and not torch.cuda.is_available():  # the CPU suite's time: one shape there
        pytest.skip("on the CPU the hybrid-cache shape stands for all (tests/test_hf_zoo.py runs every family)")
    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    hf_generate.main(["--models", shape, "--batches", "2", "--configs", "eager", "graphify",
                      "--restart-configs", "graphify", "--chat-configs", "graphify", "--new-tokens", "12",
                      "--prompt-len", "5", "--reps", "3" if torch.cuda.is_available() else "1"])  # a GPU's steady: a median
    written = list(tmp_path.glob("hf-generate-*.json"))
    assert len(written) == 1
    result = json.loads(written[0].read_text())
    assert not result["failures"]
    rows = {r["key"]: r for r in result["rows"] if "chat_total_s" not in r and r["process"] == 1}
    restarted = [r for r in result["rows"] if "chat_total_s" not in r and r["process"] == 2]
    chat = [r for r in result["rows"] if "chat_total_s" in r]
    assert set(rows) == {"eager", "graphify"}
    assert [r["key"] for r in restarted] == ["graphify"] and restarted[0]["first_generate_s"] > 0  # a 2nd process
    assert [r["key"] for r in chat] == ["graphify"] and chat[0]["chat_total_s"] > 0
    assert chat[0]["chat_calls"] == len(hf_generate.chat_calls(0, torch.cuda.is_available()))
    assert rows["graphify"]["max_logit_diff"] < 1e-4  # the simulation runs the same kernels
    # the exact logits line up with the decode steps (a step off, they differ by whole logits)
    bound = 1e-4 if not torch.cuda.is_available() else 0.5  # fp32 here; bf16's rounding on a GPU
    assert rows["eager"]["max_logit_diff_fp32"] < bound and rows["graphify"]["max_logit_diff_fp32"] < bound
    assert restarted[0]["max_logit_diff_fp32"] < bound
    assert 0 <= rows["graphify"]["rms_logit_diff_fp32"] <= rows["graphify"]["max_logit_diff_fp32"]
    assert rows["graphify"]["replayed_share"] > 0.5  # decode steps replayed, prefills eager
    assert rows["graphify"]["first_generate_s"] > 0 and rows["graphify"]["steady_ms_per_token"] > 0
    # time to the first token, beside eager's of the same batch
    assert rows["graphify"]["ttft_vs_eager"] == rows["graphify"]["ttft_ms"] / rows["eager"]["ttft_ms"] > 0
    assert "ttft_vs_eager" not in rows["eager"] or rows["eager"]["ttft_vs_eager"] == 1.0
    # and beside eager's in this process, called in turn
    line = rows["graphify"]
    assert line["ttft_vs_eager_in_turn"] == line["ttft_in_turn_ms"] / line["ttft_eager_in_turn_ms"] > 0
    assert "ttft_in_turn_ms" not in rows["eager"]


def test_steady_ms_per_token_is_the_median_pair_not_a_difference_of_medians(monkeypatch):
    """A host that slows down (every call from the fifth on takes twice as long a token) and
    one stalled call: each pair is timed at one speed, so the median pair is a speed's own
    cost; a mean would take the stall, and medians taken apart would mix the speeds."""
    import types

    from benchmarks import hf_generate

    clock = [0.0]
    calls = []

    def call(n):
        slow = 2.0 if len(calls) >= 4 else 1.0
        stall = 5.0 if len(calls) == 1 else 0.0
        calls.append(n)
        clock[0] += n * 1e-3 * slow + stall  # 1 ms a token, then 2

    monkeypatch.setattr(hf_generate, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(hf_generate, "sync", lambda: None)
    steady = hf_generate.steady_ms_per_token(call, 64, 192, 5)
    assert calls == [192, 64] * 5  # back to back, the longer first
    assert steady == pytest.approx(2.0)  # three of five pairs at the slower speed: its per-token cost
    assert hf_generate.steady_ms_per_token(call, 64, 192, 1) == pytest.approx(2.0)  # one pair, no stall


def test_hf_step_split_clocks_each_decode_step(tmp_path, monkeypatch):
    """The split of a decode step (CPU: the simulated replay is the launch): every part is
    clocked and fits inside the step's period; the peer is refused where it makes no graphs.
    The background line's compile succeeds under the clocks (a failed one raises in the
    benchmark: its rows would time eager kernels as compiled ones)."""
    from benchmarks import _report, hf_step_split

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    if torch.cuda.is_available():
        argv = ["--models", "tiny-qwen", "--batches", "2", "--configs", "graphify", "graphify_background", "hf_compile",
                "--new-tokens", "12", "--reps", "3"]
    else:
        argv = ["--configs", "graphify", "graphify_background"]
        with pytest.raises(SystemExit):
            hf_step_split.main(["--configs", "graphify", "hf_compile"])
    hf_step_split.main(argv)
    (written,) = tmp_path.glob("hf-step-split-*.json")
    result = json.loads(written.read_text())
    assert not result["failures"]
    assert {"graphify", "graphify_background"} <= {row["key"] for row in result["rows"]}
    for row in result["rows"]:
        assert len(row["calls"]) == (3 if torch.cuda.is_available() else 2)
        assert 0 < row["pre_launch_us"] and 0 < row["post_us"] and 0 < row["prepare_us"] < row["between_us"]
        assert row["pre_launch_us"] + row["between_us"] < row["period_us"]  # the launch itself is the rest
        # a steady generate() moves nothing graphify watches: no call pays the full comparison
        # (transformers' own compile has no watch to count: None)
        expected = 0.0 if row["key"].startswith("graphify") else None
        assert [call["full_checks_per_call"] for call in row["calls"]] == [expected] * len(row["calls"])
        if torch.cuda.is_available():
            assert 0 < row["gpu_graph_us"] < row["period_us"]


def test_hf_accuracy_compares_every_line_with_eager_and_the_exact_logits(tmp_path, monkeypatch):
    """Each line's logits over several prompts and steps against eager's and against fp32
    arithmetic over eager's tokens. On the CPU (fp32, simulation) the one line is eager and
    both are the exact logits to rounding; a step off, they differ by whole logits."""
    from benchmarks import _report, hf_accuracy

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    gpu = torch.cuda.is_available()
    argv = ["--models", "tiny-qwen", "--batches", "2", "--prompts", "2", "--steps", "6", "--prompt-len", "8"]
    configs = ["eager", "graphify_background", "graphify_unfolded"] if gpu else ["eager", "graphify"]
    if not gpu:  # the peer makes no graphs here: refused, not measured as something it is not
        with pytest.raises(SystemExit):
            hf_accuracy.main(argv + ["--configs", "eager", "hf_compile"])
    files = ["--files", str(tmp_path / "logits")]
    hf_accuracy.main(argv + files + ["--configs", *configs[:1]])  # a run cut after eager ...
    (written,) = tmp_path.glob("hf-accuracy-*.json")
    assert [r["key"] for r in json.loads(written.read_text())["rows"]] == ["eager"]  # ... reported what it had
    ran, run_process = [], hf_accuracy.run_process
    monkeypatch.setattr(hf_accuracy, "run_process", lambda cmd, *a: ran.append(cmd[cmd.index("--worker") + 1])
                        or run_process(cmd, *a))
    hf_accuracy.main(argv + files + ["--configs", *configs])
    assert ran == configs[1:]  # ... and goes on where it stopped: eager's logits are kept, not made again
    result = json.loads(written.read_text())
    assert not result["failures"]
    rows = {r["key"]: r for r in result["rows"]}
    assert set(rows) == set(configs)
    bound = 0.5 if gpu else 1e-4  # bf16's rounding on a GPU
    for key in configs:
        assert 0 < rows[key]["compared"] <= 1 and rows[key]["max_vs_fp32"] < bound
        assert rows[key]["rms_vs_fp32"] <= rows[key]["max_vs_fp32"]
    if not gpu:
        assert rows["graphify"]["compared"] == 1 and rows["graphify"]["max_vs_eager"] < 1e-5


@given(st.lists(st.booleans(), min_size=1, max_size=12), st.integers(1, 6))
def test_steps_are_compared_only_while_the_tokens_so_far_agree(same, length):
    """A step is compared while every generated token up to its input equals eager's; from the
    first that differs on, never again (its context differs), even where later tokens agree."""
    from benchmarks.hf_accuracy import agreeing_steps

    steps = len(same)
    ref = torch.randint(0, 50, (1, length + steps + 1))
    seq = ref.clone()
    for j, s in enumerate(same):
        if not s:
            seq[0, length + j] = ref[0, length + j] + 1
    expected = [all(same[:j + 1]) for j in range(steps)]
    assert agreeing_steps(seq, ref, length, steps)[0].tolist() == expected


def test_every_line_is_compared_over_the_same_steps(tmp_path):
    """A line whose tokens leave eager's early is not measured on fewer steps than another:
    every row covers the steps where all lines still agree with eager."""
    from benchmarks.hf_accuracy import compare

    length, steps, vocab = 3, 4, 5
    seq = torch.randint(0, vocab, (1, length + steps + 1))
    logits = torch.randn(1, steps, vocab)
    torch.save({"seq": seq, "logits": logits, "exact": logits + 0.01}, tmp_path / "m-1-0-eager.pt")
    early, late = seq.clone(), seq.clone()
    early[0, length + 2] += 1  # decode step 3 (0-based 2) reads it: from there on its context differs
    late[0, length + 3] += 1  # from decode step 4 on
    offsets = torch.tensor([1.0, 2.0, 4.0, 8.0]).view(1, steps, 1)
    torch.save({"seq": early, "logits": logits + offsets}, tmp_path / "m-1-0-graphify.pt")
    torch.save({"seq": late, "logits": logits + offsets / 2}, tmp_path / "m-1-0-hf_compile.pt")
    rows = {r["key"]: r for r in compare(tmp_path, "m", 1, ["eager", "graphify", "hf_compile"], 1, steps, length)}
    assert all(r["compared"] == 2 / steps for r in rows.values())  # decode steps 1 and 2 only, for every line
    assert rows["graphify"]["max_vs_eager"] == pytest.approx(2.0) and rows["hf_compile"]["max_vs_eager"] == pytest.approx(1.0)
    assert rows["graphify"]["rms_vs_eager"] == pytest.approx((2.5) ** 0.5)
    assert rows["eager"]["max_vs_fp32"] == pytest.approx(0.01, abs=1e-6)  # float32: x + 0.01 - x rounds


@pytest.mark.parametrize("tied", [True, False])
def test_a_decode_steps_floor_counts_each_weight_once_and_the_kv_it_reads(tied):
    """The weight-read floor's bytes: every weight once (the input embedding only where it is
    the LM head too), and the keys and values up to each sequence's mean length."""
    transformers = pytest.importorskip("transformers")
    from benchmarks.hf_generate import decode_read_bytes

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    everything = sum(p.numel() for p in model.parameters()) * 2  # bf16; a tied embedding is one parameter
    embedding = 96 * 32 * 2
    kv_a_token = 2 * 3 * 2 * (32 // 4) * 2  # keys and values, 3 layers, 2 KV heads of 8, bf16
    weights = everything if tied else everything - embedding
    assert decode_read_bytes(model, batch=4, prompt_len=10, new=6) == weights + kv_a_token * 4 * (10 + 3)
    assert decode_read_bytes(model, batch=1, prompt_len=10, new=6) < decode_read_bytes(model, batch=2, prompt_len=10, new=6)


def test_a_tokens_gpu_share_is_the_long_call_less_the_one_token_call(monkeypatch):
    """Per new token: kernels, GPU ms and idle of a `new`-token call less a 1-token call's, and
    with the bytes a step reads, the GB/s achieved and the GPU time over the floor."""
    import benchmarks._report as report
    from benchmarks.hf_generate import gpu_per_token

    def spans(count, us, gap):  # `count` kernels of `us` µs back to back, one `gap` of idle µs among them
        return [(i * us + (gap if i else 0), (i + 1) * us + (gap if i else 0), "k") for i in range(count)]

    profiles = {"long": spans(1000, 21.0, 500.0), "one": spans(100, 10.0, 100.0)}  # 21 / 1 GPU ms
    profiled = []
    monkeypatch.setattr(report, "cuda_spans", lambda call, steps: profiled.append(call()) or profiles[profiled[-1]])
    got = gpu_per_token(lambda: "long", lambda: "one", new=11, read_bytes=4e9, peak=4e12)
    assert profiled == ["long", "one"]  # one profile of each call, the classes' split taken from the same spans
    assert sum(got["class_us_per_token"].values()) == pytest.approx(got["gpu_ms_per_token"] * 1e3)
    assert got["kernels_per_token"] == 90 and got["gpu_ms_per_token"] == 2.0 and got["gpu_idle_us_per_token"] == 40
    assert got["achieved_gb_s"] == pytest.approx(2000) and got["floor_ms_per_token"] == pytest.approx(1.0)
    assert got["gpu_vs_floor"] == pytest.approx(2.0)
    assert (got["ttft_kernels"], got["ttft_gpu_ms"], got["ttft_gpu_idle_ms"]) == (100.0, 1.0, 0.1)  # the prefill's own
    assert "achieved_gb_s" not in gpu_per_token(lambda: "long", lambda: "one", new=11)


def test_a_mixture_of_experts_floor_counts_the_experts_its_tokens_reach_and_windows_cap_the_kv():
    """Expert weights in the share of experts `batch` tokens reach under even routing; a
    sliding-window layer's keys and values up to its window."""
    transformers = pytest.importorskip("transformers")
    from benchmarks.hf_generate import decode_read_bytes

    moe = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False))
    sizes = {n: p.numel() * p.element_size() for n, p in moe.named_parameters()}
    expert = sum(v for n, v in sizes.items() if ".experts." in n)
    rest = sum(sizes.values()) - expert - sizes["model.embed_tokens.weight"]
    kv = 2 * 2 * 1 * 8 * 4  # keys and values, 2 layers, one KV head of 8, fp32
    for batch in (1, 3):
        reached = 1 - (1 - 2 / 4) ** batch
        assert decode_read_bytes(moe, batch, 10, 4) == int(rest + expert * reached + kv * batch * 12)
    window = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=2))
    weights = decode_read_bytes(window, 1, 0, 0)
    assert decode_read_bytes(window, 1, 100, 0) - weights == 2 * 1 * 8 * 4 * (100 + 100 + 4 + 4)  # 2 full, 2 windowed


def test_the_inductor_trials_are_the_background_line_with_one_setting():
    from benchmarks import hf_generate

    seen = {}
    for name in hf_generate.TRIALS:
        model = hf_generate.build("tiny-qwen", "cpu")
        hf_generate.one_line(name, model)
        seen[name] = model.forward._first_use.spec.options.compile
    assert seen["graphify_background_pdl"] == {"background": True, "options": {"triton.enable_pdl": True}}
    assert seen["graphify_background_autotune"] == {"background": True, "mode": "max-autotune-no-cudagraphs"}
    assert seen["graphify_background_gemv"] == {"background": True, "gemv": True}


def test_the_chat_loops_swap_call_is_set_against_its_neighbours_own_slowdowns():
    from benchmarks.hf_generate import chat_slowdowns

    first, again = [4.0, 1.2, 3.0, 1.1, 0.9], [1.0, 1.0, 1.0, 1.0, 0.5]
    out = chat_slowdowns(first, again, swap_call=2)
    assert out["chat_slowdown"] == [4.0, 1.2, 3.0, 1.1, 1.8]
    assert out["chat_max_slowdown_after_first"] == 3.0  # the first call (captures, the job) left out
    assert out["chat_swap_slowdown"] == 3.0 and out["chat_swap_vs_neighbours"] == 3.0 / 1.2
    assert out["chat_max_vs_neighbours"] == 3.0 / 1.2  # every call after the first against its neighbours
    assert chat_slowdowns([4.0, 1.0, 1.0, 2.0], [1.0] * 4, None)["chat_max_vs_neighbours"] == 2.0  # the last: one
    assert chat_slowdowns(first, again, swap_call=4)["chat_swap_vs_neighbours"] == 1.8 / 1.1  # one neighbour
    assert "chat_swap_vs_neighbours" not in chat_slowdowns(first, again, swap_call=None)


def test_the_first_token_is_timed_in_turn_with_eager_and_the_line_is_put_back(monkeypatch):
    """The line's 1-token calls and eager's alternate (a drifting host slows both alike), eager's
    run the model's own forward, and the line's forward is back after, even when a call fails."""
    import types

    from benchmarks import hf_generate

    def own(*a, **k):
        return None

    graphed = types.SimpleNamespace(fn=own)
    model = types.SimpleNamespace(forward=graphed)
    seen, clock = [], [0.0]

    def fake_generate(m, name, ids, new, **kw):
        seen.append((name, m.forward is own))
        clock[0] += 2.0 if name == "eager" else 3.0
        if len(seen) == 4 and fail:
            raise RuntimeError("a call that fails")

    monkeypatch.setattr(hf_generate, "generate", fake_generate)
    monkeypatch.setattr(hf_generate, "sync", lambda: None)
    monkeypatch.setattr(hf_generate.time, "perf_counter", lambda: clock[0])
    fail = False
    out = hf_generate.ttft_beside_eager(model, "graphify", None, 3)
    assert seen == [("graphify", False), ("eager", True), ("eager", True), ("graphify", False)] + [
        ("graphify", False), ("eager", True)]  # each goes first in turn
    assert (out["ttft_in_turn_ms"], out["ttft_eager_in_turn_ms"]) == (3000.0, 2000.0) and out["ttft_vs_eager_in_turn"] == 1.5
    assert model.forward is graphed
    fail, seen[:] = True, []
    with pytest.raises(RuntimeError):
        hf_generate.ttft_beside_eager(model, "graphify", None, 3)
    assert model.forward is graphed


def test_logits_are_compared_only_while_the_tokens_are_eagers():
    from benchmarks.hf_generate import max_where, same_prefix

    prompt = torch.tensor([[5, 6], [5, 6]])
    ref = torch.cat([prompt, torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])], 1)
    got = torch.cat([prompt, torch.tensor([[1, 2, 9, 4], [1, 2, 3, 4]])], 1)  # row 0 parts at its third token
    keep = same_prefix(got, ref, prompt_len=2, steps=4)
    assert keep.tolist() == [[True, True, False, False], [True, True, True, True]]
    diff = torch.zeros(2, 4, 3)
    diff[0, 2, 1] = 7.0  # after the parting: not counted
    diff[1, 3, 0] = -0.25
    assert max_where(diff, keep) == 0.25
    assert max_where(diff, torch.zeros_like(keep)) != max_where(diff, torch.zeros_like(keep))  # NaN: nothing compared


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a line's tokens on the GPU beside eager's from a file")
def test_the_tokens_compared_may_sit_on_different_devices():
    from benchmarks.hf_generate import same_prefix

    ref = torch.tensor([[5, 1, 2, 3]])
    keep = same_prefix(ref.cuda(), ref, prompt_len=1, steps=3)
    assert keep.tolist() == [[True, True, True]] and keep.device.type == "cpu"
    assert same_prefix(ref, torch.tensor([[5, 1, 9, 3]]).cuda(), prompt_len=1, steps=3).tolist() == [[True, False, False]]
