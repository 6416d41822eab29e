"""Weight-streaming GEMM for few rows: y = x @ w^T (+ bias), x [M, K] with M <= 64, w [N, K], bf16.

Why: a frame step multiplies a few rows per call by ~21 GB of bf16 weights, so at small batches every GEMM
should run at the speed the weights stream from HBM; the captured step at N=1 spent 8.5 ms in cuBLAS (719
kernels). Measured since (docs/performance.md): cuBLAS alone already streams the LLM's weights at 3.5-3.6
TB/s at 1-32 rows, this kernel reached 3.1-3.6 and won only on the encoder's small GEMMs at one row and
the text head, and the whole step was 0.5-1.1 ms slower with it (every Linear of the LLM, heads, talker
and RNN-T through it, commit c884f45). So no model code uses it; it stays with its benchmark
(scripts/dev/bench_ops.py --only skinny) as the measured alternative. Here each program owns BLOCK_N output
columns for ALL rows (so each weight element is read exactly once) and a slice of K; the K slices
(split-K) exist only to put enough programs on the GPU when N is small, and their fp32 partial sums are
added by a second kernel in a fixed order (no atomics: the result does not depend on scheduling).

Numerics: bf16 products accumulated in fp32 on the tensor cores, rounded once to the output dtype (as
cuBLAS without split-K; the summation order differs, so outputs can differ from F.linear by one bf16
step). The torch reference is F.linear, which the CPU path runs.

Layout: x [M, K] and w [N, K] both K-contiguous (nn.Linear's weight), y [M, N] contiguous.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import interpreting, sm_count, use_triton
from ops.rmsnorm import round_to

MAX_ROWS = 64  # rows one program holds (BLOCK_M); above it the GEMM is no longer weight-streaming-bound


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def skinny_gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def k_slice_dot(x_ptr, w_ptr, rows, cols, row_mask, col_mask, stride_xm, stride_wn, k_start,
                K: tl.constexpr, K_PER_SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] (fp32) = x[rows, k_start:+K_PER_SPLIT] @ w[cols, same]^T, w's tiles widened to x's
    dtype in registers (a no-op for bf16 weights; exact for e4m3: ops/fp8_weight_linear.py). K and the slice
    length are compile-time constants (fixed per layer), so the loop is counted and software-pipelined (and
    Triton 3.6's interpreter can run it). UPCAST: the dot in fp32 (IEEE) instead of bf16 tensor cores, for
    the interpreter, which mis-computes bf16 dots (the values are the same: both operands are exact in fp32)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],  # [BLOCK_K, BLOCK_N] of w^T
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    return acc


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N,
    stride_xm, stride_wn, stride_ym,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr, BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (column block, K slice): acc[BLOCK_M, BLOCK_N] over K_PER_SPLIT of K (`k_slice_dot`)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = k_slice_dot(x_ptr, w_ptr, rows, cols, row_mask, col_mask, stride_xm, stride_wn, split * K_PER_SPLIT,
                      K, K_PER_SPLIT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        # rounded by round_to first: the interpreter truncates a plain fp32 -> bf16 store
        y = round_to(acc, y_ptr.dtype.element_ty, BF16).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y, mask=out_mask)
    else:  # fp32 partials [SPLIT_K, M, N]
        tl.store(part_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=out_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym,
                       SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = sum over splits in order (+ bias), rounded once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    row = offs // N
    col = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + col, round_to(acc, y_ptr.dtype.element_ty, BF16).to(y_ptr.dtype.element_ty),
             mask=mask)


def pick_split_k(n_blocks: int, k: int, block_k: int, num_sms: int) -> int:
    """K slices so that column blocks x slices give ~4 programs per SM, each slice at least 4 K blocks long
    (shorter slices spend more on the partial sums than they gain)."""
    want = triton.cdiv(4 * num_sms, n_blocks)
    return max(1, min(want, k // (4 * block_k)))


GPU_TILES = (64, 128, 4, 4)  # BLOCK_N, BLOCK_K, num_warps, num_stages (scripts/dev/bench_ops.py --only skinny --sweep)


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       tiles: tuple[int, int, int, int] | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows), weight [N, K] K-contiguous, bias [N] or None -> [..., N] in x's
    dtype. `tiles` / `split_k` override GPU_TILES / pick_split_k (the benchmark sweeps them)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert weight.stride(-1) == 1 and weight.shape[1] == k
    m, n = x2.shape[0], weight.shape[0]
    assert m <= MAX_ROWS, f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}"
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y.view(*lead, n)
    interpret = interpreting()
    if tiles is None:  # the interpreter pays per program: wide tiles on the CPU
        tiles = (128, 128, 4, 1) if interpret else GPU_TILES
    block_n, block_k, num_warps, num_stages = tiles
    block_m = max(16, triton.next_power_of_2(m))
    n_blocks = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = pick_split_k(n_blocks, k, block_k, sm_count(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slice
    part = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32) if split_k > 1 else y
    _skinny_gemm_kernel[(n_blocks, split_k)](
        x2, weight, bias if bias is not None else y, y, part, m, n,
        x2.stride(0), weight.stride(0), y.stride(0),
        K=k, K_PER_SPLIT=k_per_split, SPLIT_K=split_k, HAS_BIAS=bias is not None, UPCAST=interpret,
        BF16=x.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, bias if bias is not None else y, y, m, n, y.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BF16=x.dtype == torch.bfloat16, BLOCK=block,
        )
    return y.view(*lead, n)


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::skinny_gemm", mutates_args=())
def skinny_gemm_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return skinny_gemm_triton(x, weight, bias)


@skinny_gemm_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def use_skinny(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """The Triton path for bf16/fp16 on CUDA (or under TRITON_INTERPRET=1) with at most `max_rows` rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= min(max_rows, MAX_ROWS) and x.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == weight.dtype and weight.stride(-1) == 1
            and use_triton(x))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  max_rows: int = MAX_ROWS) -> torch.Tensor:
    """F.linear, through the weight-streaming kernel where `use_skinny` says so."""
    if use_skinny(x, weight, max_rows):
        return skinny_gemm_op(x, weight, bias)
    return F.linear(x, weight, bias)
