"""Greedy residual vector quantisation through k codebooks (the talker's RVQ, spec 4.6):

    r = z;  for each book i:  idx_i = argmin_j ||e_j||^2 - 2 r . e_j  (the first index of the minimum),
                              r -= book_i[idx_i]

Why a kernel: in torch each book is a distance GEMM and an argmin-gather-subtract kernel, and with 31
books per frame step the loop is launch-bound: 382 us at 32 calls on the H200 (docs/performance.md,
session 10), ~12 us per book for ~17 MFLOP. Here each book is ONE kernel over (row block, codeword block)
programs: a program first brings its rows' residual up to date from the previous book's result (the same
single fp32 subtraction as torch), then takes the distances of its block of codewords (an fp32 FMA dot,
no tensor cores: TF32 would move near-ties) and their minimum, which it merges into the row's result
with one 64-bit atomic min of (order-preserving distance key, index). min is order-free, so the result
is deterministic and is the first index of the minimum, as torch.argmin. Rows and books never mix.

Differences from the torch reference: the distance sums run in another order, so a codeword whose
distance is within rounding (~1e-6 relative) of the best may be picked instead (the tests check that
every code that differs is such a near-tie). NaN distances are not handled (the reference's argmin picks
the NaN; here its key orders like a large number).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ops import use_triton


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def residual_vq_reference(z: torch.Tensor, books: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """z [B, D] fp32, books [k, C, D] fp32, norms [k, C] (the books' squared norms) -> codes [B, k] int64."""
    r, codes = z.float(), []
    for book, norm in zip(books, norms):
        # the norms as a 1-D bias: cuBLAS adds them in its epilogue (a [1, C] view is first copied per row)
        distances = torch.addmm(norm, r, book.T, alpha=-2)
        idx = distances.argmin(-1)
        r = r - book[idx]
        codes.append(idx)
    return torch.stack(codes, dim=-1)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _residual_vq_book_kernel(
    src_ptr, prev_book_ptr, prev_packed_ptr, book_ptr, norm_ptr, res_ptr, packed_ptr, B, stride_p,
    C: tl.constexpr, D: tl.constexpr, HAS_PREV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Book i for rows [BLOCK_R] x codewords [BLOCK_C]. src [B, D]: the residual before book i - 1 (z for
    book 0: HAS_PREV false); prev_packed [B] (row stride stride_p): book i - 1's merged (key, index). Writes
    this book's residual input r (codeword block 0 only) to res [B, D] and merges its block's minimum into
    packed [B] (row stride stride_p)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < B
    rows64 = rows.to(tl.int64)
    cws = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    if HAS_PREV:
        prev_idx = (tl.load(prev_packed_ptr + rows64 * stride_p, mask=row_mask, other=0) & 0xFFFFFFFF).to(tl.int64)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        r = tl.load(src_ptr + rows64[:, None] * D + ds[None, :], mask=row_mask[:, None], other=0.0)
        if HAS_PREV:
            r = r - tl.load(prev_book_ptr + prev_idx[:, None] * D + ds[None, :], mask=row_mask[:, None], other=0.0)
        if tl.program_id(1) == 0:
            tl.store(res_ptr + rows64[:, None] * D + ds[None, :], r, mask=row_mask[:, None])
        e_t = tl.load(book_ptr + cws[None, :].to(tl.int64) * D + ds[:, None])  # [BLOCK_D, BLOCK_C]
        acc = tl.dot(r, e_t, acc, input_precision="ieee")
    # -2 acc is exact; one rounding for the sum, as addmm(norm, r, book^T, alpha=-2) computes it
    dist = tl.load(norm_ptr + cws)[None, :] + (-2.0) * acc
    dist = dist + 0.0  # -0.0 -> +0.0: equal distances must tie (their keys would differ)
    best = tl.min(dist, axis=1)
    best_idx = tl.argmin(dist, axis=1, tie_break_left=True) + tl.program_id(1) * BLOCK_C
    # fp32 -> int32 with the same order (negative floats count down): the high word of a signed int64
    # whose low word is the index, so int64 min = the smallest distance, then the smallest index
    bits = best.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    packed = (key.to(tl.int64) << 32) | best_idx.to(tl.int64)
    tl.atomic_min(packed_ptr + rows64 * stride_p, packed, mask=row_mask)


# 16 rows x 32 codewords per program: 64 programs per book at 32 calls, 256 at 128 (tl.dot's minimum tile
# is 16). Not tuned on the device yet beyond a first run (docs/performance.md).
GPU_BLOCKS = (16, 32, 64)   # BLOCK_R, BLOCK_C, BLOCK_D


def residual_vq_triton(z: torch.Tensor, books: torch.Tensor, norms: torch.Tensor,
                       blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    assert z.dtype == books.dtype == norms.dtype == torch.float32
    k, codewords, width = books.shape
    batch = z.shape[0]
    if blocks is None:  # the interpreter pays per program: wide codeword blocks on the CPU
        r, c, d = GPU_BLOCKS if z.is_cuda else (16, 256, 128)
        blocks = (r, math.gcd(codewords, c), math.gcd(width, d))  # whole blocks (powers of two dividing)
    block_r, block_c, block_d = blocks
    assert codewords % block_c == 0 and width % block_d == 0, "codebook and width must be whole blocks"
    assert min(block_c, block_d) >= 16, "tl.dot needs blocks of >= 16: codebook size and width multiples of 16"
    assert codewords < 2 ** 31
    z, books, norms = z.contiguous(), books.contiguous(), norms.contiguous()
    # every book's merged (key, index) per row, [B, k] (the codes' layout), starting above any key: one fill
    packed = torch.full((batch, k), torch.iinfo(torch.int64).max, dtype=torch.int64, device=z.device)
    residuals = torch.empty(2, batch, width, dtype=torch.float32, device=z.device)  # ping-pong
    if batch == 0:
        return torch.empty(0, k, dtype=torch.int64, device=z.device)
    grid = (triton.cdiv(batch, block_r), codewords // block_c)
    for i in range(k):
        first = i == 0
        # book i reads what book i - 1 wrote (residuals[(i - 1) % 2]) and writes the other half
        _residual_vq_book_kernel[grid](
            z if first else residuals[(i - 1) % 2], books[0] if first else books[i - 1],
            packed[:, 0] if first else packed[:, i - 1], books[i], norms[i], residuals[i % 2], packed[:, i], batch, k,
            C=codewords, D=width, HAS_PREV=not first, BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_D=block_d,
            num_warps=4,
        )
    return packed & 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::residual_vq", mutates_args=())
def residual_vq_op(z: torch.Tensor, books: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    return residual_vq_triton(z, books, norms)


@residual_vq_op.register_fake
def _(z, books, norms):
    return z.new_empty(z.shape[0], books.shape[0], dtype=torch.int64)


def residual_vq(z: torch.Tensor, books: torch.Tensor, norms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Codes [B, k] int64 of z [B, D] through books [k, C, D] (fp32), norms [k, C] their squared norms (computed
    if None): the Triton kernels on CUDA or under TRITON_INTERPRET=1 (C and D multiples of 16), else the torch
    reference."""
    books = books.float()
    norms = books.pow(2).sum(-1) if norms is None else norms
    if use_triton(z) and books.shape[1] % 16 == 0 and books.shape[2] % 16 == 0:  # tl.dot's smallest blocks
        return residual_vq_op(z.float(), books, norms)
    return residual_vq_reference(z, books, norms)
