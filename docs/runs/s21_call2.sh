# session 21, call 2: the carveout past 48, and the GPU test of the pipelined step
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda engine.pipeline=2"
B="engine.capture_buckets=[32] bench.batch_sizes=[32] bench.positions=[1000] bench.iters=20 bench.warmup=3 bench.compare_eager=false"
run() {  # name, timeout, probe environment ("" for none), hydra overrides...
  local name=$1 t=$2 probe=$3; shift 3
  env $probe NEMO_RUN=$name timeout $t python3 scripts/bench_step.py $M $B "$@" hydra.run.dir=/tmp/h_$name \
    > $OUT/bench_$name.log 2>&1
  echo "== $name ($probe $*)"; tail -1 $OUT/bench_$name.log
}
run carve64 60 "" engine.llm_sm_carveout=64
run carve48_again 60 "" engine.llm_sm_carveout=48
run carve80 60 "" engine.llm_sm_carveout=80
run carve96 60 "" engine.llm_sm_carveout=96
run codec_behind_c64 60 NEMO_PROBE=codec_behind engine.llm_sm_carveout=64
run carve0_again 60 "" engine.llm_sm_carveout=0
rm -f $OUT/bench_step_*.json
timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_pipeline.py > $OUT/pytest_pipeline_gpu.log 2>&1
echo "pytest exit $?"; tail -15 $OUT/pytest_pipeline_gpu.log
