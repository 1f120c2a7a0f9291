# Next session, call 1 (about 420 s on one H200): main's GPU suite on cores 0-11 (it covers the warm-ups
# routed into the graph's pool, now on main, and the grouped convolutions timed for the layout policy:
# tests/test_pool_routing.py, tests/test_layout_policy.py), while the shared-pool branch's CUDA tests run on
# cores 12-15 (merged with the warm-ups: its capture routes them only where no graph of the pool is live),
# then its invalidated-capture script.
# First, here:
#   bash notes/device/carry_branch.sh wip/shared-pool _wip_pool; cp /work/wip-pool/notes/device/invalidated_then_capture.py _wip_pool/
# then run(command="bash notes/device/next_call1.sh", carry=["_wip_pool"], timeout_s=560).
# Call 2: notes/device/next_call2.sh (the layout, timed). Then the zoo (notes/issue74.md, "Runs still to make").
mkdir -p $OUT/logs; export BENCH_RESULTS=/tmp/results PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE
log() { echo "[$(date +%T)] $*" >> $OUT/logs/steps.txt; }
save() { tar -czf $OUT/bundle.tar.gz -C $OUT logs 2>/dev/null; true; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/logs/install.txt 2>&1; log installed
(taskset -c 0-11 timeout 450 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests --durations=15 \
   --deselect tests/test_distributed.py::test_tensor_parallel_cuda_graphs_with_nccl_equal_the_single_gpu_model > $OUT/logs/pytest.txt 2>&1
 log "suite rc=$? $(tail -1 $OUT/logs/pytest.txt)"; save) &
(cd _wip_pool && taskset -c 12-15 timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -n 2 tests/test_shared_pool.py tests/test_shared_pool_captures.py tests/test_pool_trim.py tests/test_first_use.py tests/test_graph_pool.py tests/test_pool_routing.py tests/test_hf_caches.py tests/test_cuda_memory.py) > $OUT/logs/pool-tests.txt 2>&1
log "shared-pool branch rc=$? $(tail -1 $OUT/logs/pool-tests.txt)"
(cd _wip_pool && taskset -c 12-15 timeout 60 python3 invalidated_then_capture.py) > $OUT/logs/invalidated.txt 2>&1; save
wait; log done; save
