# session 20, call 8: two deep, the text half's cuBLASLt GEMMs told to leave k SMs free (NEMO_CARVEOUT probe)
source scripts/gpu_env.sh
set -f
python3 -c "import torch; print(torch.__version__, hasattr(torch._C, '_set_sm_carveout_experimental'))"
M="model=nemotron_duplex model.weights=random device=cuda engine.pipeline=2"
for k in 0 16 32 8; do
  NEMO_CARVEOUT=$k timeout 45 python3 scripts/bench_step.py $M 'engine.capture_buckets=[32]' 'bench.batch_sizes=[32]' \
    'bench.positions=[1000]' bench.iters=20 bench.warmup=3 bench.compare_eager=false hydra.run.dir=/tmp/h$k \
    > $OUT/bench_carve_$k.log 2>&1
  echo "== carveout $k"; tail -1 $OUT/bench_carve_$k.log
done
