"""RVQ codec (nemo_duplex/codec.py, spec 5): checkpoint keys, iSTFT head vs torch.istft, shape law,
causality, streaming == one-shot (delayed by 6 samples), control codes, encoder and silence codes, fp32 guard.

CPU, tiny config (C = 16, latent 32, 64 codewords x 31 quantisers; 1764 samples per code frame), fp32.
The codec's output is bounded by 1 in magnitude (|w clamp(x, -w, w)| <= w^2, divided by sum w^2), so
tolerances are absolute."""
import collections
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from nemo_duplex import codec as codec_module
from nemo_duplex.codec import GEMMS, RVQCodec, istft, linear, replace_control_codes, upsample
from nemo_duplex.config import CodecConfig, tiny_config

SPF = 1764  # samples per code frame
DELAY = 6   # decode_step's stream lags one-shot decode by (n_fft - hop) / 2 samples
STREAM_ATOL = 1e-5  # stream vs one-shot, fp32 (only the summation order differs)
# Decode error against a float64 decode, per GEMM choice (|wav| <= 1). The iSTFT head amplifies the
# decoder's relative error (magnitudes up to 100, phases), so the wav error is ~30x the per-GEMM error:
# ieee / tf32x3 ~3e-6 measured on the tiny codec, bf16x3 ~1.4e-4 (per-GEMM ~5e-6 of sum |x w|).
DECODE_ATOL = {"ieee": 2e-5, "tf32x3": 2e-5, "tf32x3w": 2e-5, "bf16x3": 1e-3}


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

    keys["encoder.layers.0.weight"] = (384, 18, 1)
    keys["encoder.layers.4.weight"] = (768, 384, 7)
    keys["encoder.layers.8.weight"] = (1536, 768, 7)
    keys["encoder.layers.12.weight"] = (512, 1536, 9)
    for first, d in ((1, 384), (5, 768), (9, 1536)):
        for i in range(first, first + 3):
            convnext(f"encoder.layers.{i}", d)
    keys["decoder.layers.0.weight"] = (512, 1536, 9)
    keys["decoder.layers.4.weight"] = (1536, 768, 7)
    keys["decoder.layers.8.weight"] = (768, 384, 7)
    keys["decoder.layers.12.weight"] = (18, 384, 1)
    for first, d in ((1, 1536), (5, 768), (9, 384)):
        for i in range(first, first + 3):
            convnext(f"decoder.layers.{i}", d)
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
                                  pytest.param("tf32x3w", marks=pytest.mark.triton_interpret), "bf16x3"])
def test_decode_error_per_gemm(gemm, monkeypatch):
    """One-shot decode and the stream against a float64 decode (DECODE_ATOL). tf32x3 runs the Triton
    kernel (through the interpreter on CPU: slow, so one call of one frame). The split GEMMs run at every
    size here (the tiny codec's GEMMs are below SPLIT_GEMM_MIN_ROWS)."""
    monkeypatch.setattr(codec_module, "SPLIT_GEMM_MIN_ROWS", 0)
    codec = _codec()
    codec.gemm = gemm
    gen = torch.Generator().manual_seed(22)
    codes = _codes(gen, 1, 1, 31) if gemm.startswith("tf32x3") else _codes(gen, 2, 3, 31)
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


# ---- streaming ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=pytest.mark.triton_interpret)])
def test_streaming_equals_one_shot_delayed(kernels, monkeypatch):
    """Three calls starting at different steps in one batch (plus a padding row on the sink, rows in a
    shuffled order each step), then a fourth call re-using the first call's slot after a reset. The state
    starts full of garbage: admission's reset must be enough. Each call's stream + flush must equal
    6 zeros followed by its one-shot decode. With `kernels`, decode_step runs the Triton kernels the GPU
    runs (the fused depthwise conv + LayerNorm, the 3xTF32 GEMMs with their epilogues) through the
    interpreter."""
    codec = _codec()
    if kernels:
        monkeypatch.setattr(codec_module, "SPLIT_GEMM_MIN_ROWS", 0)
        codec.gemm = "tf32x3w"
    gen = torch.Generator().manual_seed(6)
    num_slots = 4
    sink = num_slots - 1
    state = codec.allocate_stream_state(num_slots, "cpu")
    for tensor in state.convnext_history + [state.ola_tail, state.envelope_tail]:
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    state.frames_done.fill_(5)
    # name: (slot, first step, frames)
    calls = {"a": (0, 0, 12), "b": (2, 3, 12), "c": (1, 5, 12), "d": (0, 13, 4)}
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


# Full-size decode on the H200 against a float64 decode (|wav| <= 1), per GEMM choice.
GPU_DECODE_ATOL = {"ieee": 1e-4, "tf32x3": 1e-4, "tf32x3w": 1e-4, "auto": 1e-4, "bf16x3": 3e-3}  # auto = tf32x3 on CUDA


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
