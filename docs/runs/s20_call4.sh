# session 20, call 4: the two-deep pipelined step as committed: GPU tests, then serial / 1 / 2 deep at N = 1, 32, 64, 128
source scripts/gpu_env.sh
set -f
timeout 120 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_pipeline.py > $OUT/pytest_pipeline_gpu.log 2>&1
tail -8 $OUT/pytest_pipeline_gpu.log
M="model=nemotron_duplex model.weights=random device=cuda"
for p in 2 1 0; do
  timeout 150 python3 scripts/bench_step.py $M engine.pipeline=$p 'engine.capture_buckets=[1,32,64,128]' \
    'bench.batch_sizes=[1,32,64,128]' 'bench.positions=[1000]' bench.iters=20 bench.warmup=3 bench.compare_eager=false \
    hydra.run.dir=/tmp/h$p > $OUT/bench_final_pipeline_$p.log 2>&1
  echo "== pipeline $p"; tail -6 $OUT/bench_final_pipeline_$p.log
done
