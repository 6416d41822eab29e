"""Sum of one codeword per codebook, in codebook order: the codec's RVQ dequantisation (spec 5.1) and the
talker's code embedding (`depthsum`, spec 4.2.1),

    out[r] = tables[0, codes[r, 0]] + tables[1, codes[r, 1]] + ... + tables[Q-1, codes[r, Q-1]]

added left to right in fp32 and rounded once to the tables' dtype, so for fp32 tables (the codec) the result
is bit for bit the torch statement's (an embedding lookup and an add per codebook). Why a kernel: that
statement is 61 launches per frame step for the 31 codebooks (scripts/dev/census_step.py); this is one; the
talker's lookup + sum + offsets was 3 launches per MoG pass. tables is the codebooks stacked [Q, K, D] (the
codec keeps a stacked copy, `ResidualVQ.stacked`; the talker's padded code table viewed [Q, K + 1, D]).
`repeat` writes the rows `repeat` times over (out row r is codes row r % rows): the talker's two CFG streams
take the same code embedding, and one GEMM then embeds both (no copy kernel).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import use_triton
from ops.rmsnorm import round_to

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def codebook_sum_reference(codes: torch.Tensor, tables: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """codes [..., Q] int64, tables [Q, K, D] -> [repeat x ..., D] (repeat > 1: codes [rows, Q] only): the
    embedding of code i in table i, summed in order in fp32, then rounded to the tables' dtype."""
    out = F.embedding(codes[..., 0], tables[0]).float()
    for i in range(1, tables.shape[0]):
        out = out + F.embedding(codes[..., i], tables[i]).float()
    out = out.to(tables.dtype)
    return out if repeat == 1 else out.repeat(repeat, 1)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _codebook_sum_kernel(codes_ptr, tables_ptr, out_ptr, rows, D, stride_codes, stride_tq, stride_tk, stride_out,
                         Q: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    """One output row per program (codes row: the program's row mod `rows`); the running sum over
    codebooks in fp32 registers, in order 0..Q-1, rounded once at the store."""
    out_row = tl.program_id(0).to(tl.int64)
    row = out_row % rows
    ds = tl.arange(0, BLOCK_D)
    mask = ds < D
    code = tl.load(codes_ptr + row * stride_codes).to(tl.int64)
    acc = tl.load(tables_ptr + code * stride_tk + ds, mask=mask, other=0.0).to(tl.float32)
    for q in tl.static_range(1, Q):
        code = tl.load(codes_ptr + row * stride_codes + q).to(tl.int64)
        acc = acc + tl.load(tables_ptr + q * stride_tq + code * stride_tk + ds, mask=mask, other=0.0).to(tl.float32)
    # rounded to nearest even by round_to first (the interpreter truncates a plain cast to bf16)
    out = round_to(acc, out_ptr.dtype.element_ty, BF16).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_row * stride_out + ds, out, mask=mask)


def codebook_sum_triton(codes: torch.Tensor, tables: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    num_books, _, width = tables.shape
    assert codes.shape[-1] == num_books and tables.stride(-1) == 1
    assert repeat == 1 or codes.dim() == 2, "repeat: codes [rows, Q]"
    lead = codes.shape[:-1]
    codes2 = codes.reshape(-1, num_books)
    codes2 = codes2 if codes2.stride(-1) == 1 else codes2.contiguous()
    rows = codes2.shape[0]
    out = torch.empty(repeat * rows, width, device=tables.device, dtype=tables.dtype)
    if rows:
        _codebook_sum_kernel[(repeat * rows,)](
            codes2, tables, out, rows, width, codes2.stride(0), tables.stride(0), tables.stride(1), out.stride(0),
            Q=num_books, BLOCK_D=triton.next_power_of_2(width), BF16=tables.dtype == torch.bfloat16, num_warps=4,
        )
    return out if repeat > 1 else out.view(*lead, width)


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::codebook_sum", mutates_args=())
def codebook_sum_op(codes: torch.Tensor, tables: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    return codebook_sum_triton(codes, tables, repeat)


@codebook_sum_op.register_fake
def _(codes, tables, repeat=1):
    if repeat > 1:
        return tables.new_empty(repeat * codes.shape[0], tables.shape[-1])
    return tables.new_empty(*codes.shape[:-1], tables.shape[-1])


def codebook_sum(codes: torch.Tensor, tables: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """codes [..., Q] int64 in [0, K), tables [Q, K, D] -> [..., D], or with `repeat` > 1 (codes [rows, Q])
    [repeat x rows, D], the rows repeated: one kernel on CUDA or under TRITON_INTERPRET=1, else the torch
    statement."""
    if use_triton(tables):
        return codebook_sum_op(codes, tables, int(repeat))
    return codebook_sum_reference(codes, tables, repeat)
