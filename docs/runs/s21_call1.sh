# session 21, call 1: two deep at N=32: the LLM's SM carveout swept on one lease; probes: the codec a frame behind
# the talker on its own stream (NEMO_PROBE=codec_behind), the encoder's GEMMs leaving SMs (NEMO_ENC_CARVE=k)
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
run carve0_first 150 "" engine.llm_sm_carveout=0
run carve32 60 "" engine.llm_sm_carveout=32
run carve0 60 "" engine.llm_sm_carveout=0
run carve16 60 "" engine.llm_sm_carveout=16
run carve48 60 "" engine.llm_sm_carveout=48
run codec_behind 60 NEMO_PROBE=codec_behind engine.llm_sm_carveout=0
run codec_behind_c32 60 NEMO_PROBE=codec_behind engine.llm_sm_carveout=32
run enc_carve32 60 NEMO_ENC_CARVE=32 engine.llm_sm_carveout=0
run carve32_again 60 "" engine.llm_sm_carveout=32
