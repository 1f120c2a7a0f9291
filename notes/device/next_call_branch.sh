# The branch `wip/static-first` (dynamic="auto" compiles a function's first shape static, then dynamic) on the
# zoo's decoders and an encoder served at three lengths, beside RO, from the branch's graphify: run from inside
# _wip_static (the current directory comes first on sys.path, for the zoo's worker processes and the compile
# worker too), with main's benchmarks/ copied in. First, here:
#   bash notes/device/carry_branch.sh wip/static-first _wip_static
#   run(command="bash notes/device/next_call_branch.sh", carry=["_wip_static"], timeout_s=590)
# Then: python3 -m benchmarks.zoo --merge firststatic; compare its compile line with zoo-static's and run 3's.
cp -r benchmarks _wip_static/ && cd _wip_static || exit 3
python3 -c "import graphify.compile.shape_policy as p; assert hasattr(p, 'call_signature'), p.__file__" || exit 3
MODELS=${MODELS:-"transformers/llama-1b-shape transformers/gpt2 transformers/bert-base"} TAG=firststatic \
  ZOO_ARGS="--lines reduce_overhead graphify_compile" PER_GPU=2 WORKER_S=420 BUDGET_S=${BUDGET_S:-560} \
  MIN_LEFT=${MIN_LEFT:-100} bash benchmarks/zoo_device_run.sh
