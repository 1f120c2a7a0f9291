# Why the compile line is 1.11-1.13x reduce-overhead on EfficientNet-B3 at B = 1 in both runs (background line
# 1.02, run 2), where EfficientNet-B0 ties: each line profiled (every kernel a call, `benchmarks.zoo --profile`),
# then lined up kernel by kernel on this machine:
#   python3 -m benchmarks.zoo --merge prof-b3
#   python3 -m benchmarks.zoo_kernels zoo-prof-b3 timm/efficientnet_b3 1 reduce_overhead graphify_compile
#   python3 -m benchmarks.zoo_kernels zoo-prof-b3 timm/efficientnet_b3 1 graphify_background graphify_compile
# First the profile's own GPU test (tests/test_zoo_kernels.py, in logs/before.txt). About 330 s on one H200.
#   run(command="bash notes/device/next_call_profile.sh", timeout_s=420)
BEFORE="python3 -m pytest -q -rs -p no:cacheprovider tests/test_zoo_kernels.py" \
MODELS=${MODELS:-"timm/efficientnet_b3 timm/efficientnet_b0"} TAG=prof-b3 \
  ZOO_ARGS="--lines reduce_overhead graphify_compile graphify_background --batches 1 --profile" PER_GPU=2 WORKER_S=300 \
  BUDGET_S=${BUDGET_S:-400} MIN_LEFT=${MIN_LEFT:-100} bash benchmarks/zoo_device_run.sh
