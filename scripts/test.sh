#!/usr/bin/env bash
# Installs everything the tests need and runs them (the README's test command; .ci/run calls it).
# Two runs: the suite in .venv, then the cross-check against NVIDIA's own encoder (nemo-toolkit 3.0.0,
# test-only, spec 12) in .venv-nemo, which sees .venv's packages and adds NeMo's without touching them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider --ignore=tests/test_encoder_vs_nemo.py "$@"

[ -d .venv-nemo ] || python3 -m venv .venv-nemo
python -c "import site; print(site.getsitepackages()[0])" > "$(.venv-nemo/bin/python -c 'import site; print(site.getsitepackages()[0])')/main_venv.pth"
# --no-deps with NeMo's ASR needs listed: its own pins would replace this venv's torch and numpy
.venv-nemo/bin/python -m pip install -q --no-deps nemo-toolkit==3.0.0 "lightning>2.2.1,<=2.4.0" lightning-utilities \
  pytorch-lightning torchmetrics librosa numba llvmlite lazy_loader decorator soxr audioread pooch msgpack scipy \
  einops wrapt text-unidecode nv-one-logger-core nv-one-logger-training-telemetry \
  nv-one-logger-pytorch-lightning-integration StrEnum overrides toml lhotse intervaltree sortedcontainers cytoolz \
  toolz sentencepiece pandas kaldialign braceexpand webdataset datasets multiprocess pyarrow dill scikit-learn \
  joblib cloudpickle narwhals threadpoolctl onnx ml_dtypes soundfile cffi pycparser
.venv-nemo/bin/python -c "import nemo.collections.asr.modules"   # fail here, never skip the check below
.venv-nemo/bin/python -m pytest -q -p no:cacheprovider tests/test_encoder_vs_nemo.py
