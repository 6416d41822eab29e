# session 20, call 7: the GPU tests of tests/test_graphs.py (full-size graphs vs eager, side stream, batch
# invariance) on the refactored frame_step; the reduce-overhead ones passed in call 1
source scripts/gpu_env.sh
set -f
timeout 200 python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/test_graphs.py -k "not regions and not reduce_overhead" \
  > $OUT/pytest_graphs_gpu.log 2>&1
grep -v "^\s*$" $OUT/pytest_graphs_gpu.log | grep -v "Warning\|warn" | tail -25
