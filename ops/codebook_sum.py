"""Sum of one codeword per codebook, in codebook order: the codec's RVQ dequantisation (spec 5.1),

    out[r] = tables[0, codes[r, 0]] + tables[1, codes[r, 1]] + ... + tables[Q-1, codes[r, Q-1]]

added left to right in fp32, as the torch statement (an embedding lookup and an add per codebook) adds them,
so the result is bit for bit the same. Why a kernel: that statement is 61 launches per frame step for the 31
codebooks (scripts/census_step.py); this is one. tables is the codebooks stacked [Q, K, D] (the codec keeps
a stacked copy, `ResidualVQ.stacked`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import use_triton


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def codebook_sum_reference(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """codes [..., Q] int64, tables [Q, K, D] -> [..., D]: the embedding of code i in table i, summed in order."""
    out = F.embedding(codes[..., 0], tables[0])
    for i in range(1, tables.shape[0]):
        out = out + F.embedding(codes[..., i], tables[i])
    return out


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _codebook_sum_kernel(codes_ptr, tables_ptr, out_ptr, D, stride_codes, stride_tq, stride_tk, stride_out,
                         Q: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row per program; the running sum over codebooks in registers, in order 0..Q-1."""
    row = tl.program_id(0).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    mask = ds < D
    code = tl.load(codes_ptr + row * stride_codes).to(tl.int64)
    acc = tl.load(tables_ptr + code * stride_tk + ds, mask=mask, other=0.0)
    for q in tl.static_range(1, Q):
        code = tl.load(codes_ptr + row * stride_codes + q).to(tl.int64)
        acc = acc + tl.load(tables_ptr + q * stride_tq + code * stride_tk + ds, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + ds, acc, mask=mask)


def codebook_sum_triton(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    num_books, _, width = tables.shape
    assert codes.shape[-1] == num_books and tables.stride(-1) == 1
    lead = codes.shape[:-1]
    codes2 = codes.reshape(-1, num_books)
    codes2 = codes2 if codes2.stride(-1) == 1 else codes2.contiguous()
    out = torch.empty(codes2.shape[0], width, device=tables.device, dtype=tables.dtype)
    if codes2.shape[0]:
        _codebook_sum_kernel[(codes2.shape[0],)](
            codes2, tables, out, width, codes2.stride(0), tables.stride(0), tables.stride(1), out.stride(0),
            Q=num_books, BLOCK_D=triton.next_power_of_2(width), num_warps=4,
        )
    return out.view(*lead, width)


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::codebook_sum", mutates_args=())
def codebook_sum_op(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    return codebook_sum_triton(codes, tables)


@codebook_sum_op.register_fake
def _(codes, tables):
    return tables.new_empty(*codes.shape[:-1], tables.shape[-1])


def codebook_sum(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """codes [..., Q] int64 in [0, K), tables [Q, K, D] -> [..., D]: one kernel on CUDA or under
    TRITON_INTERPRET=1, else the torch statement."""
    if use_triton(tables):
        return codebook_sum_op(codes, tables)
    return codebook_sum_reference(codes, tables)
