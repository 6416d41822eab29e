"""scripts/census_step.py counts the device ops of one frame step on the CPU (tiny model, kernel code
paths under the interpreter). Guards on the counts that the session-2 kernels brought down."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


@pytest.mark.triton_interpret
def test_census_counts_the_fused_kernels_once():
    from census_step import census

    counts = census(calls=2)
    everything = sum((c for c in counts.values()), start=type(next(iter(counts.values())))())
    assert everything["counter_rng"] == 3          # two talker draws and the text sampler's, one op each
    assert everything["rms_norm"] > 0 and everything["rms_norm_rope"] > 0
    assert everything["bitwise_xor"] == 0          # no integer hash left in torch
    assert counts["rnnt"]["lstm_cell"] > 0 and counts["rnnt"]["sigmoid"] == 0
    assert sum(everything.values()) < 2500         # 1,787 when written (tiny model, 2 calls)
