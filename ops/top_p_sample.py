"""Top-p filter + Gumbel-max draw over one row of logits in one kernel: the talker's MoG component choice
(spec 4.5: HF TopPLogitsWarper with p = 0.95 over the 1024 mixture components, then
argmax(log_softmax(filtered) + Gumbel)), five times per frame (one per unmasking pass, spec 4.6).

Why a kernel: in torch each draw is a sort of the row, a softmax, a cumsum, a scatter of the drop mask
back to the unsorted order, a masked fill, a log_softmax, an add and an argmax: ~12 kernels, and at N=128
the segmented radix sorts and scans alone were ~2 ms of a 52 ms step (profiled, docs/performance.md).
A row of 1024 fits in one program's registers; Triton's bitonic `tl.sort` and `tl.cumsum` do
the sort and the scan there, and no permutation is needed to map the drop mask back:

    t = the largest sorted value whose ascending cumulative probability is <= 1 - p (never the last one)
    drop x_i  iff  x_i < t, or x_i == t and the probability of all entries <= t is <= 1 - p

which is HF's rule except inside a group of exactly equal logits at the threshold: HF drops the members
that its (unstable) sort happens to place first, this keeps the whole group unless all of it goes. The
Gumbel noise comes precomputed (`gumbel`, the same torch expression as before), so only the draw moved.
Sums run in a different order than torch's (softmax, cumsum), so a component may also differ where the
cumulative probability lands within an fp32 rounding of 1 - p: the tests count both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import use_triton

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF TopPLogitsWarper: drop (to -inf) the ascending-sorted entries whose cumulative probability is
    <= 1 - top_p; the most probable entry always stays."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[..., -1] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """-ln(-ln(u + 1e-8) + 1e-8) (spec 4.6)."""
    return -torch.log(-torch.log(uniform + 1e-8) + 1e-8)


def top_p_gumbel_argmax_reference(logits: torch.Tensor, noise: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [B, n] (fp32, or bf16 / fp16: taken in fp32), noise [B, n] fp32 (gumbel(u)) -> [B] int64:
    argmax(log_softmax(top_p(logits)) + noise)."""
    return (top_p_filter(logits.float(), top_p).log_softmax(-1) + noise).argmax(-1)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _top_p_gumbel_argmax_kernel(logits_ptr, noise_ptr, out_ptr, n, stride_l, stride_n, drop_mass,
                                BLOCK: tl.constexpr):
    """One row per program. Padding lanes (n < BLOCK) hold -inf: they sort first with probability 0."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    g = tl.load(noise_ptr + row * stride_n + offs, mask=mask, other=0.0)
    m = tl.max(x, axis=0)
    e = tl.exp(x - m)
    z = tl.sum(e, axis=0)
    s = tl.sort(x)  # ascending
    cumulative = tl.cumsum(tl.exp(s - m) / z, axis=0)
    candidate = (cumulative <= drop_mass) & (offs < BLOCK - 1)  # the largest entry always stays
    t = tl.max(tl.where(candidate, s, float("-inf")), axis=0)
    at_or_below = tl.sum(tl.where(x <= t, e, 0.0), axis=0) / z
    tie_dropped = (tl.zeros([BLOCK], dtype=tl.float32) + at_or_below) <= drop_mass  # as a row (interpreter)
    drop = (x < t) | ((x == t) & tie_dropped) | (offs >= n)
    kept = tl.sum(tl.where(drop, 0.0, e), axis=0)
    score = tl.where(drop, float("-inf"), (x - m) - tl.log(kept) + g)  # log_softmax over the kept ones
    tl.store(out_ptr + row, tl.argmax(score, axis=0).to(tl.int64))  # first index of the max, as torch


def top_p_gumbel_argmax_triton(logits: torch.Tensor, noise: torch.Tensor, top_p: float) -> torch.Tensor:
    assert logits.dim() == 2 and noise.shape == logits.shape and noise.dtype == torch.float32
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16)  # a GEMM's output, read in fp32
    assert logits.stride(-1) == 1 and noise.stride(-1) == 1
    batch, n = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    block = triton.next_power_of_2(n)
    _top_p_gumbel_argmax_kernel[(batch,)](logits, noise, out, n, logits.stride(0), noise.stride(0), 1.0 - top_p,
                                          BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::top_p_gumbel_argmax", mutates_args=())
def top_p_gumbel_argmax_op(logits: torch.Tensor, noise: torch.Tensor, top_p: float) -> torch.Tensor:
    return top_p_gumbel_argmax_triton(logits, noise, top_p)


@top_p_gumbel_argmax_op.register_fake
def _(logits, noise, top_p):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def top_p_gumbel_argmax(logits: torch.Tensor, noise: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [B, n] (fp32; bf16 or fp16 are read in fp32: the talker passes its head GEMM's output as it
    is, no cast kernel), noise [B, n] fp32 Gumbel draws -> the drawn index per row [B] int64."""
    if use_triton(logits):
        # rows may be strided (the talker passes one pass's slice of every pass's noise); entries contiguous
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        logits = logits if logits.dtype in (torch.float32, torch.bfloat16, torch.float16) else logits.float()
        noise = noise if noise.stride(-1) == 1 else noise.contiguous()
        return top_p_gumbel_argmax_op(logits, noise, float(top_p))
    return top_p_gumbel_argmax_reference(logits, noise, top_p)
