"""Decode attention: one new query per row over that row's slot of a KV pool.

Used by the LLM's NoPE GQA layers (40 q / 8 kv heads x 128, spec 3.4) and by the talker's Gemma3
layers (16 x 72 heads, rope applied by the caller, query scale 1/16 and an optional sliding window,
spec 4.1). The pool is `[S, kv_heads, max_len, head_dim]` and row b reads slot `slots[b]`, positions
`[0, seq_lens[b])` (the new token's own k/v are already written at `seq_lens[b] - 1`). With a window,
only keys with `pos > cur - window` take part, `cur = seq_lens[b] - 1` (Gemma's sliding mask).

Two kernels, both split over the sequence (flash-decoding) with an online softmax in base 2; with more
than one split, partial (max, sum, acc) go to fp32 scratch and a third kernel merges them.
* `_decode_attention_vector_kernel` (one kv head per query head, the talker): program (row, head, split).
  With nothing to share, q.k and p.v are elementwise products and row reductions: a matrix product would
  pad the single query to 16 rows. The head dim 72 is read as 64 + 8 columns, so no lane is padding.
* `_decode_attention_group_kernel` (GQA, the LLM): program (row, kv head, split); the group's queries
  share each K/V tile through tl.dot (head dim padded to a power of two with masks).
The pool may hold float8 e4m3 (the talker's `dtype.talker_kv: fp8`): keys and values are upcast to fp32
as they are loaded, as every other dtype is, and the reference upcasts the same stored values.
Each split covers an equal share of its row's visible keys, computed in the kernel from the row's
length, so a pool sized for long calls costs nothing while calls are short. The cache is never padded.
Paged (`pages` given, ops/kv_pages.py): the pool is `[num_pages, kv_heads, page_len, D]` and row b's
position p is at page `pages[slots[b], p // page_len]`, offset `p % page_len`. Key blocks start at multiples
of the block size, which divides page_len, so each block reads one page, looked up a block ahead.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ops import interpreting, sm_count, use_triton
from ops.kv_pages import kv_gather, kv_max_len

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slots: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               window: int | None = None, pages: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: gather each row's slot, mask by position, softmax in fp32. q [B, Hq, D] -> [B, Hq, D]."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    max_len = kv_max_len(k_cache, pages)
    group = num_heads // kv_heads
    # [B, Hq, L, D]; head h reads kv head h // group
    k = kv_gather(k_cache, pages, slots).float().repeat_interleave(group, dim=1)
    v = kv_gather(v_cache, pages, slots).float().repeat_interleave(group, dim=1)
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

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x log2 e), folded into the query scale


@triton.jit
def _split_range(slots_ptr, seq_lens_ptr, row, split, window,
                 HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The row's slot and the positions [start, end) this split reads. The row's visible keys
    [lo, seq_len) are cut into NUM_SPLITS stretches of whole BLOCK_N blocks, from the row's own length
    (a device value), so short rows do not pay for the pool's max_len and every split has similar work."""
    slot = tl.load(slots_ptr + row).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)  # keys with pos > (seq_len - 1) - window
    blocks = (seq_len - lo + BLOCK_N - 1) // BLOCK_N
    split_len = (blocks + NUM_SPLITS - 1) // NUM_SPLITS * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(seq_len, start + split_len)
    return slot, start, end


@triton.jit
def _block_page(page_row, n0, valid, slot, PAGED: tl.constexpr, PAGE_LEN: tl.constexpr):
    """The pool row that holds keys [n0, n0 + BLOCK_N): paged, the page the row's table names for them (one
    scalar load: blocks are aligned to BLOCK_N, which divides PAGE_LEN, so a block never straddles pages);
    unpaged, the row's slot."""
    if PAGED:
        return tl.load(page_row + n0 // PAGE_LEN, mask=valid, other=0).to(tl.int64)
    else:
        return slot


@triton.jit
def _next_page(page_row, n0, end, slot, PAGED: tl.constexpr, PAGE_LEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """The pool row of the block after the one at n0, looked up a block ahead: issued before this block's K
    and V loads, it is not in their way (looked up in the same block, the talker's step was 1.2x slower)."""
    return _block_page(page_row, n0 + BLOCK_N, n0 + BLOCK_N < end, slot, PAGED, PAGE_LEN)


@triton.jit
def _key_rows(n0, page, stride_ks, stride_kl, PAGED: tl.constexpr, PAGE_LEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets from the head's base of the BLOCK_N keys from n0, in pool row `page` (_block_page)."""
    within = n0 % PAGE_LEN if PAGED else n0
    return page * stride_ks + (within + tl.arange(0, BLOCK_N)).to(tl.int64) * stride_kl


@triton.jit
def _vector_block(n0, page, page_row, slot, k_base, v_base, stride_ks, stride_kl, stride_vs, stride_vl, q_a, q_b,
                  m_i, l_i, acc_a, acc_b, start, end,
                  HEAD_DIM: tl.constexpr, HAS_TAIL: tl.constexpr, ROWS_ALIGNED: tl.constexpr,
                  PAGED: tl.constexpr, PAGE_LEN: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr):
    """One block of BLOCK_N keys in pool row `page` for one query head (no GQA sharing, so no matrix
    product: q.k and p.v are elementwise products and reductions), those in [start, end) visible; returns
    the running softmax and the next block's pool row (`_next_page`). The head dim is cut into a
    power-of-two part BLOCK_DA and a tail (72 = 64 + 8) so no lane loads or multiplies padding."""
    following = _next_page(page_row, n0, end, slot, PAGED, PAGE_LEN, BLOCK_N)
    pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = (pos >= start) & (pos < end)
    offs_a = tl.arange(0, BLOCK_DA)
    offs_b = BLOCK_DA + tl.arange(0, BLOCK_DB)
    b_mask = n_mask[:, None] & (offs_b < HEAD_DIM)[None, :]
    k_rows = _key_rows(n0, page, stride_ks, stride_kl, PAGED, PAGE_LEN, BLOCK_N)
    v_rows = _key_rows(n0, page, stride_vs, stride_vl, PAGED, PAGE_LEN, BLOCK_N)
    if ROWS_ALIGNED:
        # Triton only knows an integer argument's divisibility when it is a multiple of 16, and the talker's
        # key stride is 72: without the hint every element is its own 2-byte load (the PTX: 75 `ld.global.b16`
        # per block of 16 keys, against 8 16-byte `ld.global.v4` with it; scripts/dev/ptx_loads.py). The hint
        # goes on the 1-D offsets: Triton 3.6 drops one given on the broadcast [BLOCK_N, 1] form.
        k_rows = tl.multiple_of(k_rows, 8)
        v_rows = tl.multiple_of(v_rows, 8)
    k_rows = k_base + k_rows[:, None]
    v_rows = v_base + v_rows[:, None]
    k_a = tl.load(k_rows + offs_a[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
    s = tl.sum(k_a * q_a[None, :], axis=1)
    if HAS_TAIL:
        k_b = tl.load(k_rows + offs_b[None, :], mask=b_mask, other=0.0).to(tl.float32)
        s += tl.sum(k_b * q_b[None, :], axis=1)
    s = tl.where(n_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    v_a = tl.load(v_rows + offs_a[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
    acc_a = acc_a * alpha + tl.sum(p[:, None] * v_a, axis=0)
    if HAS_TAIL:
        v_b = tl.load(v_rows + offs_b[None, :], mask=b_mask, other=0.0).to(tl.float32)
        acc_b = acc_b * alpha + tl.sum(p[:, None] * v_b, axis=0)
    return m_new, l_i, acc_a, acc_b, following


@triton.jit
def _decode_attention_vector_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, pages_ptr,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kl,
    stride_vs, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_pages,
    qk_scale, window,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_TAIL: tl.constexpr, ROWS_ALIGNED: tl.constexpr, PIPELINED: tl.constexpr,
    PAGED: tl.constexpr, PAGE_LEN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
):
    """Program (row, head, split) when every query head has its own kv head (the talker, spec 4.1)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    slot, start, end = _split_range(slots_ptr, seq_lens_ptr, row, split, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N)

    offs_a = tl.arange(0, BLOCK_DA)
    offs_b = BLOCK_DA + tl.arange(0, BLOCK_DB)
    b_mask = offs_b < HEAD_DIM
    q_row = q_ptr + row * stride_qb + head * stride_qh
    q_a = tl.load(q_row + offs_a).to(tl.float32) * qk_scale
    q_b = tl.load(q_row + offs_b, mask=b_mask, other=0.0).to(tl.float32) * qk_scale
    page_row = pages_ptr + slot * stride_pages
    k_offset = head * stride_kh   # the block's pool row (its slot, or its page) comes with its key offsets
    v_offset = head * stride_vh
    if ROWS_ALIGNED:  # (the pool's max_len, e.g. 37 + 2000 frames, need not make these multiples of 16)
        k_offset = tl.multiple_of(k_offset, 8)
        v_offset = tl.multiple_of(v_offset, 8)
    k_base = k_ptr + k_offset
    v_base = v_ptr + v_offset

    # A finite start for the running max keeps exp2(m_old - m_new) defined (every block iterated has at
    # least one visible key, so m is finite after the first).
    m_i = -1.0e30
    l_i = 0.0
    acc_a = tl.zeros([BLOCK_DA], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_DB], dtype=tl.float32)
    # Blocks start at multiples of BLOCK_N (a window's first key need not: the keys before it are masked),
    # so paged each lies in one page.
    first = start - start % BLOCK_N
    page = _block_page(page_row, first, first < end, slot, PAGED, PAGE_LEN)
    if PIPELINED:  # compiled: a counted loop, which Triton software-pipelines
        for n0 in tl.range(first, end, BLOCK_N):
            m_i, l_i, acc_a, acc_b, page = _vector_block(n0, page, page_row, slot, k_base, v_base, stride_ks,
                                                         stride_kl, stride_vs, stride_vl, q_a, q_b, m_i, l_i, acc_a,
                                                         acc_b, start, end, HEAD_DIM, HAS_TAIL, ROWS_ALIGNED, PAGED,
                                                         PAGE_LEN, BLOCK_N, BLOCK_DA, BLOCK_DB)
    else:
        # Triton 3.6's interpreter cannot take loaded (device) loop bounds under numpy >= 2.4 (int() of a
        # 1-element array): the same blocks as a while loop.
        n0 = first
        while n0 < end:
            m_i, l_i, acc_a, acc_b, page = _vector_block(n0, page, page_row, slot, k_base, v_base, stride_ks,
                                                         stride_kl, stride_vs, stride_vl, q_a, q_b, m_i, l_i, acc_a,
                                                         acc_b, start, end, HEAD_DIM, HAS_TAIL, ROWS_ALIGNED, PAGED,
                                                         PAGE_LEN, BLOCK_N, BLOCK_DA, BLOCK_DB)
            n0 += BLOCK_N

    if NUM_SPLITS == 1:
        out_row = out_ptr + row * stride_ob + head * stride_oh
        inv = 1.0 / tl.maximum(l_i, 1e-30)
        tl.store(out_row + offs_a, (acc_a * inv).to(out_ptr.dtype.element_ty))
        if HAS_TAIL:
            tl.store(out_row + offs_b, (acc_b * inv).to(out_ptr.dtype.element_ty), mask=b_mask)
    else:
        # scratch: acc [B, Hq, NUM_SPLITS, HEAD_DIM], (m, l) [B, Hq, NUM_SPLITS, 2], fp32, contiguous
        part = (row * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + part * HEAD_DIM + offs_a, acc_a)
        if HAS_TAIL:
            tl.store(part_acc_ptr + part * HEAD_DIM + offs_b, acc_b, mask=b_mask)
        tl.store(part_ml_ptr + part * 2, m_i)
        tl.store(part_ml_ptr + part * 2 + 1, l_i)


@triton.jit
def _group_block(n0, page, page_row, slot, k_base, v_base, stride_ks, stride_kl, stride_vs, stride_vl, q, m_i, l_i,
                 acc, start, end,
                 HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, PAGED: tl.constexpr, PAGE_LEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One block of BLOCK_N keys in pool row `page` for the GROUP query heads sharing a kv head: two small
    matrix products; returns the running softmax and the next block's pool row (`_next_page`)."""
    following = _next_page(page_row, n0, end, slot, PAGED, PAGE_LEN, BLOCK_N)
    pos = n0 + tl.arange(0, BLOCK_N)
    n_mask = (pos >= start) & (pos < end)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_rows = _key_rows(n0, page, stride_ks, stride_kl, PAGED, PAGE_LEN, BLOCK_N)
    v_rows = _key_rows(n0, page, stride_vs, stride_vl, PAGED, PAGE_LEN, BLOCK_N)
    # Tiles are upcast to fp32 before the dots: bf16 values are exact in tf32, so q.k loses nothing, and
    # p keeps 10 mantissa bits instead of bf16's 8 (Triton 3.6's interpreter also mis-computes bf16 dots).
    k = tl.load(k_base + k_rows[:, None] + offs_d[None, :], mask=kv_mask,
                other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + v_rows[:, None] + offs_d[None, :], mask=kv_mask,
                other=0.0).to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc, following


@triton.jit
def _decode_attention_group_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr, pages_ptr,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_kl,
    stride_vs, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_pages,
    qk_scale, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, PIPELINED: tl.constexpr,
    PAGED: tl.constexpr, PAGE_LEN: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (row, kv head, split) for GQA (the LLM, spec 3.4: 5 query heads per kv head): the group's
    queries share each K/V tile, so q.k and p.v are tensor-core products (the group padded to BLOCK_G)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot, start, end = _split_range(slots_ptr, seq_lens_ptr, row, split, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * qk_scale
    page_row = pages_ptr + slot * stride_pages
    k_base = k_ptr + kv_head * stride_kh   # the block's pool row comes with its key offsets (see the vector kernel)
    v_base = v_ptr + kv_head * stride_vh

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    first = start - start % BLOCK_N   # aligned blocks (see the vector kernel)
    page = _block_page(page_row, first, first < end, slot, PAGED, PAGE_LEN)
    if PIPELINED:
        for n0 in tl.range(first, end, BLOCK_N):
            m_i, l_i, acc, page = _group_block(n0, page, page_row, slot, k_base, v_base, stride_ks, stride_kl,
                                               stride_vs, stride_vl, q, m_i, l_i, acc, start, end, HEAD_DIM,
                                               DOT_PRECISION, PAGED, PAGE_LEN, BLOCK_N, BLOCK_D)
    else:  # the interpreter (see the vector kernel)
        n0 = first
        while n0 < end:
            m_i, l_i, acc, page = _group_block(n0, page, page_row, slot, k_base, v_base, stride_ks, stride_kl,
                                               stride_vs, stride_vl, q, m_i, l_i, acc, start, end, HEAD_DIM,
                                               DOT_PRECISION, PAGED, PAGE_LEN, BLOCK_N, BLOCK_D)
            n0 += BLOCK_N

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
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
    """Combine the splits' partial softmaxes (base 2) of one (row, head)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    part = (row * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=-1.0e30)
    l_sum = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - m_max)  # empty splits carry m = -1e30 and l = 0: weight 0
    total = tl.sum(w * l_sum, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _rows_aligned(cache: torch.Tensor) -> bool:
    """Every key row of the pool starts at a multiple of 8 elements (the base 16-byte aligned and the slot,
    head and position strides multiples of 8), which lets the kernel load 8 elements at a time: 16 bytes
    for bf16, 8 for float8 (the talker's 72-byte fp8 rows allow no more)."""
    return cache.data_ptr() % 16 == 0 and all(stride % 8 == 0 for stride in cache.stride()[:3])


def pick_num_splits(programs: int, max_len: int, block_n: int, num_sms: int, num_warps: int = 4,
                    min_splits: int = 1) -> int:
    """Splits per row so that programs x splits put about 8 warps per SM (2 programs of 4 warps, 8 of one),
    and at least `min_splits`, each split keeping at least two blocks of keys. Depends only on static
    shapes, so a captured graph keeps one choice; the split boundaries themselves follow each row's length
    (_split_range)."""
    want = max(triton.cdiv(8 * num_sms // num_warps, programs), min_splits)
    return max(1, min(want, triton.cdiv(max_len, 2 * block_n), 32))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            window: int | None = None, num_splits: int | None = None,
                            precision: str | None = None, block_n: int | None = None,
                            num_warps: int | None = None, pipelined: bool | None = None,
                            num_stages: int | None = None, pages: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton path. `num_splits`, `block_n`, `num_warps`, `pipelined`, `num_stages` override the tuned choices
    (scripts/dev/bench_ops.py sweeps them); `precision` is the group kernel's tl.dot input precision."""
    batch, num_heads, head_dim = q.shape
    _, kv_heads, page_len, cache_head_dim = k_cache.shape
    max_len = kv_max_len(k_cache, pages)
    if pages is not None:
        assert pages.dtype == torch.int32 and pages.stride(-1) == 1
    assert cache_head_dim == head_dim and v_cache.shape == k_cache.shape and num_heads % kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    # float8 e4m3 pools (ops/kv_pages.py) are upcast to fp32 as they are loaded, like every other dtype
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, torch.float8_e4m3fn)
    group = num_heads // kv_heads
    if pipelined is None:
        pipelined = not interpreting()
    if group == 1:
        # One warp per (row, head, split) and 16 keys per block: the reductions over keys stay inside a
        # warp (no barriers) and many small programs keep enough loads in flight; at least two splits per
        # row even where the rows alone fill the GPU. Measured on the H200 at the talker's shape, 1037 keys
        # (docs/performance.md, with 16-byte loads): 3.95 TB/s at N=128 with 2 splits, against
        # 3.19 for one split of 8-key blocks (the best block with 2-byte loads) and 3.53 for one of 32;
        # 3.60 TB/s at N=32 with 2 splits (the count the 8-warps-per-SM rule gives there).
        block_n = block_n or 16
        num_warps = num_warps or 1
        programs, min_splits = batch * num_heads, 2
    else:
        block_n = block_n or (64 if head_dim <= 128 else 32)
        num_warps = num_warps or 4
        programs, min_splits = batch * kv_heads, 1
    if pages is not None:   # a block must lie in one page (both are powers of two); tl.dot takes 16 or more
        block_n = min(block_n, page_len)
        assert page_len % block_n == 0 and (group == 1 or block_n >= 16), f"page_len {page_len}, block_n {block_n}"
    if num_splits is None:
        num_splits = pick_num_splits(programs, max_len, block_n, sm_count(q.device), num_warps, min_splits)
    out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(batch, num_heads, num_splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused
    strides = (q.stride(0), q.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
               out.stride(0), out.stride(1), pages.stride(0) if pages is not None else 0)
    paging = {"PAGED": pages is not None, "PAGE_LEN": page_len if pages is not None else 1}
    pages_arg = pages if pages is not None else slots   # unpaged: never read
    qk_scale = scale * LOG2E
    window_arg = window if window is not None else 0
    if group == 1:
        block_da = 1 << (head_dim.bit_length() - 1)  # largest power of two <= head_dim
        tail = head_dim - block_da
        _decode_attention_vector_kernel[(batch, num_heads, num_splits)](
            q, k_cache, v_cache, slots, seq_lens, out, part_acc, part_ml, pages_arg, *strides, qk_scale, window_arg,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_WINDOW=window is not None,
            HAS_TAIL=tail > 0, ROWS_ALIGNED=_rows_aligned(k_cache) and _rows_aligned(v_cache), PIPELINED=pipelined,
            **paging,
            BLOCK_N=block_n, BLOCK_DA=block_da, BLOCK_DB=max(2, triton.next_power_of_2(max(tail, 1))),
            num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
        )
    else:
        # fp32 caches: tf32x3 (three tf32 MMAs) is as accurate as "ieee" (~1e-6 relative on H200, plain
        # tf32 ~2e-3) and twice as fast; bf16/fp16 values are exact in tf32, so one tf32 MMA suffices.
        if precision is None:
            precision = "tf32x3" if q.dtype == torch.float32 else "tf32"
        _decode_attention_group_kernel[(batch, kv_heads, num_splits)](
            q, k_cache, v_cache, slots, seq_lens, out, part_acc, part_ml, pages_arg, *strides, qk_scale, window_arg,
            NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, DOT_PRECISION=precision, PIPELINED=pipelined,
            **paging,
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
            num_warps=num_warps,
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

# An opaque custom op around the Triton path: torch.compile sees one node with a known output shape
# instead of tracing the launcher's Python (grid and split choices, device queries), so a compiled
# frame step keeps fullgraph=True and the kernel runs as tuned here.
@torch.library.custom_op("nemo_duplex::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, window: Optional[int],
                        num_splits: Optional[int], pages: Optional[torch.Tensor]) -> torch.Tensor:
    return decode_attention_triton(q, k_cache, v_cache, slots, seq_lens, scale, window, num_splits, pages=pages)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, slots, seq_lens, scale, window, num_splits, pages):
    return torch.empty_like(q)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     window: int | None = None, num_splits: int | None = None,
                     pages: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] (one new query per row), k_cache/v_cache [S, KV, max_len, D], slots [B] int64,
    seq_lens [B] (keys per row, the new one included), scale (softmax scale), window (None or keys with
    pos > seq_len - 1 - window). Returns [B, Hq, D] in q's dtype. Query head h reads kv head h // (Hq/KV).
    Paged: k_cache/v_cache [num_pages, KV, page_len, D] and pages [R, max_pages] int32, row b's keys in the
    pages of table row slots[b] (ops/kv_pages.py)."""
    if use_triton(q):
        return decode_attention_op(q, k_cache, v_cache, slots, seq_lens, float(scale), window, num_splits, pages)
    return decode_attention_reference(q, k_cache, v_cache, slots, seq_lens, scale, window, pages)
