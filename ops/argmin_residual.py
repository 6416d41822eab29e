"""One greedy residual-quantisation step after its distances (the talker's RVQ, spec 4.6):

    idx[b] = argmin_j distances[b, j]          (the first index of the minimum, as torch.argmin)
    out[b] = residual[b] - book[idx[b]]         (fp32, one subtraction per element, as torch)

Why a kernel: per codebook the torch statement is three launches after the distance GEMM (argmin, the
codeword gather, the subtraction), 93 of them for the 31 codebooks of a frame step (scripts/dev/census_step.py);
this is one. Bit for bit the same results: the minimum and its first index are exact, and the subtraction is
the same single fp32 operation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import use_triton

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def argmin_residual_reference(distances: torch.Tensor, residual: torch.Tensor,
                              book: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """distances [B, C], residual [B, D] fp32, book [C, D] fp32 -> (idx [B] int64, residual - book[idx])."""
    idx = distances.argmin(-1)
    return idx, residual - book[idx]


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _argmin_residual_kernel(dist_ptr, res_ptr, book_ptr, idx_ptr, out_ptr, C, D,
                            stride_dist, stride_res, stride_book, stride_out,
                            BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row per program: the row's distances and residual fit in registers (C = 1024, D = 512)."""
    row = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, BLOCK_C)
    dist = tl.load(dist_ptr + row * stride_dist + cs, mask=cs < C, other=float("inf"))
    idx = tl.argmin(dist, axis=0, tie_break_left=True).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    d_mask = ds < D
    r = tl.load(res_ptr + row * stride_res + ds, mask=d_mask, other=0.0)
    e = tl.load(book_ptr + idx * stride_book + ds, mask=d_mask, other=0.0)
    tl.store(out_ptr + row * stride_out + ds, r - e, mask=d_mask)
    tl.store(idx_ptr + row, idx)


def argmin_residual_triton(distances: torch.Tensor, residual: torch.Tensor,
                           book: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert distances.dtype == residual.dtype == book.dtype == torch.float32
    assert distances.stride(-1) == residual.stride(-1) == book.stride(-1) == 1
    batch, codewords = distances.shape
    width = residual.shape[1]
    idx = torch.empty(batch, dtype=torch.int64, device=distances.device)
    out = torch.empty(batch, width, dtype=torch.float32, device=distances.device)
    if batch:
        _argmin_residual_kernel[(batch,)](
            distances, residual, book, idx, out, codewords, width,
            distances.stride(0), residual.stride(0), book.stride(0), out.stride(0),
            BLOCK_C=triton.next_power_of_2(codewords), BLOCK_D=triton.next_power_of_2(width), num_warps=4,
        )
    return idx, out


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::argmin_residual", mutates_args=())
def argmin_residual_op(distances: torch.Tensor, residual: torch.Tensor,
                       book: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return argmin_residual_triton(distances, residual, book)


@argmin_residual_op.register_fake
def _(distances, residual, book):
    return (distances.new_empty(distances.shape[0], dtype=torch.int64),
            residual.new_empty(residual.shape, dtype=torch.float32))


def argmin_residual(distances: torch.Tensor, residual: torch.Tensor,
                    book: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """distances [B, C] fp32, residual [B, D] fp32, book [C, D] fp32 -> (argmin index [B] int64,
    residual - book[index] [B, D]): one kernel on CUDA or under TRITON_INTERPRET=1, else the torch statements."""
    if use_triton(distances):
        return argmin_residual_op(distances, residual, book)
    return argmin_residual_reference(distances, residual, book)
