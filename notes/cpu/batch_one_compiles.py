"""Compiles of the compile line when batch 1 comes first (a 2-layer GPT-2 on the CPU), with
backed_size_oblivious on (argv[1] == "1") or off: whether the size-1 specialisation can be kept
out of the first dynamic compile. Run with TORCH_LOGS=recompiles and an empty TORCHINDUCTOR_CACHE_DIR."""
import sys, time, torch, transformers
import torch.fx.experimental._config as fxc
from torch._dynamo.utils import counters
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)
model = transformers.GPT2Model(cfg).eval()
from graphify import graphify, Options
obl = sys.argv[1] == "1"
with fxc.patch(backed_size_oblivious=obl):
  fn = graphify(model, options=Options(backend="sim", compile=True))
  with torch.inference_mode():
    for b in (1, 8, 3):
        ids = torch.randint(0, 1000, (b, 128))
        t = time.perf_counter()
        for _ in range(3):
            out = fn(input_ids=ids)
        want = model(input_ids=ids)
        err = (out.last_hidden_state - want.last_hidden_state).abs().max().item()
        print("oblivious" if obl else "default", "B", b, "s", round(time.perf_counter() - t, 2), "graphs", counters["stats"]["unique_graphs"], "frames", dict(counters["frames"]), "err", err, flush=True)
