# session 21, call 4: engine.llm_sm_carveout=auto (the new default: half the SMs two deep): the GPU test of the
# pipelined step, the bench at N = 1, 8, 32, 64, 128 and positions 100 / 1000 / 2000, N=32's spread, and the
# server under load two deep; everything under $OUT in one tarball (the device returns few files)
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda"
B="bench.compare_eager=false"
run() {  # name, timeout, hydra overrides...
  local name=$1 t=$2; shift 2
  timeout $t python3 scripts/bench_step.py $M $B "$@" hydra.run.dir=/tmp/h_$name > $OUT/bench_$name.log 2>&1
  echo "== $name ($*)"; grep -A8 "^copy bandwidth" $OUT/bench_$name.log
}
timeout 120 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_pipeline.py > $OUT/pytest_pipeline_gpu.log 2>&1
echo "pytest exit $?"; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/pytest_pipeline_gpu.log
run d2_auto_all 100 engine.pipeline=2 'engine.capture_buckets=[1,32,64,128]' 'bench.batch_sizes=[1,32,64,128]' \
  'bench.positions=[1000]' bench.iters=20 bench.warmup=3
run d2_auto_n32_a 60 engine.pipeline=2 'engine.capture_buckets=[32]' 'bench.batch_sizes=[32]' 'bench.positions=[1000]' \
  bench.iters=50 bench.warmup=5
run d2_auto_n32_b 60 engine.pipeline=2 'engine.capture_buckets=[32]' 'bench.batch_sizes=[32]' 'bench.positions=[1000]' \
  bench.iters=50 bench.warmup=5
run d2_auto_table 150 engine.pipeline=2 'engine.capture_buckets=[1,8,32,64,128]' 'bench.batch_sizes=[1,8,32,64,128]' \
  'bench.positions=[100,2000]' bench.iters=20 bench.warmup=3
mkdir -p $OUT/load
OUT=$OUT/load timeout 260 python3 scripts/bench.py $M model.dtype.encoder=bf16 model.dtype.llm=bf16 model.dtype.talker=bf16 \
  engine.pipeline=2 'loadtest.n_calls=[32,128,160]' 'loadtest.starts=[lockstep]' loadtest.duration_s=12 \
  loadtest.time_budget_s=230 hydra.run.dir=/tmp/h_load > $OUT/load.log 2>&1
echo "load exit $?"; cat $OUT/load/summary.md 2>/dev/null | head -20; tail -5 $OUT/load.log
set +f
cd $OUT && tar czf s21_4.tgz --exclude=s21_4.tgz . && find . -mindepth 1 ! -name s21_4.tgz -delete; ls -la $OUT
