# Next session, call 1 (about 450 s on one H200): the layout weighing with grouped convolutions timed on the
# GPU's clock (launches queued behind a spin) and the weight's per-call copy in the channels-last arm, beside
# every 2-D convolution timed both ways (the diagnostic), for the zoo's CNNs with grouped convolutions; then
# main's GPU suite (it holds the shared pool, landed on its branch's CUDA tests, and tests/test_conv_timing.py's
# CUDA cases).
#   run(command="bash notes/device/next_call1.sh", timeout_s=560)   (WEIGH=1 for the weighing too; session 81: the suite only)
# THEN="cmd": cmd after the suite. Session 82: the suite passed 400 s (its cap then) with 1938 of about 1980 run, none
# failed; now capped at SUITE_S (530 s), and a test running over 200 s dumps every thread's stack (faulthandler).
# Call 2: notes/device/next_call2.sh (zoo-layout3, then run 3). Then notes/device/next_call3.sh (run 3).
mkdir -p $OUT/logs; export BENCH_RESULTS=/tmp/results PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE
log() { echo "[$(date +%T)] $*" >> $OUT/logs/steps.txt; }
save() { tar -czf $OUT/bundle.tar.gz -C $OUT logs 2>/dev/null; true; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/logs/install.txt 2>&1; log installed
[ -n "$WEIGH" ] && { PYTHONPATH=. timeout 120 python3 notes/device/layout_weighing.py timm/regnety_016 torchvision/regnet_y_800mf \
  timm/resnext50_32x4d timm/resnet50 > $OUT/logs/weighing.jsonl 2> $OUT/logs/weighing.err; log "weighing rc=$?"; save; }
taskset -c 0-15 timeout ${SUITE_S:-530} python3 -m pytest -v -rfEs -n 8 -p no:cacheprovider tests --durations=15 -o faulthandler_timeout=200 \
   --deselect tests/test_distributed.py::test_tensor_parallel_cuda_graphs_with_nccl_equal_the_single_gpu_model > $OUT/logs/pytest.txt 2>&1
log "suite rc=$? $(tail -1 $OUT/logs/pytest.txt)"; save
[ -n "$THEN" ] && { bash -c "$THEN"; log "then rc=$?"; }; true
