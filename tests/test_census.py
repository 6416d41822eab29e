"""scripts/dev/census_step.py counts the device ops of one frame step on the CPU (tiny model, kernel code
paths under the interpreter). Guards on the counts that the kernels of ops/ brought down."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "dev"))


@pytest.fixture(scope="module")
def tiny_counts():
    """The census of the tiny model (2 calls), taken once for both tests, under the interpreter as the
    tests marked triton_interpret run (a module fixture is set up before conftest.py's per-test choice)."""
    import torch

    from census_step import census

    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            mp.setenv("TRITON_INTERPRET", "1")
        return census(calls=2)


@pytest.mark.triton_interpret
def test_census_counts_the_fused_kernels_once(tiny_counts):
    counts = tiny_counts
    everything = sum((c for c in counts.values()), start=type(next(iter(counts.values())))())
    assert everything["counter_rng"] == 3          # two talker draws and the text sampler's, one op each
    # the talker's q norm + rotary runs in its k / v store's launch, none on its own
    assert everything["rms_norm"] > 0 and everything["rms_norm_rope_qk_store"] > 0 and everything["rms_norm_rope"] == 0
    assert everything["bitwise_xor"] == 0          # no integer hash left in torch
    assert counts["rnnt"]["lstm_cell"] > 0 and counts["rnnt"]["sigmoid"] == 0
    assert sum(everything.values()) < 2500         # 1,004 (tiny model, 2 calls, the GPU's attention paths)
    assert counts["llm"]["mamba_step"] > 0 and counts["talker.backbone"]["decode_attention"] > 0
    assert counts["talker.backbone"]["_softmax"] == 0   # the kernel, not the CPU's masked softmax
    # the text condition is a row of the talker's text table (EarTTS.build_tables), not the char
    # encoder (whose attention, MLP and norms were ~80 ops here): 36 ops left in the stage
    assert counts["talker"]["_softmax"] == 0 and sum(counts["talker"].values()) <= 40


@pytest.mark.triton_interpret
def test_census_with_the_full_layer_counts(tiny_counts):
    """layers=full: the per-layer stages scale with the real model's 24 / 52 / 28 layers, the fixed ones
    (MoG passes, codec, RNN-T) do not."""
    from census_step import census

    tiny, full = tiny_counts, census(calls=2, full_layers=True)
    total = lambda c: sum(c.values())  # noqa: E731
    per_layer, rest = divmod(total(full["encoder"]) - total(tiny["encoder"]), 24 - 2)  # 2 -> 24 layers
    # 18 ops per fused encoder layer (31 before ops/layernorm.py, 19 before its add_layer_norm_then)
    assert rest == 0 and 0 < per_layer <= 18
    assert full["encoder"]["add_layer_norm_then"] == 23 and full["encoder"]["native_layer_norm"] <= 1
    assert full["talker.backbone"]["decode_attention"] == 28 and tiny["talker.backbone"]["decode_attention"] == 6
    # per talker layer one norm + rotary launch for q, k and v; the cos / sin of both thetas
    # from one product per step, not ~9 ops per theta
    assert full["talker.backbone"]["rms_norm_rope_qk_store"] == 28 and full["talker.backbone"]["cat"] == 0
    assert full["llm"]["mamba_step"] == 27
    # the LLM attention layers' q/k/v as one GEMM: 2 GEMMs per Mamba, MLP and attention layer
    assert full["llm"]["mm"] == 2 * (27 + 25 + 4)
    # the MoG passes: the trunk's joints, the stacked heads and the latent draw as kernels,
    # 296 ops before; per pass now 8 GEMMs and 9 other ops, plus each codebook's distance GEMM and argmin
    # (on the CPU an addmm also copies its bias: 31 copy_ that the GPU's epilogue does not launch)
    assert full["talker.generate"]["mog_latent"] == 5 and full["talker.generate"]["bmm"] == 0
    assert total(full["talker.generate"]) <= 180
    # the codec's iSTFT tail and state update as one kernel (107 ops in the stage before); the
    # text's argmax and its top-2 margins as one op on the step's own stream (torch.topk's ~6 kernels before)
    assert full["codec"]["istft_step"] == 1 and total(full["codec"]) <= 65
    assert full["other"]["argmax_top2"] == 1 and full["other"]["topk"] == 0
    for fixed in ("talker.generate", "codec", "rnnt"):
        assert total(full[fixed]) == total(tiny[fixed]), fixed
