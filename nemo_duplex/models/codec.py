"""RVQ-VAE audio codec (spec 5): 31 codes per 80 ms frame <-> 1764 samples at 22.05 kHz.

codes [B, T, 31] --dequantise (5.1)--> latent [B, T, 512] --decoder (5.2)--> 18 channels per spectrogram
frame (441 per code frame) --iSTFT head (5.3)--> wav [B, 1764 T].

The codec in three modules, every name importable from this one:
- codec.py (this one): its numerics, `exact_fp32` and the decoder's GEMM kinds (`Gemm`, made once at load
  by `codec_gemm`; the upsampling convs as GEMMs, the weights split once for them);
- codec_layers.py: the networks under the checkpoint's keys: the causal ConvNeXt block, the encoder
  (`Wav2Latent`), the decoder (`Latent2Wav`), the quantiser (`ResidualVQ`);
- codec_model.py: `RVQCodec`, one-shot and streaming decode (its per-call state, the iSTFT head), encode.

Numerics: always fp32 (spec 9.9: bf16 collapses the reconstruction), and TF32 must stay off (spec 1.6,
NeMo's `disable_tf32`). `decode`, `decode_step` and `encode` refuse parameters that are not fp32 and, on
CUDA in eager mode, run under `exact_fp32()` (IEEE fp32 matmuls and convolutions). Under torch.compile
the flags are read at compile time, so the caller must set `torch.backends.cuda.matmul.fp32_precision`
and `torch.backends.cudnn.conv.fp32_precision` to "ieee" before compiling. The per-frame inverse DFT
goes through `ops.dft` (IEEE fp32 whatever the flags). The decoder's pointwise and transposed convs are
GEMMs of one kind (CodecConfig.gemm / `model.codec.gemm`, checked and resolved once when the codec is built,
cast or moved: `codec_gemm`): "ieee" fp32; "tf32x3", three TF32 tensor-core products per fp32 product, as
accurate as fp32 (ops/fp32_linear.py; "tf32x3w": the weight split beforehand, for decode_step's GEMMs once
at load: RVQCodec.presplit_weights); "fp16x3w", three fp16 products of power-of-two-scaled halves, as
accurate and ~40% faster on an H200 (ops/fp16x3_linear.py; weights split once at load the same way);
"bf16x3", three bf16 products, ~1e-5 relative; "auto" (default): fp16x3w on CUDA, ieee elsewhere. Plain
TF32 or bf16 never.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ops import interpreting
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
PRESPLIT_GEMMS = ("tf32x3w", "fp16x3w")  # the kinds whose weights RVQCodec.presplit_weights splits once
# Below this many rows the split GEMMs lose to the IEEE SGEMM (too few tiles to fill the GPU), so "tf32x3" /
# "bf16x3" fall back to "ieee" there. Row counts are static per batch bucket, so a captured graph keeps one
# path. A sweep of decode_step (stage 1 has 9 rows per call, stage 2 63, stage 3 441) chose 512 for a
# single-pass kernel; the 3xTF32 kernel splits K where its grid leaves SMs idle (ops/fp32_linear.py), and the
# same sweep (docs/performance.md) puts the line at 64: N=1 / 8 / 32 / 64 / 128 = 1.15 / 1.63 / 3.65 / 6.16
# / 10.89 ms against 1.20 / 2.31 / 4.15 / 6.19 / 10.90 at 512; 0 loses at N=1 (1.36: 9-row GEMMs).
# Read when a kind is made (`codec_gemm`), so a change applies to kinds made after it.
SPLIT_GEMM_MIN_ROWS = 64
# The same line for "fp16x3w": none. The same sweep (scripts/dev/bench_ops.py --only codec, H200,
# docs/performance.md): decode_step at N=1 / 8 / 32 / 64 / 128 = 0.65 / 0.87 / 2.08 / 3.59 / 6.63 ms with
# every GEMM on the fp16 kernel, against 1.08 / 0.93 / 2.14 / 3.59 / 6.61 with the IEEE SGEMM below 64 rows.
FP16X3_MIN_ROWS = 0


def resolve_gemm(gemm: str, device: torch.device) -> str:
    """A `model.codec.gemm` name checked against GEMMS (ValueError naming them), with "auto" -> the fp16x3
    GEMM (weights split first) where there are tensor cores (docs/performance.md: the codec's GEMMs 1.9 ms
    against 3.2 for tf32x3w at 128 calls), IEEE fp32 elsewhere; any other choice as it is."""
    if gemm not in GEMMS:
        raise ValueError(f"model.codec.gemm must be one of {', '.join(GEMMS)}; got {gemm!r} "
                         "(plain TF32 or bf16 is not a choice: spec 9.9)")
    if gemm == "auto":
        return "fp16x3w" if torch.device(device).type == "cuda" else "ieee"
    return gemm


def codec_gemm(gemm: str, device: torch.device) -> Gemm:
    """The GEMM kind `gemm` (a `model.codec.gemm` name) runs as on `device`, chosen once here: "auto"
    resolved (`resolve_gemm`), the row line below which a split kind falls back to the IEEE SGEMM
    (SPLIT_GEMM_MIN_ROWS, FP16X3_MIN_ROWS as they are now), and whether its Triton kernels run there
    (CUDA, or the CPU under TRITON_INTERPRET=1: the tests), which alone take a pre-split weight."""
    kind = resolve_gemm(gemm, device)
    device = torch.device(device)
    triton = device.type == "cuda" or (device.type == "cpu" and interpreting())
    if kind == "ieee":
        return IEEE
    if kind == "bf16x3":
        return Bf16x3Gemm(SPLIT_GEMM_MIN_ROWS, cuda=device.type == "cuda")
    if kind == "fp16x3w":
        return Fp16x3Gemm(FP16X3_MIN_ROWS, triton)
    return Tf32x3Gemm(SPLIT_GEMM_MIN_ROWS, triton, presplit=kind == "tf32x3w")


def presplit_used(gemm: str, device: torch.device) -> bool:
    """Whether decode_step's GEMMs on `device` take pre-split weights, so RVQCodec.presplit_weights builds
    them: `gemm` resolves to "tf32x3w" or "fp16x3w" there and the Triton kernel runs there (`codec_gemm`).
    Elsewhere nothing would read them. Every GEMM gets its split: whether its rows reach the kind's row line
    depends on the batch bucket. memory.derived_table_bytes counts them under the same condition."""
    return codec_gemm(gemm, device).takes_split


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _epilogue(y: torch.Tensor, gelu: bool, residual: torch.Tensor | None) -> torch.Tensor:
    y = F.gelu(y) if gelu else y
    return y if residual is None else residual + y


@dataclass(frozen=True)
class Gemm:
    """A kind of the decoder's GEMMs (CodecConfig.gemm), made once at load by `codec_gemm`; the layers call
    it. This base is "ieee": an fp32 GEMM with IEEE products (under exact_fp32: cuBLAS SGEMM, no tensor
    cores), which the split kinds fall back to below their row line."""

    @property
    def takes_split(self) -> bool:
        """Whether it multiplies by a weight split beforehand (`split_weight`) where one is given."""
        return False

    def reads_split(self, x: torch.Tensor) -> bool:
        """Whether a call with x [..., K] reads its `split` rather than the weight."""
        return False

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False,
                 residual: torch.Tensor | None = None, split: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight[N, K]^T (+ bias [N]), then exact GELU if `gelu`, then + `residual` [..., N];
        fp32 in and out. `split`: the weight's `split_weight`, read only where `reads_split`; every other
        call reads `weight`, bit for bit as without it."""
        return _epilogue(F.linear(x, weight, bias), gelu, residual)

    def mlp(self, y: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
            residual: torch.Tensor, split1: torch.Tensor | None = None,
            split2: torch.Tensor | None = None) -> torch.Tensor:
        """A ConvNeXt block's k=1 convs channels-last: residual + GELU(y w1^T + b1) w2^T + b2."""
        h = self(y, w1, b1, gelu=True, split=split1)
        return self(h, w2, b2, residual=residual, split=split2)

    def upsample(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ConvTranspose1d with kernel == stride and no bias (spec 5.2: the decoder's upsampling layers), as
        a GEMM: each input frame l becomes output frames l k .. l k + k - 1, sum_i x[i, l] weight[i, :, j],
        with no overlap between input frames. x [B, C_in, L], weight [C_in, C_out, k] -> [B, C_out, L k]."""
        batch, c_in, length = x.shape
        c_out, k = weight.shape[1], weight.shape[2]
        y = self(x.transpose(1, 2), weight.reshape(c_in, c_out * k).t(), None)  # [B, L, C_out k]
        return y.view(batch, length, c_out, k).permute(0, 2, 1, 3).reshape(batch, c_out, length * k)

    def upsample_channels_last(self, x: torch.Tensor, weight: torch.Tensor,
                               split: torch.Tensor | None = None) -> torch.Tensor:
        """`upsample` channels-last: x [B, L, C_in] -> [B, L k, C_out]. The weight's rows are ordered (tap j,
        output channel o), so the GEMM's output [B, L, k C_out] already is [B, L k, C_out] in memory (no
        permute of the activations). `split`: split_weight(channels_last_weight(weight)), built once
        (RVQCodec.presplit_weights); where it is read (`reads_split`) neither the reorder nor the split runs
        per call, elsewhere the weight is reordered here (one copy of a few MB)."""
        batch, length, c_in = x.shape
        c_out, k = weight.shape[1], weight.shape[2]
        if split is not None and self.reads_split(x):
            y = self.by_split(x.reshape(-1, c_in), (k * c_out, c_in), split, None, False, None)
        else:
            y = self(x, channels_last_weight(weight), None)
        return y.view(batch, length * k, c_out)


IEEE = Gemm()


@dataclass(frozen=True)
class SplitGemm(Gemm):
    """A kind of split products: the IEEE SGEMM below `min_rows` rows (too few tiles to fill the GPU). That
    choice is the one made per call: under CUDA graph capture the row count is a static shape per batch
    bucket, so a captured graph keeps one path."""
    min_rows: int

    def reads_split(self, x: torch.Tensor) -> bool:
        return self.takes_split and _rows(x) >= self.min_rows

    def __call__(self, x, weight, bias, gelu=False, residual=None, split=None):
        if _rows(x) < self.min_rows:   # the per-call choice: rows are a static shape per captured bucket
            return IEEE(x, weight, bias, gelu, residual)
        if split is not None and self.takes_split:
            r2 = None if residual is None else residual.reshape(-1, weight.shape[0])
            y = self.by_split(x.reshape(-1, x.shape[-1]), weight.shape, split, bias, gelu, r2)
            return y.view(*x.shape[:-1], -1)
        return self.by_weight(x, weight, bias, gelu, residual)

    def by_weight(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool,
                 residual: torch.Tensor | None) -> torch.Tensor:
        """The split products of x [..., K] and the unsplit weight, with the epilogue of `__call__`."""
        raise NotImplementedError

    def by_split(self, x: torch.Tensor, weight_shape: tuple[int, int], split: torch.Tensor,
                 bias: torch.Tensor | None, gelu: bool, residual: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] times a weight of `weight_shape` [N, K] given as its `split_weight` (Triton only)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Bf16x3Gemm(SplitGemm):
    """"bf16x3": every fp32 value v is split v = hi + lo with hi = bf16(v), lo = bf16(v - hi) (16 of fp32's 24
    mantissa bits), and x w ~ x_hi w_hi + x_lo w_hi + x_hi w_lo (x_lo w_lo dropped): ONE cuBLAS bf16 GEMM
    over a 3K-long reduction, [x_hi | x_lo | x_hi] . [w_hi | w_hi | w_lo], fp32 accumulation and output.
    ~1e-5 relative per product (bf16 alone: ~4e-3); tests/test_codec.py states the bounds. Off CUDA the
    same products run as an fp32 matmul of the bf16 parts (exact products, fp32 sums)."""
    cuda: bool = False   # the weights' device is CUDA (`codec_gemm`): cuBLAS's bf16 GEMM with fp32 output

    def by_weight(self, x, weight, bias, gelu, residual):
        return _epilogue(_bf16x3_linear(x, weight, bias, self.cuda), gelu, residual)


@dataclass(frozen=True)
class Tf32x3Gemm(SplitGemm):
    """"tf32x3": ops/fp32_linear.py, three TF32 tensor-core products per fp32 product (hi/lo split in
    registers), as accurate as "ieee" (~1e-7 relative); the epilogue fused. Plain TF32 is never used.
    "tf32x3w" (`presplit`): the same products with the weight split beforehand, so the GEMM kernel splits only
    x: as accurate, ~20% faster at the decoder's shapes (docs/performance.md). Its split = (w_hi, w_lo) =
    split_tf32(weight), a [2, N, K] tensor, made once (RVQCodec.presplit_weights keeps decode_step's);
    without it one split_tf32 kernel splits the weight on every call."""
    triton: bool    # its Triton kernel runs on the device (`codec_gemm`): only it takes a pre-split weight
    presplit: bool = False

    @property
    def takes_split(self) -> bool:
        return self.presplit and self.triton

    def by_weight(self, x, weight, bias, gelu, residual):
        return fp32_linear(x, weight, bias, gelu, presplit=self.presplit, residual=residual)

    def by_split(self, x, weight_shape, split, bias, gelu, residual):
        return fp32_linear(x, split[0], bias, gelu, presplit=True, residual=residual, weight_lo=split[1])

    @staticmethod
    def split_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """weight [N, K] -> split_tf32's halves [2, N, K] fp32, into `out` where it has that shape and device
        (a captured graph keeps its pointers)."""
        return _split_into(weight, (2, *weight.shape), torch.float32, split_tf32, out)


@dataclass(frozen=True)
class Fp16x3Gemm(SplitGemm):
    """"fp16x3w": ops/fp16x3_linear.py: x and w brought into fp16's range by powers of two and split into fp16
    halves (x per row and 64-column block, in a pass before the GEMM; w per output channel), three fp16
    tensor-core products per product, as accurate as "tf32x3w" at twice its tensor-core rate. Its split =
    split_fp16_weight packed flat, made once (RVQCodec.presplit_weights); without it the weight is split on
    every call (in torch). Off Triton the same splits multiply in an fp32 matmul."""
    triton: bool    # its Triton kernels run on the device (`codec_gemm`): only they take a pre-split weight

    @property
    def takes_split(self) -> bool:
        return self.triton

    def by_weight(self, x, weight, bias, gelu, residual):
        r2 = None if residual is None else residual.reshape(-1, weight.shape[0])
        y = fp16x3_linear(split_fp16_rows(x), split_fp16_weight(weight), bias, gelu, r2)
        return y.view(*x.shape[:-1], -1)

    def by_split(self, x, weight_shape, split, bias, gelu, residual):
        return fp16x3_linear(split_fp16_rows(x), unpack_weight_split(split, *weight_shape), bias, gelu, residual)

    def mlp(self, y, w1, b1, w2, b2, residual, split1=None, split2=None):
        # In the Triton kernels pwconv1's epilogue writes its output split for pwconv2, so the 4C-wide
        # activation never exists in fp32; y is split by a pass of its own (faster on the H200 than the conv +
        # norm kernel writing it split: ops/dwconv_layernorm.py). The same with or without the weights split
        # beforehand, so both give the same bits.
        if not self.triton or _rows(y) < self.min_rows:
            return super().mlp(y, w1, b1, w2, b2, residual, split1, split2)
        h = fp16x3_linear(split_fp16_rows(y.view(-1, y.shape[-1])), fp16x3_weight(split1, w1), b1, gelu=True,
                          split_out=True)
        out = fp16x3_linear(h, fp16x3_weight(split2, w2), b2, residual=residual.reshape(-1, residual.shape[-1]))
        return out.view(residual.shape)

    @staticmethod
    def split_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """weight [N, K] -> split_fp16_weight packed flat, [2 N K + 2 N] fp16, into `out` where it has that
        shape and device (a captured graph keeps its pointers)."""
        return _split_into(weight, (weight_split_numel(*weight.shape),), torch.float16, split_fp16_weight, out)


def _split_into(weight: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, split, out) -> torch.Tensor:
    if out is None or out.shape != shape or out.dtype != dtype or out.device != weight.device:
        out = torch.empty(shape, device=weight.device, dtype=dtype)
    split(weight, out=out)
    return out


def fp16x3_weight(split: torch.Tensor | None, weight: torch.Tensor) -> Fp16Split:
    """`weight`'s fp16x3 split: the packed one built at load (`split_weight`), or made now."""
    return unpack_weight_split(split, *weight.shape) if split is not None else split_fp16_weight(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: str,
           gelu: bool = False, residual: torch.Tensor | None = None,
           split: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM kind named `gemm` (`codec_gemm`, made for x's device at this call), called: for tests and
    tools; the codec makes its kind once at load."""
    return codec_gemm(gemm, x.device)(x, weight, bias, gelu, residual, split)


def upsample(x: torch.Tensor, weight: torch.Tensor, gemm: str) -> torch.Tensor:
    """Gemm.upsample of the kind named `gemm`, made for x's device at this call (tests and tools)."""
    return codec_gemm(gemm, x.device).upsample(x, weight)


def upsample_channels_last(x: torch.Tensor, weight: torch.Tensor, gemm: str,
                           split: torch.Tensor | None = None) -> torch.Tensor:
    """Gemm.upsample_channels_last of the kind named `gemm`, made for x's device at this call."""
    return codec_gemm(gemm, x.device).upsample_channels_last(x, weight, split)


def channels_last_weight(weight: torch.Tensor) -> torch.Tensor:
    """A ConvTranspose1d weight [C_in, C_out, k] as `Gemm.upsample_channels_last` multiplies by it, [k C_out,
    C_in]: row j C_out + o is tap j of output channel o (a copy)."""
    c_in, c_out, k = weight.shape
    return weight.permute(2, 1, 0).reshape(k * c_out, c_in)


def _bf16x3_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cuda: bool) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    a = _split_bf16(x.reshape(-1, k), hi_again=True)    # [M, 3K]
    b = _split_bf16(weight, hi_again=False)             # [N, 3K]
    if cuda:
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

