"""Greedy residual quantisation through a run of codebooks (the talker's RVQ, spec 4.6):

    r = z;  for each codebook i:  idx_i[b] = argmin_j (||e_ij||^2 - 2 r[b] . e_ij)   (first index of the minimum)
                                  r[b]    -= e_i,idx_i[b]                             (fp32)

Why a kernel: the torch statements are, per codebook, an fp32 GEMM for the distances (cuBLAS runs it as a SIMT
SGEMM with a split-K reduction, TF32 being off) and the argmin-gather-subtract kernel of ops/argmin_residual.py:
three launches of ~3-7 us each at the talker's shapes (1024 codewords x 512, 32-128 rows), 93 for the 31
codebooks of a frame step (H200 profile, docs/performance.md session 18). Here one launch per codebook computes
that codebook's distances for a slice of its codewords (fp32 products, summed in fp32) and each slice's minimum,
and the next launch first resolves those per-slice minima into the index and the new residual, redundantly in
every program (a few tens of KB each from L2), before its own distances. So k codebooks take k + 1 launches and
no launch waits on another program of its grid: no grid barrier, which the interpreter (the CPU tests) could
not run either.

Same decisions as the torch statements wherever the minimum is not a near-tie: the distances are the same fp32
formula (norm - 2 dot, the -2 exact), but the dot products' fp32 sums run in a different order than cuBLAS's,
so two codewords whose distances are within a few fp32 ulps may swap (`tests/ops/test_rvq_quantise.py` measures
the margin wherever a code differs). Ties in the computed distances go to the first index, as torch.argmin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import use_triton


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def rvq_quantise_reference(z: torch.Tensor, books: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """z [B, D], books [k, C, D] fp32, norms [k, C] fp32 (the books' squared norms) -> codes [B, k] int64:
    the distances as one GEMM with the norms as its bias, then argmin, gather, subtract."""
    r = z.float()
    codes = []
    for book, norm in zip(books, norms):
        distances = torch.addmm(norm, r, book.T, alpha=-2)
        idx = distances.argmin(-1)
        r = r - book[idx]
        codes.append(idx)
    return torch.stack(codes, dim=-1)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _rvq_step_kernel(r_in_ptr, r_out_ptr, prev_book_ptr, book_ptr, norm_ptr, prev_val_ptr, prev_idx_ptr,
                     val_ptr, idx_ptr, codes_ptr, B, C, D, S, stride_codes, prev_code,
                     RESOLVE: tl.constexpr, SEARCH: tl.constexpr, PREV_SLICES: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row block, codeword slice). RESOLVE: the previous codebook's per-slice minima -> its index
    (code column `prev_code`) and the residual r = r_in - prev_book[index] (written by slice 0 to r_out);
    otherwise r = r_in. SEARCH: this codebook's distances over the slice's BLOCK_C codewords -> the slice's
    minimum and its first index per row (val / idx [S, B], S slices)."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < B
    rows64 = rows.to(tl.int64)
    part = tl.program_id(1)
    lead = row_mask & ((rows * 0 + part) == 0)  # slice 0 writes the resolved codes and residual
    ds = tl.arange(0, BLOCK_D)
    if RESOLVE:
        slices = tl.arange(0, PREV_SLICES)
        offsets = slices[:, None] * B + rows[None, :]
        present = (slices[:, None] < S) & row_mask[None, :]
        vals = tl.load(prev_val_ptr + offsets, mask=present, other=float("inf"))
        idxs = tl.load(prev_idx_ptr + offsets, mask=present, other=0)
        # the first slice holding the minimum: slices are in codeword order, each slice's index is its first
        winner = tl.argmin(vals, axis=0, tie_break_left=True)
        prev = tl.sum(tl.where(slices[:, None] == winner[None, :], idxs, 0), axis=0).to(tl.int64)
        tl.store(codes_ptr + rows64 * stride_codes + prev_code, prev, mask=lead)
    cs = part * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cs < C
    dots = tl.zeros((BLOCK_B, BLOCK_C), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_mask = (d0 + ds) < D
        rd_mask = row_mask[:, None] & d_mask[None, :]
        r = tl.load(r_in_ptr + rows64[:, None] * D + d0 + ds[None, :], mask=rd_mask, other=0.0)
        if RESOLVE:
            r = r - tl.load(prev_book_ptr + prev[:, None] * D + d0 + ds[None, :], mask=rd_mask, other=0.0)
            tl.store(r_out_ptr + rows64[:, None] * D + d0 + ds[None, :], r, mask=lead[:, None] & d_mask[None, :])
        if SEARCH:
            e = tl.load(book_ptr + cs[None, :].to(tl.int64) * D + d0 + ds[:, None],
                        mask=d_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_C]
            dots = tl.dot(r, e, dots, input_precision=PRECISION)
    if SEARCH:
        norm = tl.load(norm_ptr + cs, mask=c_mask, other=0.0)
        dist = tl.where(c_mask[None, :], norm[None, :] - 2.0 * dots, float("inf"))
        local = tl.argmin(dist, axis=1, tie_break_left=True)
        tl.store(val_ptr + part * B + rows, tl.min(dist, axis=1), mask=row_mask)
        tl.store(idx_ptr + part * B + rows, part * BLOCK_C + local, mask=row_mask)


TILES = (32, 16, 64, 4)   # rows, codewords, latent columns per step of the K loop, warps
PRECISION = "ieee"


def rvq_quantise_triton(z: torch.Tensor, books: torch.Tensor, norms: torch.Tensor,
                        tiles: tuple[int, int, int, int] = TILES, precision: str = PRECISION) -> torch.Tensor:
    assert z.dtype == books.dtype == norms.dtype == torch.float32
    k, codewords, width = books.shape
    batch = z.shape[0]
    assert z.shape == (batch, width) and norms.shape == (k, codewords)
    assert books.is_contiguous() and norms.is_contiguous()
    z = z.contiguous()
    device = z.device
    codes = torch.empty(batch, k, dtype=torch.int64, device=device)
    if batch == 0 or k == 0:
        return codes
    block_b, block_c, block_d, num_warps = tiles
    block_b = min(block_b, max(16, triton.next_power_of_2(batch)))  # tl.dot needs 16 at least
    block_d = min(block_d, max(16, triton.next_power_of_2(width)))
    slices = triton.cdiv(codewords, block_c)
    row_blocks = triton.cdiv(batch, block_b)
    # ping-pong buffers: a launch reads the previous launch's residual and minima while writing its own
    residual = torch.empty(2, batch, width, dtype=torch.float32, device=device)
    vals = torch.empty(2, slices, batch, dtype=torch.float32, device=device)
    idxs = torch.empty(2, slices, batch, dtype=torch.int32, device=device)
    for i in range(k + 1):
        resolve, search = i > 0, i < k
        r_in = z if i <= 1 else residual[(i - 1) % 2]
        _rvq_step_kernel[(row_blocks, slices if search else 1)](
            r_in, residual[i % 2], books[max(i - 1, 0)], books[min(i, k - 1)], norms[min(i, k - 1)],
            vals[(i - 1) % 2], idxs[(i - 1) % 2], vals[i % 2], idxs[i % 2], codes,
            batch, codewords, width, slices, codes.stride(0), max(i - 1, 0),
            RESOLVE=resolve, SEARCH=search, PREV_SLICES=triton.next_power_of_2(slices),
            PRECISION=precision, BLOCK_B=block_b, BLOCK_C=block_c, BLOCK_D=block_d, num_warps=num_warps,
        )
    return codes


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::rvq_quantise", mutates_args=())
def rvq_quantise_op(z: torch.Tensor, books: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    return rvq_quantise_triton(z, books, norms)


@rvq_quantise_op.register_fake
def _(z, books, norms):
    return z.new_empty(z.shape[0], books.shape[0], dtype=torch.int64)


def rvq_quantise(z: torch.Tensor, books: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """z [B, D] fp32, books [k, C, D] fp32, norms [k, C] -> codes [B, k] int64: k + 1 launches on CUDA or
    under TRITON_INTERPRET=1, else the torch statements."""
    if use_triton(z):
        return rvq_quantise_op(z.float(), books, norms)
    return rvq_quantise_reference(z, books, norms)
