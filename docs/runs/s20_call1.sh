# session 20, call 1: the reduce-overhead test alone, then the speech fork point swept (NEMO_FORK probe)
source scripts/gpu_env.sh
set -f
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_graphs.py -k reduce_overhead_records > $OUT/pytest_ro.log 2>&1
tail -60 $OUT/pytest_ro.log
M="model=nemotron_duplex model.weights=random device=cuda engine.pipeline=true"
for k in ${FORKS:-0 6 12 18}; do
  NEMO_FORK=$k timeout 100 python3 scripts/bench_step.py $M 'engine.capture_buckets=[32]' 'bench.batch_sizes=[32]' \
    'bench.positions=[1000]' bench.iters=20 bench.warmup=3 bench.compare_eager=false hydra.run.dir=/tmp/h$k > $OUT/bench_fork_$k.log 2>&1
  echo "fork $k"; tail -2 $OUT/bench_fork_$k.log
done
