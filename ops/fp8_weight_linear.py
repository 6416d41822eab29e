"""Weight-only FP8 linear layer: y = x @ w^T with the weight stored in float8 e4m3 (one scale per output row)
and x left in its bf16: each weight tile is widened to bf16 in registers and multiplied on the bf16 tensor
cores.

Why: a frame step streams every weight once, so its time at small batches is the weights' bytes; e4m3 halves
them. The other FP8 product (ops/fp8_linear.py, Hopper's FP8 GEMMs) also rounds every row of x to e4m3 and
costs a quantising kernel per projection: measured on the H200 (docs/performance.md) its step was slower than
bf16's at 1 and 32 calls (3% faster at 128) and its text moved past the gate's margins. Here x keeps its 8 mantissa bits (the only rounding is
the weight's, once, at load) and a projection is one kernel.

    w_scale[n] = max_k |w[n, k]| * (1/448)   w8 = e4m3(w / w_scale)          (once, at load: quantize_weight)
    y[m, n]    = w_scale[n] sum_k x[m, k] w8[n, k]                           (fp32 sums, rounded once to x's dtype)

e4m3 -> bf16 is exact (4 significant bits, exponents 2^-9 .. 2^8), so the tensor cores multiply the stored
values themselves. With SPLIT_K > 1 the reduction is cut into slices of whole K blocks whose fp32 partial
sums a second kernel adds in split order (no atomics: the same bits every run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import interpreting, sm_count, use_triton
from ops.fp32_linear import grouped_tile, sum_splits
from ops.rmsnorm import round_to
from ops.skinny_gemm import k_slice_dot, pick_split_k

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def fp8_weight_linear_reference(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K], w8 [N, K] e4m3, w_scale [N] fp32 -> [M, N] in x's dtype: the module doc's product in fp32."""
    return ((x.float() @ w8.float().t()) * w_scale.float()[None, :]).to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _fp8_weight_linear_kernel(
    x_ptr, w_ptr, scale_ptr, y_ptr, part_ptr, M, N, stride_xm, stride_wn, stride_ym,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Program (output tile, K slice): acc[BLOCK_M, BLOCK_N] over K_PER_SPLIT of K (`k_slice_dot`: the e4m3
    tiles widened to x's dtype in registers, exact), then scaled per column and rounded once, or with
    SPLIT_K > 1 stored unscaled to part_ptr [SPLIT_K, M, N] for `_sum_splits_kernel`."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = k_slice_dot(x_ptr, w_ptr, rows, cols, row_mask, col_mask, stride_xm, stride_wn, split * K_PER_SPLIT,
                      K, K_PER_SPLIT, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        _scale_store(acc, rows, cols, col_mask, out_mask, scale_ptr, y_ptr, stride_ym, BF16)
    else:
        tl.store(part_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=out_mask)


@triton.jit
def _scale_store(acc, rows, cols, col_mask, out_mask, scale_ptr, y_ptr, stride_ym, BF16: tl.constexpr):
    """y = acc x w_scale[col], rounded once to y's dtype (by round_to: the interpreter truncates a plain fp32
    -> bf16 store), stored."""
    y = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    y = round_to(y, y_ptr.dtype.element_ty, BF16).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y, mask=out_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, scale_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr, BF16: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The splits' partial sums added in split order (no atomics), then `_scale_store`."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    out_mask = (rows < M)[:, None] & col_mask[None, :]
    acc = sum_splits(part_ptr, rows[:, None] * N + cols[None, :], out_mask, M, N, SPLIT_K)
    _scale_store(acc, rows, cols, col_mask, out_mask, scale_ptr, y_ptr, stride_ym, BF16)


# Tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Up to 64 rows every row of x is in one tile and a
# program streams its BLOCK_N weight rows once: ops/skinny_gemm.py's design and its swept choice (64 x 128,
# 4 warps, 4 stages: 3.1-3.6 TB/s on the LLM's bf16 weights, docs/decisions.md), with BLOCK_M the rows
# rounded up to a power of two (16 at least, what tl.dot takes). Above 64 rows (the 128-call bucket, a
# prompt's prefill), 128 x 128 tiles: not yet swept on the H200 (scripts/dev/bench_ops.py --only fp8_weights
# --sweep).
SKINNY_ROWS = 64
SKINNY_TILES = (64, 128, 4, 4)   # BLOCK_N, BLOCK_K, num_warps, num_stages
WIDE_TILES = (128, 128, 64, 8, 3)


def pick_tiles(m: int) -> tuple[int, int, int, int, int]:
    if interpreting():   # the interpreter pays per program: few, large ones on the CPU
        return max(16, min(128, triton.next_power_of_2(m))), 128, 128, 4, 1
    if m <= SKINNY_ROWS:
        return (max(16, triton.next_power_of_2(m)), *SKINNY_TILES)
    return WIDE_TILES


def fp8_weight_linear_triton(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                             tiles: tuple[int, int, int, int, int] | None = None,
                             split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp16, K-contiguous), w8 [N, K] e4m3 (K-contiguous, any row stride), w_scale [N] fp32
    -> [M, N] in x's dtype. `tiles` (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) and `split_k` override
    pick_tiles and skinny_gemm's pick_split_k (~4 programs per SM, slices of at least 4 K blocks)."""
    assert x.dtype in (torch.bfloat16, torch.float16), "the product widens e4m3 to x's dtype: bf16 or fp16"
    assert w8.dtype == torch.float8_e4m3fn and w_scale.dtype == torch.float32 and w_scale.shape == (w8.shape[0],)
    assert x.stride(-1) == 1 and w8.stride(-1) == 1 and w8.shape[1] == x.shape[1]
    m, k = x.shape
    n = w8.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    block_m, block_n, block_k, num_warps, num_stages = pick_tiles(m) if tiles is None else tiles
    output_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        split_k = pick_split_k(output_tiles, k, block_k, sm_count(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no empty slice
    assert split_k == 1 or split_k * m * n < 2 ** 31, "split-K scratch offsets are 32-bit"
    part = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32) if split_k > 1 else y  # y: unwritten
    bf16 = x.dtype == torch.bfloat16
    _fp8_weight_linear_kernel[(output_tiles, split_k)](
        x, w8, w_scale, y, part, m, n, x.stride(0), w8.stride(0), y.stride(0),
        K=k, K_PER_SPLIT=k_per_split, SPLIT_K=split_k, UPCAST=interpreting(), BF16=bf16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=num_warps, num_stages=num_stages)
    if split_k > 1:
        sum_m, sum_n = 16, 128
        _sum_splits_kernel[(triton.cdiv(m, sum_m), triton.cdiv(n, sum_n))](
            part, w_scale, y, m, n, y.stride(0), SPLIT_K=split_k, BF16=bf16, BLOCK_M=sum_m, BLOCK_N=sum_n)
    return y


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (one node, as the other ops/ kernels), so a compiled step keeps fullgraph=True.
@torch.library.custom_op("nemo_duplex::fp8_weight_linear", mutates_args=())
def fp8_weight_linear_op(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return fp8_weight_linear_triton(x, w8, w_scale)


@fp8_weight_linear_op.register_fake
def _(x, w8, w_scale):
    return x.new_empty(x.shape[0], w8.shape[0])


def fp8_weight_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N]: the module doc's product (the kernel on the GPU or under TRITON_INTERPRET=1 for
    bf16/fp16 x; the fp32 torch statement otherwise)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if use_triton(x2) and x2.dtype in (torch.bfloat16, torch.float16):
        y = fp8_weight_linear_op(x2, w8, w_scale)
    else:
        y = fp8_weight_linear_reference(x2, w8, w_scale)
    return y.view(*lead, w8.shape[0])
