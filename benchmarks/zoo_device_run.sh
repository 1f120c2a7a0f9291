#!/usr/bin/env bash
# The zoo on a machine of several GPUs: one queue of models (MODELS, space-separated names), one
# worker a GPU pinned to its share of the cores, each model its own `benchmarks.zoo` run tagged
# run1-<model> (join them with `python3 -m benchmarks.zoo --merge run1`). Stops taking models
# MIN_LEFT s before BUDGET_S; results and logs go to $OUT/bundle.tar.gz as they come. SUITE=1:
# GPU 0 first runs pytest on SUITE_TESTS (default: all tests), then takes models too. BEFORE="cmd":
# GPU 0 runs cmd (its output in logs/before.txt) before anything else. PER_GPU=2: two workers a
# GPU, each on half its cores, timing only while the other leaves the GPU alone
# (`benchmarks._gpu_share`: compiles overlap; timed calls and the timings that pick kernels never do).
#
#   MODELS="timm/resnet50 transformers/bert-base" BUDGET_S=540 bash benchmarks/zoo_device_run.sh
# Every model's table and JSON, and the logs, go into $OUT/bundle.tar.gz as they come.
ROOT=$PWD; mkdir -p $OUT/logs; rm -f /tmp/before.done; unset PYTHONDONTWRITEBYTECODE; export PYTHONUNBUFFERED=1
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
log() { echo "[$(date +%T)] $*" | tee -a $OUT/steps.txt; }
# results go to /tmp/results (packed as benchmarks/results/), not into the tree the tests read
export BENCH_RESULTS=/tmp/results; mkdir -p $BENCH_RESULTS
save() { (flock /tmp/save.lock tar -czf $OUT/bundle.tar.gz -C $OUT logs steps.txt --transform 's,^tmp/results,benchmarks/results,' -C / tmp/results 2>/dev/null); true; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/logs/install.txt 2>&1; log installed
printf '%s\n' ${MODELS} > /tmp/queue
pop() { flock /tmp/queue.lock bash -c 'head -1 /tmp/queue; sed -i 1d /tmp/queue'; }
gpu_loop() {  # gpu cores
  [ "$1" = 0 ] && while [ ! -e /tmp/before.done ]; do sleep 2; done  # GPU 0 runs BEFORE alone first
  while :; do
    left=$(( END - $(date +%s) )); [ $left -lt ${MIN_LEFT:-150} ] && break
    m=$(pop); [ -z "$m" ] && break
    tag=$(echo $m | tr '/' '-')
    BENCH_GPU_LOCK=$([ ${PER_GPU:-1} -gt 1 ] && echo /tmp/gpu$1.lock) CUDA_VISIBLE_DEVICES=$1 PYTHONPYCACHEPREFIX=/tmp/pyc-z$1 \
      taskset -c $2 timeout $left python3 -m benchmarks.zoo --models $m --tag ${TAG:-run1}-$tag --timeout ${WORKER_S:-240} ${ZOO_ARGS} > $OUT/logs/zoo-$tag.txt 2>&1
    log "zoo $m gpu$1 rc=$?"; save
  done
}
N=$(nvidia-smi -L | wc -l); C=$(( $(nproc) / N )); [ $C -ge 1 ] || C=1  # GPUs, and cores a GPU
N=${GPUS:-$N}  # GPUS=n: the first n GPUs only (the others left to another job, with their cores)
cores() { echo "$(( $1 * C ))-$(( $1 * C + C - 1 ))"; }
gpus=""; for i in $(seq $([ -n "$SUITE" ] && echo 1 || echo 0) $(( N - 1 ))); do gpus="$gpus $i:$(cores $i)"; done
if [ -n "$BEFORE" ]; then  # GPU 0 runs it first, the others wait for nothing
  (CUDA_VISIBLE_DEVICES=0 taskset -c $(cores 0) timeout $(( END - $(date +%s) )) bash -c "$BEFORE" > $OUT/logs/before.txt 2>&1; log "before rc=$?"; save; touch /tmp/before.done) &
else touch /tmp/before.done
fi
if [ -n "$SUITE" ]; then  # GPU 0 runs the tests named (SUITE_TESTS, default all), then takes models too
  (while [ ! -e /tmp/before.done ]; do sleep 2; done
   CUDA_VISIBLE_DEVICES=0 taskset -c $(cores 0) timeout $(( END - $(date +%s) )) python3 -m pytest -v -rfEs -n ${XDIST:-8} -p no:cacheprovider ${SUITE_TESTS:-tests} --durations=15 \
      --deselect tests/test_distributed.py::test_tensor_parallel_cuda_graphs_with_nccl_equal_the_single_gpu_model > $OUT/logs/pytest.txt 2>&1
   log "tests rc=$? $(tail -1 $OUT/logs/pytest.txt)"; save; gpu_loop 0 $(cores 0)) &
fi
P=${PER_GPU:-1}; W=$(( C / P )); [ $W -ge 1 ] || W=$C  # PER_GPU workers a GPU, each on W of its cores
for g in $gpus; do
  i=${g%%:*}; lo=${g#*:}; lo=${lo%-*}
  for k in $(seq 0 $(( P - 1 ))); do
    a=$(( lo + (k * W) % C )); gpu_loop $i "$a-$(( a + W - 1 ))" &
  done
done
wait
log "done; left in queue: $(cat /tmp/queue | tr '\n' ' ')"; save
