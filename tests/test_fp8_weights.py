"""`model.dtype.llm_weights` and `talker_weights` (nemo_duplex/models/fp8_weights.py): which projections become
float8, that casts keep them so and stacks stay views, that the memory plan counts them, that the settings are
checked, and that the LLM, the talker and a served call still work. Tiny model, CPU."""
import dataclasses

import pytest
import torch
import torch.nn as nn

from nemo_duplex.models.config import DtypeConfig, tiny_config
from nemo_duplex.models.fp8_weights import LLM_PROJECTIONS, TALKER_PROJECTIONS, Fp8Linear, quantize_projections
from nemo_duplex.models.model import VoiceChat
from nemo_duplex.serving.memory import weight_bytes
from ops.fp8_linear import fp8_linear_reference


def _cfg(**dtype):
    return dataclasses.replace(tiny_config(), dtype=DtypeConfig(**dtype))


def test_the_llm_projections_become_fp8_and_stay_so():
    """Every Mamba in_proj/out_proj and MLP up_proj/down_proj, nothing else; a later cast moves them but keeps
    e4m3; the conversion is idempotent; the product is the stated one on the projection's own weight."""
    torch.manual_seed(0)
    model = VoiceChat(_cfg(llm="bf16", llm_weights="fp8")).cast_for_inference()
    llm = model.llm
    fp8 = {n: m for n, m in llm.named_modules() if isinstance(m, Fp8Linear)}
    wanted = {n for n, m in VoiceChat(_cfg()).llm.named_modules() if n.rsplit(".", 1)[-1] in LLM_PROJECTIONS}
    assert set(fp8) == wanted and len(wanted) >= 4
    assert not any(type(m) is nn.Linear and n.rsplit(".", 1)[-1] in LLM_PROJECTIONS for n, m in llm.named_modules())
    assert model.talker.backbone.layers[0].mlp.up_proj.weight.dtype == torch.float32   # the talker's untouched
    proj = next(iter(fp8.values()))
    llm.to(torch.float32)
    assert proj.weight.dtype == torch.float8_e4m3fn and proj.weight_scale.dtype == torch.float32
    assert quantize_projections(llm, LLM_PROJECTIONS, "fp8", "model.dtype.llm_weights=fp8") == 0
    x = torch.randn(3, proj.in_features, dtype=torch.bfloat16)
    assert torch.equal(proj(x), fp8_linear_reference(x, proj.weight, proj.weight_scale))


def test_the_talker_projections_become_fp8_and_stack_in_e4m3():
    """Every projection of the talker backbone's layers, nothing else of the talker; q/k/v and gate/up stack as
    e4m3 rows with their scales (each module's buffers views of its block), so the stacked GEMM is the
    modules' products side by side; a later cast keeps e4m3 and re-stacks."""
    torch.manual_seed(0)
    model = VoiceChat(_cfg(talker="bf16", talker_weights="fp8_weight_only")).cast_for_inference()
    backbone = model.talker.backbone
    fp8 = {n for n, m in backbone.named_modules() if isinstance(m, Fp8Linear)}
    wanted = {n for n, m in VoiceChat(_cfg()).talker.backbone.named_modules()
              if n.rsplit(".", 1)[-1] in TALKER_PROJECTIONS and n.startswith("layers.")}
    assert fp8 == wanted and len(wanted) == 7 * len(backbone.layers)
    assert not any(isinstance(m, Fp8Linear) for m in model.talker.embed_subword.modules())
    assert not any(isinstance(m, Fp8Linear) for m in model.llm.modules())
    model.talker.to(torch.float32)
    for stacked in (backbone.layers[0].self_attn, backbone.layers[-1].mlp):
        assert stacked.stack.dtype == torch.float8_e4m3fn and stacked.stack_product == "fp8_weight_only"
        row = 0
        for name in stacked.stacked:
            linear = getattr(stacked, name)
            assert linear.weight.data_ptr() == stacked.stack[row].data_ptr()
            assert linear.weight_scale.data_ptr() == stacked.stack_scale[row].data_ptr()
            row += linear.weight.shape[0]
        assert row == stacked.stack.shape[0]
        x = torch.randn(3, stacked.stack.shape[1], dtype=torch.bfloat16)
        parts = torch.cat([getattr(stacked, name)(x) for name in stacked.stacked], dim=-1)
        assert torch.equal(stacked.stacked_product(x), parts)


def test_a_stack_of_mixed_projections_is_refused():
    """A stacked module with some linears in e4m3 and some not would multiply the wrong rows: an error names it."""
    attn = VoiceChat(_cfg()).talker.backbone.layers[0].self_attn
    attn.k_proj = Fp8Linear(attn.k_proj, "fp8")
    with pytest.raises(ValueError, match=r"Gemma3Attention: .*partly Fp8Linear"):
        attn.stack_projections()


@pytest.mark.parametrize("dtype", [dict(llm="bf16", llm_weights="fp8"), dict(llm="bf16", llm_weights="fp8_weight_only",
                                                                              talker="bf16", talker_weights="fp8")])
def test_weight_bytes_count_the_fp8_projections(dtype):
    """The memory plan (weights counted on the meta device) equals the converted model's bytes, and is the
    bf16 model's less one byte per converted weight plus 4 per scale."""
    cfg8 = _cfg(**dtype)
    cfg16 = _cfg(**{k: v for k, v in dtype.items() if not k.endswith("_weights")})
    model = VoiceChat(cfg8).cast_for_inference()
    model.perception.prepare_stream()
    model.codec.prvq.stacked()
    real = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    longest = model.talker.embed_subword.char_ids.shape[1]
    assert weight_bytes(cfg8, longest, device="cpu") == real
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert any(m in set(model.talker.modules()) for m in fp8) == ("talker_weights" in dtype)
    saved = sum(m.weight.numel() - 4 * m.weight_scale.numel() for m in fp8)
    assert weight_bytes(cfg16, longest, device="cpu") - weight_bytes(cfg8, longest, device="cpu") == saved > 0


def test_the_settings_are_checked():
    """An unknown product, and the weight-only product on a part that is not bf16/fp16 (its kernel widens e4m3
    to the part's dtype), are errors naming the setting."""
    with pytest.raises(ValueError, match=r"dtype.talker_weights: 'int8'; expected null \(the talker's dtype\)"):
        DtypeConfig(talker_weights="int8")
    with pytest.raises(ValueError, match=r"llm_weights=fp8_weight_only .* dtype.llm must be bf16 or fp16, not fp32"):
        DtypeConfig(llm_weights="fp8_weight_only")
    DtypeConfig(llm="fp16", llm_weights="fp8_weight_only", talker="bf16", talker_weights="fp8_weight_only")
    DtypeConfig(talker_weights="fp8")


def test_the_llm_with_fp8_projections_follows_the_bf16_one(tiny):
    """The LLM over a sequence (its offline forward) with fp8 projections against the same weights in bf16:
    e4m3 keeps 3 mantissa bits, so the hidden states move by a few percent, not more (relative error under
    10%, cosine over 0.99 per position; random tiny weights, 24 positions: measured 5.7% and 0.997 with x
    quantised too, where bf16 against fp32 is 0.85% and 0.99993), and less with the weight-only product,
    which leaves x in bf16 (measured 4.3% against 5.7%)."""
    model = tiny[0]
    from eval.models import with_dtypes
    a = with_dtypes(model, DtypeConfig(llm="bf16"))
    x = torch.randn(2, 24, model.cfg.llm.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    errors = {}
    for product in ("fp8", "fp8_weight_only"):
        b = with_dtypes(model, DtypeConfig(llm="bf16", llm_weights=product))
        in_proj = b.llm.layers[0].mixer.in_proj
        assert isinstance(in_proj, Fp8Linear) and in_proj.product == product
        with torch.no_grad():
            ha, hb = a.llm(x).float(), b.llm(x).float()
        errors[product] = ((hb - ha).norm() / ha.norm()).item()
        assert errors[product] < 0.1
        assert torch.nn.functional.cosine_similarity(ha, hb, dim=-1).min() > 0.99
    assert errors["fp8_weight_only"] < errors["fp8"], errors


def test_the_talker_with_fp8_projections_follows_the_bf16_one(tiny):
    """The talker backbone over a sequence with its projections in e4m3 against the same weights in bf16:
    relative error under 15%, cosine over 0.98 per position (random tiny weights, 24 positions: measured 8.7%
    and 0.991 weight-only, 11.7% and 0.986 with x quantised too, where bf16 against fp32 is 1.2%), the
    weight-only product the closer."""
    model = tiny[0]
    from eval.models import with_dtypes
    a = with_dtypes(model, DtypeConfig(talker="bf16"))
    x = torch.randn(2, 24, model.cfg.talker.backbone.hidden_size, generator=torch.Generator().manual_seed(2))
    x, positions = x.to(torch.bfloat16), torch.arange(24).expand(2, 24)
    errors = {}
    for product in ("fp8", "fp8_weight_only"):
        b = with_dtypes(model, DtypeConfig(talker="bf16", talker_weights=product))
        assert b.talker.backbone.layers[0].mlp.stack.dtype == torch.float8_e4m3fn
        with torch.no_grad():
            ha, hb = a.talker.backbone(x, positions).float(), b.talker.backbone(x, positions).float()
        errors[product] = ((hb - ha).norm() / ha.norm()).item()
        assert errors[product] < 0.15
        assert torch.nn.functional.cosine_similarity(ha, hb, dim=-1).min() > 0.98
    assert errors["fp8_weight_only"] < errors["fp8"], errors


def test_a_model_built_empty_is_quantised_after_its_weights_come():
    """The random-weights and checkpoint paths build the model empty (on meta, then materialised) and fill it:
    its projections stay nn.Linear until the cast after the fill, which quantises the filled values (the same
    e4m3 weights the bf16 model's projection gives; for the talker's stacks, the bf16 stack's rows)."""
    from nemo_duplex.checkpoint.random_weights import random_model
    from ops.fp8_linear import quantize_weight

    narrow, *_ = random_model(_cfg(llm="bf16", llm_weights="fp8", talker="bf16", talker_weights="fp8_weight_only"),
                              "cpu", seed=3)
    assert type(narrow.llm.layers[0].mixer.in_proj) is nn.Linear
    assert type(narrow.talker.backbone.layers[0].self_attn.q_proj) is nn.Linear
    narrow.cast_for_inference()
    wide, *_ = random_model(_cfg(llm="bf16", talker="bf16"), "cpu", seed=3)
    wide.cast_for_inference()
    got = narrow.llm.layers[0].mixer.in_proj
    w8, scale = quantize_weight(wide.llm.layers[0].mixer.in_proj.weight)
    assert isinstance(got, Fp8Linear) and torch.equal(got.weight.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(got.weight_scale, scale)
    stacked, bf16 = narrow.talker.backbone.layers[-1].mlp, wide.talker.backbone.layers[-1].mlp
    w8, scale = quantize_weight(bf16.stack)
    assert torch.equal(stacked.stack.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(stacked.stack_scale, scale)


@pytest.mark.parametrize("dtype", [dict(llm="bf16", llm_weights="fp8"), dict(talker="bf16", talker_weights="fp8"),
                                   dict(llm="bf16", llm_weights="fp8_weight_only", talker="bf16",
                                        talker_weights="fp8_weight_only")])
def test_the_engine_serves_with_fp8_projections(tiny, example_clip, monkeypatch, dtype):
    """The served path (prompt prefill, the batched step, an upload beside a live call) runs through the
    float8 products: every e4m3 weight (a projection's, or a stack's) is multiplied by its own product on
    every step, every frame of both calls comes back. (Its text is not compared with bf16's: the random tiny
    model's text margins are near-ties, so the ~6% the hidden states move, tests above, turns its very first
    token with a prompt.)"""
    from eval.models import with_dtypes
    from nemo_duplex.models import fp8_weights
    from nemo_duplex.models.stacking import StackedProjections
    from nemo_duplex.serving.drive import clip_plans, drive
    from nemo_duplex.serving.engine import build_engine
    from nemo_duplex.settings import EngineConfig

    model, tok, *_ = tiny
    cfg = EngineConfig(max_calls=2, max_call_s=2.0, kv_page_len=16, max_prompt_tokens=32)
    clips = [example_clip[i * 5000: i * 5000 + 1280 * 12] for i in range(2)]
    narrow = with_dtypes(model, DtypeConfig(**dtype))
    stacks = [m for m in narrow.modules() if isinstance(m, StackedProjections) and m.stack_scale is not None]
    in_stacks = {id(getattr(m, name)) for m in stacks for name in m.stacked}
    alone = [m for m in narrow.modules() if isinstance(m, Fp8Linear) and id(m) not in in_stacks]
    weights = [(m.stack_product, m.stack.data_ptr()) for m in stacks]
    weights += [(m.product, m.weight.data_ptr()) for m in alone]
    assert len(stacks) == (2 * len(narrow.talker.backbone.layers) if "talker_weights" in dtype else 0)
    rows = {}

    def counting(product, fn):
        def counted(x, w8, w_scale):
            rows[(product, w8.data_ptr())] = rows.get((product, w8.data_ptr()), 0) + x.numel() // x.shape[-1]
            return fn(x, w8, w_scale)
        return counted
    monkeypatch.setattr(fp8_weights, "fp8_linear", counting("fp8", fp8_weights.fp8_linear))
    monkeypatch.setattr(fp8_weights, "fp8_weight_linear", counting("fp8_weight_only", fp8_weights.fp8_weight_linear))
    out = drive(build_engine(narrow, tok, cfg), clip_plans(clips, prompt="Be brief.", uploads=[False, True], seed=1))
    for o in out:
        assert o.text_tokens.shape[0] == 12 and torch.isfinite(o.wav).all()
    # each weight multiplied by its product only, at least the 24 frames' rows and (the LLM's) the prompt's tokens
    # or (the talker's) its warm-up
    assert set(rows) == set(weights) and min(rows.values()) >= 24 + 3


def test_a_gpu_without_float8_is_refused_at_load(monkeypatch):
    """An A100 (compute capability 8.0) has no float8 GEMMs nor Triton's e4m3: loading refuses, naming the
    setting (the FP8 projections, or the talker's fp8 KV pools), before any step could fail; 8.9 and 9.0 pass,
    and the CPU (the torch statements) needs nothing."""
    import pytest

    from ops import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    for capability, refused in (((8, 0), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        if refused:
            with pytest.raises(ValueError, match=r"model.dtype.llm_weights=fp8 needs float8 support .*A100 has 8.0"):
                check_fp8_device(torch.device("cuda"))
            with pytest.raises(ValueError, match=r"model.dtype.talker_kv=fp8 needs float8 support"):
                check_fp8_device(torch.device("cuda"), "model.dtype.talker_kv=fp8")
        else:
            check_fp8_device(torch.device("cuda"))
    check_fp8_device(torch.device("cpu"))
    # the engine's pools: refused before anything is allocated
    from nemo_duplex.serving.state import allocate_call_state
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"model.dtype.talker_kv=fp8 needs float8 support .*A100"):
        allocate_call_state(VoiceChat(_cfg(talker_kv="fp8")), 1, 4, torch.device("cuda"))
