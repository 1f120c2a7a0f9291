# Whether the compile line's symbolic sequence length is what makes it 1.05-1.08x reduce-overhead on the zoo's
# one-length decoders (llama-1b-shape B = 1 and 8, gpt2 B = 8: 1.02-1.05 in three runs), where the encoders served
# at three lengths tie. RO compiles the first shape static and only the batch dynamic after; the compile line traces
# the length symbolic from its first compile (on the CPU: placeholders (1, s81) against RO's (1, 128), and a
# trace 2-4x RO's: notes/issue74.md, Session 83). Lines: RO, the compile line, per shape (`dynamic: False`) and
# dynamo's own automatic dynamic (`dynamic: None`), each profiled (every kernel a call). About 480 s on one H200.
#   run(command="bash notes/device/next_call_static.sh", timeout_s=590)
# Then here: python3 -m benchmarks.zoo --merge static
#   python3 -m benchmarks.zoo_kernels --length 128 zoo-static transformers/llama-1b-shape 1 reduce_overhead graphify_compile
#   python3 -m benchmarks.zoo_kernels --length 128 zoo-static transformers/llama-1b-shape 1 graphify_compile_static graphify_compile
MODELS=${MODELS:-"transformers/llama-1b-shape transformers/gpt2"} TAG=static \
  ZOO_ARGS="--lines reduce_overhead graphify_compile graphify_compile_static graphify_compile_auto --profile" PER_GPU=2 \
  WORKER_S=420 BUDGET_S=${BUDGET_S:-560} MIN_LEFT=${MIN_LEFT:-100} bash benchmarks/zoo_device_run.sh
