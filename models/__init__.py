"""Reference models that use graphify: plain modules with frozen configs, called through
`torch.func.functional_call` so graphify never owns their parameters.

- `decoder`: a decode step over a contiguous KV cache (one token per request).
- `varlen`: prefill, decode and mixed batches over a paged KV cache, attention as a
  registered op with two backends (`attention`) of different CUDA-graph support.
- `tensor_parallel`: the varlen model sharded over torch.distributed ranks.
"""

from .attention import BACKENDS as ATTENTION_BACKENDS
from .attention import AttentionBackend
from .decoder import SCRATCH_ROW, Decoder, DecoderConfig, decode_step, init_params, new_kv_cache
from .tensor_parallel import (
    ALL_REDUCE_KINDS, all_reduce_fn, init_shard_params, shard_config, shard_paged_cache, shard_params, tp_varlen_step,
)
from .varlen import BatchLayout, BlockTables, VarlenDecoder, model_support, new_paged_cache, split_ops, varlen_axes, varlen_step

__all__ = [
    "ATTENTION_BACKENDS", "AttentionBackend", "BatchLayout", "BlockTables", "Decoder", "DecoderConfig", "SCRATCH_ROW",
    "VarlenDecoder", "decode_step", "init_params", "model_support", "new_kv_cache", "new_paged_cache",
    "split_ops", "varlen_axes", "varlen_step", "all_reduce_fn", "shard_config", "shard_paged_cache", "shard_params",
    "init_shard_params", "tp_varlen_step", "ALL_REDUCE_KINDS",
]
