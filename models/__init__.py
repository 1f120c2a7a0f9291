"""Reference models that use graphify: plain modules with frozen configs, called through
`torch.func.functional_call` so graphify never owns their parameters."""

from .decoder import SCRATCH_ROW, Decoder, DecoderConfig, decode_step, init_params, new_kv_cache

__all__ = ["SCRATCH_ROW", "Decoder", "DecoderConfig", "decode_step", "init_params", "new_kv_cache"]
