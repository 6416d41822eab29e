#!/usr/bin/env bash
# One device-machine call: install the carried wheels, run the step benchmark.
# Here first: mkdir -p .whl && cp ../shared/device-wheels/*.whl .whl/ (Hydra; .whl/ is git-ignored),
# plus pytest's wheels in .whl/extra/ if the GPU tests should run too; name .whl in the call's carry.
# Usage (on the device): bash scripts/dev/gpu_bench.sh [extra bench_step overrides...]
set -o pipefail
source scripts/dev/gpu_env.sh   # the carried wheels (Hydra; pytest and wandb if carried)
export OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 scripts/bench_step.py model=nemotron_duplex model.weights=random device=cuda hydra.run.dir=$OUT/hydra "$@" 2>&1 | tee "$OUT/bench_step.log"
