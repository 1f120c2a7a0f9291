# Next session, call 1 (about 560 s on one H200). First, here:
#   bash notes/device/carry_branch.sh wip/warm-ups-in-pool _wip_warm
#   bash notes/device/carry_branch.sh wip/shared-pool _wip_pool; cp notes/review-shared-pool-3/*.py _wip_pool/
#   (window_check.py: drop its `0 * torch.rand(...)` term, or its captures hold the lock throughout; see review 5)
# then run(command="bash notes/device/next_call1.sh", carry=["_wip_warm", "_wip_pool"], timeout_s=590).
mkdir -p $OUT/logs; export BENCH_RESULTS=/tmp/results PYTHONUNBUFFERED=1; unset PYTHONDONTWRITEBYTECODE
log() { echo "[$(date +%T)] $*" >> $OUT/logs/steps.txt; }
save() { tar -czf $OUT/bundle.tar.gz -C $OUT logs -C / tmp/results 2>/dev/null; true; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/logs/install.txt 2>&1; log installed
# 1. the branches' CUDA tests (GPU shared; nothing timed runs meanwhile)
(cd _wip_warm && timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -n 4 tests/test_pool_routing.py tests/test_hf_caches.py tests/test_cuda_memory.py) > $OUT/logs/warm-tests.txt 2>&1
log "warm-ups branch rc=$? $(tail -1 $OUT/logs/warm-tests.txt)"
(cd _wip_pool && timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -n 4 tests/test_shared_pool.py tests/test_shared_pool_captures.py tests/test_pool_trim.py tests/test_first_use.py) > $OUT/logs/pool-tests.txt 2>&1
log "shared-pool branch rc=$? $(tail -1 $OUT/logs/pool-tests.txt)"
(cd _wip_pool && timeout 40 python3 window_check.py; timeout 30 python3 bench_calls.py) > $OUT/logs/pool-scripts.txt 2>&1
cp _wip_pool/bench_calls.py /tmp/bc.py; timeout 30 python3 /tmp/bc.py > $OUT/logs/bench-calls-main.txt 2>&1; save
# 2. RegNetY's layout (alone on the GPU), what is left of the call
left=$(( 560 - SECONDS )); log "layout run with ${left}s"
timeout $left python3 -m benchmarks.zoo --models timm/regnety_016 timm/resnet50 --lines reduce_overhead graphify_compile graphify_compile_channels_first --tag layout --timeout 240 > $OUT/logs/layout.txt 2>&1
log "layout rc=$?"; save
