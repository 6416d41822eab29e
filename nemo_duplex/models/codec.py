"""RVQ-VAE audio codec (spec 5): 31 codes per 80 ms frame <-> 1764 samples at 22.05 kHz.

codes [B, T, 31] --dequantise (5.1)--> latent [B, T, 512] --decoder (5.2)--> 18 channels per spectrogram
frame (441 per code frame) --iSTFT head (5.3)--> wav [B, 1764 T].

Module paths give the official keys under `tts_model.audio_codec.` (spec 6.3): `encoder.layers.N`,
`decoder.layers.N`, `prvq.mus_list.i`, `prvq._variance_list.i.variance`.

Numerics: always fp32 (spec 9.9: bf16 collapses the reconstruction), and TF32 must stay off (spec 1.6,
NeMo's `disable_tf32`). `decode`, `decode_step` and `encode` refuse parameters that are not fp32 and, on
CUDA in eager mode, run under `exact_fp32()` (IEEE fp32 matmuls and convolutions). Under torch.compile
the flags are read at compile time, so the caller must set `torch.backends.cuda.matmul.fp32_precision`
and `torch.backends.cudnn.conv.fp32_precision` to "ieee" before compiling. The per-frame inverse DFT
goes through `ops.dft` (IEEE fp32 whatever the flags). The decoder's pointwise and transposed convs are
GEMMs (`linear`, CodecConfig.gemm / `codec.gemm`): "ieee" fp32; "tf32x3", three TF32 tensor-core
products per fp32 product, as accurate as fp32 (ops/fp32_linear.py; "tf32x3w": the weight split
beforehand, for decode_step's GEMMs once at load: RVQCodec.presplit_weights); "fp16x3w", three fp16
products of power-of-two-scaled halves, as accurate and ~40% faster on an H200 (ops/fp16x3_linear.py;
weights split once at load the same way); "bf16x3", three bf16 products, ~1e-5 relative; "auto"
(default): fp16x3w on CUDA, ieee elsewhere. Plain TF32 or bf16 never.

Streaming (`decode_step`): the transposed convolutions have kernel == stride (no overlap, no state);
each causal ConvNeXt keeps its last 6 input frames; the overlap-add keeps the 12 samples (and their
window envelope) that the next frame's spectrogram frames still add to. The output is the one-shot
decode delayed by `stream_delay` = 6 samples, EXACTLY (up to fp32 rounding of a different summation
order), from the first sample on: the stream starts with 6 zeros, and `flush_step` returns the last 6
samples of the one-shot decode. NeMo's streaming wrapper (spec 5.4, 12.7) delays by 8 and differs
from one-shot at stream samples 8..13, because it divides the first frame by the full window envelope
where one-shot divides by the partial one; keeping the envelope's overlap-add tail in the state (zero
after reset) removes that difference and 6 is the smallest delay at which every output sample is final.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nemo_duplex.models.config import CodecConfig
from ops import interpreting, use_triton
from ops.codebook_sum import codebook_sum
from ops.dwconv_layernorm import dwconv_layer_norm
from ops.fp16x3_linear import (
    Fp16Split,
    fp16x3_linear,
    split_fp16_rows,
    split_fp16_weight,
    unpack_weight_split,
    weight_split_numel,
)
from ops.fp32_linear import fp32_linear, split_tf32
from ops.istft_step import hann_window, istft_step, overlap_add, synthesis_frames, window_envelope

# ----------------------------------------------------------------------------------------------------
# Numerics guards
# ----------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def exact_fp32(device: torch.device):
    """IEEE fp32 matmuls and cuDNN convolutions on CUDA for the duration, restoring the flags after.
    A no-op off CUDA and while torch.compile traces (set the flags before compiling instead)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        yield
        return
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    saved = (matmul.fp32_precision, conv.fp32_precision)
    matmul.fp32_precision = "ieee"
    conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision, conv.fp32_precision = saved


# ----------------------------------------------------------------------------------------------------
# GEMMs in fp32, or fp32-accurate from TF32 / fp16 / bf16 tensor cores
# ----------------------------------------------------------------------------------------------------

GEMMS = ("auto", "ieee", "tf32x3", "tf32x3w", "fp16x3w", "bf16x3")
PRESPLIT_GEMMS = ("tf32x3w", "fp16x3w")  # the paths whose weights RVQCodec.presplit_weights splits once
# Below this many rows the split GEMMs lose to the IEEE SGEMM (too few tiles to fill the GPU), so "tf32x3" /
# "bf16x3" fall back to "ieee" there. Row counts are static per batch bucket, so a captured graph keeps one
# path. A sweep of decode_step (stage 1 has 9 rows per call, stage 2 63, stage 3 441) chose 512 for a
# single-pass kernel; the 3xTF32 kernel splits K where its grid leaves SMs idle (ops/fp32_linear.py), and the
# same sweep (docs/performance.md) puts the line at 64: N=1 / 8 / 32 / 64 / 128 = 1.15 / 1.63 / 3.65 / 6.16
# / 10.89 ms against 1.20 / 2.31 / 4.15 / 6.19 / 10.90 at 512; 0 loses at N=1 (1.36: 9-row GEMMs).
SPLIT_GEMM_MIN_ROWS = 64
# The same line for "fp16x3w": none. The same sweep (scripts/dev/bench_ops.py --only codec, H200,
# docs/performance.md): decode_step at N=1 / 8 / 32 / 64 / 128 = 0.65 / 0.87 / 2.08 / 3.59 / 6.63 ms with
# every GEMM on the fp16 kernel, against 1.08 / 0.93 / 2.14 / 3.59 / 6.61 with the IEEE SGEMM below 64 rows.
FP16X3_MIN_ROWS = 0


def split_min_rows(gemm: str) -> int:
    """Rows below which the split GEMM `gemm` falls back to the IEEE SGEMM."""
    return FP16X3_MIN_ROWS if gemm == "fp16x3w" else SPLIT_GEMM_MIN_ROWS


def resolve_gemm(gemm: str, device: torch.device) -> str:
    """"auto" -> the fp16x3 GEMM (weights split first) where there are tensor cores (docs/performance.md:
    the codec's GEMMs 1.9 ms against 3.2 for tf32x3w at 128 calls), IEEE fp32 elsewhere; any
    other choice as it is."""
    if gemm == "auto":
        return "fp16x3w" if torch.device(device).type == "cuda" else "ieee"
    return gemm


def gemm_path(gemm: str, x: torch.Tensor) -> str:
    """The GEMM `linear` runs for x [..., K]: `resolve_gemm`, then "ieee" for the split GEMMs below
    `split_min_rows` rows."""
    gemm = resolve_gemm(gemm, x.device)
    if gemm in ("tf32x3", "bf16x3", *PRESPLIT_GEMMS) and x.numel() // x.shape[-1] < split_min_rows(gemm):
        return "ieee"
    return gemm


def takes_split(gemm: str, x: torch.Tensor) -> bool:
    """Whether `linear` of x multiplies by a pre-split weight (its `split`) where one is given: only the
    Triton tf32x3w and fp16x3w kernels do; every other path reads the weight itself."""
    return gemm_path(gemm, x) in PRESPLIT_GEMMS and use_triton(x)


def presplit_used(gemm: str, device: torch.device) -> bool:
    """Whether decode_step's GEMMs on `device` can take pre-split weights, so RVQCodec.presplit_weights
    builds them: `gemm` resolves to "tf32x3w" or "fp16x3w" there and the Triton kernel runs there (CUDA, or
    the CPU under TRITON_INTERPRET=1: the tests). Elsewhere nothing would read them. Every GEMM gets its
    split: whether its rows reach `split_min_rows` depends on the batch bucket. memory.derived_table_bytes
    counts them under the same condition."""
    device = torch.device(device)
    triton_there = device.type == "cuda" or (device.type == "cpu" and interpreting())
    return resolve_gemm(gemm, device) in PRESPLIT_GEMMS and triton_there


def split_weight(weight: torch.Tensor, gemm: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """A decoder GEMM weight [N, K] split once for `gemm`'s kernel, as RVQCodec.presplit_weights keeps it:
    "tf32x3w": split_tf32, [2, N, K] fp32; "fp16x3w": split_fp16_weight packed flat, [2 N K + 2 N] fp16.
    Into `out` where it has that shape and device (a captured graph keeps its pointers)."""
    n, k = weight.shape
    shape, dtype = ((2, n, k), torch.float32) if gemm == "tf32x3w" else ((weight_split_numel(n, k),), torch.float16)
    if out is None or out.shape != shape or out.dtype != dtype or out.device != weight.device:
        out = torch.empty(shape, device=weight.device, dtype=dtype)
    if gemm == "tf32x3w":
        split_tf32(weight, out=out)
    else:
        split_fp16_weight(weight, out=out)
    return out


def _fp16_weight(split: torch.Tensor | None, weight: torch.Tensor) -> Fp16Split:
    """`weight`'s fp16x3 split: the packed one built at load (`split_weight`), or made now."""
    return unpack_weight_split(split, *weight.shape) if split is not None else split_fp16_weight(weight)


def _linear_2d(x: torch.Tensor, weight_shape: tuple[int, int], gemm: str, split: torch.Tensor, bias, gelu,
               residual) -> torch.Tensor:
    """x [M, K] times a weight pre-split for `gemm` (tf32x3w / fp16x3w), in the Triton kernels."""
    if gemm_path(gemm, x) == "fp16x3w":
        weight = unpack_weight_split(split, *weight_shape)
        return fp16x3_linear(split_fp16_rows(x), weight, bias, gelu, residual)
    return fp32_linear(x, split[0], bias, gelu, presplit=True, residual=residual, weight_lo=split[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: str,
           gelu: bool = False, residual: torch.Tensor | None = None,
           split: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias [N]), then exact GELU if `gelu`, then + `residual` [..., N];
    fp32 in and out. The split GEMMs add the bias, GELU and residual in their epilogue.

    "ieee": an fp32 GEMM with IEEE products (under exact_fp32: cuBLAS SGEMM, no tensor cores).
    "tf32x3": ops/fp32_linear.py, three TF32 tensor-core products per fp32 product (hi/lo split in
      registers), as accurate as "ieee" (~1e-7 relative); bias and GELU fused. Plain TF32 is never used.
    "tf32x3w": the same products with the weight split beforehand, so the GEMM kernel splits only x: as
      accurate, ~20% faster at the decoder's shapes (docs/performance.md). `split` = (w_hi, w_lo) =
      split_tf32(weight), e.g. a [2, N, K] tensor, is that split made once (RVQCodec.presplit_weights
      keeps decode_step's); without it one split_tf32 kernel splits the weight on every call. `split` is
      read only where this path runs the Triton kernel (`takes_split`): every other path, the "ieee"
      fallback below SPLIT_GEMM_MIN_ROWS included, reads `weight`.
    "fp16x3w": ops/fp16x3_linear.py: x and w brought into fp16's range by powers of two and split into fp16
      halves (x per row and 64-column block, in a pass before the GEMM; w per output channel), three fp16
      tensor-core products per product, as accurate as "tf32x3w" at twice its tensor-core rate. `split` =
      split_weight(weight, "fp16x3w"), packed; without it the weight is split on every call (in torch).
      Off Triton the same splits multiply in an fp32 matmul.
    "bf16x3": every fp32 value v is split v = hi + lo with hi = bf16(v), lo = bf16(v - hi) (16 of fp32's 24
      mantissa bits), and x w ~ x_hi w_hi + x_lo w_hi + x_hi w_lo (x_lo w_lo dropped): ONE cuBLAS bf16 GEMM
      over a 3K-long reduction, [x_hi | x_lo | x_hi] . [w_hi | w_hi | w_lo], fp32 accumulation and output.
      ~1e-5 relative per product (bf16 alone: ~4e-3); tests/test_codec.py states the bounds. Off CUDA the
      same products run as an fp32 matmul of the bf16 parts (exact products, fp32 sums)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if split is not None and takes_split(gemm, x):
        r2 = None if residual is None else residual.reshape(-1, weight.shape[0])
        return _linear_2d(x.reshape(-1, k), weight.shape, gemm, split, bias, gelu, r2).view(*lead, -1)
    gemm = gemm_path(gemm, x)
    if gemm == "fp16x3w":
        r2 = None if residual is None else residual.reshape(-1, weight.shape[0])
        y = fp16x3_linear(split_fp16_rows(x), _fp16_weight(None, weight), bias, gelu, r2)
        return y.view(*lead, -1)
    if gemm in ("tf32x3", "tf32x3w"):
        return fp32_linear(x, weight, bias, gelu, presplit=gemm == "tf32x3w", residual=residual)
    if gemm == "ieee":
        y = F.linear(x, weight, bias)
    elif gemm == "bf16x3":
        y = _bf16x3_linear(x, weight, bias)
    else:
        raise ValueError(f"gemm must be one of {GEMMS}; got {gemm!r}")
    y = F.gelu(y) if gelu else y
    return y if residual is None else residual + y


def _bf16x3_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    a = _split_bf16(x.reshape(-1, k), hi_again=True)    # [M, 3K]
    b = _split_bf16(weight, hi_again=False)             # [N, 3K]
    if x.is_cuda:
        if bias is None:
            y = torch.mm(a, b.t(), out_dtype=torch.float32)
        else:
            y = torch.addmm(bias, a, b.t(), out_dtype=torch.float32)
    else:
        y = torch.matmul(a.float(), b.float().t())
        if bias is not None:
            y = y + bias
    return y.view(*lead, weight.shape[0])


@torch.no_grad()  # inference only (out= ops); the ieee path stays differentiable
def _split_bf16(v: torch.Tensor, hi_again: bool) -> torch.Tensor:
    """v [M, K] fp32 -> [hi | lo | hi] (hi_again) or [hi | hi | lo], [M, 3K] bf16, written in place."""
    m, k = v.shape
    out = torch.empty(m, 3 * k, dtype=torch.bfloat16, device=v.device)
    hi = out[:, :k]
    hi.copy_(v)  # round to nearest
    lo, second_hi = (out[:, k:2 * k], out[:, 2 * k:]) if hi_again else (out[:, 2 * k:], out[:, k:2 * k])
    second_hi.copy_(hi)
    torch.sub(v, hi, out=lo)  # v - hi is exact in fp32; its bf16 rounding is the split's error
    return out


def upsample(x: torch.Tensor, weight: torch.Tensor, gemm: str) -> torch.Tensor:
    """ConvTranspose1d with kernel == stride and no bias (spec 5.2: the decoder's upsampling layers), as a
    matmul: each input frame l becomes output frames l k .. l k + k - 1, sum_i x[i, l] weight[i, :, j], with
    no overlap between input frames. x [B, C_in, L], weight [C_in, C_out, k] -> [B, C_out, L k]."""
    batch, c_in, length = x.shape
    c_out, k = weight.shape[1], weight.shape[2]
    y = linear(x.transpose(1, 2), weight.reshape(c_in, c_out * k).t(), None, gemm)  # [B, L, C_out k]
    return y.view(batch, length, c_out, k).permute(0, 2, 1, 3).reshape(batch, c_out, length * k)


def channels_last_weight(weight: torch.Tensor) -> torch.Tensor:
    """A ConvTranspose1d weight [C_in, C_out, k] as `upsample_channels_last` multiplies by it, [k C_out,
    C_in]: row j C_out + o is tap j of output channel o (a copy)."""
    c_in, c_out, k = weight.shape
    return weight.permute(2, 1, 0).reshape(k * c_out, c_in)


def upsample_channels_last(x: torch.Tensor, weight: torch.Tensor, gemm: str,
                           split: torch.Tensor | None = None) -> torch.Tensor:
    """`upsample` channels-last: x [B, L, C_in] -> [B, L k, C_out]. The weight's rows are ordered (tap j,
    output channel o), so the GEMM's output [B, L, k C_out] already is [B, L k, C_out] in memory (no
    permute of the activations). `split`: split_weight(channels_last_weight(weight), gemm), built once
    (RVQCodec.presplit_weights); where the GEMM takes it (`takes_split`) neither the reorder nor the split
    runs per call, elsewhere the weight is reordered here (one copy of a few MB)."""
    batch, length, c_in = x.shape
    c_out, k = weight.shape[1], weight.shape[2]
    if split is not None and takes_split(gemm, x):
        y = _linear_2d(x.reshape(-1, c_in), (k * c_out, c_in), gemm, split, None, False, None)
    else:
        y = linear(x, channels_last_weight(weight), None, gemm)
    return y.view(batch, length * k, c_out)


def replace_control_codes(codes: torch.Tensor, silence_codes: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """codes [..., Q]: every code >= codebook_size (speech pad / eos / bos, spec 5.4) becomes the silence
    code of its codebook, silence_codes [Q]."""
    return torch.where(codes >= codebook_size, silence_codes.to(codes.dtype).expand_as(codes), codes)


# ----------------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------------

def _normal_(param: torch.Tensor, generator: torch.Generator, std: float, mean: float = 0.0) -> None:
    """Draw on the CPU with the generator (device independent), then copy to the parameter's device."""
    with torch.no_grad():
        param.copy_(torch.randn(param.shape, generator=generator, device=generator.device) * std + mean)


class ConvNeXtBlock(nn.Module):
    """Causal ConvNeXt1d (spec 5.2): x + pwconv2(GELU(pwconv1(LN_c(dwconv(leftpad(x)))))).
    dwconv is depthwise with kernel k and a (k-1)-frame causal left pad; LayerNorm over channels with
    eps 1e-6; exact (erf) GELU; pwconv1/pwconv2 are k=1 convolutions (applied as linears)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.history = kernel_size - 1  # input frames of left context each output needs
        self.dwconv = nn.Conv1d(channels, channels, kernel_size, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=1e-6)
        self.pwconv1 = nn.Conv1d(channels, 4 * channels, 1)
        self.pwconv2 = nn.Conv1d(4 * channels, channels, 1)
        # split_weight of pwconv1/pwconv2's weight for `step` (decoder blocks only): derived, so not in the
        # state_dict; empty unless RVQCodec.presplit_weights built them.
        self.register_buffer("pwconv1_split", torch.empty(0), persistent=False)
        self.register_buffer("pwconv2_split", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor, gemm: str = "ieee") -> torch.Tensor:
        """x [B, C, L] from the start of the signal: zeros before it (the causal pad)."""
        return self.forward_padded(F.pad(x, (self.history, 0)), gemm)

    def forward_padded(self, padded: torch.Tensor, gemm: str = "ieee") -> torch.Tensor:
        """padded [B, C, history + L]: the input with its `history` preceding frames -> [B, C, L].
        `gemm`: how the k=1 convs run (`linear`)."""
        residual = padded[:, :, self.history:]
        y = self.dwconv(padded).transpose(1, 2)  # [B, L, C]: LayerNorm and k=1 convs over channels
        y = self.norm(y)
        y = linear(y, self.pwconv1.weight[:, :, 0], self.pwconv1.bias, gemm, gelu=True)
        y = linear(y, self.pwconv2.weight[:, :, 0], self.pwconv2.bias, gemm)
        return residual + y.transpose(1, 2)

    def step(self, x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, gemm: str) -> torch.Tensor:
        """Streaming, channels-last: x [B, L, C] new frames, history [S, k-1, C] the last k-1 input frames of
        each slot (rows `slots` precede x, then are moved on in place) -> [B, L, C]. The conv and the
        LayerNorm are one kernel reading the history where it is (ops/dwconv_layernorm.py); the skip is
        added in the second GEMM's epilogue. Same sums as `forward_padded` up to their order. The k=1
        convs take their weights' pre-split halves where built (RVQCodec.presplit_weights)."""
        split1, split2 = _built(self.pwconv1_split), _built(self.pwconv2_split)
        # fp16x3w in the Triton kernels: pwconv1's epilogue writes its output split for pwconv2, so the 4C-wide
        # activation never exists in fp32; the conv + norm output is split by a pass of its own (faster on the
        # H200 than the conv + norm kernel writing it split: ops/dwconv_layernorm.py). The same with or
        # without the weights split beforehand, so both give the same bits.
        fp16_chain = gemm_path(gemm, x) == "fp16x3w" and use_triton(x)
        y = dwconv_layer_norm(x, history, slots, self.dwconv.weight, self.dwconv.bias, self.norm.weight,
                              self.norm.bias, self.norm.eps)
        # after the read above: the last k-1 input frames (fewer new frames than that: some old ones stay)
        if x.shape[1] >= self.history:
            history.index_copy_(0, slots, x[:, x.shape[1] - self.history:])
        else:
            history.index_copy_(0, slots, torch.cat([history.index_select(0, slots), x], 1)[:, -self.history:])
        if fp16_chain:
            w1, w2 = self.pwconv1.weight[:, :, 0], self.pwconv2.weight[:, :, 0]
            h = fp16x3_linear(split_fp16_rows(y.view(-1, y.shape[-1])), _fp16_weight(split1, w1), self.pwconv1.bias,
                              gelu=True, split_out=True)
            out = fp16x3_linear(h, _fp16_weight(split2, w2), self.pwconv2.bias, residual=x.reshape(-1, x.shape[-1]))
            return out.view(x.shape)
        y = linear(y, self.pwconv1.weight[:, :, 0], self.pwconv1.bias, gemm, gelu=True, split=split1)
        return linear(y, self.pwconv2.weight[:, :, 0], self.pwconv2.bias, gemm, residual=x, split=split2)

    def init_weights(self, generator: torch.Generator) -> None:
        channels, kernel = self.dwconv.weight.shape[0], self.dwconv.weight.shape[-1]
        _normal_(self.dwconv.weight, generator, kernel ** -0.5)
        _normal_(self.dwconv.bias, generator, 0.1)
        _normal_(self.norm.weight, generator, 0.1, mean=1.0)
        _normal_(self.norm.bias, generator, 0.1)
        _normal_(self.pwconv1.weight, generator, channels ** -0.5)
        _normal_(self.pwconv1.bias, generator, 0.1)
        # Small residual branch: nine blocks in a row must not blow the activations up.
        _normal_(self.pwconv2.weight, generator, 0.5 * (4 * channels) ** -0.5)
        _normal_(self.pwconv2.bias, generator, 0.05)


def _built(table: torch.Tensor) -> torch.Tensor | None:
    """A derived buffer, or None while it is empty (not built)."""
    return table if table.numel() else None


def gemm_weight(layer: nn.Module) -> torch.Tensor:
    """A decoder GEMM layer's weight [N, K] in the row order `Latent2Wav.step` multiplies by: a k=1
    Conv1d's [N, K, 1] as a view, a ConvTranspose1d's reordered channels-last (a copy)."""
    if isinstance(layer, nn.ConvTranspose1d):
        return channels_last_weight(layer.weight)
    return layer.weight[:, :, 0]


def _init_conv(conv: nn.Module, generator: torch.Generator) -> None:
    """Unit-gain init for a bias-free (transposed) convolution: std 1/sqrt(fan-in). A transposed conv
    with kernel == stride sums over input channels only; a strided conv over channels x kernel."""
    if isinstance(conv, nn.ConvTranspose1d):
        fan_in = conv.in_channels
    else:
        fan_in = conv.in_channels * conv.kernel_size[0]
    _normal_(conv.weight, generator, fan_in ** -0.5)


# ----------------------------------------------------------------------------------------------------
# iSTFT head (spec 5.3)
# ----------------------------------------------------------------------------------------------------

# hann_window, synthesis_frames, overlap_add and window_envelope: ops/istft_step.py, whose reference they are


def istft(head: torch.Tensor, n_fft: int, hop: int, by_matmul: bool = False) -> torch.Tensor:
    """One-shot iSTFT: head [B, n_fft + 2, S] -> wav [B, hop*S]. Overlap-add, trim (n-hop)/2 samples at each
    end ("same" padding), divide by the window envelope trimmed the same way."""
    frames = synthesis_frames(head.transpose(1, 2), n_fft, by_matmul)
    trim = (n_fft - hop) // 2
    signal = overlap_add(frames, hop)[:, trim:-trim]
    envelope = window_envelope(frames.shape[1], n_fft, hop, head.device)[:, trim:-trim]
    return signal / envelope


# ----------------------------------------------------------------------------------------------------
# Encoder, decoder, quantiser
# ----------------------------------------------------------------------------------------------------

class Wav2Latent(nn.Module):
    """Encoder (spec 5.5): STFT (16/4, periodic Hann, zero pad 6 | 6, center=False) -> [Re | Im] 18 ch
    -> Conv1d k1 -> per stage: ConvNeXt x num_blocks, strided Conv1d (rates 7, 7, 9). No biases outside
    the ConvNeXt blocks."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.n_fft, self.hop = cfg.n_fft, cfg.hop_length
        widths = [cfg.base_hidden_size * m for m in cfg.channel_mult]
        layers: list[nn.Module] = [nn.Conv1d(cfg.n_fft + 2, widths[0], 1, bias=False)]
        for stage, (width, rate) in enumerate(zip(widths, cfg.rates)):
            layers += [ConvNeXtBlock(width, cfg.kernel_size) for _ in range(cfg.num_blocks)]
            next_width = widths[stage + 1] if stage + 1 < len(widths) else cfg.latent_size
            layers.append(nn.Conv1d(width, next_width, rate, stride=rate, bias=False))
        self.layers = nn.ModuleList(layers)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, N] (N a multiple of hop * prod(rates)) -> latent [B, latent, N / 1764]."""
        pad = (self.n_fft - self.hop) // 2
        spec = torch.stft(F.pad(wav, (pad, pad)), self.n_fft, hop_length=self.hop, win_length=self.n_fft,
                          window=hann_window(self.n_fft, wav.device), center=False, return_complex=True)
        x = torch.cat([spec.real, spec.imag], dim=1)  # [B, 18, N / hop]
        for layer in self.layers:
            x = layer(x)
        return x

    def init_weights(self, generator: torch.Generator) -> None:
        for layer in self.layers:
            layer.init_weights(generator) if isinstance(layer, ConvNeXtBlock) else _init_conv(layer, generator)


class Latent2Wav(nn.Module):
    """Decoder (spec 5.2): per stage (rates 9, 7, 7; widths 4C, 2C, C) a ConvTranspose1d with kernel ==
    stride, then ConvNeXt x num_blocks; a final Conv1d k1 to n_fft + 2 channels (the iSTFT head input)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        widths = [cfg.base_hidden_size * m for m in reversed(cfg.channel_mult)]
        layers: list[nn.Module] = []
        width_in = cfg.latent_size
        for width, rate in zip(widths, reversed(cfg.rates)):
            layers.append(nn.ConvTranspose1d(width_in, width, rate, stride=rate, bias=False))
            layers += [ConvNeXtBlock(width, cfg.kernel_size) for _ in range(cfg.num_blocks)]
            width_in = width
        layers.append(nn.Conv1d(width_in, cfg.n_fft + 2, 1, bias=False))
        self.layers = nn.ModuleList(layers)
        # split_{i}: split_weight(gemm_weight(layers[i]), gemm) for the upsampling layers and the final
        # conv in `step` (the ConvNeXt blocks hold their own); empty unless RVQCodec.presplit_weights built them.
        for i, layer in enumerate(layers):
            if not isinstance(layer, ConvNeXtBlock):
                self.register_buffer(f"split_{i}", torch.empty(0), persistent=False)

    def forward(self, latent: torch.Tensor, gemm: str = "ieee") -> torch.Tensor:
        """latent [B, latent, T] -> iSTFT head input [B, n_fft + 2, 441 T]. `gemm`: see `linear`."""
        x = latent
        for layer in self.layers:
            x = layer(x, gemm) if isinstance(layer, ConvNeXtBlock) else self._linear_layer(layer, x, gemm)
        return x

    @staticmethod
    def _linear_layer(layer: nn.Module, x: torch.Tensor, gemm: str) -> torch.Tensor:
        """The upsampling ConvTranspose1d layers and the final k=1 Conv1d, as matmuls (no cuDNN dgrad
        kernels, and the same GEMM numerics as the ConvNeXt blocks)."""
        if isinstance(layer, nn.ConvTranspose1d):
            return upsample(x, layer.weight, gemm)
        return linear(x.transpose(1, 2), layer.weight[:, :, 0], None, gemm).transpose(1, 2)

    def convnext_blocks(self) -> list[ConvNeXtBlock]:
        return [layer for layer in self.layers if isinstance(layer, ConvNeXtBlock)]

    def step_gemms(self) -> list[tuple[nn.Module, str, nn.Module]]:
        """(holder, buffer name, layer) for every GEMM of `step`, in order: the buffer of `holder` that keeps
        the split of gemm_weight(layer) (RVQCodec.presplit_weights)."""
        gemms: list[tuple[nn.Module, str, nn.Module]] = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ConvNeXtBlock):
                gemms += [(layer, "pwconv1_split", layer.pwconv1), (layer, "pwconv2_split", layer.pwconv2)]
            else:
                gemms.append((self, f"split_{i}", layer))
        return gemms

    def step(self, latent: torch.Tensor, history: list[torch.Tensor], slots: torch.Tensor,
             gemm: str = "ieee") -> torch.Tensor:
        """One code frame per row, channels-last throughout (every GEMM's rows are frames, so no transpose
        between layers): latent [B, 1, latent] -> head input [B, 441, n_fft + 2]. history[i] [S, k-1, C_i]
        holds the last k-1 input frames of ConvNeXt block i per slot; rows `slots` are read and then
        overwritten in place. `forward` (channels-first, one-shot) is the reference it is tested against.
        The GEMMs take the pre-split weights where built (RVQCodec.presplit_weights)."""
        x = latent
        block = 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ConvNeXtBlock):
                x = layer.step(x, history[block], slots, gemm)
                block += 1
            elif isinstance(layer, nn.ConvTranspose1d):
                x = upsample_channels_last(x, layer.weight, gemm, split=_built(getattr(self, f"split_{i}")))
            else:
                x = linear(x, layer.weight[:, :, 0], None, gemm, split=_built(getattr(self, f"split_{i}")))
        return x

    def init_weights(self, generator: torch.Generator) -> None:
        for layer in self.layers:
            layer.init_weights(generator) if isinstance(layer, ConvNeXtBlock) else _init_conv(layer, generator)


class CodebookVariance(nn.Module):
    """Holds the `variance` scalar of one codebook (`prvq._variance_list.i.variance`, training only)."""

    def __init__(self):
        super().__init__()
        self.variance = nn.Parameter(torch.ones(()))


class ResidualVQ(nn.Module):
    """Residual vector quantiser: `mus_list[i]` [codebook, latent] per quantiser (spec 5.1, 5.5)."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.mus_list = nn.ParameterList(
            [nn.Parameter(torch.empty(cfg.codebook_size, cfg.latent_size)) for _ in range(cfg.num_quantizers)])
        self._variance_list = nn.ModuleList([CodebookVariance() for _ in range(cfg.num_quantizers)])
        # The codebooks stacked [Q, codebook, latent], derived from mus_list, so not in the state_dict: built
        # on first use (`stacked`), emptied when a state_dict loads or the weights are drawn (64 MiB at full
        # size). It lets dequantize run as one kernel (ops/codebook_sum.py).
        self.register_buffer("mus_stacked", torch.empty(0), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.clear_stacked())

    def clear_stacked(self) -> None:
        self.mus_stacked = torch.empty(0, device=self.mus_list[0].device)

    def stacked(self) -> torch.Tensor:
        if self.mus_stacked.numel() == 0 or self.mus_stacked.device != self.mus_list[0].device \
                or self.mus_stacked.dtype != self.mus_list[0].dtype:
            with torch.no_grad():
                self.mus_stacked = torch.stack(list(self.mus_list))
        return self.mus_stacked

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [..., Q] -> sum_i mus_list[i][codes[..., i]], [..., latent], added in order i = 0..Q-1."""
        return codebook_sum(codes, self.stacked())

    def quantize(self, latent: torch.Tensor) -> torch.Tensor:
        """Greedy residual quantisation: latent [..., latent] -> codes [..., Q] int64; code i is the nearest
        codeword of codebook i to the residual left by codes 0..i-1."""
        residual = latent
        codes = []
        for mus in self.mus_list:
            # argmin |r - m|^2 = argmin (|m|^2 - 2 r.m): |r|^2 is the same for every codeword.
            distance = mus.square().sum(-1) - 2.0 * residual @ mus.T
            code = distance.argmin(-1)
            codes.append(code)
            residual = residual - F.embedding(code, mus)
        return torch.stack(codes, dim=-1)

    def init_weights(self, generator: torch.Generator) -> None:
        # Codebook i has std sqrt((1 - r) r^i): the sum of all 31 has unit variance, later codebooks refine.
        self.clear_stacked()
        ratio = 0.7
        for i, mus in enumerate(self.mus_list):
            _normal_(mus, generator, math.sqrt((1 - ratio) * ratio ** i))
        for entry in self._variance_list:
            with torch.no_grad():
                entry.variance.copy_(0.5 + torch.rand((), generator=generator, device=generator.device))


# ----------------------------------------------------------------------------------------------------
# Codec
# ----------------------------------------------------------------------------------------------------

@dataclass
class CodecStreamState:
    """Per-call streaming state, one row per slot (the last row of a pool is the sink)."""
    convnext_history: list[torch.Tensor]  # per decoder ConvNeXt block (9): [S, 6, C_i] last input frames
    ola_tail: torch.Tensor       # [S, n_fft - hop] overlap-add samples the next frame still adds to
    envelope_tail: torch.Tensor  # [S, n_fft - hop] their window envelope (0 after reset: a stream's start)
    frames_done: torch.Tensor    # [S] int64 code frames decoded since reset


class RVQCodec(nn.Module):
    """The codec under `tts_model.audio_codec.` (spec 5). Always fp32."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        if math.prod(cfg.rates) * cfg.hop_length != cfg.wav_to_token_ratio:
            raise ValueError(f"prod(rates) * hop_length must equal wav_to_token_ratio: {cfg}")
        if cfg.n_fft % cfg.hop_length or (cfg.n_fft - cfg.hop_length) % 2:
            raise ValueError(f"n_fft must be a multiple of hop_length with an even difference: {cfg}")
        if cfg.gemm not in GEMMS:
            raise ValueError(f"codec gemm must be one of {GEMMS}; got {cfg.gemm!r}")
        self.cfg = cfg
        # The decoder's GEMM numerics (`linear`); a plain attribute so a caller can switch it (the pre-split
        # weights are read only where the GEMM runs tf32x3w, so a switch never reads them wrongly).
        self.gemm = cfg.gemm
        self.encoder = Wav2Latent(cfg)
        self.decoder = Latent2Wav(cfg)
        self.prvq = ResidualVQ(cfg)
        self.keep_presplit = False  # presplit_weights was called: keep them built and current
        self.register_load_state_dict_post_hook(lambda module, incompatible: module.weights_loaded())
        # decode_step's constants (not in the state_dict): built once here and after every cast or move
        # (`_apply`), not in every step (they were ~15 small launches of each captured frame step)
        for name in ("step_window", "step_inner_bins", "step_envelope", "step_head"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self._build_step_constants()

    @torch.no_grad()
    def _build_step_constants(self) -> None:
        """step_window: the periodic Hann window [n_fft]; step_inner_bins: 1 for the complex bins, 0 for DC and
        Nyquist [n_fft / 2 + 1]; step_envelope: the window envelope of one code frame's spectrogram frames
        [1, 1764 + n_fft - hop]; step_head: the first `stream_delay` output samples of a frame [1764] (bool).
        Always fp32 whatever the module was cast to (the codec runs in fp32, spec 9.9)."""
        device = self.step_window.device
        n_fft, hop = self.cfg.n_fft, self.cfg.hop_length
        inner = torch.ones(n_fft // 2 + 1, device=device)
        inner[0] = inner[-1] = 0.0
        self.step_window = hann_window(n_fft, device)
        self.step_inner_bins = inner
        self.step_envelope = window_envelope(self.samples_per_frame // hop, n_fft, hop, device)
        self.step_head = torch.arange(self.samples_per_frame, device=device) < self.stream_delay

    @property
    def samples_per_frame(self) -> int:  # 1764
        return self.cfg.wav_to_token_ratio

    @property
    def stream_delay(self) -> int:
        """Samples by which `decode_step`'s stream lags the one-shot decode: (n_fft - hop) / 2 = 6."""
        return (self.cfg.n_fft - self.cfg.hop_length) // 2

    def _require_fp32(self) -> None:
        for name, tensor in self.named_parameters():
            if tensor.dtype != torch.float32:
                raise TypeError(f"the codec runs in fp32 only (spec 9.9: bf16 collapses the reconstruction); "
                                f"{name} is {tensor.dtype}. Keep the codec out of dtype casts (model.codec.float()).")

    # ---- one-shot ------------------------------------------------------------------------------------
    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, Q] -> latent [B, T, latent] (spec 5.1)."""
        return self.prvq.dequantize(codes)

    def decode(self, codes: torch.Tensor, by_matmul: bool = False,
               silence_codes: torch.Tensor | None = None) -> torch.Tensor:
        """codes [B, T, Q] -> wav [B, 1764 T] fp32. `silence_codes` [Q], if given, replaces control codes
        first (spec 5.4); otherwise every code must be < codebook_size. `by_matmul` uses ops.dft's inverse
        DFT instead of torch.fft.irfft (what decode_step uses)."""
        self._require_fp32()
        if silence_codes is not None:
            codes = replace_control_codes(codes, silence_codes, self.cfg.codebook_size)
        with exact_fp32(codes.device):
            head = self.decoder(self.dequantize(codes).transpose(1, 2), self.gemm)
            return istft(head, self.cfg.n_fft, self.cfg.hop_length, by_matmul)

    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, N] fp32 at 22.05 kHz, N a multiple of 1764 -> codes [B, N / 1764, Q] (spec 5.5)."""
        self._require_fp32()
        if wav.shape[-1] % self.samples_per_frame:
            raise ValueError(f"encode needs a multiple of {self.samples_per_frame} samples; got {wav.shape[-1]}")
        with exact_fp32(wav.device):
            latent = self.encoder(wav.float()).transpose(1, 2)
            return self.prvq.quantize(latent)

    @torch.no_grad()
    def silence_codes(self, seconds: float = 10.0, sample_rate: int = 22050) -> torch.Tensor:
        """The most frequent code frame when encoding `seconds` of zeros, [Q] int64 (spec 5.5,
        `get_codec_silence_frame`). Ties go to the lexicographically smallest frame. The checkpoint's
        stored `codec_silence_tokens` is what the reference uses; this recomputes it."""
        num_frames = max(1, int(seconds * sample_rate) // self.samples_per_frame)
        device = self.prvq.mus_list[0].device
        codes = self.encode(torch.zeros(1, num_frames * self.samples_per_frame, device=device))[0]
        frames, counts = torch.unique(codes, dim=0, return_counts=True)  # sorted lexicographically
        return frames[counts.argmax()]

    # ---- streaming -----------------------------------------------------------------------------------
    def allocate_stream_state(self, num_slots: int, device) -> CodecStreamState:
        """Zeroed state for `num_slots` rows (callers include the sink row). Also builds the stacked
        codebooks here, before any step is captured or compiled, so a traced step only reads them."""
        self.prvq.stacked()
        tail = self.cfg.n_fft - self.cfg.hop_length
        history = [torch.zeros(num_slots, block.history, block.dwconv.in_channels, device=device)
                   for block in self.decoder.convnext_blocks()]
        return CodecStreamState(
            convnext_history=history,
            ola_tail=torch.zeros(num_slots, tail, device=device),
            envelope_tail=torch.zeros(num_slots, tail, device=device),
            frames_done=torch.zeros(num_slots, dtype=torch.int64, device=device))

    @staticmethod
    def reset_slots(state: CodecStreamState, slots: torch.Tensor) -> None:
        """Rows `slots` back to a stream's start (zero history = the one-shot causal zero padding)."""
        for history in state.convnext_history:
            history.index_fill_(0, slots, 0.0)
        state.ola_tail.index_fill_(0, slots, 0.0)
        state.envelope_tail.index_fill_(0, slots, 0.0)
        state.frames_done.index_fill_(0, slots, 0)

    @torch.no_grad()
    def decode_step(self, codes: torch.Tensor, state: CodecStreamState, slots: torch.Tensor,
                    silence_codes: torch.Tensor | None = None) -> torch.Tensor:
        """One code frame per call: codes [B, Q], slots [B] -> wav [B, 1764] fp32, which is the one-shot
        decode of the call's frames so far delayed by `stream_delay` samples (6 zeros at a stream's start).
        Pure tensor code with fixed shapes (CUDA-graph capturable); the iSTFT tail is ops/istft_step.py, its
        inverse DFT a dot with ops.dft's basis."""
        self._require_fp32()
        if silence_codes is not None:
            codes = replace_control_codes(codes, silence_codes, self.cfg.codebook_size)
        hop = self.cfg.hop_length
        with exact_fp32(codes.device):
            latent = self.dequantize(codes[:, None, :])  # [B, 1, latent]
            head = self.decoder.step(latent, state.convnext_history, slots, self.gemm)  # [B, 441, 18]
            # the iSTFT, overlap-add with the state's tails, envelope division, before-start zeros and the
            # state update: one kernel (ops/istft_step.py; its torch reference on the CPU)
            return istft_step(head, self.step_window, self.step_inner_bins, self.step_envelope, self.step_head,
                              state.ola_tail, state.envelope_tail, state.frames_done, slots, hop)

    @torch.no_grad()
    def flush_step(self, state: CodecStreamState, slots: torch.Tensor) -> torch.Tensor:
        """The last `stream_delay` samples of the one-shot decode, [B, 6] (zeros for a slot with no frames).
        Reads the state, changes nothing."""
        delay = self.stream_delay
        signal = state.ola_tail.index_select(0, slots)[:, :delay]
        envelope = state.envelope_tail.index_select(0, slots)[:, :delay]
        return torch.where(envelope > 0, signal / envelope.clamp_min(1e-30), 0.0)

    # ---- weights -------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Seeded random weights keeping activations O(1); codewords distinct (continuous draws)."""
        self.encoder.init_weights(generator)
        self.decoder.init_weights(generator)
        self.prvq.init_weights(generator)
        self.weights_loaded()

    @torch.no_grad()
    def presplit_weights(self) -> None:
        """Split every decoder GEMM weight of decode_step (ConvNeXt pwconv1/pwconv2, the upsampling layers
        in their channels-last row order, the final k=1 conv) once for the GEMM kernel that multiplies by it
        (`split_weight`: TF32 halves for tf32x3w, scaled fp16 halves for fp16x3w) into buffers
        (Latent2Wav.step_gemms), so the GEMMs take them as they are: for tf32x3w, without them every step
        ran split_tf32 over the ~92 M weights (0.26 ms in an H200 profile) and copied the upsampling weights
        into their row order; with them decode_step took 0.38 / 0.36 / 0.47 / 0.44 ms less at 8 / 32 / 64 /
        128 calls on the H200, bit for bit the same output (scripts/dev/bench_ops.py --only codec).
        fp16x3w has no per-step split kernel (its weight split is torch code). Bytes per weight: 2 x 4
        (tf32x3w: 700 MiB at full size) or 2 x 2 plus 4 per output channel (fp16x3w: 350 MiB), counted by
        memory.derived_table_bytes. Built only where decode_step reads them (`presplit_used`: tf32x3w or
        fp16x3w on CUDA, or on the CPU under TRITON_INTERPRET=1)
        and kept current from then on: re-split in place when weights are loaded (`weights_loaded`:
        load_state_dict, checkpoint.load_state, init_weights), rebuilt from the new weights after a cast
        or move, or dropped where no longer read (`_apply`). VoiceChat.cast_for_inference calls it.
        Weights written in place any other way need `weights_loaded`."""
        self.keep_presplit = True
        self._build_presplit()

    def weights_loaded(self) -> None:
        """The weights were overwritten in place: the splits are re-made, into the same memory where the
        shapes allow (a captured graph keeps reading them)."""
        if self.keep_presplit:
            self._build_presplit()

    @torch.no_grad()
    def _build_presplit(self) -> None:
        """Split where `presplit_used` (into the tables already there when they fit: a captured graph keeps
        its pointers), else drop."""
        device = self.decoder.layers[-1].weight.device
        build = presplit_used(self.gemm, device) and all(
            layer.weight.dtype == torch.float32 for _, _, layer in self.decoder.step_gemms())
        gemm = resolve_gemm(self.gemm, device)
        for holder, name, layer in self.decoder.step_gemms():
            if not build:
                setattr(holder, name, torch.empty(0, device=device))
                continue
            setattr(holder, name, split_weight(gemm_weight(layer), gemm, out=getattr(holder, name)))

    def _apply(self, fn, *args, **kwargs):
        if self.keep_presplit:  # not moved or cast: made again from the moved or cast weights below
            for holder, name, layer in self.decoder.step_gemms():
                setattr(holder, name, torch.empty(0, device=layer.weight.device))
        out = super()._apply(fn, *args, **kwargs)
        self._build_step_constants()   # a cast would leave them rounded; a move keeps the values
        if self.keep_presplit:
            self._build_presplit()
        return out
