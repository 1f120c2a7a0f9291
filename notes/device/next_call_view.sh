# What graphify's default copy of a replay's outputs costs beside reduce-overhead's hand-out of its pool's
# buffers: the compile line with Options(outputs="view") (the zoo's `_view` lines) beside the default, on the
# B = 1 shapes where the compile line ties the peer's kernels at 1.00-1.02x (one copy kernel more a call).
# About 300 s on one H200; after run 3 is complete.
#   run(command="bash notes/device/next_call_view.sh", timeout_s=420)
MODELS="timm/resnet50 timm/resnet18 timm/vit_small_patch16_224 timm/mobilenetv2_100" TAG=view \
  ZOO_ARGS="--lines reduce_overhead graphify_compile graphify_compile_view" PER_GPU=2 WORKER_S=300 BUDGET_S=400 \
  MIN_LEFT=100 bash benchmarks/zoo_device_run.sh
