"""What graphify does about compiles around a graphified function.

transformers' `generate()` compiles the module's `__call__` around its forward
(torch.compile, reduce-overhead) whenever the cache is static. Around a graphified forward
that compile adds nothing: dynamo cannot trace into graphify's call (a graph break) and
graphify's graphs already replace its CUDA graphs. It still costs its frame and guards on
every decode step (against `generate(disable_compile=True)`: `benchmarks/results/README.md`). So `graphify(model.forward)` of a transformers model turns that
compile off for the model (`generation_config.disable_compile = True`), once, and logs it;
`Options(compile=True)` brings inductor's kernels into the graphs instead.

A library's adapters may change more about the model whose forward is graphified
(`graphify.reads.stateful_types.register_forward_adapter`: transformers' decode mask, built inside
the graphs instead of on the host, `graphify.transforms.hf`).

Also: torch's global module-registration hooks (`graphify.reads.parameter_storage`) are installed when a
function is graphified, before anything compiles it: installed later, they change a guard
of every compiled module frame and force one recompile of each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from graphify.reads.parameter_storage import install_hooks
from graphify.reads.stateful_types import adapt_forward_owner

__all__ = ["prepare_for_compilers"]

log = logging.getLogger("graphify")


def prepare_for_compilers(fn: Callable) -> None:
    """Before `fn` is graphified: hooks first, and transformers' compile of `generate()`
    turned off where `fn` is a transformers model's bound `forward`."""
    install_hooks()
    model = getattr(fn, "__self__", None)
    if model is None or getattr(fn, "__name__", None) != "forward":
        return
    adapt_forward_owner(model)
    config = getattr(model, "generation_config", None)
    if not hasattr(config, "disable_compile"):
        return
    if not config.disable_compile:
        config.disable_compile = True
        log.info(
            "graphify(%s.forward): transformers' own compile of generate() turned off for this model "
            "(generation_config.disable_compile = True); graphify's graphs replace it. For inductor's kernels "
            "in the graphs: graphify(model.forward, options=Options(compile=True))", type(model).__name__,
        )
