"""The model-zoo benchmark: its models as users pick them, and its CPU smoke run end to end
(a tiny BERT on the simulation: eager and the plain line, each in a process of its own)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")


def test_the_zoo_holds_thirty_models_from_three_libraries_most_used_first():
    from benchmarks._zoo_models import MODELS, by_name

    assert len(MODELS) >= 30
    assert {m.library for m in MODELS} == {"timm", "torchvision", "transformers"}
    assert MODELS[0].name == "timm/resnet50"
    assert len({m.name for m in MODELS}) == len(MODELS)
    assert {m.kind for m in by_name(["transformers"])} >= {"encoder", "vit", "speech", "decoder"}
    with pytest.raises(ValueError, match="no zoo model"):
        by_name(["timm/not-a-model"])


def test_models_of_a_library_not_installed_are_left_out(monkeypatch):
    import importlib.util

    from benchmarks import _zoo_models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "timm" else real(name))
    assert not any(m.library == "timm" for m in _zoo_models.available())
    assert any(m.library == "transformers" for m in _zoo_models.available())


def test_the_smoke_run_measures_every_line_and_shape_equal_to_eager(tmp_path, monkeypatch):
    from benchmarks import _report, zoo

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    zoo.main(["--smoke", "--batches", "2", "--timeout", "300"])
    result = json.loads(next(tmp_path.glob("zoo-smoke-*.json")).read_text())
    assert result["failures"] == []
    rows = {(r["line"], r["length"]): r for r in result["rows"]}
    assert set(rows) == {(line, n) for line in ("eager", "graphify") for n in (8, 16)}
    for n in (8, 16):
        ours = rows["graphify", n]
        # the simulation replays the kernels eager ran; 8 tokens are padded to 16 (an encoder's
        # sequence, `graphify.base.length_padding`): the same values to rounding
        assert ours["max_err"] <= (0 if n == 16 else 1e-5)
        # on the CPU the model is fp32: its fp32 copy is eager itself, so eager's error from it is none;
        # on a GPU the model is bf16, and graphify's error from the fp32 copy is eager's own
        eagers = rows["eager", n]["max_err_exact"]
        assert eagers == 0 or torch.cuda.is_available()
        assert ours["max_err_exact"] <= eagers + (0 if n == 16 else 1e-5) + (2e-2 * eagers)
        assert ours["replayed"] > 0 and ours["ms"] > 0 and ours["vs_eager"] is not None
        assert ours["pool_mib"] is not None and ours["pool_mib"] >= 0 and rows["eager", n]["pool_mib"] is None
        assert not any("cannot capture" in w for w in ours["warnings"]), ours["warnings"]


def test_runs_of_one_model_each_merge_into_one_result(tmp_path, monkeypatch):
    """Several GPUs each run some models (a result per model); --merge joins them, with ratios
    over the joined rows, and removes the parts."""
    from benchmarks import _report, zoo

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    env = {"device": "GPU X", "gpu": True, "date": "2026-01-01"}
    for model, ms in (("a", {"eager": 4.0, "reduce_overhead": 1.0, "graphify": 0.5}), ("b", {"eager": 2.0})):
        rows = [{"model": model, "batch": 1, "length": None, "line": line, "ms": v} for line, v in ms.items()]
        _report.write(f"zoo-t-{model}", env, {"rows": rows, "failures": [f"{model} failed once"]}, "")
    result = zoo.main(["--merge", "t"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo-t-gpu-x.json", "zoo-t-gpu-x.md"]
    by = {(r["model"], r["line"]): r for r in result["rows"]}
    assert by["a", "graphify"]["vs_peer"] == 0.5 and by["a", "graphify"]["vs_eager"] == 0.125
    assert by["b", "eager"]["vs_peer"] is None
    assert result["failures"] == ["a failed once", "b failed once"]
    with pytest.raises(SystemExit, match="no results"):
        zoo.main(["--merge", "missing"])
    for device in ("GPU X", "GPU Y"):  # parts of two cards are not one run
        _report.write(f"zoo-mixed-{device[-1].lower()}", {**env, "device": device}, {"rows": [], "failures": []}, "")
    with pytest.raises(SystemExit, match="several devices"):
        zoo.main(["--merge", "mixed"])


def test_a_run_cut_short_keeps_the_lines_it_measured(tmp_path, monkeypatch):
    """The device's time runs out in the middle of a model: the lines measured so far are on
    disk, marked partial, and --merge names such parts."""
    from benchmarks import _report, zoo

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    monkeypatch.setattr(zoo, "environment", lambda: {"device": "GPU X", "gpu": True, "date": "2026-01-01"})
    done = []

    def measured(module, job, what, timeout, failures):
        if len(done) == 2:
            raise KeyboardInterrupt("the call's time is up (made to)")
        done.append(job["line"])
        return [{"model": job["model"], "batch": 1, "length": None, "line": job["line"], "ms": 1.0 + len(done)}]

    monkeypatch.setattr(zoo, "in_process", measured)
    with pytest.raises(KeyboardInterrupt):
        zoo.main(["--models", "transformers/bert-tiny", "--lines", "eager", "reduce_overhead", "graphify",
                  "--tag", "cut"])
    kept = json.loads((tmp_path / "zoo-cut-gpu-x.json").read_text())
    assert kept["partial"] and [r["line"] for r in kept["rows"]] == ["eager", "reduce_overhead"]
    assert kept["rows"][1]["vs_eager"] == 3.0 / 2.0
    merged = zoo.main(["--merge", "cut"])
    assert merged["cut_short"] == ["zoo-cut-gpu-x.json"] and len(merged["rows"]) == 2


def test_merging_again_keeps_what_the_earlier_merge_held_and_a_rerun_replaces_its_rows(tmp_path, monkeypatch):
    """A run spans calls: the merge of the first call's parts is a part of the next merge. Its
    parts and its models cut short stay named; a model run again (the lines the call's end cut
    off) replaces that model's rows and the failures of the lines it measured, its ratios come
    from the rows that stand, and a complete rerun is no longer cut short."""
    from benchmarks import _report, zoo

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    env = {"device": "GPU X", "gpu": True, "date": "2026-01-01"}

    def part(model, ms, partial=False, failures=()):
        rows = [{"model": model, "batch": 1, "length": None, "line": line, "ms": v} for line, v in ms.items()]
        _report.write(f"zoo-r-{model}", env, {"rows": rows, "failures": list(failures), **({"partial": True} if partial else {})}, "")

    part("a", {"eager": 4.0, "reduce_overhead": 2.0, "graphify": 1.0})
    part("b", {"eager": 8.0, "reduce_overhead": 4.0}, partial=True, failures=["graphify on b: timed out after 9 s"])
    first = zoo.main(["--merge", "r"])
    assert first["parts"] == ["zoo-r-a-gpu-x.json", "zoo-r-b-gpu-x.json"] and first["cut_short"] == ["zoo-r-b-gpu-x.json"]
    part("c", {"eager": 1.0, "reduce_overhead": 0.5}, partial=True)
    second = zoo.main(["--merge", "r"])
    assert second["parts"] == ["zoo-r-a-gpu-x.json", "zoo-r-b-gpu-x.json", "zoo-r-c-gpu-x.json"]
    assert second["cut_short"] == ["zoo-r-b-gpu-x.json", "zoo-r-c-gpu-x.json"]
    assert second["failures"] == ["graphify on b: timed out after 9 s"] and len(second["rows"]) == 7
    _report.write("zoo-r-d", env, {"rows": [], "failures": ["graphify on d: exit 1"]}, "")
    part("b", {"reduce_overhead": 5.0, "graphify": 2.5})  # b again, whole this time
    third = zoo.main(["--merge", "r"])
    assert third["failures"] == ["graphify on d: exit 1"]  # b's line measured since, d's not
    by = {(r["model"], r["line"]): r for r in third["rows"]}
    assert len(third["rows"]) == 8 and by["b", "reduce_overhead"]["ms"] == 5.0
    assert by["b", "graphify"]["vs_peer"] == 0.5 and by["b", "graphify"]["vs_eager"] == 2.5 / 8.0
    assert third["cut_short"] == ["zoo-r-c-gpu-x.json"] and third["parts"] == [*second["parts"], "zoo-r-d-gpu-x.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo-r-gpu-x.json", "zoo-r-gpu-x.md"]


def test_a_rerun_replaces_by_when_it_ran_not_by_its_file_name():
    from benchmarks._zoo_merge import joined

    def part(date, ms, failures=(), partial=False):
        rows = [{"model": "m", "batch": 1, "length": None, "line": line, "ms": v} for line, v in ms.items()]
        return {"environment": {"date": date}, "rows": rows, "failures": list(failures),
                **({"partial": True} if partial else {})}

    first = part("2026-01-02T10:00", {"eager": 4.0}, ["graphify_background on m: timed out"], partial=True)
    rerun = part("2026-01-02T11:00", {"eager": 4.1, "graphify_background": 1.0})
    merged = joined([("zoo-r-m-bg-x.json", rerun), ("zoo-r-m-x.json", first)])  # the rerun's name sorts first
    assert [r["ms"] for r in merged["rows"]] == [4.1, 1.0] and merged["failures"] == []
    assert merged["cut_short"] == ["zoo-r-m-x.json"] and merged["parts"] == ["zoo-r-m-x.json", "zoo-r-m-bg-x.json"]


def test_a_shape_stream_is_seeded_and_of_the_models_kind():
    from benchmarks import zoo_shapes
    from benchmarks._zoo_models import MODELS, TINY

    encoder = zoo_shapes.stream(TINY, 50)
    assert encoder == zoo_shapes.stream(TINY, 50) and encoder != zoo_shapes.stream(TINY, 50, seed=1)
    assert all(1 <= b <= 8 and 8 <= n <= 512 for b, n in encoder) and len(set(encoder)) > 20
    vision = zoo_shapes.stream(MODELS[0], 50)
    assert set(vision) <= {(b, r) for b in zoo_shapes.BATCHES for r in zoo_shapes.RESOLUTIONS}
    assert len(set(vision)) == 4


def test_the_shape_stream_smoke_run_answers_as_eager_with_graphs_bounded(tmp_path, monkeypatch):
    from benchmarks import _report, zoo_shapes

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    zoo_shapes.main(["--smoke", "--calls", "30", "--timeout", "300"])
    result = json.loads(next(tmp_path.glob("zoo-shapes-smoke-*.json")).read_text())
    assert result["failures"] == []
    rows = {r["line"]: r for r in result["rows"]}
    ours = rows["graphify"]
    assert ours["max_err"] <= 1e-5 and ours["calls"] == 30  # sequences padded: equal to rounding
    assert 0 < ours["graphs"] <= 8 * 2  # batches of 1-8 at lengths padded to 16 or 24, whatever lengths came
    assert ours["replayed"] == 30  # the third pass: every call a graph (a shape met once is captured by the second)
    assert ours["graphs_by_pass"][1] == ours["graphs_by_pass"][2]  # none captured in the third
    assert ours["graphs_by_pass"][0] <= ours["graphs_by_pass"][1]
    assert not any("cannot" in w for w in ours["warnings"]), ours["warnings"]


def test_a_cudnn_find_line_benchmarks_convolutions_only_for_its_own_calls(monkeypatch):
    """`<line>_cudnn_find` is `<line>` with cuDNN's algorithm search on; eager's reference
    outputs are still computed with the search off."""
    import torch

    from benchmarks import zoo

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model = torch.nn.Conv2d(3, 4, 3)
    with pytest.raises(ValueError, match="unknown line"):  # refused before it turns the search on
        zoo.wrapped(model, "graphify_but_faster_cudnn_find", "cpu")
    assert torch.backends.cudnn.benchmark is False
    fn = zoo.wrapped(model, "graphify_cudnn_find", "cpu")
    assert torch.backends.cudnn.benchmark is True and type(fn).__name__ != "Conv2d"
    with zoo.cudnn_defaults():
        assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cudnn.benchmark is True
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(fn(x), model(x))
    with pytest.raises(ValueError, match="unknown line"):
        zoo.wrapped(model, "eager_but_faster", "cpu")


def test_a_view_line_hands_out_the_graphs_buffers_and_the_default_a_copy():
    """`<line>_view` is `<line>` with `Options(outputs="view")`, reduce-overhead's hand-out: two
    calls' outputs share the graph's buffer; the default line's are copies of their own."""
    import torch

    from benchmarks import zoo

    model = torch.nn.Linear(8, 8)
    for line, shared in (("graphify_view", True), ("graphify", False)):
        fn = zoo.wrapped(model, line, "cpu")
        outs = [fn(torch.randn(4, 8)) for _ in range(3)]  # warm-up, capture, replay
        x = torch.randn(4, 8)
        got = fn(x)
        assert (got.data_ptr() == outs[-1].data_ptr()) is shared, line
        torch.testing.assert_close(got, model(x))
    assert "graphify_compile_view" in zoo.KNOWN_LINES and "reduce_overhead_view" not in zoo.KNOWN_LINES


def test_timing_waits_for_another_process_using_the_gpu_and_using_does_not(tmp_path, monkeypatch):
    """`benchmarks._gpu_share`: a process timing its calls holds the GPU alone; untimed use is shared."""
    import subprocess
    import sys
    import time

    from benchmarks import _gpu_share

    lock, ready = tmp_path / "gpu0.lock", tmp_path / "ready"
    monkeypatch.setenv(_gpu_share.ENV, str(lock))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, time\nfrom benchmarks import _gpu_share\n"
        f"with _gpu_share.using():\n    pathlib.Path({str(ready)!r}).touch()\n    time.sleep(1.0)\n")],
        env={**__import__("os").environ, _gpu_share.ENV: str(lock)}, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.02)
        assert ready.exists()
        t0 = time.perf_counter()
        with _gpu_share.using():  # shared with the other process: no wait
            shared = time.perf_counter() - t0
        with _gpu_share.timing():  # alone: waits for the other's use to end
            alone = time.perf_counter() - t0
        assert shared < 0.5 and alone >= 0.5
    finally:
        holder.wait(30)
    monkeypatch.delenv(_gpu_share.ENV)
    t0 = time.perf_counter()
    with _gpu_share.timing(), _gpu_share.using():  # no lock named: both do nothing
        pass
    assert time.perf_counter() - t0 < 0.1


def test_every_variant_line_names_settings_inductor_has():
    """A variant's inductor options are names in `torch._inductor.config` (a misspelt one would
    fail only on the device, after a compile's worth of time), and its compile mode is torch's."""
    import torch
    import torch._inductor.config as inductor_config

    from benchmarks import zoo

    for line, settings in zoo.VARIANTS.items():
        for name in settings.get("options", {}):
            assert hasattr(inductor_config, name), (line, name)
        if "mode" in settings:
            assert settings["mode"] in torch._inductor.list_mode_options(), (line, settings["mode"])
    assert zoo.VARIANTS["graphify_compile_channels_first"]["options"] == {"layout_optimization": False}


def test_a_background_lines_compile_holds_the_gpu_alone_while_its_worker_runs(monkeypatch):
    """The background line's worker process runs the compiled code on the GPU and inductor times
    kernel configs there: waiting for it holds the GPU alone, so neither another process's
    timed calls nor its untimed work run beside the worker's picks."""
    import contextlib

    import torch

    from benchmarks import _zoo_models, zoo

    held = {"using": 0, "alone": 0}
    waits = []

    def holding(kind):
        @contextlib.contextmanager
        def hold():
            held[kind] += 1
            try:
                yield
            finally:
                held[kind] -= 1
        return hold

    spec = _zoo_models.TINY
    model = spec.build().eval()

    class Background:
        """Its compiles settle at the third look that does not wait."""

        def __init__(self):
            self.calls, self.looks = [], 0

        def __call__(self, **x):
            self.calls.append(self.looks)
            return model(**x)

        def wait_compiles(self, timeout):
            waits.append((dict(held), timeout))
            self.looks += 1
            return timeout != 0 or self.looks >= 3

    made = []
    monkeypatch.setattr(zoo.gpu_share, "using", holding("using"))
    monkeypatch.setattr(zoo.gpu_share, "alone", holding("alone"))
    monkeypatch.setattr(zoo, "wrapped", lambda model, line, device: made.append(Background()) or made[-1])
    with torch.inference_mode():
        inputs = zoo.shape_inputs(spec, 2, 8, "cpu", torch.float32)
        row = zoo.measure(model, spec, "graphify_background", 2, 8, "cpu", inputs)
        assert waits == [({"using": 0, "alone": 1}, zoo.COMPILE_WAIT_S)]
        assert row["max_err"] == 0 and row["ms"] > 0
        # the busy line: calls go on while the worker compiles, a call after each look that found
        # the compiles running, none after the look that found them settled (but the swap's)
        waits.clear()
        row = zoo.measure(model, spec, "graphify_background_busy", 2, 8, "cpu", inputs)
    assert waits == [({"using": 0, "alone": 1}, 0)] * 3
    during = [looks for looks in made[-1].calls if 0 < looks < 3]
    assert during == [1, 2] and row["max_err"] == 0


class _Mix(__import__("torch").nn.Module):
    """A bf16 model of a linear, a batch norm and a convolution, called with keyword tensors."""

    def __init__(self):
        import torch

        super().__init__()
        self.lin, self.norm, self.conv = torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(4), torch.nn.Conv1d(4, 4, 3)

    def forward(self, x, scale):
        return {"out": self.conv(self.norm(self.lin(x))) * scale, "steps": scale.round().long()}


def test_the_exact_outputs_are_an_fp32_copys_and_the_model_is_left_as_it_was():
    """`exact_outputs`: the fp32 answer for the same bf16 weights (floating inputs in fp32,
    integer ones as given, TF32 settings put back), nearer it than bf16 eager is; the model keeps
    its dtype and values."""
    import copy

    import torch

    from benchmarks import zoo

    torch.manual_seed(0)
    model = _Mix().eval().to(torch.bfloat16)
    model.norm.running_mean.normal_()
    before = copy.deepcopy(model.state_dict())
    inputs = [{"x": torch.randn(2, 4, 32).to(torch.bfloat16), "scale": torch.rand(1).to(torch.bfloat16) * 3}
              for _ in range(2)]
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with torch.inference_mode():
        exact = zoo.exact_outputs(model, inputs)
        by_hand = copy.deepcopy(model).float()
        for got, x in zip(exact, inputs):
            assert got["out"].dtype == torch.float32
            want = by_hand(x["x"].float(), x["scale"].float())
            torch.testing.assert_close(got["out"], want["out"], rtol=0, atol=0)
            assert torch.equal(got["steps"], want["steps"])
            eager = model(**x)["out"].float()
            assert 0 < (eager - got["out"]).abs().max() < 0.1  # bf16 rounding, not another answer
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == tf32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_errors_compare_each_output_before_the_next_call_overwrites_it():
    """reduce-overhead hands out its graph's buffers, which the next replay overwrites: the
    errors are taken call by call, from eager's outputs and from the exact ones alike."""
    import torch

    from benchmarks import zoo

    buffer = torch.empty(3)

    def fn(x):  # one buffer for every call's output, as a graph's
        return buffer.copy_(x * 2)

    fresh = [{"x": torch.randn(3)} for _ in range(3)]
    want = [x["x"] * 2 for x in fresh]
    assert zoo.errors(fn, fresh, want, None) == (0.0, None)
    exact = [w + 0.25 for w in want]
    error, error_exact = zoo.errors(fn, fresh, want, exact)
    assert error == 0.0 and error_exact == pytest.approx(0.25)
    outputs = [fn(**x) for x in fresh]  # collected first, every one is the last call's
    assert max(zoo.largest_difference(o, w) for o, w in zip(outputs, want)) > 0


def _blocked(lock, kind) -> bool:
    """Whether `kind` cannot be taken on `lock` now (a new open file: it meets every other hold,
    this process's too)."""
    import fcntl

    with open(lock, "a") as f:
        try:
            fcntl.flock(f, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_alone_inside_untimed_use_waits_for_the_other_process_then_shares_again(tmp_path, monkeypatch):
    """`_gpu_share.alone()`: from inside `using()` it lets this process's share go, waits for the
    other process's use to end, holds the GPU alone, and takes the share back after."""
    import fcntl
    import subprocess
    import sys
    import time
    from pathlib import Path

    from benchmarks import _gpu_share

    lock, ready = tmp_path / "gpu0.lock", tmp_path / "ready"
    monkeypatch.setenv(_gpu_share.ENV, str(lock))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, time\nfrom benchmarks import _gpu_share\n"
        f"with _gpu_share.using():\n    pathlib.Path({str(ready)!r}).touch()\n    time.sleep(1.0)\n")],
        env={**__import__("os").environ, _gpu_share.ENV: str(lock)}, cwd=str(Path(__file__).parents[1]))
    try:
        deadline = time.time() + 30
        while not ready.exists() and time.time() < deadline:
            time.sleep(0.02)
        assert ready.exists()
        with _gpu_share.using():
            t0 = time.perf_counter()
            with _gpu_share.alone():
                waited = time.perf_counter() - t0
                assert _blocked(lock, fcntl.LOCK_SH)  # nobody else may use the GPU now
                with _gpu_share.alone(), _gpu_share.timing():  # already alone: nothing more to take
                    pass
            assert waited >= 0.5
            assert _blocked(lock, fcntl.LOCK_EX) and not _blocked(lock, fcntl.LOCK_SH)  # shared again
        assert not _blocked(lock, fcntl.LOCK_EX)
    finally:
        holder.wait(30)


def test_tune_alone_makes_the_timings_that_pick_kernels_hold_the_gpu_alone(tmp_path, monkeypatch):
    """`_gpu_share.tune_alone()`: inductor's benchmarker and graphify's convolution timing run
    alone (once wrapped however often installed); the real ones are where it looks; nothing is
    wrapped without a lock named."""
    import fcntl
    import types

    from benchmarks import _gpu_share

    lock = tmp_path / "gpu0.lock"
    seen = []

    class Benchmarker:
        def benchmark(self, fn):
            return self.benchmark_gpu(fn)

        def benchmark_gpu(self, fn):
            seen.append(_blocked(lock, fcntl.LOCK_SH))
            return fn()

    bench, conv = Benchmarker(), types.SimpleNamespace(_timed=lambda c: seen.append(_blocked(lock, fcntl.LOCK_SH)))
    _gpu_share.tune_alone(bench, conv)  # no lock named: left as they are
    assert "benchmark" not in vars(bench) and not hasattr(conv._timed, "bench_alone")
    monkeypatch.setenv(_gpu_share.ENV, str(lock))
    _gpu_share.tune_alone(bench, conv)
    _gpu_share.tune_alone(bench, conv)
    assert not hasattr(bench.benchmark_gpu.__wrapped__, "__wrapped__")  # wrapped once
    with _gpu_share.using():
        assert bench.benchmark(lambda: 1.5) == 1.5
        conv._timed(None)
        assert _blocked(lock, fcntl.LOCK_EX)  # the share taken back after each
    assert seen == [True, True]
    with pytest.raises(AttributeError, match="benchmark_gpu"):  # moved in another torch: said, not timed by chance
        _gpu_share.tune_alone(types.SimpleNamespace(benchmark=lambda fn: fn()), conv)

    from torch._inductor.runtime import benchmarking

    from graphify.compile import conv_timing

    real, before = benchmarking.benchmarker, dict(vars(benchmarking.benchmarker))
    monkeypatch.setattr(conv_timing, "_timed", conv_timing._timed)  # put back after
    other = Benchmarker()
    _gpu_share.tune_alone(other, graphify=False)  # reduce-overhead's process: graphify left alone
    assert getattr(other.benchmark_gpu, "bench_alone", False) and not hasattr(conv_timing._timed, "bench_alone")
    try:
        _gpu_share.tune_alone()
        assert all(getattr(getattr(o, n), "bench_alone", False)
                   for o, n in ((real, "benchmark"), (real, "benchmark_gpu"), (conv_timing, "_timed")))
    finally:
        for name in ("benchmark", "benchmark_gpu"):
            if name in before:
                setattr(real, name, before[name])
            else:
                vars(real).pop(name, None)
