# Zoo run 3 (the second run of the current code for the two-run claims), one call of about 560 s on one H200.
# QUEUE: the models not yet in zoo-run3 (notes/issue74.md, "Runs still to make"); maxvit first, alone it
# takes most of a call. Without the plain line: it was the best line on none of run 2's 76 shapes, and
# its process is a tenth of a model's time (run 2 and run 1 hold its figures).
#   run(command="QUEUE='timm/maxvit_tiny_tf_224 timm/resnet50 ...' bash notes/device/next_call3.sh", timeout_s=590)
# Zoo run 4 (the first-shape policy): TAG=run4 and the models in run 3's order, a call at a time, e.g.
#   run(command="TAG=run4 QUEUE='transformers/bert-base transformers/gpt2 ...' bash notes/device/next_call3.sh", timeout_s=590)
MODELS="$QUEUE" TAG=${TAG:-run3} ZOO_ARGS="--lines eager reduce_overhead graphify_compile graphify_background" PER_GPU=2 WORKER_S=420 BUDGET_S=${BUDGET_S:-560} MIN_LEFT=${MIN_LEFT:-150} bash benchmarks/zoo_device_run.sh
