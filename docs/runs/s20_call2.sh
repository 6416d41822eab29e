# session 20, call 2: the encoder one frame ahead of the LLM (NEMO_PROBE=enc_branch), against the pipelined step
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda engine.pipeline=true"
B="'engine.capture_buckets=[32]' 'bench.batch_sizes=[32]' 'bench.positions=[1000]'"
for p in none enc_branch; do
  NEMO_PROBE=$p timeout 100 python3 scripts/bench_step.py $M 'engine.capture_buckets=[32]' 'bench.batch_sizes=[32]' \
    'bench.positions=[1000]' bench.iters=20 bench.warmup=3 bench.compare_eager=false hydra.run.dir=/tmp/h$p > $OUT/bench_$p.log 2>&1
  echo "probe $p"; tail -2 $OUT/bench_$p.log
done
NEMO_PROBE=enc_branch timeout 150 python3 scripts/profile_step.py $M 'bench.batch_sizes=[32]' 'bench.positions=[1000]' \
  +profile_graphs=true +profile_greedy=true hydra.run.dir=/tmp/hp > $OUT/profile_enc_branch.log 2>&1
tail -40 $OUT/profile_enc_branch.log
