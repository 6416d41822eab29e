"""FP8 linear layer: y = x @ w^T with the weight in float8 e4m3, one scale per output row, and each row of x
quantised to e4m3 with its own scale as it comes (Hopper's FP8 tensor cores, `torch._scaled_mm`).

Why: a frame step reads ~19 GiB of bf16 weights, ~14 of them the LLM's Mamba and MLP projections, at the copy
rate; in e4m3 they are half the bytes (`model.dtype.llm_weights: fp8`, docs/decisions.md says what it costs).

    w_scale[n] = max_k |w[n, k]| * (1/448)     w8 = e4m3(w / w_scale)          (once, at load)
    x_scale[m] = max_k |x[m, k]| * (1/448)     x8 = e4m3(x / x_scale)          (every call: the kernel below)
    y[m, n]    = x_scale[m] w_scale[n] sum_k x8[m, k] w8[n, k]                 (fp32 sums, rounded once)

e4m3(.) is the nearest e4m3 value, ties to even (ops/kv_pages.py to_pool); the division is IEEE (div_rn, and
torch's tensor by tensor), so the kernel's x8 and scales are the reference's bit for bit. A row of zeros gets
scale 1 (nothing to divide). The product is `torch._scaled_mm` with row-wise scales on CUDA; the reference
states it in fp32 torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import use_triton
from ops.kv_pages import FP8_MAX, to_pool
from ops.rmsnorm import round_e4m3

FP8 = torch.float8_e4m3fn
# The scale is amax times the fp32 value of 1/448, a multiplication, rounded alike everywhere: torch on CUDA
# divides a tensor by a Python number as a multiplication by its reciprocal (so amax / 448 there is not the
# IEEE quotient the kernel's division gives, and the elements near a tie fell the other way).
INV_FP8_MAX = 1.0 / FP8_MAX
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)   # (a kernel reads only constexpr globals)

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M, K] e4m3, scale [M, 1] fp32) with x ~ x8 * scale, row by row."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax * INV_FP8_MAX, torch.ones_like(amax))
    return to_pool(xf / scale, FP8), scale


def fp8_linear_reference(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16), w8 [N, K] e4m3, w_scale [N] fp32 -> [M, N] in x's dtype: the module doc's product."""
    x8, x_scale = quantize_rows_reference(x)
    y = (x8.float() @ w8.float().t()) * x_scale * w_scale.float()[None, :]
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    """Program = one row: its amax over K, then every element divided by amax / 448 and rounded to e4m3."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, top * _INV_FP8_MAX, 1.0)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = round_e4m3(tl.div_rn(x, scale))
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    assert x.stride(-1) == 1
    q = torch.empty(m, k, device=x.device, dtype=FP8)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=1024, num_warps=4)
    return q, scale


def fp8_linear_triton(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    x8, x_scale = quantize_rows_triton(x)
    # w8 [N, K] row-major is the column-major [K, N] operand the FP8 GEMM takes (its "TN" layout)
    return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=x.dtype)


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (one node, as the other ops/ kernels), so a compiled step keeps fullgraph=True.
@torch.library.custom_op("nemo_duplex::fp8_linear", mutates_args=())
def fp8_linear_op(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return fp8_linear_triton(x, w8, w_scale)


@fp8_linear_op.register_fake
def _(x, w8, w_scale):
    return x.new_empty(x.shape[0], w8.shape[0])


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N]: the module doc's product (the kernel and `_scaled_mm` on the GPU or under
    TRITON_INTERPRET=1, the fp32 torch statement otherwise)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = fp8_linear_op(x2, w8, w_scale) if use_triton(x2) else fp8_linear_reference(x2, w8, w_scale)
    return y.view(*lead, w8.shape[0])


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An nn.Linear weight [N, K] -> (w8 [N, K] e4m3, w_scale [N] fp32): one scale per output row (the
    same rule as the activations', quantize_rows_reference)."""
    w8, scale = quantize_rows_reference(weight)
    return w8, scale[:, 0].contiguous()
