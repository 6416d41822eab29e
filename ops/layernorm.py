"""Residual add + LayerNorm in one kernel: the streaming FastConformer's macaron joints (spec 2.3).

    s = x + alpha * delta          (fp32 math, one rounding to x's dtype; alpha 1 or 0.5, so the product is exact)
    y = layer_norm(s) * w + b      (F.layer_norm: mean / variance in fp32, one rounding to x's dtype)

Each block of a Conformer layer ends with a residual add and the next block starts by norming the sum
(ff1's add + norm_self_att, attention's add + norm_conv, conv's add + norm_feed_forward2, ff2's add with
alpha 0.5 + norm_out). In torch that is two kernels per joint, and the sum makes a round trip through
memory between them; here one program per row reads x and delta once and writes both the new residual
stream s and the normed y. With delta None it is a plain LayerNorm (y only). With `then` (a second
LayerNorm) the sum is not kept: (y, then(y)), a layer's output norm and the next layer's first norm
(norm_out, then the next layer's norm_feed_forward1): 23 fewer launches per frame step at full size.
Why a kernel: at full size (24 layers, d_model 1024) the four joints were 192 of the encoder's 828 launches
of a frame step (scripts/dev/census_step.py), each a few microseconds inside a CUDA graph for a [B, 1024] tile.
bf16 roundings inside the kernel use rmsnorm's `round_to` (bit arithmetic, see its docstring).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import use_triton
from ops.rmsnorm import as_rows, round_to

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def add_layer_norm_reference(x: torch.Tensor, delta: torch.Tensor | None, alpha: float, weight: torch.Tensor,
                             bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch statement (the encoder's CPU path and the kernel's reference): the two ops the streaming
    layer ran before. The sum is written `x + delta * alpha`, not `torch.add(x, delta, alpha=alpha)`: when
    delta comes from a matmul, Inductor fuses that add into an addmm and drops the alpha (pytorch/pytorch
    #167313: from it the tiny model's whole step compiled by Inductor came out ~0.5 relative off eager).
    For the alphas the encoder uses (1 and 0.5) the product is exact, so the bits are the same."""
    assert alpha in (1.0, 0.5), f"alpha {alpha}: only 1 and 0.5 keep x + delta * alpha exact"
    s = x if delta is None else x + delta * alpha
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


def add_layer_norm_then_reference(x: torch.Tensor, delta: torch.Tensor, alpha: float, weight: torch.Tensor,
                                  bias: torch.Tensor, eps: float, weight2: torch.Tensor, bias2: torch.Tensor,
                                  eps2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z): y = LayerNorm(x + alpha delta), z = LayerNorm2(y), each rounded to x's dtype."""
    y = add_layer_norm_reference(x, delta, alpha, weight, bias, eps)[1]
    return y, F.layer_norm(y, (y.shape[-1],), weight2, bias2, eps2)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def layer_norm_row(x, mask, w_ptr, b_ptr, offs, eps, D: tl.constexpr, dtype: tl.constexpr, BF16: tl.constexpr):
    """x: one row [BLOCK] fp32 (0 where ~mask) -> LayerNorm(x) * w + b rounded to `dtype`, as fp32.
    Two passes over the registers (mean, then the centred sum of squares), 1 / sqrt rounded as torch's."""
    mean = tl.sum(x, axis=0) / D
    centred = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(centred * centred, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(centred * rstd * w + b, dtype, BF16)


@triton.jit
def _add_layer_norm_kernel(
    x_ptr, delta_ptr, w_ptr, b_ptr, s_ptr, y_ptr, w2_ptr, b2_ptr,
    stride_x, stride_d, stride_s, stride_y, alpha, eps, eps2,
    D: tl.constexpr, HAS_DELTA: tl.constexpr, NEXT: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
):
    """Program = one row of D channels (BLOCK_D = next power of two, masked). NEXT: the sum is not stored;
    s_ptr gets the norm y and y_ptr the second norm of y (w2, b2, eps2)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dtype = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:  # torch.add's opmath: x + alpha * delta in fp32, rounded once; the norm reads the rounded sum
        delta = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + alpha * delta, dtype, BF16)
        if not NEXT:
            tl.store(s_ptr + row * stride_s + offs, x.to(dtype), mask=mask)
    y = layer_norm_row(x, mask, w_ptr, b_ptr, offs, eps, D, dtype, BF16)
    if NEXT:  # y is 0 where ~mask, as layer_norm_row wants its input
        tl.store(s_ptr + row * stride_s + offs, y.to(dtype), mask=mask)
        y = layer_norm_row(y, mask, w2_ptr, b2_ptr, offs, eps2, D, dtype, BF16)
    tl.store(y_ptr + row * stride_y + offs, y.to(dtype), mask=mask)


def add_layer_norm_triton(x: torch.Tensor, delta: torch.Tensor | None, alpha: float, weight: torch.Tensor,
                          bias: torch.Tensor, eps: float,
                          then: tuple[torch.Tensor, torch.Tensor, float] | None = None
                          ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(s, y) with s None when delta is None (the caller's x is the sum); with `then` = (weight2, bias2,
    eps2) and a delta, (y, LayerNorm2(y)) instead."""
    width = x.shape[-1]
    assert weight.shape == bias.shape == (width,) and weight.stride(-1) == 1 and bias.stride(-1) == 1
    weight2, bias2, eps2 = then if then is not None else (weight, bias, eps)
    assert weight2.shape == bias2.shape == (width,) and weight2.stride(-1) == 1 and bias2.stride(-1) == 1
    assert then is None or delta is not None
    x2 = as_rows(x, width)
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    s, d2 = None, x2  # without delta the kernel reads neither d2 nor writes s (any pointer will do)
    if delta is not None:
        assert delta.shape == x.shape and delta.dtype == x.dtype
        d2 = as_rows(delta, width)
        s = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(width)
        _add_layer_norm_kernel[(rows,)](
            x2, d2, weight, bias, y if s is None else s, y, weight2, bias2,
            x2.stride(0), d2.stride(0), y.stride(0) if s is None else s.stride(0), y.stride(0),
            float(alpha), float(eps), float(eps2),
            D=width, HAS_DELTA=s is not None, NEXT=then is not None, BLOCK_D=block, BF16=x.dtype == torch.bfloat16,
            num_warps=max(1, min(8, block // 256)),
        )
    y = y.view(x.shape)
    return (s.view(x.shape) if s is not None else None), y


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py). Two ops because a custom op may not return its
# input: without delta the sum is x itself and only y is new.
@torch.library.custom_op("nemo_duplex::add_layer_norm", mutates_args=())
def add_layer_norm_op(x: torch.Tensor, delta: torch.Tensor, alpha: float, weight: torch.Tensor,
                      bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_layer_norm_triton(x, delta, alpha, weight, bias, eps)


@add_layer_norm_op.register_fake
def _(x, delta, alpha, weight, bias, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("nemo_duplex::add_layer_norm_then", mutates_args=())
def add_layer_norm_then_op(x: torch.Tensor, delta: torch.Tensor, alpha: float, weight: torch.Tensor,
                           bias: torch.Tensor, eps: float, weight2: torch.Tensor, bias2: torch.Tensor,
                           eps2: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_layer_norm_triton(x, delta, alpha, weight, bias, eps, (weight2, bias2, eps2))


@add_layer_norm_then_op.register_fake
def _(x, delta, alpha, weight, bias, eps, weight2, bias2, eps2):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("nemo_duplex::layer_norm", mutates_args=())
def layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return add_layer_norm_triton(x, None, 1.0, weight, bias, eps)[1]


@layer_norm_op.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


def add_layer_norm(x: torch.Tensor, delta: Optional[torch.Tensor], alpha: float, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., D] (same dtype), weight/bias [D] -> (s = x + alpha delta, y = LayerNorm(s)), both in
    x's dtype; delta None -> (x, LayerNorm(x)). The kernel on CUDA or under TRITON_INTERPRET=1, else the
    torch reference."""
    if not use_triton(x):
        return add_layer_norm_reference(x, delta, alpha, weight, bias, eps)
    if delta is None:
        return x, layer_norm_op(x, weight, bias, float(eps))
    return add_layer_norm_op(x, delta, float(alpha), weight, bias, float(eps))


def add_layer_norm_then(x: torch.Tensor, delta: torch.Tensor, alpha: float, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float, weight2: torch.Tensor, bias2: torch.Tensor,
                        eps2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., D] -> (y = LayerNorm(x + alpha delta), LayerNorm2(y)), both in x's dtype, in one kernel on
    CUDA or under TRITON_INTERPRET=1 (the sum is not kept), else the torch reference."""
    if not use_triton(x):
        return add_layer_norm_then_reference(x, delta, alpha, weight, bias, eps, weight2, bias2, eps2)
    return add_layer_norm_then_op(x, delta, float(alpha), weight, bias, float(eps), weight2, bias2, float(eps2))
