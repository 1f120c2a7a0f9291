# Next session, call 2 (about 560 s on one H200): zoo-layout3, RegNetY-016, torchvision's RegNetY-800MF and
# ResNeXt-50 under reduce-overhead, the compile line (the policy, timed on the GPU's clock) and the compile
# line channels-first, each from cold caches (about 330 s); the policy holds where the compile line is at or
# under the better of the other two on every row. Then zoo run 3's first models with what is left.
#   run(command="bash notes/device/next_call2.sh", timeout_s=600)
MODELS="timm/regnety_016 torchvision/regnet_y_800mf timm/resnext50_32x4d" TAG=layout3 PER_GPU=2 WORKER_S=400 \
  BUDGET_S=340 MIN_LEFT=100 ZOO_ARGS="--lines reduce_overhead graphify_compile graphify_compile_channels_first" \
  bash benchmarks/zoo_device_run.sh
MODELS="timm/resnet18 timm/mobilenetv2_100" TAG=run3 ZOO_ARGS="--lines eager reduce_overhead graphify_compile graphify_background" \
  PER_GPU=2 WORKER_S=420 BUDGET_S=215 MIN_LEFT=0 bash benchmarks/zoo_device_run.sh
