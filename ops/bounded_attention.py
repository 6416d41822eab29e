"""Bounded relative-position attention for the streaming FastConformer: one new query per row over
its call's window of the last W = 70 frames plus itself (att_context [70, 0], spec 2.6).

For a single query at frame t the Transformer-XL terms of spec 2.4 only depend on the distance
d = t - j of key j, so with P[d] = linear_pos(pe(d)) precomputed for d = 0..W:

    score_j = ((q + u) . k_j + (q + v) . P[t - j]) / sqrt(Dh),   j in [max(0, t-W), t]
    out     = sum_j softmax(score)_j * v_j

Window layout: a ring buffer per slot, `keys[s, j % W]` holds frame j of the call in slot s. At step t
the ring still holds frames t-W .. t-1 (slot t % W holds frame t-W, which the query must see), so the
current frame's k/v come in as separate inputs and `write_window` stores them at t % W only after the
attention has read the window (`bounded_attention_and_store`: the kernel's own programs store them, each
after reading its (slot, head) window, so the step needs no separate writes). Ring position w holds the frame at distance d(w) = ((t - 1 - w) mod W) + 1;
it exists iff d(w) <= t (the call has had that many frames).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ops import use_triton

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def ring_distances(t: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t [B] int64 -> (distance [B, W] of the frame held at each ring position, exists [B, W] bool)."""
    w = torch.arange(window, device=t.device)
    distance = torch.remainder(t[:, None] - 1 - w[None, :], window) + 1
    return distance, distance <= t[:, None]


def bounded_attention_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                                pos_bias_u: torch.Tensor, pos_bias_v: torch.Tensor,
                                slots: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """q, k_new, v_new [B, H, D]; keys, values [S, W, H, D] ring windows; pos [W+1, H, D] = P[d];
    pos_bias_u, pos_bias_v [H, D]; slots, t [B] int64 -> [B, H, D] in q's dtype (fp32 inside)."""
    window = keys.shape[1]
    distance, exists = ring_distances(t, window)
    zero = torch.zeros_like(distance[:, :1])
    distance = torch.cat([distance, zero], dim=1)  # the current frame is at distance 0
    exists = torch.cat([exists, torch.ones_like(exists[:, :1])], dim=1)
    k = torch.cat([keys[slots], k_new[:, None]], dim=1).float()  # [B, W+1, H, D]
    v = torch.cat([values[slots], v_new[:, None]], dim=1).float()
    p = pos.float()[distance]  # [B, W+1, H, D]
    qf = q.float()
    content = torch.einsum("bhd,bjhd->bhj", qf + pos_bias_u.float(), k)
    position = torch.einsum("bhd,bjhd->bhj", qf + pos_bias_v.float(), p)
    scores = (content + position) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~exists[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    v = v.masked_fill(~exists[:, :, None, None], 0.0)  # never-written ring rows may hold anything
    return torch.einsum("bhj,bjhd->bhd", probs, v).to(q.dtype)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _bounded_attention_kernel(
    q_ptr, k_new_ptr, v_new_ptr, keys_ptr, values_ptr, pos_ptr, u_ptr, vb_ptr, slots_ptr, t_ptr, out_ptr,
    stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh,
    stride_ks, stride_kw, stride_kh, stride_vs, stride_vw, stride_vh,
    stride_pd, stride_ph, stride_uh, stride_vbh, stride_ob, stride_oh,
    scale,
    WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
    STORE: tl.constexpr,
):
    # One program per (row, head): the whole window (W <= BLOCK_W) is one tile, so no online softmax.
    row = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    t = tl.load(t_ptr + row).to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, BLOCK_W)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(q_ptr + row * stride_qb + head * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    q_u = q + tl.load(u_ptr + head * stride_uh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    q_v = q + tl.load(vb_ptr + head * stride_vbh + offs_d, mask=d_mask, other=0.0).to(tl.float32)

    # Ring position w holds the frame at distance ((t-1-w) mod W) + 1; +W keeps the operand >= 0.
    distance = (t - 1 - offs_w + WINDOW) % WINDOW + 1
    exists = (offs_w < WINDOW) & (distance <= t)
    tile_mask = exists[:, None] & d_mask[None, :]

    k = tl.load(keys_ptr + slot * stride_ks + offs_w[:, None] * stride_kw + head * stride_kh + offs_d[None, :],
                mask=tile_mask, other=0.0).to(tl.float32)
    p = tl.load(pos_ptr + distance[:, None] * stride_pd + head * stride_ph + offs_d[None, :],
                mask=tile_mask, other=0.0).to(tl.float32)
    scores = (tl.sum(q_u[None, :] * k, axis=1) + tl.sum(q_v[None, :] * p, axis=1)) * scale
    scores = tl.where(exists, scores, float("-inf"))

    k_raw = tl.load(k_new_ptr + row * stride_knb + head * stride_knh + offs_d, mask=d_mask, other=0.0)
    k_cur = k_raw.to(tl.float32)
    p_cur = tl.load(pos_ptr + head * stride_ph + offs_d, mask=d_mask, other=0.0).to(tl.float32)  # P[0]
    score_cur = (tl.sum(q_u * k_cur, axis=0) + tl.sum(q_v * p_cur, axis=0)) * scale

    m = tl.maximum(tl.max(scores, axis=0), score_cur)
    e = tl.where(exists, tl.exp(scores - m), 0.0)
    e_cur = tl.exp(score_cur - m)
    denom = tl.sum(e, axis=0) + e_cur

    v = tl.load(values_ptr + slot * stride_vs + offs_w[:, None] * stride_vw + head * stride_vh + offs_d[None, :],
                mask=tile_mask, other=0.0).to(tl.float32)
    v_raw = tl.load(v_new_ptr + row * stride_vnb + head * stride_vnh + offs_d, mask=d_mask, other=0.0)
    out = (tl.sum(e[:, None] * v, axis=0) + e_cur * v_raw.to(tl.float32)) / denom
    tl.store(out_ptr + row * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)
    if STORE:
        # Frame t goes to ring position t % W, which held frame t - W: only this program reads this (slot,
        # head), and every thread's window loads precede the barrier. (Padding rows share the sink slot:
        # their stores race there, which nothing reads as a real call's state.)
        tl.debug_barrier()
        ring = t % WINDOW
        tl.store(keys_ptr + slot * stride_ks + ring * stride_kw + head * stride_kh + offs_d,
                 k_raw.to(keys_ptr.dtype.element_ty), mask=d_mask)
        tl.store(values_ptr + slot * stride_vs + ring * stride_vw + head * stride_vh + offs_d,
                 v_raw.to(values_ptr.dtype.element_ty), mask=d_mask)


def bounded_attention_triton(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t, store=False):
    """`store`: also write k_new / v_new into the ring at t % W (bounded_attention_and_store)."""
    batch, num_heads, head_dim = q.shape
    window = keys.shape[1]
    assert pos.shape[0] == window + 1, "pos must hold P[d] for d = 0..W"
    for x in (q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v):
        assert x.stride(-1) == 1, "last dim must be contiguous"
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _bounded_attention_kernel[(batch, num_heads)](
        q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t, out,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        pos.stride(0), pos.stride(1), pos_bias_u.stride(0), pos_bias_v.stride(0), out.stride(0), out.stride(1),
        1.0 / math.sqrt(head_dim),
        WINDOW=window, HEAD_DIM=head_dim,
        BLOCK_W=triton.next_power_of_2(window), BLOCK_D=triton.next_power_of_2(head_dim), STORE=store,
        num_warps=4 if head_dim <= 64 else 8,
    )
    return out


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::bounded_attention", mutates_args=())
def bounded_attention_op(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, pos: torch.Tensor, pos_bias_u: torch.Tensor,
                         pos_bias_v: torch.Tensor, slots: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return bounded_attention_triton(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t)


@bounded_attention_op.register_fake
def _(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t):
    return torch.empty_like(q)


@torch.library.custom_op("nemo_duplex::bounded_attention_store", mutates_args=("keys", "values"))
def bounded_attention_store_op(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, keys: torch.Tensor,
                               values: torch.Tensor, pos: torch.Tensor, pos_bias_u: torch.Tensor,
                               pos_bias_v: torch.Tensor, slots: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return bounded_attention_triton(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t, store=True)


@bounded_attention_store_op.register_fake
def _(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t):
    return torch.empty_like(q)


def bounded_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                      pos_bias_u: torch.Tensor, pos_bias_v: torch.Tensor,
                      slots: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Attention of each row's new frame over its slot's ring window (see the module docstring).
    Reads only; call `write_window` afterwards to store the new k/v. Shapes as in the reference."""
    if use_triton(q):
        return bounded_attention_op(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t)
    return bounded_attention_reference(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t)


def bounded_attention_and_store(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                                keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                                pos_bias_u: torch.Tensor, pos_bias_v: torch.Tensor, slots: torch.Tensor,
                                t: torch.Tensor) -> torch.Tensor:
    """`bounded_attention` then `write_window`: with Triton in one kernel (two launches fewer per encoder
    layer), else the two torch statements."""
    if use_triton(q):
        return bounded_attention_store_op(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t)
    out = bounded_attention_reference(q, k_new, v_new, keys, values, pos, pos_bias_u, pos_bias_v, slots, t)
    write_window(keys, values, slots, t, k_new, v_new)
    return out


def write_window(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, t: torch.Tensor,
                 k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    """Store frame t's k/v [B, H, D] at ring position t % W of each row's slot, in place."""
    position = torch.remainder(t, keys.shape[1])
    keys.index_put_((slots, position), k_new.to(keys.dtype))
    values.index_put_((slots, position), v_new.to(values.dtype))
