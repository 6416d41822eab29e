"""fp32-accurate linear layer from three fp16 tensor-core products: y = x @ w^T + b (optionally then exact
GELU, then + a residual), with x and w split into fp16 halves beforehand.

Why: the codec must run in fp32 (spec 9.9; TF32 off, spec 1.6) and its GEMMs are arithmetic-bound
(docs/performance.md). ops/fp32_linear.py gets fp32 accuracy from three TF32 products; fp16 has TF32's 11
significant bits at twice TF32's tensor-core rate on Hopper, but a 5-bit exponent. So every operand is
brought into fp16's range by a power of two first (exact), then split like the TF32 halves:

    v = s (v_hi + v_lo),  v_hi = fp16(v / s),  v_lo = fp16(v / s - v_hi)   (v / s - v_hi is exact in fp32)

with s chosen so the scaled block's largest |v| is in [2^14, 2^15): w per output channel (once, at load:
`split_fp16_weight`), x per row and per K block of SCALE_BLOCK columns (`split_fp16_rows`, or a GEMM's
epilogue writing its output already split: `split_out`). The dropped terms (x_lo w_lo, the halves'
rounding, and tails below fp16's subnormal step of 2^-24, i.e. 2^-38 of the block's max) are ~2^-22
relative, as for 3xTF32. Each K block's three products are summed on their own (smallest first) and the
block's sum, scaled back by its x scale, is added to the fp32 accumulator: accumulating the products
straight into the running sum loses their low bits in the tensor cores (measured on the H200 for fp16 as
for TF32: 3e-6 to 4e-5 relative against 4e-7 to 9e-7 with per-block sums; docs/performance.md).
Powers of two make every scaling exact, so the result differs from 3xTF32's only by the
order and rounding of the same ~2^-22 terms.

Measured on the H200 (a probe of the codec's seven GEMM shapes at 128 calls, each replayed from a
CUDA graph): 1.91 ms against 3.22 ms for the 3xTF32 kernel with its weight pre-split, errors 3.6e-7 to
6.4e-7 relative to each row's max |y|.

Layout: halves [M, K] fp16 and scales [M, ceil(K / SCALE_BLOCK)] fp32 (the inverse scale, 1 / s) for x;
[N, K] fp16 and [N] fp32 for w; y [M, N] fp32, or split like x (`split_out`: scale blocks along N), which
is what the next GEMM reads (the codec's pwconv1 -> pwconv2).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import interpreting, sm_count, use_triton
from ops.fp32_linear import grouped_tile, pick_split_k

# Columns of x per scale; the GEMM's K block (each block's three products are summed with one x scale).
SCALE_BLOCK = 64


class Fp16Split(NamedTuple):
    """v = inv[..., block] * (hi + lo), block = column // SCALE_BLOCK (x: inv [M, ceil(K / SCALE_BLOCK)]),
    or per row for a weight (inv [N])."""
    hi: torch.Tensor
    lo: torch.Tensor
    inv: torch.Tensor


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def pow2_scale_reference(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 amax >= 0 -> (s, 1/s), powers of two with amax * s in [2^14, 2^15) (bit operations on the
    exponent, as `_pow2_scale`; an amax of 0 or below 2^-112 gets the largest scale, 2^126)."""
    e = (amax.contiguous().view(torch.int32) >> 23) & 0xFF
    s = (268 - e).clamp(1, 253)
    return (s << 23).view(torch.float32), ((254 - s) << 23).view(torch.float32)


def split_scaled_reference(v: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v * scale (exact) -> its fp16 halves (round to nearest even, as the kernels' conversions)."""
    scaled = v * scale
    hi = scaled.to(torch.float16)
    return hi, (scaled - hi.float()).to(torch.float16)


def split_fp16_rows_reference(x: torch.Tensor) -> Fp16Split:
    """x [M, K] fp32 -> its halves and per-(row, SCALE_BLOCK columns) inverse scales; bit for bit the
    kernel's."""
    m, k = x.shape
    blocks = triton.cdiv(k, SCALE_BLOCK)
    padded = F.pad(x.float(), (0, blocks * SCALE_BLOCK - k)).view(m, blocks, SCALE_BLOCK)
    scale, inv = pow2_scale_reference(padded.abs().amax(dim=2))
    hi, lo = split_scaled_reference(padded, scale[:, :, None])
    return Fp16Split(hi.view(m, -1)[:, :k], lo.view(m, -1)[:, :k], inv)


def merge_fp16_split(split: Fp16Split) -> torch.Tensor:
    """The fp32 values a split stands for (to ~2^-22 relative to each block's max), [M, K]."""
    m, k = split.hi.shape
    inv = split.inv.repeat_interleave(SCALE_BLOCK, dim=1)[:, :k] if split.inv.dim() == 2 else split.inv[:, None]
    return (split.hi.float() + split.lo.float()) * inv


def fp16x3_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False,
                            residual: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in fp32 (the tests compare both with it and with float64)."""
    y = F.linear(x, weight, bias)
    y = F.gelu(y) if gelu else y
    return y if residual is None else residual + y


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _pow2_scale(amax):
    """(s, 1/s) for amax >= 0: powers of two built from amax's exponent bits so that amax * s is in
    [2^14, 2^15) (fp16's largest binade below 2^15, so the rounded head stays finite)."""
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    s = tl.minimum(tl.maximum(268 - e, 1), 253)
    return (s << 23).to(tl.float32, bitcast=True), ((254 - s) << 23).to(tl.float32, bitcast=True)


@triton.jit
def split_tile(v, ROWS: tl.constexpr, COLS: tl.constexpr, SCALE: tl.constexpr):
    """An fp32 tile [ROWS, COLS] (COLS a multiple of SCALE) -> its halves [ROWS, COLS] fp16 and inverse
    scales [ROWS, COLS // SCALE], one per SCALE columns: what a kernel writes where its output is the next
    fp16x3 GEMM's x."""
    SCALES: tl.constexpr = COLS // SCALE
    blocks = tl.reshape(v, (ROWS, SCALES, SCALE))
    scale, inv = _pow2_scale(tl.max(tl.abs(blocks), axis=2))
    scaled = tl.reshape(blocks * scale[:, :, None], (ROWS, COLS))
    hi = scaled.to(tl.float16)
    return hi, (scaled - hi.to(tl.float32)).to(tl.float16), inv


@triton.jit
def _split_rows_kernel(x_ptr, hi_ptr, lo_ptr, inv_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr,
                       SCALE: tl.constexpr):
    """One BLOCK_M x SCALE tile: its rows' scales, then both halves."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    block = tl.program_id(1)
    ks = block * SCALE + tl.arange(0, SCALE)
    mask = (rows < M)[:, None] & (ks < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    hi, lo, inv = split_tile(x, BLOCK_M, SCALE, SCALE)  # inv [BLOCK_M, 1]: the tile is one scale block
    tl.store(hi_ptr + rows[:, None] * K + ks[None, :], hi, mask=mask)
    tl.store(lo_ptr + rows[:, None] * K + ks[None, :], lo, mask=mask)
    tl.store(inv_ptr + rows[:, None] * tl.num_programs(1) + block, inv, mask=(rows < M)[:, None])


@triton.jit
def _fp16x3_kernel(
    xh_ptr, xl_ptr, xinv_ptr, wh_ptr, wl_ptr, winv_ptr, b_ptr, r_ptr, y_ptr, yh_ptr, yl_ptr, yinv_ptr, part_ptr,
    M, N, stride_xm, stride_wn, stride_rm, stride_ym,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SPLIT_OUT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of y, or with SPLIT_K > 1 its share of the K blocks (program axis 1) to
    part_ptr [SPLIT_K, M, N] for `_split_k_sum_kernel`. The K block is the x scale block (SCALE)."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    K_BLOCKS: tl.constexpr = (K + SCALE - 1) // SCALE
    BLOCKS_PER_SPLIT: tl.constexpr = K_BLOCKS // SPLIT_K  # whole blocks (the launcher checks)
    first_block = tl.program_id(1) * BLOCKS_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, BLOCKS_PER_SPLIT):
        block = first_block + i
        ks = block * SCALE + tl.arange(0, SCALE)
        k_mask = ks < K
        x_offsets = rows[:, None] * stride_xm + ks[None, :]
        x_mask = row_mask[:, None] & k_mask[None, :]
        x_hi = tl.load(xh_ptr + x_offsets, mask=x_mask, other=0.0)
        x_lo = tl.load(xl_ptr + x_offsets, mask=x_mask, other=0.0)
        w_offsets = cols[None, :] * stride_wn + ks[:, None]  # [SCALE, BLOCK_N] view of w^T, K-major
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_hi = tl.load(wh_ptr + w_offsets, mask=w_mask, other=0.0)
        w_lo = tl.load(wl_ptr + w_offsets, mask=w_mask, other=0.0)
        part = tl.dot(x_lo, w_hi)
        part = tl.dot(x_hi, w_lo, part)
        part = tl.dot(x_hi, w_hi, part)
        x_inv = tl.load(xinv_ptr + rows * K_BLOCKS + block, mask=row_mask, other=0.0)
        acc += part * x_inv[:, None]  # a power of two: exact, then one fp32 add
    acc = acc * tl.load(winv_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if SPLIT_K > 1:
        part_out = part_ptr + tl.program_id(1).to(tl.int64) * M * N
        tl.store(part_out + rows[:, None] * N + cols[None, :], acc, mask=row_mask[:, None] & col_mask[None, :])
    else:
        _epilogue(acc, rows, cols, pid_n, row_mask, col_mask, b_ptr, r_ptr, y_ptr, yh_ptr, yl_ptr, yinv_ptr, N,
                  stride_rm, stride_ym, HAS_BIAS, GELU, HAS_RESIDUAL, SPLIT_OUT, BLOCK_M, BLOCK_N, SCALE)


@triton.jit
def _epilogue(acc, rows, cols, pid_n, row_mask, col_mask, b_ptr, r_ptr, y_ptr, yh_ptr, yl_ptr, yinv_ptr, N,
              stride_rm, stride_ym, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              SPLIT_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr):
    """y = GELU?(acc + bias) (+ residual), stored in fp32, or (SPLIT_OUT) split as `_split_rows_kernel`
    splits (scale blocks of SCALE columns: BLOCK_N is a multiple of SCALE, and columns past N are 0 here, so
    they do not change a block's scale)."""
    out_mask = row_mask[:, None] & col_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if GELU:  # exact (erf) GELU, as F.gelu's default
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    if HAS_RESIDUAL:
        acc = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=out_mask, other=0.0) + acc
    if SPLIT_OUT:
        hi, lo, inv = split_tile(acc, BLOCK_M, BLOCK_N, SCALE)
        offsets = rows[:, None] * N + cols[None, :]
        tl.store(yh_ptr + offsets, hi, mask=out_mask)
        tl.store(yl_ptr + offsets, lo, mask=out_mask)
        n_blocks = (N + SCALE - 1) // SCALE
        block_ids = pid_n * (BLOCK_N // SCALE) + tl.arange(0, BLOCK_N // SCALE)
        tl.store(yinv_ptr + rows[:, None] * n_blocks + block_ids[None, :], inv,
                 mask=row_mask[:, None] & (block_ids < n_blocks)[None, :])
    else:
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc, mask=out_mask)


@triton.jit
def _split_k_sum_kernel(part_ptr, b_ptr, r_ptr, y_ptr, yh_ptr, yl_ptr, yinv_ptr, M, N, stride_rm, stride_ym,
                        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, SPLIT_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, SCALE: tl.constexpr):
    """The splits' partial products summed in split order (deterministic: no atomics), then the epilogue."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    out_mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None] * N + cols[None, :]
    acc = tl.load(part_ptr + offsets, mask=out_mask, other=0.0)
    for split in range(1, SPLIT_K):
        acc += tl.load(part_ptr + split * M * N + offsets, mask=out_mask, other=0.0)  # < 2^31: the launcher checks
    _epilogue(acc, rows, cols, tl.program_id(1), row_mask, col_mask, b_ptr, r_ptr, y_ptr, yh_ptr, yl_ptr, yinv_ptr,
              N, stride_rm, stride_ym, HAS_BIAS, GELU, HAS_RESIDUAL, SPLIT_OUT, BLOCK_M, BLOCK_N, SCALE)


def split_fp16_rows_triton(x: torch.Tensor) -> Fp16Split:
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    blocks = triton.cdiv(k, SCALE_BLOCK)
    hi = torch.empty(m, k, device=x.device, dtype=torch.float16)
    lo = torch.empty_like(hi)
    inv = torch.empty(m, blocks, device=x.device, dtype=torch.float32)
    if m:
        block_m = 1024 if interpreting() else 32
        _split_rows_kernel[(triton.cdiv(m, block_m), blocks)](x, hi, lo, inv, m, k, x.stride(0), BLOCK_M=block_m,
                                                               SCALE=SCALE_BLOCK)
    return Fp16Split(hi, lo, inv)


TILES = (128, 128, 8, 3)  # BLOCK_M, BLOCK_N, num_warps, num_stages: best of the H200 probe above (K block 64)


def fp16x3_linear_triton(x: Fp16Split, weight: Fp16Split, bias: torch.Tensor | None, gelu: bool = False,
                         residual: torch.Tensor | None = None, split_out: bool = False,
                         tiles: tuple[int, int, int, int] | None = None,
                         split_k: int | None = None) -> torch.Tensor | Fp16Split:
    """x split [M, K] (`split_fp16_rows`), weight split [N, K] (`split_fp16_weight`), bias [N] fp32 or None,
    residual [M, N] fp32 or None -> y [M, N] fp32, or its split (`split_out`)."""
    m, k = x.hi.shape
    n = weight.hi.shape[0]
    assert weight.hi.shape == (n, k) and weight.lo.shape == (n, k) and weight.inv.shape == (n,), weight.hi.shape
    assert x.lo.shape == (m, k) and x.inv.shape == (m, triton.cdiv(k, SCALE_BLOCK)), (x.lo.shape, x.inv.shape)
    assert x.hi.is_contiguous() and x.lo.is_contiguous() and x.inv.is_contiguous()
    assert weight.hi.stride(-1) == 1 and weight.lo.stride() == weight.hi.stride()
    device = x.hi.device
    n_blocks = triton.cdiv(n, SCALE_BLOCK)
    if split_out:
        y = torch.empty(0, device=device)
        out = Fp16Split(torch.empty(m, n, device=device, dtype=torch.float16),
                        torch.empty(m, n, device=device, dtype=torch.float16),
                        torch.empty(m, n_blocks, device=device, dtype=torch.float32))
    else:
        y = torch.empty(m, n, device=device, dtype=torch.float32)
        out = Fp16Split(y, y, y)  # unwritten
    r = residual if residual is not None else y  # unread without a residual
    if residual is not None:
        assert residual.dtype == torch.float32 and residual.shape == (m, n) and residual.stride(-1) == 1
    if m == 0:
        return out if split_out else y
    if tiles is None:  # the interpreter pays per program: large tiles on the CPU
        tiles = (1024, 128, 4, 1) if interpreting() else TILES
    block_m, block_n, num_warps, num_stages = tiles
    assert block_n % SCALE_BLOCK == 0, "an output tile holds whole scale blocks"
    output_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, SCALE_BLOCK)
    if split_k is None:
        split_k = pick_split_k(output_tiles, k_blocks * SCALE_BLOCK, SCALE_BLOCK, sm_count(device))
    assert k_blocks % split_k == 0, f"split_k={split_k} must cut K={k} into whole blocks of {SCALE_BLOCK}"
    assert split_k == 1 or split_k * m * n < 2 ** 31, "split-K scratch offsets are 32-bit"
    part = torch.empty(split_k, m, n, device=device, dtype=torch.float32) if split_k > 1 else out.inv  # unread
    b = bias if bias is not None else out.inv  # unread without a bias
    flags = dict(HAS_BIAS=bias is not None, GELU=gelu, HAS_RESIDUAL=residual is not None, SPLIT_OUT=split_out)
    _fp16x3_kernel[(output_tiles, split_k)](
        x.hi, x.lo, x.inv, weight.hi, weight.lo, weight.inv, b, r, y, out.hi, out.lo, out.inv, part, m, n,
        x.hi.stride(0), weight.hi.stride(0), r.stride(0), n,
        K=k, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, SCALE=SCALE_BLOCK, GROUP_M=8,
        num_warps=num_warps, num_stages=num_stages, **flags,
    )
    if split_k > 1:
        sum_block_m, sum_block_n = 32, 128
        _split_k_sum_kernel[(triton.cdiv(m, sum_block_m), triton.cdiv(n, sum_block_n))](
            part, b, r, y, out.hi, out.lo, out.inv, m, n, r.stride(0), n, SPLIT_K=split_k,
            BLOCK_M=sum_block_m, BLOCK_N=sum_block_n, SCALE=SCALE_BLOCK, **flags,
        )
    return out if split_out else y


def split_fp16_weight(weight: torch.Tensor, out: torch.Tensor | None = None) -> Fp16Split:
    """fp32 w [N, K] -> its halves [N, K] fp16 and one inverse scale per output channel [N] fp32. Done once
    per weight (the codec at load: RVQCodec.presplit_weights), in torch. `out`, if given, is a flat fp16
    buffer of `weight_split_numel(N, K)` elements that receives the three (views of it are returned), so a
    re-split after a weight load keeps a captured graph's pointers valid."""
    n, k = weight.shape
    scale, inv = pow2_scale_reference(weight.float().abs().amax(dim=1))
    hi, lo = split_scaled_reference(weight.float(), scale[:, None])
    if out is None:
        return Fp16Split(hi.contiguous(), lo.contiguous(), inv)
    split = unpack_weight_split(out, n, k)
    split.hi.copy_(hi)
    split.lo.copy_(lo)
    split.inv.copy_(inv)
    return split


def weight_split_numel(n: int, k: int) -> int:
    """fp16 elements of a packed weight split: hi, lo, then the fp32 scales (two fp16 slots each)."""
    return 2 * n * k + 2 * n


def unpack_weight_split(packed: torch.Tensor, n: int, k: int) -> Fp16Split:
    """Views (hi, lo, inv) of a flat fp16 buffer of weight_split_numel(n, k) elements."""
    assert packed.dtype == torch.float16 and packed.shape == (weight_split_numel(n, k),), packed.shape
    return Fp16Split(packed[:n * k].view(n, k), packed[n * k:2 * n * k].view(n, k),
                     packed[2 * n * k:].view(torch.float32))


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::split_fp16_rows", mutates_args=())
def split_fp16_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(split_fp16_rows_triton(x))


@split_fp16_rows_op.register_fake
def _(x):
    m, k = x.shape
    return (x.new_empty(m, k, dtype=torch.float16), x.new_empty(m, k, dtype=torch.float16),
            x.new_empty(m, triton.cdiv(k, SCALE_BLOCK), dtype=torch.float32))


def split_fp16_rows(x: torch.Tensor) -> Fp16Split:
    """x [..., K] fp32 -> its split with leading dims flattened ([M, K] halves, [M, ceil(K / 64)] scales):
    the kernel on CUDA or under TRITON_INTERPRET=1, else the torch reference (bit for bit the same)."""
    x2 = x.reshape(-1, x.shape[-1])
    if use_triton(x2):
        return Fp16Split(*split_fp16_rows_op(x2))
    return split_fp16_rows_reference(x2)


@torch.library.custom_op("nemo_duplex::fp16x3_linear", mutates_args=())
def fp16x3_linear_op(x_hi: torch.Tensor, x_lo: torch.Tensor, x_inv: torch.Tensor, w_hi: torch.Tensor,
                     w_lo: torch.Tensor, w_inv: torch.Tensor, bias: Optional[torch.Tensor], gelu: bool,
                     residual: Optional[torch.Tensor]) -> torch.Tensor:
    return fp16x3_linear_triton(Fp16Split(x_hi, x_lo, x_inv), Fp16Split(w_hi, w_lo, w_inv), bias, gelu, residual)


@fp16x3_linear_op.register_fake
def _(x_hi, x_lo, x_inv, w_hi, w_lo, w_inv, bias, gelu, residual):
    return x_hi.new_empty(x_hi.shape[0], w_hi.shape[0], dtype=torch.float32)


@torch.library.custom_op("nemo_duplex::fp16x3_linear_split", mutates_args=())
def fp16x3_linear_split_op(x_hi: torch.Tensor, x_lo: torch.Tensor, x_inv: torch.Tensor, w_hi: torch.Tensor,
                           w_lo: torch.Tensor, w_inv: torch.Tensor, bias: Optional[torch.Tensor],
                           gelu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(fp16x3_linear_triton(Fp16Split(x_hi, x_lo, x_inv), Fp16Split(w_hi, w_lo, w_inv), bias, gelu,
                                      split_out=True))


@fp16x3_linear_split_op.register_fake
def _(x_hi, x_lo, x_inv, w_hi, w_lo, w_inv, bias, gelu):
    m, n = x_hi.shape[0], w_hi.shape[0]
    return (x_hi.new_empty(m, n), x_hi.new_empty(m, n),
            x_hi.new_empty(m, triton.cdiv(n, SCALE_BLOCK), dtype=torch.float32))


def fp16x3_linear(x: Fp16Split, weight: Fp16Split, bias: torch.Tensor | None, gelu: bool = False,
                  residual: torch.Tensor | None = None, split_out: bool = False) -> torch.Tensor | Fp16Split:
    """fp32-accurate x @ w^T + bias (then exact GELU if `gelu`, then + `residual` [M, N]) from the splits of x
    (`split_fp16_rows`) and w (`split_fp16_weight`): y [M, N] fp32, or its split (`split_out`), which the
    next fp16x3_linear takes as its x. The kernel on CUDA or under TRITON_INTERPRET=1; elsewhere the fp32
    reference on the values the splits stand for (`merge_fp16_split`)."""
    if use_triton(x.hi):
        if split_out:
            assert residual is None, "split_out: no residual (the codec's pwconv1 has none)"
            return Fp16Split(*fp16x3_linear_split_op(*x, *weight, bias, gelu))
        return fp16x3_linear_op(*x, *weight, bias, gelu, residual)
    y = fp16x3_linear_reference(merge_fp16_split(x), merge_fp16_split(weight), bias, gelu, residual)
    return split_fp16_rows_reference(y) if split_out else y
