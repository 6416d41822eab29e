# Source on the device machine (carry .whl): puts the carried wheels on PYTHONPATH.
#   .whl/*.whl        Hydra + OmegaConf + antlr (cp ../shared/device-wheels/*.whl .whl/)
#   .whl/extra/*.whl  optional: pytest's wheels, for the GPU tests
#   .whl/wandb/*.whl  optional: wandb and its dependencies for Python 3.12, for W&B runs of scripts/bench.py:
#                     pip download wandb --only-binary=:all: --python-version 3.12 --implementation cp \
#                         --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl/wandb
# wandb's dependencies go last on the path, so the device's own packages (torch's) win any overlap.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    $(ls .whl/extra/*.whl 2>/dev/null) >/dev/null 2>&1
if ls .whl/wandb/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-wandb .whl/wandb/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD:/tmp/site-wandb PYTHONUNBUFFERED=1
