# What a compile nobody waits for buys: the background line compiling each captured shape static in the worker
# (`graphify_background_static`: {"background": True, "dynamic": False}) beside RO, the compile line (first shape
# static, then dynamic) and today's background line (dynamic), on the zoo's decoders at one length and an encoder at
# three. The static compile's kernels beat the symbolic length's on the H200 (Llama-1B shape B = 1: rotary kernel
# 54.8 against 106.8 us; B = 8: Triton kernels 909 us a call against RO's batch-dynamic 1022). About 520 s, one H200.
#   run(command="bash notes/device/next_call_bgstatic.sh", timeout_s=590)
# Profiled: each row also records the autotuner's picks (`benchmarks._kernel_configs`), which zoo_kernels shows
# beside the kernels that differ (llama B = 8: RO's SiLU-mul kernel 185 us against graphify's 264-272 in zoo-static).
# Then here: python3 -m benchmarks.zoo --merge bgstatic; python3 -m benchmarks.zoo_claims run3 bgstatic;
#   python3 -m benchmarks.zoo_kernels --length 128 zoo-bgstatic transformers/llama-1b-shape 8 reduce_overhead graphify_compile
MODELS=${MODELS:-"transformers/llama-1b-shape transformers/gpt2 transformers/bert-base"} TAG=bgstatic \
  ZOO_ARGS="--lines reduce_overhead graphify_compile graphify_background graphify_background_static --profile" PER_GPU=2 \
  WORKER_S=480 BUDGET_S=${BUDGET_S:-560} MIN_LEFT=${MIN_LEFT:-100} bash benchmarks/zoo_device_run.sh
