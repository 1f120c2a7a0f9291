"""A decode token's GPU time by kernel class (benchmarks/_kernel_classes, and its use in
benchmarks/hf_generate.classes_per_token)."""

from __future__ import annotations

import glob
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks._kernel_classes import CLASSES, fold, kernel_class
from benchmarks._report import summarise

# names from the H100 decode profiles under benchmarks/results (cut to 70-80 characters there)
PROFILED = [
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_bias_TNT", "gemm"),
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __n", "gemm"),
    ("triton_tem_fused__fused_rms_norm_addmm_t_1", "gemm"),  # inductor's matmul template
    ("triton_tem_fused__fused_rms_norm_clamp_index_mm_sub_t_7", "gemm"),
    ("triton_tem_fused_addmm_mul_silu_split_t_4", "gemm"),
    ("triton_red_fused__fused_rms_norm_add_0", "triton"),
    ("triton_per_fused__fused_rms_norm_index_0", "triton"),
    ("triton_poi_fused_mul_silu_split_1", "triton"),
    ("triton_poi_fused_add_cat_mul_slice_split_with_sizes_sub_view_2", "triton"),
    ("_attention_kernel", "attention"),  # models/_triton_attention.py's
    ("_combine_kernel", "attention"),  # its split-KV combine
    ("conv2d_c1_k1_nhwc", "conv"),  # cuDNN's, from the zoo's EfficientNet-B3 profile (H200)
    ("void convolve_common_engine_float_NHWC<__nv_bfloat16, __nv_bfloat16, 128, 5, 5, 3, 3, 3, t", "conv"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "conv"),
    ("triton_poi_fused_convolution_mean_silu", "triton"),  # inductor's epilogue, named after the convolution it follows
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("memcpy32_post", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<at::nativ", "copy"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c1", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<long, at::native::fu", "elementwise"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat", "elementwise"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<a", "elementwise"),
    ("void at_cuda_detail::cub::detail::scan::DeviceScanKernel<at_cuda_detail::cub::de", "elementwise"),
    ("void at::native::_assert_async_cuda_kernel<bool>(bool const*, at::native::Msg)", "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_u64_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "other"),
    ("void (anonymous namespace)::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(c10", "other"),
]
# the libraries' H100 names for what those profiles did not run (cuDNN/flash/mem-efficient
# attention, cuBLAS's older GEMMs and GEMVs, aten's copies)
LIBRARIES = [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, false, true>(Flash_fwd_params)",
     "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...> > >(...)", "attention"),
    ("triton_poi_fused__scaled_dot_product_efficient_attention_0", "triton"),  # an SDPA's inputs, fused
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "gemm"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false, true, "
     "true, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const> > >(...)", "gemm"),
    ("void gemvx::kernel<int, int, __nv_bfloat16, __nv_bfloat16, float, float, false, true, true, false, 7, false>(...)",
     "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", "gemm"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda"
     "(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(c10::BFloat16)#1}> >(int, ...)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float, c10::BFloat16>(...)",
     "elementwise"),
]


@pytest.mark.parametrize(("name", "cls"), PROFILED + LIBRARIES)
def test_a_kernel_name_falls_in_its_class(name, cls):
    assert kernel_class(name) == cls


def profiled_names() -> set[str]:
    """Every kernel name of the top-kernel lists in benchmarks/results/*.json."""
    names = set()

    def walk(o):
        if isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            if len(o) == 3 and isinstance(o[0], str) and isinstance(o[1], (int, float)):
                names.add(o[0])
            for v in o:
                walk(v)

    for path in glob.glob("benchmarks/results/*.json"):
        with open(path) as f:
            walk(json.load(f))
    return names


def test_only_collectives_among_the_results_kernels_fall_to_other():
    """Every kernel the recorded profiles name has a class but the all-reduces."""
    names = profiled_names()
    unclassed = {n for n in names if kernel_class(n) == "other"}
    assert unclassed == {n for n in names if re.search(r"nccl|all_reduce", n)}
    assert any(kernel_class(n) == "gemm" for n in names) or not names


# durations of 0 or of a nanosecond and more: a profiler's µs never hold a subnormal float (5e-324 µs
# summed to a positive class share but to 0 ms in the total, the / 1e3 underflowing)
DURATIONS = st.one_of(st.just(0.0), st.floats(1e-3, 100))
SPANS = st.lists(st.tuples(st.floats(0, 1e4), DURATIONS, st.sampled_from([n for n, _ in PROFILED + LIBRARIES])),
                 max_size=40).map(lambda raw: [(s, s + d, n) for s, d, n in raw])


@given(SPANS, st.integers(1, 5))
def test_the_classes_add_up_to_the_total(spans, steps):
    got = fold(spans, steps)
    assert set(got) == set(CLASSES)
    count, gpu_ms, _, _ = summarise(spans, steps)
    assert sum(c["kernels"] for c in got.values()) == pytest.approx(count)
    assert sum(c["us"] for c in got.values()) == pytest.approx(gpu_ms * 1e3)
    for cls in CLASSES:
        assert got[cls]["us"] == pytest.approx(sum(e - s for s, e, n in spans if kernel_class(n) == cls) / steps)
    shares = sum(c["share"] for c in got.values())
    assert shares == pytest.approx(1.0 if gpu_ms > 0 else 0.0)


def test_a_tokens_classes_are_the_long_call_less_the_one_token_call():
    """Per new token and class: kernels and µs of a `new`-token call's profiler spans less a
    1-token call's; their sum is the token's GPU µs; GEMMs' GB/s over the weights, attention's
    over the KV."""
    from benchmarks.hf_generate import classes_per_token

    gemm, attn, norm = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "_attention_kernel", "triton_red_fused__fused_rms_norm_0"
    one = [(0, 30, gemm), (30, 40, attn), (40, 45, norm)]
    # 10 more tokens: 10 GEMMs of 20 µs, 10 attentions of 5 µs, 20 norms of 1 µs
    extra = [(100 + 30 * i, 120 + 30 * i, gemm) for i in range(10)] + [(400 + 5 * i, 405 + 5 * i, attn) for i in range(10)]
    extra += [(500 + i, 501 + i, norm) for i in range(20)]
    spans = {"long": one + extra, "one": one}
    got = classes_per_token(spans["long"], spans["one"], new=11, weight_bytes=4e6, kv_bytes=1e6)
    assert got["class_kernels_per_token"] == {"gemm": 1, "attention": 1, "conv": 0, "triton": 2, "copy": 0, "elementwise": 0, "other": 0}
    assert got["class_us_per_token"] == {"gemm": 20, "attention": 5, "conv": 0, "triton": 2, "copy": 0, "elementwise": 0, "other": 0}
    _, long_ms, _, _ = summarise(spans["long"], 1)
    _, one_ms, _, _ = summarise(spans["one"], 1)
    assert sum(got["class_us_per_token"].values()) == pytest.approx((long_ms - one_ms) * 1e3 / 10)  # the token's GPU µs
    assert got["class_share"]["gemm"] == pytest.approx(20 / 27)
    assert (got["gemm_us_per_token"], got["attention_us_per_token"]) == (20, 5)
    assert got["gemm_gb_s"] == pytest.approx(200) and got["attention_gb_s"] == pytest.approx(200)  # 4 MB in 20 µs
    bare = classes_per_token(spans["long"], spans["one"], new=11)  # no bytes: µs alone
    assert "gemm_gb_s" not in bare and "attention_gb_s" not in bare
    # no attention past the prefill's: no attention GB/s
    assert "attention_gb_s" not in classes_per_token(one + extra[:10], one, new=11, weight_bytes=4e6, kv_bytes=1e6)


def test_a_steps_bytes_split_into_weights_and_kv():
    pytest.importorskip("transformers")
    from benchmarks.hf_generate import build, decode_read_bytes, decode_read_parts

    model = build("tiny-qwen", "cpu")
    weights, kv = decode_read_parts(model, 3, 8, 4)
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is not embedding  # untied: a step reads 3 rows of the embedding
    assert weights == sum(p.numel() * p.element_size() for p in model.parameters()) - embedding.numel() * 4
    assert kv == 2 * 2 * 16 * 4 * 3 * 2 * (8 + 2)  # keys and values, 2 KV heads of 16, fp32, B = 3, 2 layers
    assert decode_read_bytes(model, 3, 8, 4) == int(weights + kv)


def test_the_table_shows_a_dash_where_a_cpu_row_has_no_classes():
    """On the CPU no profile runs: the class fields are absent and the table shows '-'."""
    from benchmarks._report import table
    from benchmarks.hf_generate import COLUMNS

    md = table([{"model": "tiny-qwen", "batch": 1}], COLUMNS)
    head, _, row = md.splitlines()
    cells = dict(zip(head.strip("|").split(" | "), row.strip("|").split(" | ")))
    assert cells["GEMM µs/token"].strip() == cells["GEMM GB/s"].strip() == cells["attention µs/token"].strip() == "-"
