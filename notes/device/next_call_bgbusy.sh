# The background line as a service runs it: calls going on while the worker compiles and tunes (the zoo's
# `graphify_background_busy`), beside the line whose caller waits idle (`graphify_background`) and RO, on the two
# one-length decoders, profiled with the picks. If the busy line's kernels are slower (its worker's picks made
# beside the caller's replays), the worker's tuning needs its own remedy. About 500 s on one H200.
#   run(command="bash notes/device/next_call_bgbusy.sh", timeout_s=590)
# Then here: python3 -m benchmarks.zoo --merge bgbusy;
#   python3 -m benchmarks.zoo_kernels --length 128 zoo-bgbusy transformers/llama-1b-shape 8 graphify_background graphify_background_busy
MODELS=${MODELS:-"transformers/llama-1b-shape transformers/gpt2"} TAG=bgbusy \
  ZOO_ARGS="--lines reduce_overhead graphify_background graphify_background_busy --profile" PER_GPU=2 \
  WORKER_S=480 BUDGET_S=${BUDGET_S:-560} MIN_LEFT=${MIN_LEFT:-100} bash benchmarks/zoo_device_run.sh
