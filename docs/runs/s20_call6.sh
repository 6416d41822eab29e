# session 20, call 6: two deep as committed, N=32 at position 1000 in three processes (the spread), then its profile
source scripts/gpu_env.sh
set -f
M="model=nemotron_duplex model.weights=random device=cuda engine.pipeline=2"
for r in 1 2 3; do
  timeout 80 python3 scripts/bench_step.py $M 'engine.capture_buckets=[32]' 'bench.batch_sizes=[32]' \
    'bench.positions=[1000]' bench.iters=50 bench.warmup=5 bench.compare_eager=false hydra.run.dir=/tmp/h$r \
    > $OUT/bench_n32_run$r.log 2>&1
  echo "== run $r"; tail -1 $OUT/bench_n32_run$r.log
done
timeout 120 python3 scripts/profile_step.py $M 'bench.batch_sizes=[32]' 'bench.positions=[1000]' \
  +profile_graphs=true +profile_greedy=true hydra.run.dir=/tmp/hp > $OUT/profile_pipeline_2.log 2>&1
grep -A8 "^streams" $OUT/profile_pipeline_2.log
