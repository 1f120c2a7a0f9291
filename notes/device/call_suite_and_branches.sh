# One call (about 480 s on one H200): main's GPU suite on cores 0-11 while both branches' CUDA tests run on
# cores 12-15, then review 3's scripts alone (bench_calls.py times host cost). Before it, here:
#   bash notes/device/carry_branch.sh wip/warm-ups-in-pool _wip_warm
#   bash notes/device/carry_branch.sh wip/shared-pool _wip_pool; cp notes/review-shared-pool-3/*.py _wip_pool/
#   (window_check.py: drop its `0 * torch.rand` term, or its captures hold the lock throughout; review 5)
# then run(command="bash notes/device/call_suite_and_branches.sh", carry=["_wip_warm", "_wip_pool"]).
mkdir -p $OUT/logs; export BENCH_RESULTS=/tmp/results PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE
log() { echo "[$(date +%T)] $*" >> $OUT/logs/steps.txt; }
save() { tar -czf $OUT/bundle.tar.gz -C $OUT logs 2>/dev/null; true; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/logs/install.txt 2>&1; log installed
(taskset -c 0-11 timeout 420 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests --durations=15 \
   --deselect tests/test_distributed.py::test_tensor_parallel_cuda_graphs_with_nccl_equal_the_single_gpu_model > $OUT/logs/pytest.txt 2>&1
 log "suite rc=$? $(tail -1 $OUT/logs/pytest.txt)"; save) &
(cd _wip_warm && taskset -c 12-15 timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -n 2 tests/test_pool_routing.py tests/test_hf_caches.py tests/test_cuda_memory.py) > $OUT/logs/warm-tests.txt 2>&1
log "warm-ups branch rc=$? $(tail -1 $OUT/logs/warm-tests.txt)"
(cd _wip_pool && taskset -c 12-15 timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -n 2 tests/test_shared_pool.py tests/test_shared_pool_captures.py tests/test_pool_trim.py tests/test_first_use.py) > $OUT/logs/pool-tests.txt 2>&1
log "shared-pool branch rc=$? $(tail -1 $OUT/logs/pool-tests.txt)"; save
wait
(cd _wip_pool && timeout 40 python3 window_check.py; timeout 30 python3 bench_calls.py) > $OUT/logs/pool-scripts.txt 2>&1
cp _wip_pool/bench_calls.py /tmp/bc.py; timeout 30 python3 /tmp/bc.py > $OUT/logs/bench-calls-main.txt 2>&1
log "scripts done"; save
