# Next session, call 2 (about 480 s on one H200, nothing else on it): the layout policy with grouped
# convolutions timed. First the weighing of the zoo's CNNs with grouped convolutions (the ratios timed, the
# decision), then RegNetY-016, torchvision's RegNetY-800MF and ResNeXt-50 under reduce-overhead, the compile
# line (the policy) and the compile line channels-first, each model from cold caches:
#   run(command="bash notes/device/next_call2.sh", timeout_s=580)
# The policy holds where the compile line is at or under both others on every row (zoo-layout2).
export BEFORE="PYTHONPATH=. timeout 120 python3 notes/device/layout_weighing.py timm/regnety_016 torchvision/regnet_y_800mf \
  timm/resnext50_32x4d timm/resnet50 > \$OUT/logs/weighing.jsonl" MODELS="timm/regnety_016 torchvision/regnet_y_800mf \
  timm/resnext50_32x4d" ZOO_ARGS="--lines reduce_overhead graphify_compile graphify_compile_channels_first" \
  TAG=layout2 PER_GPU=2 WORKER_S=400 BUDGET_S=540 MIN_LEFT=100
bash benchmarks/zoo_device_run.sh
