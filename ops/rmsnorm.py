"""RMSNorm in one kernel: every norm of the LLM, the talker and the MoG head.

    y = rmsnorm_G(x * silu(gate)) * (offset + w)      [then  y = round(y) + residual]

computed in fp32 and rounded once to the output dtype, over groups of G channels (G = the whole row
except for the Mamba-2 gated norm, whose 10240 channels are normed in 8 groups of 1280, spec 3.3).
  * Nemotron-H RMSNorm (spec 3.2): offset 0, no gate;
  * Gemma RMSNorm (spec 4.1, pitfall 9.6: the weight is an offset from 1): offset 1; also the talker's
    per-head q/k norms over head_dim 72 (rows = tokens x heads);
  * Mamba-2 GatedRMSNorm (norm_before_gate = False): gate z, G = d_inner / n_groups;
  * `residual`: Gemma's post-norms are added to the residual stream, x + round(norm(h)), as the
    reference adds them in the compute dtype.
`add_rms_norm` is the joint between two pre-normed blocks, one kernel instead of two or three:
s = x + d (d = delta, or round(norm_a(delta)) for Gemma's post-norms), y = norm(s); it returns the new
residual stream s and the next block's input y (the LLM's 56 joints and the talker's 56 per frame).
`rms_norm_rope` is the talker's q/k path: Gemma RMSNorm over each head, then rotary embedding
(rotate-half layout, cos/sin given per token in the compute dtype), with the reference's roundings
(norm, each product and the sum each rounded to the compute dtype, as bf16 torch ops do).
Why a kernel: in torch each norm is 7-9 kernels (casts, pow, mean, rsqrt, two multiplies, cast back);
with ~250 norms per frame step that was roughly 2,000 of the step's ~7,300 kernels (an estimate from the
op counts; with these and the other first kernels of ops/ the step went to ~3,600, docs/performance.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import use_triton
from ops.kv_pages import FP8_MAX, kv_write

_FP8_MAX = tl.constexpr(FP8_MAX)   # (a kernel reads only constexpr globals)

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                       gate: torch.Tensor | None = None, group_size: int | None = None,
                       residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch statement of the norms above (the models' CPU path and the kernel's reference)."""
    out_dtype = out_dtype or x.dtype
    h = x.float()
    if gate is not None:
        h = h * F.silu(gate.float())
    groups = h.unflatten(-1, (-1, group_size or h.shape[-1]))
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() if offset == 0.0 else offset + weight.float()
    y = (groups.flatten(-2) * w).to(out_dtype)
    return y if residual is None else residual + y


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                           offset: float = 0.0, delta_weight: torch.Tensor | None = None,
                           delta_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = x + d in x's dtype, d = delta or, with delta_weight, the norm of delta (rounded to x's
    dtype first, as `residual` does above); y = the norm of s with `weight`."""
    if delta_weight is None:
        s = x + delta
    else:
        s = rms_norm_reference(delta, delta_weight, eps if delta_eps is None else delta_eps, offset, residual=x)
    return s, rms_norm_reference(s, weight, eps, offset)


def rms_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                            sin: torch.Tensor, offset: float = 1.0) -> torch.Tensor:
    """x [B, T, heads, D] -> norm over D, then x cos + rotate_half(x) sin with cos/sin [B, T, D]."""
    y = rms_norm_reference(x, weight, eps, offset)
    half = y.shape[-1] // 2
    rotated = torch.cat([-y[..., half:], y[..., :half]], dim=-1)
    cos, sin = cos[:, :, None].to(y.dtype), sin[:, :, None].to(y.dtype)
    return y * cos + rotated * sin


def rms_norm_rope_store_reference(k: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                                  sin: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                                  rows: torch.Tensor, positions: torch.Tensor, offset: float = 1.0,
                                  pages: torch.Tensor | None = None) -> None:
    """A decode step's k/v into its KV pools: k [B, 1, heads, D] normed and rotated (rms_norm_rope), v
    [B, 1, heads, D] as it is, written at pool[rows[b], :, positions[b]] of pool_k / pool_v [R, heads, L, D]
    (paged: in the page of table row rows[b] that holds positions[b], ops/kv_pages.py)."""
    k = rms_norm_rope_reference(k, weight, eps, cos, sin, offset)
    kv_write(pool_k, pages, rows, positions, k[:, 0])
    kv_write(pool_v, pages, rows, positions, v[:, 0])


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def round_to(x, dtype: tl.constexpr, BF16: tl.constexpr):
    """fp32 -> the nearest `dtype` value, as fp32. For bf16 by integer arithmetic on the bits (round to
    nearest even), which no compiler pass can fold away: with `.to(bfloat16).to(float32)` between fp32
    ops the norm + rotary kernel agreed with torch's bf16 ops in only 80% of elements on the H200 (as if
    the pair did not round), and the interpreter truncates such casts; with this, 100% on both."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, res_ptr, out_ptr, R,
    stride_x, stride_g, stride_r, stride_o, eps, offset,
    G: tl.constexpr, N_GROUPS: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BF16: tl.constexpr,
):
    """Program = BLOCK_R group-rows of G channels; group-row r is group r % N_GROUPS of row r // N_GROUPS."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_G)
    mask = (r < R)[:, None] & (c < G)[None, :]
    row, grp = r // N_GROUPS, r % N_GROUPS
    col = (grp * G)[:, None] + c[None, :]
    x = tl.load(x_ptr + row[:, None] * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        z = tl.load(gate_ptr + row[:, None] * stride_g + col, mask=mask, other=0.0).to(tl.float32)
        x = x * (z * tl.sigmoid(z))
    mean_sq = tl.sum(x * x, axis=1) / G
    x = x * tl.rsqrt(mean_sq + eps)[:, None]
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    y = round_to(x * (w + offset), dtype, BF16)
    if HAS_RES:  # round the norm first, then add in fp32 and round again: the reference's two bf16 ops
        res = tl.load(res_ptr + row[:, None] * stride_r + col, mask=mask, other=0.0).to(tl.float32)
        y = round_to(y + res, dtype, BF16)
    tl.store(out_ptr + row[:, None] * stride_o + col, y.to(dtype), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, dw_ptr, s_ptr, y_ptr, stride_x, stride_d, stride_s, stride_y, eps, delta_eps, offset,
    C: tl.constexpr, NORM_DELTA: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr,
):
    """Program = one row of C channels: the joint's two (or three) torch ops, with their roundings."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < C
    dtype = s_ptr.dtype.element_ty
    d = tl.load(d_ptr + row * stride_d + c, mask=mask, other=0.0).to(tl.float32)
    if NORM_DELTA:  # Gemma's post-norm of the block output, rounded before the residual add
        dw = tl.load(dw_ptr + c, mask=mask, other=0.0).to(tl.float32)
        d = round_to(d * tl.rsqrt(tl.sum(d * d, axis=0) / C + delta_eps) * (dw + offset), dtype, BF16)
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    s = round_to(x + d, dtype, BF16)
    tl.store(s_ptr + row * stride_s + c, s.to(dtype), mask=mask)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    y = round_to(s * tl.rsqrt(tl.sum(s * s, axis=0) / C + eps) * (w + offset), dtype, BF16)
    tl.store(y_ptr + row * stride_y + c, y.to(dtype), mask=mask)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                        offset: float = 0.0, delta_weight: torch.Tensor | None = None,
                        delta_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = x.shape[-1]
    assert delta.shape == x.shape and weight.numel() == width
    x2, d2 = as_rows(x, width), as_rows(delta, width)
    s = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    y = torch.empty_like(s)
    if x2.shape[0]:
        block = triton.next_power_of_2(width)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, d2, weight, delta_weight if delta_weight is not None else weight, s, y,
            x2.stride(0), d2.stride(0), s.stride(0), y.stride(0), float(eps),
            float(eps if delta_eps is None else delta_eps), float(offset),
            C=width, NORM_DELTA=delta_weight is not None, BLOCK=block, BF16=x.dtype == torch.bfloat16,
            num_warps=max(1, min(8, block // 512)),
        )
    return s.view(x.shape), y.view(x.shape)


@triton.jit
def round_e4m3(x):
    """fp32 -> the nearest float8 e4m3 value (ties to even), saturated at +-448, as fp32 (ops/kv_pages.py's
    to_pool). By integer arithmetic on the bits, as `round_to` rounds to bf16: the cast that follows sees
    only exact e4m3 values, which Triton 3.6's interpreter casts right (it rounds others wrongly near a
    power of two: 31.5 -> 16, where the GPU and torch give 32). Below e4m3's smallest normal, 2^-6, the
    steps are 2^-9: there x * 2^9 (exact) is rounded to an integer by adding and taking away 2^23, one IEEE
    rounding (ties to even)."""
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    a = tl.minimum(tl.abs(x), _FP8_MAX)
    bits = a.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20
    r = tl.where(a < 0.015625, ((a * 512.0 + 8388608.0) - 8388608.0) * 0.001953125, bits.to(tl.float32, bitcast=True))
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _to_pool(x, dtype: tl.constexpr, FP8: tl.constexpr):
    """x as a KV pool of `dtype` stores it (ops/kv_pages.py's to_pool)."""
    if FP8:
        x = round_e4m3(x.to(tl.float32))
    return x.to(dtype)


@triton.jit
def _norm_rope_rows(
    pid, x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, R, stride_xt, stride_xh, stride_cs, stride_o, eps, offset,
    v_ptr, v_out_ptr, rows_ptr, pos_ptr, stride_vt, stride_vh, stride_ps, stride_ph, stride_pl,
    pages_ptr, stride_pages,
    D: tl.constexpr, HEADS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
    STORE: tl.constexpr, PAGED: tl.constexpr, PAGE_LEN: tl.constexpr, FP8: tl.constexpr,
):
    """Block `pid` = BLOCK_R (token, head) rows of D; token = row // HEADS picks the cos/sin row, and x's
    row sits at token * stride_xt + head * stride_xh (so x may be a column slice of a fused q/k/v GEMM's
    output, no copy first; v likewise). The rotated half is the same normalised row read at the partner
    columns (c +- D/2), so no shuffle.
    STORE (one token per batch row): the result goes to out_ptr[rows[token], head, pos[token]] of a KV
    pool [R, heads, L, D] (strides stride_ps / ph / pl) instead of out_ptr[row], and v's row (strides
    stride_vt / vh) is copied to the same place of the v pool (v_out_ptr). PAGED: the pool is
    [pages, heads, PAGE_LEN, D] and the place is page pages[rows[token], pos // PAGE_LEN], pos % PAGE_LEN.
    The pools may hold another dtype than x (FP8: float8 e4m3): k is computed and rounded in x's dtype,
    as the reference computes it, and only then cast to the pool's."""
    HALF: tl.constexpr = D // 2
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_D)
    mask = (r < R)[:, None] & (c < D)[None, :]
    partner = tl.where(c < HALF, c + HALF, c - HALF)
    tok = r // HEADS
    head = r % HEADS
    x_row = (tok.to(tl.int64) * stride_xt + head * stride_xh)[:, None]
    x = tl.load(x_ptr + x_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + x_row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=c < D, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    y = round_to(x * rstd * (w + offset), dtype, BF16)
    yp = round_to(xp * rstd * (wp + offset), dtype, BF16)
    rot = tl.where((c < HALF)[None, :], -yp, yp)
    cs = tok[:, None] * stride_cs + c[None, :]
    cos = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    out = round_to(round_to(y * cos, dtype, BF16) + round_to(rot * sin, dtype, BF16), dtype, BF16).to(dtype)
    if STORE:
        slot = tl.load(rows_ptr + tok, mask=r < R, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + tok, mask=r < R, other=0).to(tl.int64)
        if PAGED:
            slot = tl.load(pages_ptr + slot * stride_pages + pos // PAGE_LEN, mask=r < R, other=0).to(tl.int64)
            pos = pos % PAGE_LEN
        dst = slot[:, None] * stride_ps + head[:, None].to(tl.int64) * stride_ph + pos[:, None] * stride_pl
        tl.store(out_ptr + dst + c[None, :], _to_pool(out, out_ptr.dtype.element_ty, FP8), mask=mask)
        v_row = (tok.to(tl.int64) * stride_vt + head * stride_vh)[:, None]
        v = tl.load(v_ptr + v_row + c[None, :], mask=mask, other=0.0)
        tl.store(v_out_ptr + dst + c[None, :], _to_pool(v, v_out_ptr.dtype.element_ty, FP8), mask=mask)
    else:
        tl.store(out_ptr + r[:, None] * stride_o + c[None, :], out, mask=mask)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, R, stride_xt, stride_xh, stride_cs, stride_o, eps, offset,
    v_ptr, v_out_ptr, rows_ptr, pos_ptr, stride_vt, stride_vh, stride_ps, stride_ph, stride_pl,
    pages_ptr, stride_pages,
    q_ptr, qw_ptr, q_out_ptr, RQ, stride_qt, stride_qh, x_programs,
    D: tl.constexpr, HEADS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
    STORE: tl.constexpr, PAGED: tl.constexpr, PAGE_LEN: tl.constexpr, FP8: tl.constexpr,
):
    """`_norm_rope_rows` over x's rows in the first `x_programs` programs; the programs after them (if the
    grid has any) do the same for q (RQ rows, its own weight, written to q_out_ptr [RQ, D]) in the same
    launch: the talker's q beside its k/v store, one launch per layer instead of two."""
    pid = tl.program_id(0)
    if pid >= x_programs:
        _norm_rope_rows(pid - x_programs, q_ptr, qw_ptr, cos_ptr, sin_ptr, q_out_ptr, RQ, stride_qt, stride_qh,
                        stride_cs, D, eps, offset, v_ptr, v_out_ptr, rows_ptr, pos_ptr, stride_vt, stride_vh,
                        stride_ps, stride_ph, stride_pl, pages_ptr, stride_pages, D, HEADS, BLOCK_R, BLOCK_D, BF16,
                        False, PAGED, PAGE_LEN, FP8)
    else:
        _norm_rope_rows(pid, x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, R, stride_xt, stride_xh, stride_cs, stride_o,
                        eps, offset, v_ptr, v_out_ptr, rows_ptr, pos_ptr, stride_vt, stride_vh, stride_ps,
                        stride_ph, stride_pl, pages_ptr, stride_pages, D, HEADS, BLOCK_R, BLOCK_D, BF16, STORE,
                        PAGED, PAGE_LEN, FP8)


def rms_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor, offset: float = 1.0) -> torch.Tensor:
    b, t, heads, d = x.shape
    assert d % 2 == 0 and cos.shape == sin.shape == (b, t, d) and weight.numel() == d
    x, (stride_xt, stride_xh) = _token_heads(x)
    cos2, sin2 = as_rows(cos.to(x.dtype), d), as_rows(sin.to(x.dtype), d)
    rows = b * t * heads
    out = torch.empty(rows, d, device=x.device, dtype=x.dtype)
    if rows:
        block_d = triton.next_power_of_2(d)
        block_r = max(1, min(16, 2048 // block_d))
        _rms_norm_rope_kernel[(triton.cdiv(rows, block_r),)](
            x, weight, cos2, sin2, out, rows, stride_xt, stride_xh, cos2.stride(0), out.stride(0), float(eps),
            float(offset), out, out, cos2, cos2, 0, 0, 0, 0, 0, cos2, 0,  # no store
            x, weight, out, 0, 0, 0, triton.cdiv(rows, block_r),  # no q
            D=d, HEADS=heads, BLOCK_R=block_r, BLOCK_D=block_d, BF16=x.dtype == torch.bfloat16, STORE=False,
            PAGED=False, PAGE_LEN=1, FP8=False,
        )
    return out.view(b, t, heads, d)


def rms_norm_rope_store_triton(k: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                               sin: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                               rows: torch.Tensor, positions: torch.Tensor, offset: float = 1.0,
                               q: torch.Tensor | None = None, q_weight: torch.Tensor | None = None,
                               pages: torch.Tensor | None = None) -> torch.Tensor | None:
    """With q [B, 1, heads, D] (as many heads as k) and its norm weight: also rms_norm_rope(q), returned, in
    the same launch."""
    b, t, heads, d = k.shape
    assert t == 1 and v.shape == k.shape and cos.shape == sin.shape == (b, 1, d) and weight.numel() == d
    assert pool_k.dtype == pool_v.dtype and pool_k.shape == pool_v.shape and pool_k.stride() == pool_v.stride()
    assert pool_k.shape[1] == heads and pool_k.shape[3] == d and pool_k.stride(-1) == 1
    k, (stride_kt, stride_kh) = _token_heads(k)
    v, (stride_vt, stride_vh) = _token_heads(v)
    cos2, sin2 = as_rows(cos.to(k.dtype), d), as_rows(sin.to(k.dtype), d)
    n = b * heads
    q_out, stride_qt, stride_qh = None, 0, 0
    if q is not None:
        assert q.shape == k.shape and q.dtype == k.dtype and q_weight is not None and q_weight.numel() == d
        q, (stride_qt, stride_qh) = _token_heads(q)
        q_out = torch.empty(b, t, heads, d, device=k.device, dtype=k.dtype)
    if n:
        block_d = triton.next_power_of_2(d)
        block_r = max(1, min(16, 2048 // block_d))
        k_programs = triton.cdiv(n, block_r)
        _rms_norm_rope_kernel[(k_programs * (2 if q is not None else 1),)](
            k, weight, cos2, sin2, pool_k, n, stride_kt, stride_kh, cos2.stride(0), 0, float(eps), float(offset),
            v, pool_v, rows, positions, stride_vt, stride_vh, pool_k.stride(0), pool_k.stride(1), pool_k.stride(2),
            pages if pages is not None else rows, pages.stride(0) if pages is not None else 0,
            q if q is not None else k, q_weight if q is not None else weight, q_out if q is not None else k, n,
            stride_qt, stride_qh, k_programs,
            D=d, HEADS=heads, BLOCK_R=block_r, BLOCK_D=block_d, BF16=k.dtype == torch.bfloat16, STORE=True,
            PAGED=pages is not None, PAGE_LEN=pool_k.shape[2] if pages is not None else 1,
            FP8=pool_k.dtype == torch.float8_e4m3fn,
        )
    return q_out


def _token_heads(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """x [B, T, heads, D] -> (x, (token stride, head stride)) with token = b * T + t: strided views as
    they are (the q/k/v column slices of a fused projection), a copy only if no such strides exist."""
    b, t, _, _ = x.shape
    if x.stride(-1) != 1 or (t > 1 and b > 1 and x.stride(0) != t * x.stride(1)):
        x = x.contiguous()
    return x, (x.stride(1) if t > 1 else x.stride(0), x.stride(2))


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as [rows, width] with unit column stride, for the kernels here and in layernorm.py / activation.py
    (a copy only where the view cannot have it)."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                    gate: torch.Tensor | None = None, group_size: int | None = None,
                    residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    width = x.shape[-1]
    g = group_size or width
    assert width % g == 0 and weight.numel() == width and weight.stride(-1) == 1
    out_dtype = residual.dtype if residual is not None else (out_dtype or x.dtype)
    x2 = as_rows(x, width)
    out = torch.empty(x2.shape, device=x.device, dtype=out_dtype)
    gate2 = as_rows(gate, width) if gate is not None else x2
    res2 = as_rows(residual, width) if residual is not None else out
    n_groups = width // g
    rows = x2.shape[0] * n_groups
    if rows:
        block_g = triton.next_power_of_2(g)
        block_r = max(1, min(16, 2048 // block_g))
        _rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            x2, gate2, weight, res2, out, rows,
            x2.stride(0), gate2.stride(0), res2.stride(0), out.stride(0), float(eps), float(offset),
            G=g, N_GROUPS=n_groups, HAS_GATE=gate is not None, HAS_RES=residual is not None,
            BLOCK_R=block_r, BLOCK_G=block_g, BF16=out_dtype == torch.bfloat16,
            num_warps=4 if block_r * block_g <= 2048 else 8,
        )
    return out.view(*x.shape[:-1], width)


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, gate: Optional[torch.Tensor],
                group_size: Optional[int], residual: Optional[torch.Tensor],
                out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return rms_norm_triton(x, weight, eps, offset, gate, group_size, residual, out_dtype)


@rms_norm_op.register_fake
def _(x, weight, eps, offset, gate, group_size, residual, out_dtype):
    dtype = residual.dtype if residual is not None else (out_dtype or x.dtype)
    return x.new_empty(x.shape, dtype=dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             gate: torch.Tensor | None = None, group_size: int | None = None,
             residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., C] (C = n_groups x group_size), weight [C], gate like x or None, residual like x (its dtype
    is the output's) or None -> [..., C] in out_dtype (default x's). The kernel on CUDA or under
    TRITON_INTERPRET=1, else the torch reference."""
    if use_triton(x):
        return rms_norm_op(x, weight, float(eps), float(offset), gate, group_size, residual, out_dtype)
    return rms_norm_reference(x, weight, eps, offset, gate, group_size, residual, out_dtype)


@torch.library.custom_op("nemo_duplex::rms_norm_rope", mutates_args=())
def rms_norm_rope_op(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     offset: float) -> torch.Tensor:
    return rms_norm_rope_triton(x, weight, eps, cos, sin, offset)


@rms_norm_rope_op.register_fake
def _(x, weight, eps, cos, sin, offset):
    return torch.empty_like(x)


@torch.library.custom_op("nemo_duplex::rms_norm_rope_qk_store", mutates_args=("pool_k", "pool_v"))
def rms_norm_rope_qk_store_op(q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor, weight: torch.Tensor,
                              eps: float, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor,
                              pool_v: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                              offset: float, pages: Optional[torch.Tensor]) -> torch.Tensor:
    return rms_norm_rope_store_triton(k, weight, eps, cos, sin, v, pool_k, pool_v, rows, positions, offset, q, q_weight,
                                      pages)


@rms_norm_rope_qk_store_op.register_fake
def _(q, q_weight, k, weight, eps, cos, sin, v, pool_k, pool_v, rows, positions, offset, pages):
    return q.new_empty(q.shape)


def rms_norm_rope_qk_store(q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor, weight: torch.Tensor, eps: float,
                           cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor, pool_k: torch.Tensor,
                           pool_v: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                           offset: float = 1.0, pages: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention inputs in one launch: rms_norm_rope(q) [B, 1, heads, D] returned, and k
    [B, 1, heads, D] normed and rotated with v written in place at pool[rows[b], :, positions[b]] of pool_k /
    pool_v [R, heads, L, D] (no k output, no index_put launches; q with its own norm weight, as many heads
    as k, the same eps; paged pools with their page table `pages`, ops/kv_pages.py). The kernel on CUDA or
    under TRITON_INTERPRET=1, else the torch statements."""
    if use_triton(k):
        return rms_norm_rope_qk_store_op(q, q_weight, k, weight, float(eps), cos, sin, v, pool_k, pool_v, rows,
                                         positions, float(offset), pages)
    rms_norm_rope_store_reference(k, weight, eps, cos, sin, v, pool_k, pool_v, rows, positions, offset, pages)
    return rms_norm_rope_reference(q, q_weight, eps, cos, sin, offset)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  offset: float = 1.0) -> torch.Tensor:
    """x [B, T, heads, D], weight [D], cos/sin [B, T, D] -> [B, T, heads, D] in x's dtype: the kernel on
    CUDA or under TRITON_INTERPRET=1, else the torch reference."""
    if use_triton(x):
        return rms_norm_rope_op(x, weight, float(eps), cos, sin, float(offset))
    return rms_norm_rope_reference(x, weight, eps, cos, sin, offset)


@torch.library.custom_op("nemo_duplex::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                    delta_weight: Optional[torch.Tensor], delta_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_triton(x, delta, weight, eps, offset, delta_weight, delta_eps)


@add_rms_norm_op.register_fake
def _(x, delta, weight, eps, offset, delta_weight, delta_eps):
    return torch.empty_like(x), torch.empty_like(x)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                 delta_weight: torch.Tensor | None = None,
                 delta_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., C] (x's dtype is the output's), weight [C] -> (s, y) [..., C]: s = x + delta, or
    x + round(norm(delta) * (offset + delta_weight)) with delta_weight; y = norm(s) * (offset + weight).
    The kernel on CUDA or under TRITON_INTERPRET=1, else the torch reference."""
    if use_triton(x):
        return add_rms_norm_op(x, delta, weight, float(eps), float(offset), delta_weight,
                               float(eps if delta_eps is None else delta_eps))
    return add_rms_norm_reference(x, delta, weight, eps, offset, delta_weight, delta_eps)
