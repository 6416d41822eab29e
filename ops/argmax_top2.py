"""The text logits' argmax and their two largest values in one pass: for x [B, V],

    index[b] = argmax_j x[b, j]            (the first index of the maximum, as torch.argmax)
    top2[b]  = x[b].topk(2).values         (fp32; a repeated maximum gives it twice, as torch.topk)

Why: a greedy frame step took the text token with torch's argmax (one ~13 us reduction over 131,072 logits at
32 calls) and the margins (`StepOutput.top2`) with torch.topk on the side stream, whose radix select is six
kernels and ~0.14 ms of GPU time beside the talker's chain (H200 profile, docs/performance.md).
Here the vocabulary is cut into chunks, one program per (row, chunk) keeps its chunk's maximum, that maximum's
first index and the largest other value, and a second launch merges the chunks in order. Every value is an
input value (no arithmetic), so the result equals torch's exactly, ties included. Rows with NaN are not
supported (torch ranks NaN above every number; this kernel does not): the logits of a finite model are finite.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import interpreting, use_triton

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def argmax_top2_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, V] -> (argmax [B] int64, the two largest values [B, 2] fp32)."""
    return x.argmax(-1), x.topk(2, dim=-1).values.float()


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _chunk_kernel(x_ptr, best_ptr, index_ptr, second_ptr, V, stride_x, CHUNKS, BLOCK: tl.constexpr):
    """Program (row, chunk): the chunk's maximum, its first index and the largest value at any other index."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    first = tl.argmax(x, axis=0, tie_break_left=True)
    second = tl.max(tl.where(tl.arange(0, BLOCK) == first, float("-inf"), x), axis=0)
    out = row * CHUNKS + chunk
    tl.store(best_ptr + out, best)
    tl.store(index_ptr + out, chunk * BLOCK + first)
    tl.store(second_ptr + out, second)


@triton.jit
def _merge_kernel(best_ptr, index_ptr, second_ptr, argmax_ptr, top2_ptr, CHUNKS, BLOCK_CHUNKS: tl.constexpr):
    """One row: the first chunk holding the maximum gives the index; the second value is the largest of the
    other chunks' maxima and every chunk's second value."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    present = chunks < CHUNKS
    best = tl.load(best_ptr + row * CHUNKS + chunks, mask=present, other=float("-inf"))
    second = tl.load(second_ptr + row * CHUNKS + chunks, mask=present, other=float("-inf"))
    winner = tl.argmax(best, axis=0, tie_break_left=True)
    index = tl.load(index_ptr + row * CHUNKS + winner)
    top = tl.max(best, axis=0)
    runner_up = tl.maximum(tl.max(tl.where(chunks == winner, float("-inf"), best), axis=0), tl.max(second, axis=0))
    tl.store(argmax_ptr + row, index.to(tl.int64))
    tl.store(top2_ptr + row * 2, top)
    tl.store(top2_ptr + row * 2 + 1, runner_up)


def argmax_top2_triton(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] >= 2
    batch, vocab = x.shape
    if block is None:  # 32 chunks of the 131072-token vocabulary: 1024 programs at 32 calls
        block = min(4096, triton.next_power_of_2(vocab)) if not interpreting() else triton.next_power_of_2(vocab)
    chunks = triton.cdiv(vocab, block)
    best = torch.empty(batch, chunks, device=x.device, dtype=torch.float32)
    second = torch.empty_like(best)
    index = torch.empty(batch, chunks, device=x.device, dtype=torch.int32)
    argmax = torch.empty(batch, device=x.device, dtype=torch.int64)
    top2 = torch.empty(batch, 2, device=x.device, dtype=torch.float32)
    if batch:
        _chunk_kernel[(batch, chunks)](x, best, index, second, vocab, x.stride(0), chunks, BLOCK=block, num_warps=8)
        _merge_kernel[(batch,)](best, index, second, argmax, top2, chunks,
                                BLOCK_CHUNKS=triton.next_power_of_2(chunks), num_warps=1)
    return argmax, top2


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::argmax_top2", mutates_args=())
def argmax_top2_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return argmax_top2_triton(x)


@argmax_top2_op.register_fake
def _(x):
    return x.new_empty(x.shape[0], dtype=torch.int64), x.new_empty(x.shape[0], 2, dtype=torch.float32)


def argmax_top2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, V] (bf16 or fp32 logits) -> (argmax [B] int64, top-2 values [B, 2] fp32): two launches on CUDA or
    under TRITON_INTERPRET=1, else torch's argmax and topk."""
    if use_triton(x):
        return argmax_top2_op(x)
    return argmax_top2_reference(x)
