#!/usr/bin/env bash
# One device-machine call: install the carried wheels, check the kernels on the GPU, run the step
# benchmark. Usage (on the device): bash scripts/gpu_bench.sh [extra bench_step overrides...]
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/codec/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 scripts/bench_step.py model=nemotron_duplex model.weights=random device=cuda hydra.run.dir=$OUT/hydra "$@" 2>&1 | tee "$OUT/bench_step.log"
