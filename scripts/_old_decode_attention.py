"""Decode attention: one new query per row over that row's slot of a KV pool.

Used by the LLM's NoPE GQA layers (40 q / 8 kv heads x 128, spec 3.4) and by the talker's Gemma3
layers (16 x 72 heads, rope applied by the caller, query scale 1/16 and an optional sliding window,
spec 4.1). The pool is `[S, kv_heads, max_len, head_dim]` and row b reads slot `slots[b]`, positions
`[0, seq_lens[b])` (the new token's own k/v are already written at `seq_lens[b] - 1`). With a window,
only keys with `pos > cur - window` take part, `cur = seq_lens[b] - 1` (Gemma's sliding mask).

The kernel is split over the sequence (flash-decoding): program (b, kv head, split) handles the GROUP
query heads of one kv head on one stretch of positions and keeps an online softmax; with more than
one split, partial (max, sum, acc) go to scratch and a second kernel merges them. Head dims that are
not powers of two (72) use a padded BLOCK_D with masks; the cache itself is never padded.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slots: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               window: int | None = None) -> torch.Tensor:
    """Plain torch: gather each row's slot, mask by position, softmax in fp32. q [B, Hq, D] -> [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    kv_heads, max_len = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [B, Hq, L, D]; head h reads kv head h // group
    v = v_cache[slots].float().repeat_interleave(group, dim=1)
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < seq_lens[:, None]  # [B, L]
    if window is not None:
        valid &= pos[None, :] > (seq_lens[:, None] - 1 - window)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), k) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Positions past a row's length may hold anything (stale calls): zero them so 0 * garbage can't NaN.
    v = v.masked_fill(~valid[:, None, :, None], 0.0)
    return torch.einsum("bhl,bhld->bhd", probs, v).to(q.dtype)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kl,
    stride_vs, stride_vh, stride_vl,
    stride_ob, stride_oh,
    scale, window, split_len,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    slot = tl.load(slots_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)  # keys with pos > (seq_len - 1) - window
    start = tl.maximum(lo, split * split_len)
    end = tl.minimum(seq_len, (split + 1) * split_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    # Tiles are upcast to fp32 before the dots: bf16 values are exact in tf32, so q.k loses nothing, and
    # p keeps 10 mantissa bits instead of bf16's 8 (Triton 3.6's interpreter also mis-computes bf16 dots).
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh

    # A finite start for the running max keeps exp(m_old - m_new) defined when a block is all masked.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # A while loop, not `range(start, end, ...)`: Triton 3.6's interpreter cannot take runtime loop
    # bounds under numpy >= 2.4 (int() of a 1-element array), and the bounds are per-row device values.
    n0 = start
    while n0 < end:
        pos = n0 + offs_n
        n_mask = pos < end
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + pos[:, None].to(tl.int64) * stride_kl + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + pos[:, None].to(tl.int64) * stride_vl + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
        n0 += BLOCK_N

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # scratch: acc [B, Hq, NUM_SPLITS, HEAD_DIM], (m, l) [B, Hq, NUM_SPLITS, 2], all fp32, contiguous
        part = (row * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    part = (row * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=-1.0e30)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - m_max)  # empty splits carry m = -1e30 and l = 0: weight 0
    total = tl.sum(w * l, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _pick_num_splits(batch: int, kv_heads: int, max_len: int, block_n: int) -> int:
    """Enough programs to fill a GPU (~132 SMs x 2) when the batch is small; at most one split per
    256 positions. Depends only on static shapes, so a captured graph keeps one choice."""
    programs = batch * kv_heads
    want = triton.cdiv(264, programs)
    return max(1, min(want, triton.cdiv(max_len, 256), 32))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            window: int | None = None, num_splits: int | None = None,
                            precision: str | None = None) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_slots, kv_heads, max_len, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape and num_heads % kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert q.dtype == k_cache.dtype == v_cache.dtype
    group = num_heads // kv_heads
    block_n = 64 if head_dim <= 128 else 32
    if num_splits is None:
        num_splits = _pick_num_splits(batch, kv_heads, max_len, block_n)
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(batch, num_heads, num_splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused
    # fp32 caches: tf32x3 (three tf32 MMAs) is as accurate as "ieee" (~1e-6 relative on H200, plain tf32
    # ~2e-3) and twice as fast; bf16/fp16 values are exact in tf32, so one tf32 MMA suffices.
    if precision is None:
        precision = "tf32x3" if q.dtype == torch.float32 else "tf32"
    _decode_attention_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, slots, seq_lens, out, part_acc, part_ml,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        scale, window if window is not None else 0, split_len,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, DOT_PRECISION=precision,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        )
    return out


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     window: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """q [B, Hq, D] (one new query per row), k_cache/v_cache [S, KV, max_len, D], slots [B] int64,
    seq_lens [B] (keys per row, the new one included), scale (softmax scale), window (None or keys with
    pos > seq_len - 1 - window). Returns [B, Hq, D] in q's dtype. Query head h reads kv head h // (Hq/KV)."""
    if use_triton(q):
        return decode_attention_triton(q, k_cache, v_cache, slots, seq_lens, scale, window, num_splits)
    return decode_attention_reference(q, k_cache, v_cache, slots, seq_lens, scale, window)
