"""session 18: scripts/bench_step.py with ops/act_linear.py switched off (MAX_ROWS = 0: every down projection
takes the torch steps, activation kernel then cuBLAS) or left on, for an A/B on one lease.

    python3 docs/runs/ab_s18_act_linear.py off|on <bench_step.py overrides...>

ops/act_linear.py and its wiring were removed after this A/B (slower, docs/performance.md session 18): run it from
a checkout of commit 60e741c.
"""
import runpy
import sys

sys.path.insert(0, ".")
import ops.act_linear  # noqa: E402

if sys.argv[1] == "off":
    ops.act_linear.MAX_ROWS = 0
sys.argv = ["scripts/bench_step.py"] + sys.argv[2:]
runpy.run_path("scripts/bench_step.py", run_name="__main__")
