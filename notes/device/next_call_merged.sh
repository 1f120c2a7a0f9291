# After wip/static-first merged into main: the zoo's one-length decoder gpt2 and the encoder bert-base under RO and
# the compile line (the branch's first run of these two imported a copy of graphify without its built C helper, so
# every call checked its watched dicts in Python: a ~1.2 ms host floor, not the branch), then the GPU tests that the
# branch's carried copy could not run (no benchmarks/ or README beside it). About 500 s on one H200.
#   run(command="bash notes/device/next_call_merged.sh", timeout_s=560)
# Then here: python3 -m benchmarks.zoo --merge firststatic2
MODELS=${MODELS:-"transformers/gpt2 transformers/bert-base"} TAG=firststatic2 \
  ZOO_ARGS="--lines reduce_overhead graphify_compile" PER_GPU=2 WORKER_S=230 BUDGET_S=${BUDGET_S:-240} \
  MIN_LEFT=${MIN_LEFT:-100} bash benchmarks/zoo_device_run.sh
wait
python3 -c "import graphify.reads.dict_marks as d; print('C helper', d.HELPER)" >> $OUT/steps.txt 2>&1
taskset -c 0-15 timeout ${TESTS_S:-230} python3 -m pytest -q -rs -n 8 -p no:cacheprovider --durations=10 -o faulthandler_timeout=200 \
  tests/test_aot_swap.py tests/test_code_shape.py tests/test_distributed.py tests/test_hf.py tests/test_hf_benchmark.py \
  tests/test_hf_tp_benchmark.py tests/test_layers.py tests/test_split.py tests/test_zoo_benchmark.py \
  tests/test_all_reduce_choice.py tests/test_idle_between.py tests/test_kernel_classes.py tests/test_memory_benchmark.py \
  tests/test_one_row_gemm.py tests/test_reduce_norm.py tests/test_results_readme.py tests/test_serving_benchmark.py \
  tests/test_tp_decode.py tests/test_trace.py tests/test_zoo_claims.py tests/test_zoo_kernels.py \
  --deselect tests/test_distributed.py::test_tensor_parallel_cuda_graphs_with_nccl_equal_the_single_gpu_model \
  > $OUT/logs/pytest.txt 2>&1
echo "[$(date +%T)] tests rc=$? $(tail -1 $OUT/logs/pytest.txt)" >> $OUT/steps.txt
tar -czf $OUT/bundle.tar.gz -C $OUT logs steps.txt --transform 's,^tmp/results,benchmarks/results,' -C / tmp/results 2>/dev/null; true
