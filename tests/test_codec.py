"""RVQ codec (nemo_duplex/models/codec.py, spec 5): checkpoint keys, iSTFT head vs torch.istft, shape law,
causality, streaming == one-shot (delayed by 6 samples), the decoder's GEMMs with their weights split once
(RVQCodec.presplit_weights), control codes, encoder and silence codes, fp32 guard.

CPU, tiny config (C = 16, latent 32, 64 codewords x 31 quantisers; 1764 samples per code frame), fp32.
The codec's output is bounded by 1 in magnitude (|w clamp(x, -w, w)| <= w^2, divided by sum w^2), so
tolerances are absolute. One file past 500 lines on purpose: one per model part, sharing its tiny codec."""
import collections
import copy
import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F

from nemo_duplex.models import codec as codec_module
from nemo_duplex.models.codec import GEMMS, RVQCodec, istft, linear, replace_control_codes, upsample
from nemo_duplex.models.config import CodecConfig, tiny_config

SPF = 1764  # samples per code frame
DELAY = 6   # decode_step's stream lags one-shot decode by (n_fft - hop) / 2 samples
STREAM_ATOL = 1e-5  # stream vs one-shot, fp32 (only the summation order differs)
# Decode error against a float64 decode, per GEMM choice (|wav| <= 1). The iSTFT head amplifies the
# decoder's relative error (magnitudes up to 100, phases), so the wav error is ~30x the per-GEMM error:
# ieee / tf32x3 ~3e-6 measured on the tiny codec, bf16x3 ~1.4e-4 (per-GEMM ~5e-6 of sum |x w|).
DECODE_ATOL = {"ieee": 2e-5, "tf32x3": 2e-5, "tf32x3w": 2e-5, "fp16x3w": 2e-5, "bf16x3": 1e-3}


def _codec(seed: int = 0) -> RVQCodec:
    codec = RVQCodec(tiny_config().codec)
    codec.init_weights(torch.Generator().manual_seed(seed))
    return codec


def _codes(gen: torch.Generator, *shape: int, codebook: int = 64) -> torch.Tensor:
    return torch.randint(0, codebook, shape, generator=gen)


# ---- checkpoint keys (spec 6.3 "Codec"), full size on the meta device --------------------------------

def _spec_keys() -> dict[str, tuple[int, ...]]:
    """The spec 6.3 codec table, written out by hand."""
    keys: dict[str, tuple[int, ...]] = {}

    def convnext(prefix: str, d: int) -> None:
        keys.update({f"{prefix}.dwconv.weight": (d, 1, 7), f"{prefix}.dwconv.bias": (d,),
                     f"{prefix}.norm.weight": (d,), f"{prefix}.norm.bias": (d,),
                     f"{prefix}.pwconv1.weight": (4 * d, d, 1), f"{prefix}.pwconv1.bias": (4 * d,),
                     f"{prefix}.pwconv2.weight": (d, 4 * d, 1), f"{prefix}.pwconv2.bias": (d,)})

    # layers 0, 4, 8, 12: the convs between stages; 1-3, 5-7, 9-11: each stage's three ConvNeXt blocks
    for side, convs, widths in (
            ("encoder", [(384, 18, 1), (768, 384, 7), (1536, 768, 7), (512, 1536, 9)], (384, 768, 1536)),
            ("decoder", [(512, 1536, 9), (1536, 768, 7), (768, 384, 7), (18, 384, 1)], (1536, 768, 384))):
        for layer, shape in zip((0, 4, 8, 12), convs):
            keys[f"{side}.layers.{layer}.weight"] = shape
        for first, d in zip((1, 5, 9), widths):
            for i in range(first, first + 3):
                convnext(f"{side}.layers.{i}", d)
    for i in range(31):
        keys[f"prvq.mus_list.{i}"] = (1024, 512)
        keys[f"prvq._variance_list.{i}.variance"] = ()
    return keys


def test_state_dict_matches_spec_full_size():
    with torch.device("meta"):
        codec = RVQCodec(CodecConfig())
    got = {k: tuple(v.shape) for k, v in codec.state_dict().items()}
    want = _spec_keys()
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    assert {k: v for k, v in got.items() if v != want[k]} == {}
    assert all(v.dtype == torch.float32 for v in codec.state_dict().values())


# ---- iSTFT head (spec 5.3) vs an independent torch.istft computation ---------------------------------

def _istft_reference(head: torch.Tensor) -> torch.Tensor:
    """float64. Complex spectrum from (m, phi); irfft; clamp to [-w, w] per frame (torch.istft has no clamp,
    so the clamped frames go back to a spectrum with rfft, which irfft inverts exactly); torch.istft with
    the periodic Hann window (it multiplies by w, overlap-adds and divides by sum w^2). NeMo trims
    (16 - 4) / 2 = 6 samples at the start; center=True trims n_fft / 2 = 8 (center=False would need the
    envelope at sample 0, which is w[0]^2 = 0, and torch.istft refuses that), so torch.istft gives
    samples 2.. and samples 0, 1 are written out by hand from the two frames that cover them."""
    head = head.double()
    batch, _, frames_n = head.shape
    mag = 100.0 * torch.sigmoid(head[:, :9] - math.log(100.0))
    phase = head[:, 9:]
    real, imag = mag * torch.cos(phase), mag * torch.sin(phase)
    imag[:, 0] = 0.0  # DC and Nyquist are real: |X| cos(phi)
    imag[:, 8] = 0.0
    frames = torch.fft.irfft(torch.complex(real, imag), n=16, dim=1)  # [B, 16, S]
    window = torch.hann_window(16, periodic=True, dtype=torch.float64)
    clamped = torch.maximum(torch.minimum(frames, window[:, None]), -window[:, None])
    tail = torch.istft(torch.fft.rfft(clamped, dim=1), n_fft=16, hop_length=4, win_length=16, window=window,
                       center=True, normalized=False, onesided=True, length=4 * frames_n - 2)
    # Output sample p is overlap-add sample p + 6: frames 0 (offset p + 6) and 1 (offset p + 2) cover p = 0, 1.
    head_samples = [(window[p + 6] * clamped[:, p + 6, 0] + window[p + 2] * clamped[:, p + 2, 1])
                    / (window[p + 6] ** 2 + window[p + 2] ** 2) for p in (0, 1)]
    return torch.cat([torch.stack(head_samples, dim=1), tail], dim=1), (clamped != frames).double().mean()


@pytest.mark.parametrize("by_matmul", [False, True])
def test_istft_head_matches_torch_istft(by_matmul):
    gen = torch.Generator().manual_seed(1)
    frames_n = 40
    head = torch.randn(2, 18, frames_n, generator=gen) * 3.0  # magnitudes from ~0 to saturated (100)
    ours = istft(head, n_fft=16, hop=4, by_matmul=by_matmul)
    ref, clamped_fraction = _istft_reference(head)
    assert ours.shape == ref.shape == (2, 4 * frames_n)
    assert clamped_fraction > 0.1  # the clamp is really exercised
    assert (ours.double() - ref).abs().max() <= 1e-5


# ---- one-shot decode ---------------------------------------------------------------------------------

@pytest.mark.parametrize("frames_n", [1, 3])
def test_decode_shape_law_and_scale(frames_n):
    codec = _codec()
    gen = torch.Generator().manual_seed(2)
    wav = codec.decode(_codes(gen, 2, frames_n, 31))
    assert wav.shape == (2, SPF * frames_n) and wav.dtype == torch.float32
    assert torch.isfinite(wav).all() and wav.abs().max() <= 1.0
    assert 0.05 < wav.std() < 1.0  # random weights give O(1) audio, not silence


def test_decode_by_matmul_agrees_with_fft():
    codec = _codec()
    codes = _codes(torch.Generator().manual_seed(3), 2, 3, 31)
    assert (codec.decode(codes, by_matmul=True) - codec.decode(codes)).abs().max() <= 1e-5


def test_dequantize_is_the_sum_of_codewords():
    codec = _codec()
    codes = _codes(torch.Generator().manual_seed(4), 2, 3, 31)
    want = torch.zeros(2, 3, 32, dtype=torch.float64)
    for b in range(2):
        for t in range(3):
            for i in range(31):
                want[b, t] += codec.prvq.mus_list[i][codes[b, t, i]].double()
    assert (codec.dequantize(codes).double() - want).abs().max() <= 1e-5


def test_decoder_is_causal():
    """Changing code frame t leaves every sample before t's region minus the iSTFT overlap (6 samples)
    unchanged, and does change t's own region."""
    codec = _codec()
    gen = torch.Generator().manual_seed(5)
    codes = _codes(gen, 1, 4, 31)
    changed = codes.clone()
    t = 2
    changed[0, t] = (codes[0, t] + 1 + _codes(gen, 31, codebook=62)) % 64
    a, b = codec.decode(codes), codec.decode(changed)
    first = SPF * t - DELAY
    assert (a[:, :first] - b[:, :first]).abs().max() <= 1e-6
    assert (a[:, SPF * t:SPF * (t + 1)] - b[:, SPF * t:SPF * (t + 1)]).abs().max() > 1e-2


# ---- decoder GEMMs (codec.linear) ---------------------------------------------------------------------

def test_upsample_is_conv_transpose_with_kernel_equal_stride():
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(2, 24, 5, generator=gen)
    weight = torch.randn(24, 16, 7, generator=gen)
    expected = F.conv_transpose1d(x, weight, stride=7)
    torch.testing.assert_close(upsample(x, weight, "ieee"), expected, rtol=1e-5, atol=1e-5)  # fp32, same sums


def test_bf16x3_linear_error_is_the_split_error():
    """bf16x3 keeps 16 mantissa bits of each operand: error <= 2.5e-5 of sum |x w| (3 x 2^-17, the dropped
    lo*lo term and the lo parts' rounding); a single bf16 product is ~100x worse, so the bound can fail."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(3, 400, 96, generator=gen)  # 1200 rows: >= SPLIT_GEMM_MIN_ROWS, so the split path runs
    w = torch.randn(40, 96, generator=gen) / 10
    b = torch.randn(40, generator=gen)
    ref = F.linear(x.double(), w.double(), b.double())
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()

    def error(y):
        return ((y.double() - ref).abs() / scale).max().item()

    assert error(linear(x, w, b, "ieee")) <= 1e-6
    assert error(linear(x, w, b, "bf16x3")) <= 2.5e-5
    assert error(F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())) > 1e-3
    gelu = linear(x, w, b, "bf16x3", gelu=True)
    torch.testing.assert_close(gelu, F.gelu(linear(x, w, b, "bf16x3")), rtol=0, atol=0)
    with pytest.raises(ValueError):
        linear(x, w, b, "tf32")
    # fewer rows than SPLIT_GEMM_MIN_ROWS: the IEEE GEMM, bit for bit
    few = codec_module.SPLIT_GEMM_MIN_ROWS - 1
    assert torch.equal(linear(x[0, :few], w, b, "bf16x3"), linear(x[0, :few], w, b, "ieee"))
    assert not torch.equal(linear(x[0, :few + 1], w, b, "bf16x3"), linear(x[0, :few + 1], w, b, "ieee"))


def _decode_fp64(codec: RVQCodec, codes: torch.Tensor) -> torch.Tensor:
    reference = copy.deepcopy(codec).double()
    with torch.no_grad():
        head = reference.decoder(reference.dequantize(codes).transpose(1, 2))
    return istft(head, codec.cfg.n_fft, codec.cfg.hop_length)


@pytest.mark.parametrize("gemm", ["ieee", pytest.param("tf32x3", marks=pytest.mark.triton_interpret),
                                  pytest.param("tf32x3w", marks=pytest.mark.triton_interpret),
                                  pytest.param("fp16x3w", marks=pytest.mark.triton_interpret), "bf16x3"])
def test_decode_error_per_gemm(gemm, monkeypatch):
    """One-shot decode and the stream against a float64 decode (DECODE_ATOL). tf32x3 runs the Triton
    kernel (through the interpreter on CPU: slow, so one call of one frame). The split GEMMs run at every
    size here (the tiny codec's GEMMs are below SPLIT_GEMM_MIN_ROWS)."""
    monkeypatch.setattr(codec_module, "SPLIT_GEMM_MIN_ROWS", 0)
    codec = _codec()
    codec.gemm = gemm
    gen = torch.Generator().manual_seed(22)
    codes = _codes(gen, 1, 1, 31) if gemm in ("tf32x3", "tf32x3w", "fp16x3w") else _codes(gen, 2, 3, 31)
    ref = _decode_fp64(codec, codes)
    assert (codec.decode(codes).double() - ref).abs().max() <= DECODE_ATOL[gemm]
    state = codec.allocate_stream_state(codes.shape[0] + 1, "cpu")
    slots = torch.arange(codes.shape[0])
    parts = [codec.decode_step(codes[:, t], state, slots) for t in range(codes.shape[1])]
    stream = torch.cat(parts + [codec.flush_step(state, slots)], dim=1)[:, DELAY:]
    assert (stream.double() - ref).abs().max() <= DECODE_ATOL[gemm]


def test_gemm_choice_comes_from_the_config():
    cfg = tiny_config().codec
    cfg.gemm = "bf16x3"
    assert RVQCodec(cfg).gemm == "bf16x3"
    cfg.gemm = "tf32"  # plain TF32 is not a choice (spec 9.9)
    with pytest.raises(ValueError):
        RVQCodec(cfg)


# ---- pre-split GEMM weights (RVQCodec.presplit_weights) ---------------------------------------------
# On the CPU through the interpreter (TRITON_INTERPRET=1, tiny sizes); where there is a GPU, on it with the
# compiled kernels (the full-size check is test_gpu_full_size_presplit_step_equals_the_per_step_split).

KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _splits(codec: RVQCodec) -> list[torch.Tensor]:
    """The split of every GEMM of decode_step, in step order (empty where not built)."""
    return [getattr(holder, name) for holder, name, _ in codec.decoder.step_gemms()]


def _assert_splits_current(codec: RVQCodec) -> None:
    """Every GEMM of decode_step has its split for the codec's gemm, the halves of its weight as the step
    multiplies by it (upsampling weights reordered channels-last), from the weights as they are now."""
    from ops.fp16x3_linear import split_fp16_weight, unpack_weight_split
    from ops.fp32_linear import split_tf32_reference

    gemm = codec_module.resolve_gemm(codec.gemm, codec.decoder.layers[-1].weight.device)
    for holder, name, layer in codec.decoder.step_gemms():
        weight = codec_module.gemm_weight(layer)
        table = getattr(holder, name)
        if gemm == "tf32x3w":
            hi, lo = split_tf32_reference(weight)
            assert table.shape == (2, *hi.shape) and torch.equal(table[0], hi) and torch.equal(table[1], lo), name
        else:
            assert gemm == "fp16x3w" and table.dtype == torch.float16, (gemm, table.dtype)
            want = split_fp16_weight(weight)
            assert all(torch.equal(a, e) for a, e in zip(unpack_weight_split(table, *weight.shape), want)), name


def _no_splits(codec: RVQCodec) -> bool:
    return all(table.numel() == 0 for table in _splits(codec))


@pytest.mark.triton_interpret
def test_a_split_is_read_only_where_the_gemm_takes_it(monkeypatch):
    """linear and upsample_channels_last read `split` only in the Triton tf32x3w and fp16x3w GEMMs; every
    other path reads the unsplit weight, bit for bit as without a split: the other gemm choices, the IEEE
    fallback below `split_min_rows` (64 rows for tf32x3w; fp16x3w has none, so it is set to 64 here to test
    its fallback too), and both off Triton (the torch reference on the CPU without the interpreter). A NaN
    split shows any read."""
    from ops.fp16x3_linear import weight_split_numel

    monkeypatch.setattr(codec_module, "FP16X3_MIN_ROWS", codec_module.SPLIT_GEMM_MIN_ROWS)

    gen = torch.Generator().manual_seed(23)
    min_rows = codec_module.SPLIT_GEMM_MIN_ROWS
    x = torch.randn(min_rows + 36, 24, generator=gen)
    w, b = torch.randn(40, 24, generator=gen) / 5, torch.randn(40, generator=gen)
    up = torch.randn(24, 8, 5, generator=gen) / 5   # ConvTranspose1d weight [C_in, C_out, k]
    nan = {"tf32x3w": torch.full((2, 40, 24), float("nan")),   # also [2, k C_out, C_in] for `up`
           "fp16x3w": torch.full((weight_split_numel(40, 24),), float("nan"), dtype=torch.float16)}
    for device, triton in ((KERNEL_DEVICE, True), ("cpu", False)):
        if not triton:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        xd, wd, bd, upd = (t.to(device) for t in (x, w, b, up))
        with codec_module.exact_fp32(xd.device):
            for gemm in GEMMS:
                for rows in (min_rows - 1, min_rows + 36):
                    resolved = codec_module.resolve_gemm(gemm, xd.device)
                    read = triton and resolved in codec_module.PRESPLIT_GEMMS and rows >= min_rows
                    nand = nan.get(resolved, nan["tf32x3w"]).to(device)
                    out = codec_module.linear(xd[:rows], wd, bd, gemm, split=nand)
                    up_out = codec_module.upsample_channels_last(xd[None, :rows], upd, gemm, split=nand)
                    if read:
                        assert torch.isnan(out).all() and torch.isnan(up_out).all(), (gemm, rows, device)
                    else:
                        assert torch.equal(out, codec_module.linear(xd[:rows], wd, bd, gemm)), (gemm, rows, device)
                        assert torch.equal(up_out, codec_module.upsample_channels_last(xd[None, :rows], upd, gemm))


@pytest.mark.triton_interpret
@pytest.mark.parametrize("gemm", ["tf32x3w", "fp16x3w"])
def test_presplit_decode_step_equals_the_per_step_split_bit_for_bit(gemm, monkeypatch):
    """With the decoder's GEMM weights split once (presplit_weights), decode_step gives the per-step split
    path's output bit for bit (the same products; for fp16x3w the same chain of split activations, the
    conv + norm's and pwconv1's outputs written split) and runs no weight split. tf32x3w: 2 rows per step
    put stage 1 (2 and 18 rows) below SPLIT_GEMM_MIN_ROWS, where the IEEE fallback must read the unsplit
    weights: NaN in those splits changes nothing; fp16x3w (no fallback) reads every split. NaN in a split
    the step takes shows up."""
    from ops import fp32_linear as fp32_linear_module

    codec = _codec().to(KERNEL_DEVICE)
    codec.gemm = gemm
    per_step = copy.deepcopy(codec)
    codec.presplit_weights()
    _assert_splits_current(codec)
    assert _no_splits(per_step)
    splits = []
    module, name = (fp32_linear_module, "split_tf32") if gemm == "tf32x3w" else (codec_module, "split_fp16_weight")
    real_split = getattr(module, name)
    monkeypatch.setattr(module, name, lambda w, out=None: splits.append(1) or real_split(w, out))
    gen = torch.Generator().manual_seed(24)
    codes = _codes(gen, 2, 2, 31).to(KERNEL_DEVICE)
    slots = torch.tensor([2, 0], device=KERNEL_DEVICE)
    state = codec.allocate_stream_state(3, KERNEL_DEVICE)
    state_per_step = per_step.allocate_stream_state(3, KERNEL_DEVICE)
    for t in range(2):
        splits.clear()
        want = per_step.decode_step(codes[:, t], state_per_step, slots)
        # tf32x3w, at or above 64 rows: stage 2's and 3's six pwconvs each, their upsampling layer, the final
        # conv; fp16x3w: also stage 1's six and its upsampling layer
        assert len(splits) == (14 if gemm == "tf32x3w" else 22)
        before = copy.deepcopy(state)
        splits.clear()
        got = codec.decode_step(codes[:, t], state, slots)
        assert splits == [] and torch.equal(got, want), t
    blocks = codec.decoder.layers[1:4]   # stage 1; layers 0 and 4 are the upsampling GEMMs around it
    below = [b.pwconv1_split for b in blocks] + [b.pwconv2_split for b in blocks] + \
        [codec.decoder.split_0, codec.decoder.split_4]
    for table in below:
        table.fill_(float("nan"))
    stage_1_nan = codec.decode_step(codes[:, 1], copy.deepcopy(before), slots)
    if gemm == "tf32x3w":
        assert torch.equal(stage_1_nan, want)   # below SPLIT_GEMM_MIN_ROWS: not read
    else:
        assert torch.isnan(stage_1_nan).all()   # no fallback: read
        codec.weights_loaded()
    codec.decoder.split_12.fill_(float("nan"))
    assert torch.isnan(codec.decode_step(codes[:, 1], copy.deepcopy(before), slots)).all()
    codec.weights_loaded()   # re-split: every table current again
    _assert_splits_current(codec)


@pytest.mark.triton_interpret
@pytest.mark.parametrize("gemm", ["tf32x3w", "fp16x3w"])
def test_presplit_weights_follow_loads_and_casts(gemm, monkeypatch):
    """The splits are never stale: load_state_dict and init_weights re-split them in place (the same
    memory, so a captured graph keeps reading them) and the step follows the new weights; a cast rebuilds
    them from the cast weights (none while not fp32); they exist only where a GEMM reads them."""
    codec = _codec(0).to(KERNEL_DEVICE)
    codec.gemm = gemm
    codec.presplit_weights()
    pointers = [table.data_ptr() for table in _splits(codec)]
    codec.load_state_dict(_codec(1).state_dict())
    _assert_splits_current(codec)
    assert [table.data_ptr() for table in _splits(codec)] == pointers
    loaded = _codec(1).to(KERNEL_DEVICE)
    loaded.gemm = gemm
    codes = _codes(torch.Generator().manual_seed(25), 2, 31).to(KERNEL_DEVICE)
    slots = torch.tensor([0, 1], device=KERNEL_DEVICE)
    assert torch.equal(codec.decode_step(codes, codec.allocate_stream_state(3, KERNEL_DEVICE), slots),
                       loaded.decode_step(codes, loaded.allocate_stream_state(3, KERNEL_DEVICE), slots))
    codec.init_weights(torch.Generator().manual_seed(2))
    _assert_splits_current(codec)
    codec.double()
    assert _no_splits(codec)
    with torch.no_grad():
        codec.decoder.layers[0].weight.mul_(2)   # changed while not split
    codec.float()
    _assert_splits_current(codec)
    interpreter = "TRITON_INTERPRET" in os.environ
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    codec.cpu()   # the CPU without the interpreter: fp32_linear's torch reference, which reads no split
    assert _no_splits(codec)
    if interpreter:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    codec.to(KERNEL_DEVICE)
    _assert_splits_current(codec)
    ieee = _codec().to(KERNEL_DEVICE)
    ieee.gemm = "ieee"
    ieee.presplit_weights()
    assert _no_splits(ieee)


# ---- streaming ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernels", [None, pytest.param("tf32x3w", marks=pytest.mark.triton_interpret),
                                     pytest.param("fp16x3w", marks=pytest.mark.triton_interpret)])
def test_streaming_equals_one_shot_delayed(kernels, monkeypatch):
    """Three calls starting at different steps in one batch (plus a padding row on the sink, rows in a
    shuffled order each step), then a fourth call re-using the first call's slot after a reset. The state
    starts full of garbage: admission's reset must be enough. Each call's stream + flush must equal
    6 zeros followed by its one-shot decode. With `kernels`, decode_step runs the Triton kernels the GPU
    runs (the fused depthwise conv + LayerNorm, the 3xTF32 or fp16x3 GEMMs with their epilogues) through
    the interpreter, on a decoder of one ConvNeXt block per stage (num_blocks 1 instead of 3: every kernel
    still runs at every stage's frame rate, at a third of the interpreter's work); without, the tiny codec
    as it is."""
    codec = _codec()
    if kernels:
        codec = RVQCodec(dataclasses.replace(tiny_config().codec, num_blocks=1))
        codec.init_weights(torch.Generator().manual_seed(0))
        monkeypatch.setattr(codec_module, "SPLIT_GEMM_MIN_ROWS", 0)
        codec.gemm = kernels
    gen = torch.Generator().manual_seed(6)
    num_slots = 4
    sink = num_slots - 1
    state = codec.allocate_stream_state(num_slots, "cpu")
    for tensor in state.convnext_history + [state.ola_tail, state.envelope_tail]:
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    state.frames_done.fill_(5)
    # name: (slot, first step, frames)
    calls = {"a": (0, 0, 8), "b": (2, 3, 8), "c": (1, 5, 8), "d": (0, 9, 4)}  # 8 frames > the 6 of history
    codes = {name: _codes(gen, n, 31) for name, (_, _, n) in calls.items()}
    streams = {name: [] for name in calls}
    for step in range(max(start + n for _, start, n in calls.values())):
        rows = []
        for name, (slot, start, n) in calls.items():
            if step == start:
                codec.reset_slots(state, torch.tensor([slot]))
            if start <= step < start + n:
                rows.append(name)
        order = torch.randperm(len(rows) + 1, generator=gen).tolist()
        batch = [(rows + [None])[i] for i in order]
        slots = torch.tensor([sink if name is None else calls[name][0] for name in batch])
        step_codes = torch.stack([_codes(gen, 31) if name is None else codes[name][step - calls[name][1]]
                                  for name in batch])
        wav = codec.decode_step(step_codes, state, slots)
        assert wav.shape == (len(batch), SPF)
        for row, name in enumerate(batch):
            if name is not None:
                streams[name].append(wav[row])
        for name, (slot, start, n) in calls.items():
            if step == start + n - 1:
                streams[name].append(codec.flush_step(state, torch.tensor([slot]))[0])
    for name, parts in streams.items():
        stream = torch.cat(parts)
        one_shot = codec.decode(codes[name][None])[0]
        assert stream.shape == (SPF * calls[name][2] + DELAY,)
        assert torch.equal(stream[:DELAY], torch.zeros(DELAY))
        assert (stream[DELAY:] - one_shot).abs().max() <= STREAM_ATOL, name


def test_step_constants_are_built_once_and_stay_fp32():
    """decode_step's window, inner-bin mask, envelope and head mask are the values the functions compute,
    not checkpoint keys, and a cast (which would round them) rebuilds them in fp32."""
    from nemo_duplex.models.codec import hann_window, window_envelope

    codec = RVQCodec(tiny_config().codec)
    cfg = codec.cfg
    window = hann_window(cfg.n_fft, torch.device("cpu"))
    envelope = window_envelope(codec.samples_per_frame // cfg.hop_length, cfg.n_fft, cfg.hop_length,
                               torch.device("cpu"))
    assert not any(k.startswith("step_") for k in codec.state_dict())
    codec.to(torch.bfloat16).float()
    assert codec.step_window.dtype == torch.float32 and torch.equal(codec.step_window, window)
    assert torch.equal(codec.step_envelope, envelope) and codec.step_envelope.shape[1] == codec.samples_per_frame + 12
    assert codec.step_inner_bins.tolist() == [0.0] + [1.0] * (cfg.n_fft // 2 - 1) + [0.0]
    assert codec.step_head.tolist() == [True] * codec.stream_delay + [False] * (codec.samples_per_frame - 6)
    assert not torch.equal(window.bfloat16().float(), window)   # the cast would have rounded it


def test_flush_of_an_empty_slot_is_silence():
    codec = _codec()
    state = codec.allocate_stream_state(2, "cpu")
    assert torch.equal(codec.flush_step(state, torch.tensor([0, 1])), torch.zeros(2, DELAY))


# ---- control codes (spec 5.4) ------------------------------------------------------------------------

def test_control_codes_are_replaced_by_silence():
    codec = _codec()
    gen = torch.Generator().manual_seed(7)
    silence = _codes(gen, 31)
    codes = _codes(gen, 2, 3, 31)
    codes[0, 1, :] = 64            # speech pad on every codebook
    codes[1, 0, 5] = 65            # eos on one codebook
    codes[1, 2, 30] = 66           # bos on the last
    replaced = replace_control_codes(codes, silence, 64)
    for b in range(2):
        for t in range(3):
            for i in range(31):
                want = silence[i] if codes[b, t, i] >= 64 else codes[b, t, i]
                assert replaced[b, t, i] == want
    assert torch.equal(codec.decode(codes, silence_codes=silence), codec.decode(replaced))
    state = codec.allocate_stream_state(3, "cpu")
    slots = torch.tensor([0, 1])
    with_control = codec.decode_step(codes[:, 1], state, slots, silence_codes=silence)
    codec.reset_slots(state, slots)
    assert torch.equal(with_control, codec.decode_step(replaced[:, 1], state, slots))


# ---- encoder (spec 5.5) ------------------------------------------------------------------------------

@pytest.mark.parametrize("frames_n", [1, 2])
def test_encoder_shape_law(frames_n):
    codec = _codec()
    wav = torch.randn(2, SPF * frames_n, generator=torch.Generator().manual_seed(8)) * 0.3
    codes = codec.encode(wav)
    assert codes.shape == (2, frames_n, 31) and codes.dtype == torch.int64
    assert codes.min() >= 0 and codes.max() < 64
    latent = codec.encoder(wav)
    assert latent.shape == (2, 32, frames_n) and 0.1 < latent.std() < 10  # O(1) activations
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(1, SPF + 1))


def test_quantize_is_greedy_nearest_codeword():
    codec = _codec()
    latent = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(9))
    codes = codec.prvq.quantize(latent)
    residual = latent.double()
    for i, mus in enumerate(codec.prvq.mus_list):
        distance = (residual[..., None, :] - mus.double()).square().sum(-1)  # [3, 5, 64]
        chosen = distance.gather(-1, codes[..., i:i + 1])[..., 0]
        assert (chosen <= distance.min(-1).values * (1 + 1e-5) + 1e-7).all(), i
        residual = residual - mus.double()[codes[..., i]]


def test_silence_codes_is_the_most_frequent_frame_of_encoded_zeros():
    codec = _codec()
    silence = codec.silence_codes(seconds=5.0)  # 62 code frames at 22.05 kHz
    assert silence.shape == (31,) and silence.dtype == torch.int64
    frames = codec.encode(torch.zeros(1, 62 * SPF))[0]
    counts = collections.Counter(tuple(f) for f in frames.tolist())
    assert counts[tuple(silence.tolist())] == max(counts.values())


# ---- numerics guard and weights ----------------------------------------------------------------------

def test_bf16_codec_is_refused():
    codec = _codec().to(torch.bfloat16)
    codes = torch.zeros(1, 1, 31, dtype=torch.int64)
    with pytest.raises(TypeError, match="fp32"):
        codec.decode(codes)
    with pytest.raises(TypeError, match="fp32"):
        codec.decode_step(codes[:, 0], codec.allocate_stream_state(2, "cpu"), torch.tensor([0]))
    with pytest.raises(TypeError, match="fp32"):
        codec.encode(torch.zeros(1, SPF))


def test_init_weights_is_seeded_and_fills_everything():
    a, b, c = _codec(0), _codec(0), _codec(1)
    for key, value in a.state_dict().items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, b.state_dict()[key]), key
    assert not torch.equal(a.prvq.mus_list[0], c.prvq.mus_list[0])
    nan_filled = RVQCodec(tiny_config().codec)
    for p in nan_filled.parameters():
        p.data.fill_(float("nan"))
    nan_filled.init_weights(torch.Generator().manual_seed(0))
    assert all(torch.isfinite(p).all() for p in nan_filled.parameters())
    for mus in a.prvq.mus_list:
        assert torch.unique(mus, dim=0).shape[0] == mus.shape[0]  # distinct codewords


# ---- GPU (full size) ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_codec_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    codec = RVQCodec(CodecConfig())
    codec.init_weights(torch.Generator().manual_seed(0))
    return codec


@pytest.mark.gpu
def test_gpu_full_size_matches_cpu_with_tf32_flags_on(full_codec_cuda):
    """Global TF32 flags on (cuDNN convs default to TF32): decode must still match the CPU's fp32 decode,
    because it runs under exact_fp32(). Tolerance 1e-4 absolute (|wav| <= 1)."""
    codec = full_codec_cuda
    codes = _codes(torch.Generator().manual_seed(10), 2, 3, 31, codebook=1024)
    cpu = codec.decode(codes)
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision)
    matmul.fp32_precision, conv.fp32_precision = "tf32", "tf32"
    try:
        gpu = codec.cuda().decode(codes.cuda()).cpu()
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")  # flags restored
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved
        codec.cpu()
    assert (gpu - cpu).abs().max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", GEMMS)
def test_gpu_full_size_streaming_in_a_cuda_graph(full_codec_cuda, gemm):
    """decode_step captured once in a CUDA graph, replayed per frame for two calls (+ a sink row),
    equals the one-shot decode delayed by 6 samples (1e-4 ieee / tf32x3; bf16x3: both sides carry its
    error, 2 x GPU_DECODE_ATOL)."""
    codec = full_codec_cuda.cuda()
    codec.gemm = gemm
    try:
        frames_n, num_slots = 5, 4
        codes = _codes(torch.Generator().manual_seed(11), 2, frames_n, 31, codebook=1024).cuda()
        state = codec.allocate_stream_state(num_slots, "cuda")
        codes_in = torch.zeros(3, 31, dtype=torch.int64, device="cuda")
        slots_in = torch.full((3,), num_slots - 1, dtype=torch.int64, device="cuda")
        codec.decode_step(codes_in, state, slots_in)  # warm-up outside the capture (kernels, DFT basis)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            wav_out = codec.decode_step(codes_in, state, slots_in)
        slots_in.copy_(torch.tensor([1, num_slots - 1, 0]))
        codec.reset_slots(state, slots_in[[0, 2]])
        parts = []
        for t in range(frames_n):
            codes_in[0] = codes[0, t]
            codes_in[2] = codes[1, t]
            graph.replay()
            parts.append(wav_out[[0, 2]].clone())
        parts.append(codec.flush_step(state, slots_in[[0, 2]]))
        stream = torch.cat(parts, dim=1)
        one_shot = codec.decode(codes)
        assert torch.equal(stream[:, :DELAY], torch.zeros(2, DELAY, device="cuda"))
        assert (stream[:, DELAY:] - one_shot).abs().max() <= (2 * GPU_DECODE_ATOL[gemm] if gemm == "bf16x3" else 1e-4)
    finally:
        codec.gemm = "ieee"
        codec.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["auto", "tf32x3w"])
def test_gpu_full_size_presplit_step_equals_the_per_step_split(full_codec_cuda, gemm):
    """Full size, gemm "auto" (fp16x3w on CUDA) and tf32x3w: decode_step with the decoder's GEMM weights
    split once (presplit_weights, ~350 / ~700 MiB) gives the per-step split's output bit for bit, at 1 call
    (tf32x3w: stage 1 below SPLIT_GEMM_MIN_ROWS, the IEEE fallback on the unsplit weights; fp16x3w has no
    fallback) and at 128 (every GEMM split), eagerly and replayed from a CUDA graph."""
    per_step = full_codec_cuda.cuda()
    split = copy.deepcopy(per_step)
    try:
        per_step.gemm = split.gemm = gemm
        split.presplit_weights()
        _assert_splits_current(split)
        gen = torch.Generator().manual_seed(13)
        for calls in (1, 128):
            codes = _codes(gen, calls, 3, 31, codebook=1024).cuda()
            slots = torch.arange(calls, device="cuda")
            state_per_step, state_split, state_graph = (c.allocate_stream_state(calls + 1, "cuda")
                                                        for c in (per_step, split, split))
            codes_in = codes[:, 0].clone()
            split.decode_step(codes_in, state_graph, slots)  # warm-up outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                wav_graph = split.decode_step(codes_in, state_graph, slots)
            split.reset_slots(state_graph, slots)
            for t in range(3):
                want = per_step.decode_step(codes[:, t], state_per_step, slots)
                assert torch.equal(split.decode_step(codes[:, t], state_split, slots), want), (calls, t)
                codes_in.copy_(codes[:, t])
                graph.replay()
                assert torch.equal(wav_graph, want), (calls, t)
    finally:
        per_step.gemm = "ieee"
        per_step.cpu()
        del split


# Full-size decode on the H200 against a float64 decode (|wav| <= 1), per GEMM choice.
# auto = fp16x3w on CUDA
GPU_DECODE_ATOL = {"ieee": 1e-4, "tf32x3": 1e-4, "tf32x3w": 1e-4, "fp16x3w": 1e-4, "auto": 1e-4, "bf16x3": 3e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", GEMMS)
def test_gpu_full_size_decode_error_per_gemm(full_codec_cuda, gemm):
    codec = full_codec_cuda.cuda()
    codec.gemm = gemm
    try:
        codes = _codes(torch.Generator().manual_seed(12), 3, 3, 31, codebook=1024).cuda()
        ref = _decode_fp64(codec, codes)
        error = (codec.decode(codes).double() - ref).abs().max().item()
        print(f"full-size decode, gemm {gemm}: max |wav - float64| = {error:.2e}")
        assert error <= GPU_DECODE_ATOL[gemm]
    finally:
        codec.gemm = "ieee"
        codec.cpu()
