# Whether the autotuner's picks were chance because two zoo processes shared the GPU while they tuned: the same
# Triton kernel of llama-1b-shape B = 8 took 185 us under RO and 264-272 under every graphify line in zoo-static,
# and 267 under RO against 182 under the static background line in zoo-bgstatic (and the rotary kernel 78 against
# 198 the other way round). The zoo now tunes alone (`benchmarks._gpu_share.tune_alone`). Two rounds of RO and the
# compile line at B = 8 alone (its first shape: both lines compile it static, the same kernels), llama-1b-shape
# beside gpt2 as before (two processes on the GPU), each row with its picks (`configs`, read in torch 2.11's
# layout now): four processes' picks for each kernel. After the zoo tests' GPU cases. About 540 s on one H200.
#   run(command="bash notes/device/next_call_picks.sh", timeout_s=590)
# Then here: for t in picksa picksb; do python3 -m benchmarks.zoo --merge $t; done;
#   python3 -m benchmarks.zoo_kernels --length 128 zoo-picksa transformers/llama-1b-shape 8 reduce_overhead graphify_compile
#   (and picksb; and picksa's RO against picksb's RO: the same picks and times if tuning alone made them steady)
mkdir -p $OUT/logs; unset PYTHONDONTWRITEBYTECODE; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/logs/install.txt 2>&1
timeout 90 python3 -m pytest -v -rfEs -p no:cacheprovider tests/test_zoo_benchmark.py tests/test_zoo_kernels.py > $OUT/logs/pytest-zoo.txt 2>&1
echo "zoo tests rc=$? $(tail -1 $OUT/logs/pytest-zoo.txt)" >> $OUT/logs/steps.txt
for t in picksa picksb; do
  MODELS="transformers/llama-1b-shape transformers/gpt2" TAG=$t ZOO_ARGS="--lines reduce_overhead graphify_compile --profile --batches 8" \
    PER_GPU=2 WORKER_S=200 BUDGET_S=225 MIN_LEFT=60 bash benchmarks/zoo_device_run.sh
  mkdir -p $OUT/$t; mv $OUT/bundle.tar.gz $OUT/$t/; rm -rf /tmp/results/*
done
