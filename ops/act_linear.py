"""An MLP's down projection with its activation applied as the operand is loaded, for few rows (M <= 64):

    silu:          y = silu(x) @ w^T                                  x [M, K]
    gelu_tanh_mul: y = (gelu_tanh(x[:, :K]) * x[:, K:]) @ w^T         x [M, 2K]: a stacked gate | up GEMM's output

w [N, K], bf16 (or fp32) in and out. The activation rounds where the separate kernel's output would be rounded
(silu once to x's dtype, as torch; gelu_tanh_mul as ops/activation.py: the gelu, then the product), so the
product's operand is the same tensor the two-kernel path multiplies, up to the activation's fp32 ulps.

Why: at 32 calls the encoder's feed-forward down projections (48 a step, [32 x 4096] -> 1024) and the talker's
gated MLPs' (28 backbone + 15 MoG, [64 x 4608] -> 1152) each follow a separate activation kernel (~1.7 us plus
a launch in the chain), and cuBLAS splits these K-long GEMMs into a GEMM and a reduction kernel. Here one launch
does the activation, the product and the split-K sum: programs own BLOCK_N output columns for all rows (each
weight element read once) and a slice of K; each writes its fp32 partial sums, and the last program of a
column block to finish (an atomic ticket per block, reset by that program) adds the partials in split order,
so the result does not depend on which program finished last. A session 15 probe of that kernel without the
activation (docs/runs/probe_s15_2_small_gemm.py) ran the encoder's shape in 10.13 us against cuBLASLt's
10.95 us in a chain of GEMMs (H200).

Numerics: bf16 products accumulated in fp32 on the tensor cores, rounded once to the output dtype; the
summation order differs from cuBLAS's, so outputs may differ from F.linear by one bf16 step.

`tickets` [cdiv(N, BLOCK_N)] int32, zero before the first call: the caller owns it (one per call site, as
a module buffer) and every launch leaves it zero again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import interpreting, use_triton
from ops.activation import gelu_tanh_mul_reference
from ops.rmsnorm import _round_to

MAX_ROWS = 64
ACTIVATIONS = ("silu", "gelu_tanh_mul")


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def act_linear_reference(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.linear(F.silu(x), weight)
    gate, up = x.chunk(2, dim=-1)
    return F.linear(gelu_tanh_mul_reference(gate, up), weight)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _act_linear_kernel(x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, k_per_split, stride_xm, stride_ym,
                       GELU_MUL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Program (column block, K slice): acc [BLOCK_N, BLOCK_M] = w[cols, slice] @ act(x[:, slice])^T."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                    mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)                   # [BLOCK_N, BLOCK_K]
        x_offsets = rows[None, :] * stride_xm + ks[:, None]
        x_mask = (rows[None, :] < M) & (ks[:, None] < K)
        g = tl.load(x_ptr + x_offsets, mask=x_mask, other=0.0).to(tl.float32)                 # [BLOCK_K, BLOCK_M]
        if GELU_MUL:
            up = tl.load(x_ptr + x_offsets + K, mask=x_mask, other=0.0).to(tl.float32)
            inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))     # GELU_BETA, GELU_KAPPA
            tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)                  # as ops/activation.py
            a = _round_to(_round_to(0.5 * g * (1.0 + tanh), dtype, BF16) * up, dtype, BF16)
        else:
            a = _round_to(g / (1.0 + tl.exp(-g)), dtype, BF16)
        if UPCAST:  # the interpreter's bf16 dot is wrong: the same products in fp32 (exact for bf16 inputs)
            acc = tl.dot(w.to(tl.float32), a, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, a.to(w.dtype), acc, input_precision=DOT_PRECISION)
    out_mask = (cols[:, None] < N) & (rows[None, :] < M)
    y_offsets = rows[None, :] * stride_ym + cols[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offsets, _round_to(acc, dtype, BF16).to(dtype), mask=out_mask)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + rows[None, :]
        base = part_ptr + pid_n * SPLIT_K * BLOCK_N * BLOCK_M
        tl.store(base + split * BLOCK_N * BLOCK_M + tile, acc)
        ticket = tl.atomic_add(ticket_ptr + pid_n, 1, sem="acq_rel")   # after this program's partial is stored
        if ticket == SPLIT_K - 1:   # the last of the block's programs: every partial is written
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):   # split order, whichever program arrived last
                total += tl.load(base + s * BLOCK_N * BLOCK_M + tile, cache_modifier=".cg")
            tl.store(y_ptr + y_offsets, _round_to(total, dtype, BF16).to(dtype), mask=out_mask)
            tl.atomic_xchg(ticket_ptr + pid_n, 0)   # ready for the next launch (a graph replays this one)


# (BLOCK_N, BLOCK_K, warps, stages, K slices): the session 15 probe's best for [32 x 4096] -> 1024 and
# [64 x 4608] -> 1152 on the H200; the interpreter takes few large programs
TILES = (64, 128, 4, 4, 8)


def tickets_for(n: int, device, tiles=TILES) -> torch.Tensor:
    """The zeroed ticket array a call site of an N-column act_linear keeps (one int32 per column block)."""
    return torch.zeros(triton.cdiv(n, tiles[0]), dtype=torch.int32, device=device)


def act_linear_triton(x: torch.Tensor, weight: torch.Tensor, tickets: torch.Tensor, activation: str,
                      tiles: tuple[int, int, int, int, int] = TILES) -> torch.Tensor:
    assert activation in ACTIVATIONS and x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if activation == "gelu_tanh_mul" else k) and m <= MAX_ROWS, (x.shape, weight.shape)
    block_n, block_k, num_warps, num_stages, split = tiles
    if interpreting():
        block_k, split = max(block_k, triton.next_power_of_2(triton.cdiv(k, 2))), 2
    assert tickets.dtype == torch.int32 and tickets.numel() >= triton.cdiv(n, block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    block_m = max(16, triton.next_power_of_2(m))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    n_blocks = triton.cdiv(n, block_n)
    part = torch.empty(n_blocks * split * block_n * block_m if split > 1 else 1, device=x.device,
                       dtype=torch.float32)
    if m:
        _act_linear_kernel[(n_blocks, split)](
            x, weight, y, part, tickets, m, n, k, k_per_split, x.stride(0), y.stride(0),
            GELU_MUL=activation == "gelu_tanh_mul", SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, BF16=x.dtype == torch.bfloat16,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 (the yardstick): no TF32
            UPCAST=interpreting(),
            num_warps=num_warps, num_stages=num_stages)
    return y


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py). The tickets are left as they were found (zero).
@torch.library.custom_op("nemo_duplex::act_linear", mutates_args=())
def act_linear_op(x: torch.Tensor, weight: torch.Tensor, tickets: torch.Tensor, activation: str) -> torch.Tensor:
    return act_linear_triton(x, weight, tickets, activation)


@act_linear_op.register_fake
def _(x, weight, tickets, activation):
    return x.new_empty(x.shape[0], weight.shape[0])


def act_linear(x: torch.Tensor, weight: torch.Tensor, tickets: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x) @ weight^T for x [..., K] (silu) or [..., 2K] (gelu_tanh_mul, gate then up): one launch on CUDA or
    under TRITON_INTERPRET=1 for at most MAX_ROWS rows with `tickets` (tickets_for), else the two torch steps."""
    rows = x.reshape(-1, x.shape[-1])
    if tickets is not None and use_triton(x) and rows.shape[0] <= MAX_ROWS and rows.stride(-1) == 1:
        return act_linear_op(rows, weight, tickets, activation).view(*x.shape[:-1], weight.shape[0])
    return act_linear_reference(x, weight, activation)
