#!/usr/bin/env bash
# Installs everything the tests need and runs them (the README's test command; .ci/run calls it).
# Two runs: the suite in .venv, then the cross-check against NVIDIA's own encoder (nemo-toolkit 3.0.0,
# test-only, spec 12) in .venv-nemo, which sees .venv's packages and adds NeMo's without touching them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
# The suite on every core (pytest-xdist, test by test, faster than one module at a time: the fixtures a
# worker builds again are cheap; on a 2-core machine 533 s with Inductor's compile cache warm, 734 s with
# it empty), then the tests that time a real-time server, browser or engine on their own (123 s): on a 2-core
# machine a busy neighbour would make their clients late.
SERIAL=(tests/test_server.py tests/test_server_fuzz.py tests/test_server_model.py tests/test_browser.py tests/test_bench.py
        tests/test_replicas.py
        # times an engine's steps against an admission's pieces in real time: beside another worker it saw
        # two pieces overlap a step where its bound is one
        tests/test_engine.py::test_admission_pieces_run_between_the_live_calls_steps)
if [ $# -gt 0 ]; then   # a selection of one's own (paths, -k, ...): one plain run
  python -m pytest -q -p no:cacheprovider --ignore=tests/test_encoder_vs_nemo.py "$@"
else
  python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-auto}" --dist load --durations=12 \
    --ignore=tests/test_encoder_vs_nemo.py $(for t in "${SERIAL[@]}"; do
      [[ $t == *::* ]] && echo "--deselect=$t" || echo "--ignore=$t"; done)
  python -m pytest -q -p no:cacheprovider "${SERIAL[@]}"
fi

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
