# session 21, call 3: the carveout at N = 1, 32, 64, 128 (two and one deep), and its spread at N=32 over 50 steps
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda"
B="bench.positions=[1000] bench.compare_eager=false"
ALL="engine.capture_buckets=[1,32,64,128] bench.batch_sizes=[1,32,64,128] bench.iters=20 bench.warmup=3"
N32="engine.capture_buckets=[32] bench.batch_sizes=[32] bench.iters=50 bench.warmup=5"
run() {  # name, timeout, probe environment ("" for none), hydra overrides...
  local name=$1 t=$2 probe=$3; shift 3
  env $probe NEMO_RUN=$name timeout $t python3 scripts/bench_step.py $M $B "$@" hydra.run.dir=/tmp/h_$name \
    > $OUT/bench_$name.log 2>&1
  echo "== $name ($probe $*)"; tail -4 $OUT/bench_$name.log
}
run d2_carve0_all 90 "" engine.pipeline=2 $ALL engine.llm_sm_carveout=0
run d2_carve64_all 90 "" engine.pipeline=2 $ALL engine.llm_sm_carveout=64
run d1_carve64_all 90 "" engine.pipeline=1 $ALL engine.llm_sm_carveout=64
run d0_carve64_all 90 "" engine.pipeline=0 $ALL engine.llm_sm_carveout=64
run d2_carve64_n32_50a 60 "" engine.pipeline=2 $N32 engine.llm_sm_carveout=64
run d2_carve64_n32_50b 60 "" engine.pipeline=2 $N32 engine.llm_sm_carveout=64
run d2_carve0_n32_50 60 "" engine.pipeline=2 $N32 engine.llm_sm_carveout=0
