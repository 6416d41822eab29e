# session 20, call 5: two deep, where the listening half runs (NEMO_ENC probe): its own stream (own), on the
# speech stream after the talker + codec (speech), or before them (speech_first); N = 1, 32, 64, 128
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda engine.pipeline=2"
for e in speech_first speech own; do
  NEMO_ENC=$e timeout 130 python3 scripts/bench_step.py $M 'engine.capture_buckets=[1,32,64,128]' \
    'bench.batch_sizes=[1,32,64,128]' 'bench.positions=[1000]' bench.iters=20 bench.warmup=3 bench.compare_eager=false \
    hydra.run.dir=/tmp/h$e > $OUT/bench_enc_$e.log 2>&1
  echo "== $e"; tail -5 $OUT/bench_enc_$e.log
done
