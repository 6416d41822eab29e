"""The gate's model rows on the tiny model: each passes on the model as built and fails, naming
what broke, on a deliberately broken variant. CPU, fp32 yardstick + bf16 variant, fresh noisy clips."""
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import nemo_duplex.models.encoder as encoder_module
from eval.audio import write_wav
from eval.clips.make_clips import Clip
from eval.consistency import Comparison, consistency, judge
from eval.encoder_parity import encoder_parity
from eval.gate import FAIL, PASS, GateContext, freeze
from eval.margins import margins
from eval.models import ModelSet

BF16 = {"encoder": "bf16", "llm": "bf16", "talker": "bf16", "mamba_ssm_state": "fp32"}
CRITERIA = freeze({   # conf/eval/gate.yaml's defaults, copied so a change there cannot loosen this test
    "encoder_parity": {"fp32_min_cosine": 0.99999, "fp32_max_rel_err": 1e-4, "bf16_min_cosine": 0.995,
                       "bf16_max_rel_err": 0.1, "bf16_factor": 2.0},
    "margins": {"near_tie_margin": 1.0, "max_non_tie_divergences": 0, "max_divergence_rate": 0.1,
                "codec_max_abs_err": 1e-6},
    "consistency": {"near_tie_margin": 1.0, "max_near_tie_divergences": 0, "max_code_divergences": 0,
                    "pcm_max_abs_err": 3.1e-5},
})


@pytest.fixture(scope="module")
def models(tiny):
    model, tok, rnnt_vocab, _ = tiny
    return ModelSet.from_fp32(model, tok, rnnt_vocab, BF16)


def _clip(folder: Path, name: str, audio: torch.Tensor, seed: int | None = None) -> Clip:
    """A WAV clip from the example speech plus noise: a fresh draw every run unless `seed` is given."""
    noise = np.random.default_rng(seed).standard_normal(audio.shape[0]).astype(np.float32)
    wav = audio.numpy() + 0.01 * noise
    path = folder / f"{name}.wav"
    write_wav(path, wav, 16000)
    return Clip(name=name, kind="user", path=str(path), text=None, duration_s=len(wav) / 16000, sample_rate=16000)


def _ctx(tmp_path, clips, models, **settings) -> GateContext:
    return GateContext(clips=clips, out_dir=tmp_path, checkpoint_kind="random", show_progress=False,
                       load_models=lambda: models, settings=freeze({"seed": 0, "max_seconds": None, **settings}))


# --- encoder_parity ---------------------------------------------------------------------------------

def test_encoder_parity_passes_and_catches_a_wrong_attention_window(tmp_path, models, example_clip, monkeypatch):
    # 64 frames: past frame 60, where a 60-frame window first differs from the configured 70 (spec 2.6)
    clip = _clip(tmp_path, "speech", example_clip[: 64 * 1280])
    ctx = _ctx(tmp_path, [clip], models, chunk_sizes=[320, 4000])
    good = encoder_parity(ctx, CRITERIA["encoder_parity"])
    assert good.status == PASS, good.reason
    assert good.metrics["fp32_max_rel_err"] < 1e-4 and good.metrics["bf16_max_factor"] <= 2.0

    real_mask = encoder_module.chunked_limited_mask

    def window_60(lengths, max_len, left, right=0):
        return real_mask(lengths, max_len, 60, right)

    monkeypatch.setattr(encoder_module, "chunked_limited_mask", window_60)  # the offline encoder's mask
    bad = encoder_parity(ctx, CRITERIA["encoder_parity"])
    assert bad.status == FAIL
    assert "fp32 streaming" in bad.reason and "relative error" in bad.reason
    worst = bad.details["clips"]["speech"]["fp32_chunk320"]["worst_rel_frame"]
    assert worst > 60, worst  # frames up to 60 see the same keys under both windows


# --- margins ----------------------------------------------------------------------------------------

def test_margins_passes_and_catches_a_wrong_channel_weight(tmp_path, models, example_clip, monkeypatch):
    # One fixed noise draw: the tiny model's bf16 near-ties vary with the draw (frames where bf16 decided
    # otherwise, of 48, for noise seeds 0-5: 4, 3, 0, 1, 1, 0; a fresh draw reached 5 and failed the 10%
    # bound in CI), so fresh draws made this test fail now and then. Seed 3 is a typical draw (1 of 48).
    clip = _clip(tmp_path, "speech", example_clip[20 * 1280: 68 * 1280], seed=3)
    ctx = _ctx(tmp_path, [clip], models)
    good = margins(ctx, CRITERIA["margins"])
    assert good.status == PASS, good.reason
    assert good.metrics["frames"] == 48 and good.metrics["codec_max_abs_err"] <= 1e-6
    for d in good.details["clips"]["speech"]["divergences"]:   # what bf16 may differ on: near-ties only
        assert d["fp32_margin"] < 1.0

    # the bf16 deployment fuses the function channel with weight 1.0 instead of 2.0 (spec 9, item 2)
    monkeypatch.setattr(models.bf16, "cfg", dataclasses.replace(models.bf16.cfg, function_channel_weight=1.0))
    bad = margins(ctx, CRITERIA["margins"])
    assert bad.status == FAIL and "bf16 decides otherwise than fp32" in bad.reason
    assert bad.metrics["divergence_rate"] > 0.1


def test_margins_catches_a_bf16_cast_in_the_codec(tmp_path, models, example_clip, monkeypatch):
    clip = _clip(tmp_path, "speech", example_clip[: 8 * 1280])
    codec = models.bf16.codec
    real_step = codec.decode_step

    def bf16_step(codes, state, slots, silence_codes=None):
        return real_step(codes, state, slots, silence_codes).to(torch.bfloat16).float()

    monkeypatch.setattr(codec, "decode_step", bf16_step)
    bad = margins(_ctx(tmp_path, [clip], models), CRITERIA["margins"])
    assert bad.status == FAIL and "codec" in bad.reason and "spec 9.9" in bad.reason
    assert bad.metrics["codec_max_abs_err"] > 1e-4


def test_margins_reports_the_codes_an_fp8_talker_kv_moves(tmp_path, tiny, example_clip):
    """The codes' figures (reported, not judged): none move when the variant is the yardstick itself; with
    the talker's KV in float8 (`eval.models.bf16_dtype.talker_kv=fp8`) some do while the text stays fp32's on
    every frame (the talker never feeds the LLM), and the row says which KV dtype it measured."""
    model, tok, rnnt_vocab, _ = tiny
    clip = _clip(tmp_path, "speech", example_clip[20 * 1280: 44 * 1280], seed=3)
    same = margins(_ctx(tmp_path, [clip], ModelSet(model, model, model, tok, rnnt_vocab)), CRITERIA["margins"])
    assert same.status == PASS and same.metrics["code_diverging_frames"] == 0 and same.metrics["diverging_frames"] == 0
    fp8 = ModelSet.from_fp32(model, tok, rnnt_vocab, {"talker_kv": "fp8"})
    assert fp8.bf16.cfg.dtype.talker == "fp32"
    moved = margins(_ctx(tmp_path, [clip], fp8), CRITERIA["margins"])
    assert moved.metrics["talker_kv"] == "fp8" and moved.metrics["diverging_frames"] == 0
    assert (moved.metrics["llm_weights"], moved.metrics["talker_weights"], moved.metrics["mamba_ssm_state"]) == (
        "llm", "talker", "fp32")
    assert 0 < moved.metrics["code_diverging_frames"] <= 24 and 0 < moved.metrics["codes_differing_rate"] < 1


def test_margins_reports_the_codes_fp8_talker_weights_move(tmp_path, tiny, example_clip):
    """The talker's projections in e4m3 (`eval.models.bf16_dtype.talker_weights=fp8_weight_only`, the talker in
    bf16): codes move, the text stays fp32's on every frame (the talker never feeds the LLM), and the row names
    the weights it measured."""
    model, tok, rnnt_vocab, _ = tiny
    clip = _clip(tmp_path, "speech", example_clip[20 * 1280: 44 * 1280], seed=3)
    fp8 = ModelSet.from_fp32(model, tok, rnnt_vocab, {"talker": "bf16", "talker_weights": "fp8_weight_only"})
    moved = margins(_ctx(tmp_path, [clip], fp8), CRITERIA["margins"])
    assert moved.metrics["talker_weights"] == "fp8_weight_only" and moved.metrics["diverging_frames"] == 0
    assert 0 < moved.metrics["code_diverging_frames"] <= 24 and 0 < moved.metrics["codes_differing_rate"] < 1


# --- consistency ------------------------------------------------------------------------------------

def test_consistency_passes_and_catches_a_slot_mixup(tmp_path, models, example_clip, monkeypatch):
    clips = [_clip(tmp_path, "a", example_clip[: 12 * 1280]), _clip(tmp_path, "b", example_clip[30 * 1280: 40 * 1280])]
    ctx = _ctx(tmp_path, clips, models, chunk_sizes=[320, 1280, 4000], batch_calls=4, graphs="auto")
    good = consistency(ctx, CRITERIA["consistency"])
    assert good.status == PASS, good.reason
    # per clip offline/streaming + live + upload, then the batch of 4
    assert good.metrics["comparisons"] == 2 * 3 + 4 and good.metrics["diverged"] == 0
    assert all(c["frames"] in (12, 10) for c in good.details["comparisons"])

    # the engine's batched step hands each call its batch mate's audio (a slot mix-up)
    import nemo_duplex.serving.runner as runner_module

    real_step = runner_module.frame_step

    def mixed_up(model, st, slots, audio, forced, specials, **kwargs):
        return real_step(model, st, slots, audio.roll(1, dims=0), forced, specials, **kwargs)

    monkeypatch.setattr(runner_module, "frame_step", mixed_up)
    bad = consistency(ctx, CRITERIA["consistency"])
    assert bad.status == FAIL and "streaming/engine" in bad.reason
    offline_streaming = [c for c in bad.details["comparisons"] if c["pair"] == "offline/streaming"]
    assert all(c["first_token_diff"] is None for c in offline_streaming)  # the reference paths are untouched


def _cmp(first, margin, code=None):
    return Comparison("c", "streaming/engine live (eager)", 10, 0.5, 1.0, first, "text", margin, code, 0.0)


def test_consistency_judgement():
    crit = CRITERIA["consistency"]
    assert judge([_cmp(None, None)], crit, [False]).status == PASS
    far = judge([_cmp(3, 2.5)], crit, [False])                 # parts where fp32 was sure: never forgiven
    assert far.status == FAIL and "no near-tie" in far.reason and "frame 3" in far.reason
    tie = judge([_cmp(3, 0.2)], crit, [False])                 # a near-tie, but fp32 allows none
    assert tie.status == FAIL and "near-tie divergences" in tie.reason
    loose = freeze({**crit, "max_near_tie_divergences": 1})
    assert judge([_cmp(3, 0.2)], loose, [False]).status == PASS
    assert judge([_cmp(3, float("nan"))], loose, [False]).status == FAIL   # unknown margin: no near-tie
    assert judge([_cmp(None, None, code=4)], crit, [False]).status == FAIL  # codes part before tokens


# --- on a GPU: graphs on and off --------------------------------------------------------------------

@pytest.mark.gpu
def test_model_rows_on_gpu_with_graphs(tmp_path, tiny, example_clip, monkeypatch):
    """The three rows on the tiny model on CUDA, the engine run with and without captured graphs
    (cudagraph-eager: captured in seconds), in IEEE fp32 as the gate runs them (eval.models.ieee_fp32)."""
    import copy

    monkeypatch.setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")
    model, tok, rnnt_vocab, _ = tiny
    on_gpu = ModelSet.from_fp32(copy.deepcopy(model).cuda(), tok, rnnt_vocab, BF16)
    clips = [_clip(tmp_path, "a", example_clip[: 64 * 1280]), _clip(tmp_path, "b", example_clip[10 * 1280: 30 * 1280])]
    ctx = _ctx(tmp_path, clips, on_gpu, chunk_sizes=[320, 1280, 4000], batch_calls=8, graphs="true",
               graph_backend="cudagraph-eager")
    for name, row in (("encoder_parity", encoder_parity), ("margins", margins), ("consistency", consistency)):
        result = row(ctx, CRITERIA[name])
        assert result.status == PASS, f"{name}: {result.reason}"
    assert result.details["graphs_runs"] == [False, True]
    assert any("(graphs)" in c["pair"] for c in result.details["comparisons"])
