# Zoo run 3 (the second run of the current code for the two-run claims), one call of about 560 s on one H200.
# QUEUE: the models not yet in zoo-run3 (notes/issue74.md, "Runs still to make"); maxvit first, alone it
# takes most of a call.
#   run(command="QUEUE='timm/maxvit_tiny_tf_224 timm/resnet50 ...' bash notes/device/next_call3.sh", timeout_s=590)
MODELS="$QUEUE" TAG=run3 PER_GPU=2 WORKER_S=420 BUDGET_S=560 MIN_LEFT=150 bash benchmarks/zoo_device_run.sh
