# session 20, call 3: encoder one frame ahead (NEMO_PROBE=enc_branch) with stream priorities; N=1 / 128
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda engine.pipeline=true"
run() {  # name, probe, prio, sizes
  NEMO_PROBE=$2 NEMO_PRIO=$3 timeout 150 python3 scripts/bench_step.py $M "engine.capture_buckets=$4" "bench.batch_sizes=$4" \
    'bench.positions=[1000]' bench.iters=20 bench.warmup=3 bench.compare_eager=false hydra.run.dir=/tmp/h$1 > $OUT/bench_$1.log 2>&1
  echo "== $1"; tail -3 $OUT/bench_$1.log
}
run enc_none enc_branch none '[32]'
run enc_speech enc_branch speech '[32]'
run enc_both enc_branch both '[32]'
run enc_1_128 enc_branch none '[1,128]'
run none_1_128 none none '[1,128]'
