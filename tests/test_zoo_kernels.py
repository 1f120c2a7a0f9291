"""The zoo's kernel-by-kernel comparison of two profiled lines (`benchmarks.zoo_kernels`), and
the profile a zoo row keeps (`benchmarks.zoo.profiled`): every kernel, not only the costliest."""

import json
import os

import pytest
import torch

from benchmarks import zoo, zoo_kernels


def test_only_inductors_running_number_is_folded():
    assert zoo_kernels.kind("triton_poi_fused_add_mul_12") == "triton_poi_fused_add_mul"
    assert zoo_kernels.kind("triton_red_fused_mean_3") == "triton_red_fused_mean"
    for kept in ("nvjet_sm90_tst_64x8_64x16_2x4_h_bz_TNT", "void at::native::elementwise_kernel<128, 4>",
                 "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize64", "triton_poi_fused_add_mul"):
        assert zoo_kernels.kind(kept) == kept


def _rows():
    ro = [("triton_poi_fused_add_1", 2, 10.0), ("triton_poi_fused_add_2", 1, 4.0), ("sm90_xmma_fprop_nhwc", 3, 60.0)]
    ours = [("triton_poi_fused_add_7", 3, 15.0), ("sm90_xmma_fprop_nhwc", 3, 61.0),
            ("triton_red_fused_mean_0", 1, 9.0), ("void at::native::direct_copy_kernel_cuda", 1, 2.0)]
    line = lambda name, every: {"model": "m", "batch": 1, "line": name, "every_kernel": every}  # noqa: E731
    return [line("reduce_overhead", ro), line("graphify_compile", ours), {"model": "m", "batch": 8, "line": "x"}]


def test_two_lines_kernels_line_up_by_kind_the_largest_difference_first():
    rows = _rows()
    diff = zoo_kernels.difference(rows[0]["every_kernel"], rows[1]["every_kernel"])
    assert diff[0] == ("triton_red_fused_mean", 0, 1, 0.0, 9.0)  # only one line runs it
    assert ("triton_poi_fused_add", 3, 3, 14.0, 15.0) in diff  # numbered names folded
    assert [d[0] for d in diff] == ["triton_red_fused_mean", "void at::native::direct_copy_kernel_cuda",
                                    "sm90_xmma_fprop_nhwc", "triton_poi_fused_add"]
    text = zoo_kernels.report(rows, "m", 1, "reduce_overhead", "graphify_compile")
    assert "| triton | 3 | 4 | 14.0 | 24.0 |" in text and "| copy | 0 | 1 | 0.0 | 2.0 |" in text
    assert "| conv | 3 | 3 | 60.0 | 61.0 |" in text  # cuDNN's implicit-GEMM convolution


def test_a_row_not_profiled_or_missing_is_named(tmp_path, monkeypatch):
    from benchmarks import _report

    with pytest.raises(SystemExit, match="not profiled"):
        zoo_kernels.report(_rows(), "m", 8, "x", "x")
    with pytest.raises(SystemExit, match="no row for m B = 2"):
        zoo_kernels.report(_rows(), "m", 2, "x", "x")
    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    (tmp_path / "zoo-p-gpu-x.json").write_text(json.dumps({"rows": _rows()}))
    assert "triton_red_fused_mean" in zoo_kernels.main(["zoo-p", "m", "1", "reduce_overhead", "graphify_compile"])
    with pytest.raises(SystemExit, match="no result"):
        zoo_kernels.main(["zoo-q", "m", "1", "a", "b"])


def test_a_model_measured_at_several_lengths_needs_the_length_named(tmp_path, monkeypatch):
    from benchmarks import _report

    rows = [{"model": "bert", "batch": 1, "length": n, "line": line, "every_kernel": [(f"k{n}", 1, float(n))]}
            for n in (32, 128) for line in ("a", "b")]
    with pytest.raises(SystemExit, match=r"lengths \[128, 32\]: name one"):
        zoo_kernels.report(rows, "bert", 1, "a", "b")
    assert "`k128`" in zoo_kernels.report(rows, "bert", 1, "a", "b", length=128)
    assert "`k32`" not in zoo_kernels.report(rows, "bert", 1, "a", "b", length=128)
    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    for name, d in (("zoo-p-bert-x.json", {"rows": rows[:2]}), ("zoo-p-x.json", {"rows": rows, "parts": []})):
        (tmp_path / name).write_text(json.dumps(d))
    assert "`k32`" in zoo_kernels.main(["zoo-p", "bert", "1", "a", "b", "--length", "32"])  # the merged file's rows
    (tmp_path / "zoo-p-x.json").unlink()
    (tmp_path / "zoo-p-gpt-x.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="merge them first"):
        zoo_kernels.main(["zoo-p", "bert", "1", "a", "b"])


def test_a_profiled_row_keeps_every_kernel_whole_and_the_costliest(monkeypatch):
    """Spans as torch.profiler gives them on the GPU (start µs, end µs, name), made up here."""
    names = [f"triton_poi_fused_{i}_{'x' * 500}" for i in range(14)]
    spans, t = [], 0.0
    for _ in range(zoo.PROFILED_CALLS):
        for i, name in enumerate(names):
            spans.append((t, t + 1.0 + i, name))
            t += 2.0 + i
    monkeypatch.setattr(zoo, "cuda_spans", lambda call, steps: spans)
    got = zoo.profiled(lambda: None)
    assert got["kernels"] == len(names) and len(got["top"]) == 12 and len(got["every_kernel"]) == len(names)
    assert {n for n, _, _ in got["every_kernel"]} == set(names)  # whole names: not cut to the table's width
    assert sum(us for _, _, us in got["every_kernel"]) == pytest.approx(got["gpu_ms"] * 1e3)
    gaps = len(names) * zoo.PROFILED_CALLS - 1  # 1 µs after every kernel but the last
    assert got["idle_us"] == pytest.approx(gaps / zoo.PROFILED_CALLS)
    assert got["top"][0][0] == names[-1][:70]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles CUDA kernels (the zoo's --profile runs on a GPU)")
def test_a_profiled_zoo_run_on_the_gpu_lines_up_two_lines(tmp_path, monkeypatch):
    from benchmarks import _report

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    result = zoo.main(["--models", "transformers/bert-tiny", "--lines", "reduce_overhead", "graphify", "--batches", "1",
                       "--profile", "--tag", "prof"])
    assert result["failures"] == []
    rows = {r["line"]: r for r in result["rows"] if r["length"] == result["rows"][0]["length"]}
    for r in rows.values():
        assert r["kernels"] > 0 and sum(c for _, c, _ in r["every_kernel"]) == pytest.approx(r["kernels"])
        assert all(name.startswith("triton_") and all("num_warps" in c for c in picks)
                   for name, picks in r["configs"].items())  # the picks a row's own compile made, if any
        assert "picks_error" not in r, r["picks_error"]
        assert r["configs"] or not r["picks_kept"], r.get("picks_unread")  # picks kept are read (this torch's layout)
    text = zoo_kernels.report(result["rows"], "transformers/bert-tiny", 1, "reduce_overhead", "graphify",
                              length=result["rows"][0]["length"])
    assert "| class |" in text


def test_the_autotuners_picks_are_read_from_inductors_cache_each_once(tmp_path):
    """`chosen_configs`: a kernel's pick is the `.best_config` inductor's own autotune cache saved
    for its source (wherever this torch names it), named by the kernel the source defines; a
    source without one has no pick; sources already seen are left out and the rest added."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    from benchmarks._kernel_configs import _best_config_path, chosen_configs, picks_kept, picks_unread

    class Picked:  # what Triton's autotuner hands the cache: a config's kwargs, warps and stages
        kwargs, num_warps, num_stages = {"XBLOCK": 1024}, 4, 1

    folder = tmp_path / "ab"
    folder.mkdir()
    tuned, untuned = folder / "cabc.py", folder / "cabd.py"
    tuned.write_text("import triton\n\n@triton.jit\ndef triton_poi_fused_mul_silu_3(in_ptr0, xnumel):\n    pass\n")
    untuned.write_text("def triton_red_fused_mean_0(in_ptr0):\n    pass\n")
    AutotuneCache.create({}, str(tuned), "h").save(Picked(), 1_000_000)  # as inductor saves a pick
    seen: set = set()
    assert chosen_configs(str(tmp_path), seen) == {
        "triton_poi_fused_mul_silu_3": [{"XBLOCK": 1024, "num_warps": 4, "num_stages": 1, "found_by_coordesc": False}]}
    assert chosen_configs(str(tmp_path), seen) == {} and seen == {str(tuned)}
    assert chosen_configs(str(tmp_path / "nowhere")) == {}
    assert picks_kept(str(tmp_path)) == 1 and picks_kept(str(tmp_path / "nowhere")) == 0
    assert picks_unread(str(tmp_path)) == []
    stray = folder / "elsewhere.best_config"  # a pick kept under a name this torch would not give it
    stray.write_text(json.dumps({"XBLOCK": 64, "num_warps": 2, "num_stages": 1}))
    assert picks_unread(str(tmp_path)) == [
        {"kept": "ab/elsewhere.best_config", "named": sorted(os.path.basename(_best_config_path(str(p)))
                                                             for p in (tuned, untuned))}]


def test_an_inductor_keeping_no_local_picks_is_said_not_read_as_none(tmp_path, monkeypatch):
    """Where inductor's `AutotuneCache.create` gives no local cache (switched off, or a torch
    without one), `chosen_configs` raises (a zoo row keeps the reason as `picks_error`) rather
    than report no picks."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache

    from benchmarks._kernel_configs import chosen_configs

    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "cabc.py").write_text("def triton_poi_fused_add_0(in_ptr0):\n    pass\n")
    monkeypatch.setattr(AutotuneCache, "create", staticmethod(lambda inductor_meta, filename, configs_hash: None))
    with pytest.raises(LookupError, match="no local autotune cache"):
        chosen_configs(str(tmp_path))


def test_the_report_shows_each_lines_picks_for_the_kernels_that_differ():
    rows = _rows()
    rows[0]["configs"] = {"triton_poi_fused_add_1": [{"XBLOCK": 512, "num_warps": 4, "num_stages": 1}]}
    rows[1]["configs"] = {}
    rows.append({"model": "m", "batch": 8, "line": "graphify_compile",  # an earlier shape built it
                 "configs": {"triton_poi_fused_add_7": [{"XBLOCK": 1024, "num_warps": 8, "num_stages": 1,
                                                         "found_by_coordesc": True}]}})
    text = zoo_kernels.report(rows, "m", 1, "reduce_overhead", "graphify_compile")
    assert "| `triton_poi_fused_add` | XBLOCK=512 w4 s1 | XBLOCK=1024 w8 s1 coordesc |" in text
    assert "`triton_red_fused_mean` |" not in text.split("Autotuner's picks")[1]  # neither line has a pick for it
    assert "Autotuner's picks" not in zoo_kernels.report(_rows(), "m", 1, "reduce_overhead", "graphify_compile")
