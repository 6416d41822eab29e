"""scripts/dev/compile_kernels.py: the GPU build (to an sm_90 cubin, with Triton's own ptxas) of the kernels it
covers succeeds on a machine without a GPU. In a subprocess without TRITON_INTERPRET, since the test
process defines every kernel for the interpreter (tests/conftest.py)."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_kernels_build_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(REPO / "scripts/dev/compile_kernels.py")], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    built = [line for line in r.stdout.splitlines() if line.endswith("ptx chars)")]
    assert len(built) == 37, r.stdout
    # the talker's attention over float8 pages reads its 72-byte rows 8 bytes at a time, not byte by byte
    assert int(r.stdout.split("8-byte loads: ")[1].split()[0]) >= 8, r.stdout
    # the weight-only FP8 GEMM's two tile shapes stream their tiles 16 bytes at a time (the script checks none
    # is narrower)
    assert r.stdout.count("16-byte async copies: ") == 2, r.stdout
