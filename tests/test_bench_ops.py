"""scripts/dev/bench_ops.py: the GEMM census it times on the GPU, and a CPU smoke run of that section."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "dev"))

import bench_ops  # noqa: E402


def test_step_gemm_shapes_full_size():
    """Counts follow from the architecture (spec 2-4): 24 Conformer layers with q, k, v, out, the conv's
    second pointwise (1024 -> 1024), its first (1024 -> 2048) and two macaron FFs; 27 Mamba, 25 MLP and
    4 attention blocks in the LLM; 28 talker layers run on two rows per call; one text head."""
    from nemo_duplex.models.config import ModelConfig

    cfg = ModelConfig()
    got = {(part, k, n): (count, rows) for part, k, n, count, rows in bench_ops.step_gemm_shapes(cfg)}
    pattern = cfg.llm.hybrid_override_pattern
    assert got[("encoder", 1024, 1024)] == (5 * 24, 1) and got[("encoder", 1024, 2048)] == (24, 1)
    assert got[("encoder", 1024, 4096)] == got[("encoder", 4096, 1024)] == (2 * 24, 1)
    assert got[("llm", 10240, 4480)] == (pattern.count("M"), 1) and pattern.count("M") == 27
    assert got[("llm", 15680, 4480)] == (pattern.count("-"), 1)
    assert got[("llm", 4480, 1024)] == (2 * pattern.count("*"), 1)   # k and v
    assert got[("talker", 1152, 1152)] == (4 * 28, 2) and got[("talker", 4608, 1152)] == (28, 2)
    assert got[("heads", 4480, 131072)] == (1, 1)


def test_gemm_section_smoke(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(REPO / "scripts/dev/bench_ops.py"), "--smoke", "--only", "gemm",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_ops.json").read_text())["rows"]
    per_step = {row["case"]: row for row in rows if row["section"] == "gemm per step"}
    assert set(per_step) == {"encoder N=2", "llm N=2", "talker N=2", "heads N=2"}
    assert all(row["ms"] > 0 and row["bytes"] > 0 for row in rows)
