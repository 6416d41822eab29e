"""RVQ-VAE audio codec (spec 5): 31 codes per 80 ms frame <-> 1764 samples at 22.05 kHz.

codes [B, T, 31] --dequantise (5.1)--> latent [B, T, 512] --decoder (5.2)--> 18 channels per spectrogram
frame (441 per code frame) --iSTFT head (5.3)--> wav [B, 1764 T].

The codec in three modules, every name importable from this one:
- codec.py (this one): its numerics, `exact_fp32` and the decoder's GEMMs (`linear`, the upsampling convs
  as GEMMs, the weights split once for them);
- codec_layers.py: the networks under the checkpoint's keys: the causal ConvNeXt block, the encoder
  (`Wav2Latent`), the decoder (`Latent2Wav`), the quantiser (`ResidualVQ`);
- codec_model.py: `RVQCodec`, one-shot and streaming decode (its per-call state, the iSTFT head), encode.

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
"""
from __future__ import annotations

import contextlib
import importlib

import torch
import torch.nn.functional as F

from ops import interpreting, use_triton
from ops.fp16x3_linear import (
    Fp16Split,
    fp16x3_linear,
    split_fp16_rows,
    split_fp16_weight,
    unpack_weight_split,
    weight_split_numel,
)
from ops.fp32_linear import fp32_linear, split_tf32

# The codec's parts defined in the other modules, importable from here (`from nemo_duplex.models.codec
# import RVQCodec`). Looked up on first use (module `__getattr__`): those modules import this one's GEMMs,
# so importing them at the top of this one would be circular.
_PARTS = {
    "nemo_duplex.models.codec_layers": ("CodebookVariance", "ConvNeXtBlock", "Latent2Wav", "ResidualVQ",
                                        "Wav2Latent", "gemm_weight"),
    "nemo_duplex.models.codec_model": ("CodecStreamState", "RVQCodec", "istft", "replace_control_codes"),
    "ops.istft_step": ("hann_window", "istft_step", "overlap_add", "synthesis_frames", "window_envelope"),
}


def __getattr__(name: str):
    for module, names in _PARTS.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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



def fp16x3_weight(split: torch.Tensor | None, weight: torch.Tensor) -> Fp16Split:
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
        y = fp16x3_linear(split_fp16_rows(x), fp16x3_weight(None, weight), bias, gelu, r2)
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

