"""A decode step's GPU time by kernel class (GEMM, attention, convolution, Triton, copy, elementwise, other):
where a token's time goes, and against which bytes its bandwidth is measured (GEMMs read the
weights, attention reads the KV cache)."""

from __future__ import annotations

import re
from collections.abc import Iterable

# (class, pattern), the first match wins: the order carries the rules (see `kernel_class`)
RULES = (
    ("gemm", r"^triton_tem_.*_(?:mm|addmm|bmm|baddbmm)(?:_|$)"),
    ("triton", r"^triton_"),
    ("attention", r"flash|fmha|sdpa|attention|attn|^_combine_kernel$"),
    ("conv", r"conv|fprop|dgrad|wgrad"),
    ("gemm", r"gemm|gemv|nvjet|xmma|splitkreduce|cutlass|cublas|^ampere_|^sm\d+_"),
    ("copy", r"memcpy|memset|copy"),
    ("elementwise", r"at::native::|at_cuda_detail::"),
)
CLASSES = ("gemm", "attention", "conv", "triton", "copy", "elementwise", "other")
_COMPILED = tuple((cls, re.compile(pattern, re.IGNORECASE)) for cls, pattern in RULES)


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel named `name` (profiler names, full or cut short), by `RULES`:

    - gemm, first: inductor's matmul templates (`triton_tem_fused_..._addmm_...`, what
      max-autotune picks over cuBLAS) are GEMMs that read the weights, though Triton's.
    - triton: inductor's other kernels (`triton_poi_`, `triton_red_`, `triton_per_`), before
      attention: inductor names a kernel after the ops it fuses, and one that only prepares an
      SDPA's inputs is called `..._scaled_dot_product_efficient_attention_...`.
    - attention, before gemm: flash (`pytorch_flash::flash_fwd_kernel`, FA3's
      `cutlass::device_kernel<flash::FlashAttnFwdSm90...>`) and memory-efficient attention
      (`fmha_cutlassF_...`, `AttentionKernel`) carry `cutlass` in their names; cuDNN's
      `cudnn_generated_fort_native_sdpa_...`; this repo's paged attention (`_attention_kernel`)
      and its split-KV `_combine_kernel`.
    - conv, before gemm: cuDNN's convolutions (`conv2d_c1_k1_nhwc`, its depthwise
      `convolve_common_engine_float_NHWC`, the implicit GEMMs `sm90_xmma_fprop_implicit_gemm_...`
      and `implicit_convolve_sgemm`), the CNNs' share of a call.
    - gemm: cuBLAS/cuBLASLt on Hopper (`nvjet_sm90_...`, `sm90_xmma_gemm_...`, the split-K
      `cublasLt::splitKreduce_kernel`), its matrix-vector kernels (`gemv2T_kernel_val`,
      `gemvx::kernel`), CUTLASS's (`cutlass_80_tensorop_...gemm`), Ampere's (`ampere_bf16_s16816gemm_...`,
      `sm80_xmma_gemm_...`).
    - copy: `Memcpy DtoD`, `Memset`, aten's copies (`direct_copy_kernel_cuda`, `index_copy`,
      `CatArrayBatchedCopy`: torch.cat).
    - elementwise: aten's other kernels (`at::native::`: elementwise, reductions, norms,
      softmax, gathers; its bundled cub's scans).
    - other: the rest (NCCL and symmetric-memory all-reduces among them).
    """
    return next((cls for cls, pattern in _COMPILED if pattern.search(name)), "other")


def fold(spans: Iterable[tuple[float, float, str]], steps: int) -> dict[str, dict[str, float]]:
    """Per class (every one of `CLASSES`): kernels per step, GPU µs per step and share of the
    GPU time, from `cuda_spans`' (start µs, end µs, name) over `steps` calls. The classes' µs
    add up to the spans' total GPU time, as `summarise` counts it (durations summed)."""
    count = dict.fromkeys(CLASSES, 0)
    us = dict.fromkeys(CLASSES, 0.0)
    for start, end, name in spans:
        cls = kernel_class(name)
        count[cls] += 1
        us[cls] += end - start
    total = sum(us.values())
    return {cls: {"kernels": count[cls] / steps, "us": us[cls] / steps, "share": us[cls] / total if total else 0.0}
            for cls in CLASSES}
