#!/usr/bin/env bash
# One device-machine call that checks and measures the serving defaults, in the order that matters when
# the call is cut short: the GPU tests of the kernels and the captured step, the step benchmark, then the
# load sweep with the uploads run on the same server. Results under $OUT (small files only: the Hydra and
# load directories stay under /tmp, and only their summaries are copied).
# Here first: mkdir -p .whl && cp ../shared/device-wheels/*.whl .whl/ (+ pytest's wheels in .whl/extra/,
# wandb's in .whl/wandb/), then run it with carry [".whl"].
# Usage (on the device): bash scripts/gpu_check.sh [seconds for the load sweep, default 300]
set -o pipefail
source scripts/gpu_env.sh
export OUT=${OUT:-outputs/gpu_check}
mkdir -p "$OUT"
LOAD_S=${1:-300}
M="model=nemotron_duplex model.weights=random device=cuda"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse --short HEAD >> "$OUT/device.txt" 2>/dev/null
timeout 240 python3 -m pytest -q -m gpu tests/ops/ tests/test_graphs.py -k "not regions" \
    > "$OUT/pytest.log" 2>&1; tail -n 3 "$OUT/pytest.log"
mkdir -p "$OUT/step"
OUT="$OUT/step" timeout 150 python3 scripts/bench_step.py $M 'engine.capture_buckets=[1,32,128]' \
    'bench.batch_sizes=[1,32,128]' 'bench.positions=[1000]' bench.iters=10 bench.warmup=2 \
    bench.compare_eager=false hydra.run.dir=/tmp/gpu_check_step > "$OUT/step.log" 2>&1; tail -n 4 "$OUT/step.log"
timeout $((LOAD_S + 60)) python3 scripts/bench.py $M model.dtype.encoder=bf16 model.dtype.llm=bf16 \
    model.dtype.talker=bf16 'loadtest.n_calls=[1,16,32,64,96,128,160]' loadtest.duration_s=12 \
    'loadtest.upload_runs=[32]' loadtest.time_budget_s=$LOAD_S loadtest.out=/tmp/gpu_check_load \
    hydra.run.dir=/tmp/gpu_check_hydra > "$OUT/load.log" 2>&1
cp /tmp/gpu_check_load/{summary.md,load.json,server.log} "$OUT/" 2>/dev/null
cp /tmp/gpu_check_load/*.png "$OUT/" 2>/dev/null
tar czf "$OUT/wandb.tgz" -C /tmp/gpu_check_load wandb 2>/dev/null
cat "$OUT/summary.md" 2>/dev/null || tail -n 20 "$OUT/load.log"
