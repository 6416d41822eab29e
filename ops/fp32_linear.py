"""fp32-accurate linear layer on tensor cores: y = x @ w^T + b (optionally then exact GELU, then + a
residual), 3xTF32.

Why: the codec must run in fp32 (spec 9.9: bf16 collapses it; TF32 off, spec 1.6), and fp32 GEMMs without
tensor cores (cuBLAS SGEMM, ~50 TFLOP/s on an H200) are most of its time. `tl.dot(..., "tf32x3")` splits
each fp32 operand into a tf32 head and a tf32 tail (a = a_hi + a_lo) and sums a_hi b_hi + a_hi b_lo +
a_lo b_hi in fp32: the dropped a_lo b_lo term and the tails' rounding are ~2^-22 relative, so the
result is as accurate as an fp32 GEMM (~1e-7 relative, tests/ops/test_fp32_linear.py), unlike plain TF32
(~1e-3). The split happens in registers, so x is read once, in fp32.

Layout: x [M, K] and w [N, K] both K-contiguous (what 32-bit tensor-core operands need), y [M, N] fp32.
Tiles are grouped along M so consecutive programs reuse the same weight columns from L2.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import interpreting, sm_count, use_triton

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def fp32_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          gelu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    y = F.gelu(y) if gelu else y
    return y if residual is None else residual + y


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _round_tf32(x):
    """fp32 -> the nearest TF32 value (10 mantissa bits, ties away from zero), as fp32. Rounding, not
    truncating: with truncated heads both tails carry their operand's sign, so the dropped x_lo w_lo term
    has the sign of x w and adds up over K instead of cancelling (measured on the H200: 3.5e-6 relative
    at K=6144 against 2e-6 for tl.dot's own split, and 13x the codec's waveform error)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program 0's id in grouped order: GROUP_M row tiles sweep the same column
    tiles, so consecutive programs reuse the same weight columns from L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * tiles_n)) % group_size, (pid % (GROUP_M * tiles_n)) // group_size


@triton.jit
def _fp32_linear_kernel(
    x_ptr, w_ptr, wl_ptr, b_ptr, r_ptr, y_ptr, part_ptr, M, N,
    stride_xm, stride_wn, stride_rm, stride_ym,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    PRECISION: tl.constexpr, PRESPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N tile of y, or with SPLIT_K > 1 its share K / SPLIT_K of the reduction (program
    axis 1), written to part_ptr [SPLIT_K, M, N] for `_split_k_sum_kernel`. K is a compile-time constant
    (fixed per layer; Triton 3.6's interpreter cannot run a loop with a runtime bound).
    PRESPLIT: w_ptr holds w_hi (exactly a TF32 value) and wl_ptr w_lo = w - w_hi (split_tf32), so the
    weight tiles go to the tensor cores as they are loaded and only x is split, in registers: the same
    products as tl.dot's "tf32x3" (x_lo w_hi + x_hi w_lo + x_hi w_hi, smallest first), without splitting
    the weight tile on every K step of every program. Otherwise tl.dot with input precision PRECISION."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    K_SPLIT: tl.constexpr = K // SPLIT_K  # a multiple of BLOCK_K (the launcher checks)
    k_first = tl.program_id(1) * K_SPLIT
    for k_step in range(0, K_SPLIT, BLOCK_K):
        ks = k_first + k_step + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_offsets = cols[None, :] * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N] view of w^T, K-major
        w_mask = k_mask[:, None] & col_mask[None, :]
        w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)
        if PRESPLIT:
            w_lo = tl.load(wl_ptr + w_offsets, mask=w_mask, other=0.0)
            x_hi = _round_tf32(x)
            x_lo = _round_tf32(x - x_hi)  # x - x_hi is exact in fp32
            # This block's three products summed on their own, then added to acc by an fp32 add: the
            # tensor cores align every product to the accumulator's exponent with few guard bits, so
            # accumulating the small products straight into the running acc lost their low bits (on the
            # H200: 2.5-3.5e-6 relative at K=6144 against 2e-6 for tl.dot's own tf32x3, which also sums
            # the parts before adding them).
            part = tl.dot(x_lo, w, input_precision="tf32")
            part = tl.dot(x_hi, w_lo, part, input_precision="tf32")
            acc += tl.dot(x_hi, w, part, input_precision="tf32")
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K > 1:
        part_out = part_ptr + tl.program_id(1).to(tl.int64) * M * N
        tl.store(part_out + rows[:, None] * N + cols[None, :], acc, mask=out_mask)
    else:
        _epilogue(acc, rows, cols, col_mask, out_mask, b_ptr, r_ptr, y_ptr, stride_rm, stride_ym,
                  HAS_BIAS, GELU, HAS_RESIDUAL)


@triton.jit
def _epilogue(acc, rows, cols, col_mask, out_mask, b_ptr, r_ptr, y_ptr, stride_rm, stride_ym,
              HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """y = GELU?(acc + bias) (+ residual), stored: the GEMM's last step, or the split-K sum's."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if GELU:  # exact (erf) GELU, as F.gelu's default
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    if HAS_RESIDUAL:  # residual + y, as the reference adds it (the ConvNeXt blocks' skip connection)
        acc = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=out_mask, other=0.0) + acc
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc, mask=out_mask)


@triton.jit
def _split_k_sum_kernel(part_ptr, b_ptr, r_ptr, y_ptr, M, N, stride_rm, stride_ym,
                        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The splits' partial products summed in split order (deterministic: no atomics), then the epilogue."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    out_mask = (rows < M)[:, None] & col_mask[None, :]
    acc = sum_splits(part_ptr, rows[:, None] * N + cols[None, :], out_mask, M, N, SPLIT_K)
    _epilogue(acc, rows, cols, col_mask, out_mask, b_ptr, r_ptr, y_ptr, stride_rm, stride_ym,
              HAS_BIAS, GELU, HAS_RESIDUAL)


@triton.jit
def sum_splits(part_ptr, offsets, mask, M, N, SPLIT_K: tl.constexpr):
    """The partial products [SPLIT_K, M, N] (fp32) at `offsets` of one split's [M, N], added in split order."""
    acc = tl.load(part_ptr + offsets, mask=mask, other=0.0)
    for split in range(1, SPLIT_K):
        acc += tl.load(part_ptr + split * M * N + offsets, mask=mask, other=0.0)  # < 2^31: the launchers check
    return acc


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest TF32 value as fp32, as `_round_tf32` (add half of the dropped range, then clear
    the low 13 bits: -8192 = 0xFFFFE000)."""
    return ((t.contiguous().view(torch.int32) + 0x1000) & -8192).view(torch.float32)


def split_tf32_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = round_tf32(weight)
    return hi, round_tf32(weight - hi)


@triton.jit
def _split_tf32_kernel(w_ptr, hi_ptr, lo_ptr, numel, K, stride_wn, stride_wk, BLOCK: tl.constexpr):
    """Both halves in one pass over w (any 2-D strides), written contiguous [N, K]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    w = tl.load(w_ptr + (offs // K) * stride_wn + (offs % K) * stride_wk, mask=mask, other=0.0)
    hi = _round_tf32(w)
    tl.store(hi_ptr + offs, hi, mask=mask)
    tl.store(lo_ptr + offs, _round_tf32(w - hi), mask=mask)


def split_tf32(weight: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 w [N, K] -> (w_hi, w_lo), both [N, K] contiguous fp32 TF32 values (what the tensor cores take
    exactly): w_hi = w rounded to TF32's 10 mantissa bits, w_lo = w - w_hi (exact in fp32, |w_lo| <=
    2^-11 |w|, signed) rounded to TF32 again. One kernel on CUDA (or under the interpreter): in torch
    the split is five elementwise kernels and ~11 passes over the weight. `out` [2, N, K] fp32, if given,
    receives (w_hi, w_lo) in place (the codec keeps its decoder's ~92 M weights split this way, built
    once: RVQCodec.presplit_weights; re-splitting into the same memory keeps a captured graph's pointers
    valid); without it `tf32x3w` splits a weight on every call."""
    n, k = weight.shape
    if out is not None:
        assert out.shape == (2, n, k) and out.dtype == torch.float32 and out.is_contiguous(), out.shape
    if not use_triton(weight):
        hi, lo = split_tf32_reference(weight)
        if out is None:
            return hi, lo
        out[0].copy_(hi)
        out[1].copy_(lo)
        return out[0], out[1]
    hi = torch.empty(n, k, device=weight.device, dtype=torch.float32) if out is None else out[0]
    lo = torch.empty_like(hi) if out is None else out[1]
    block = 1024
    _split_tf32_kernel[(triton.cdiv(n * k, block),)](weight, hi, lo, n * k, k, weight.stride(0), weight.stride(1),
                                                      BLOCK=block)
    return hi, lo


GPU_TILES = (128, 64, 32, 4, 4)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages: best of a sweep (docs/performance.md)
PRESPLIT_TILES = (128, 128, 32, 8, 3)  # the same for tf32x3w (a sweep at stage 3: -6% against GPU_TILES)


# Split-K: at most this many splits (1 turns it off). Each split keeps at least SPLIT_K_MIN_K of the reduction.
SPLIT_K_MAX = 8
SPLIT_K_MIN_K = 512


def pick_split_k(tiles: int, k: int, block_k: int, num_sms: int, max_splits: int | None = None) -> int:
    """Splits of the reduction for a grid of `tiles` output tiles, one program per SM at a time (a 128 x 128
    tile's three stages fill an SM's shared memory): the count s with the fewest waves of programs per unit
    of work, ceil(tiles s / SMs) / s, among those that cut K into equal whole BLOCK_K blocks of at least
    SPLIT_K_MIN_K; ties go to fewer splits, and a split must save at least 10% of the waves (it also writes
    and re-reads s partial products). Grids above two waves are not split. Why: a grid a little above or far
    below the SM count leaves SMs idle for a whole wave (the codec's stage-1 pwconv2: 9 x 12 = 108 tiles
    for 132 SMs at 128 calls, 3 x 12 = 36 at 32 calls). Measured on the H200 at 32 calls' codec shapes
    (docs/performance.md): 36 tiles, 3 splits 0.094 ms against 0.259 for one pass; 144 tiles, 3
    splits 0.108 against 0.135; 96 tiles, 4 splits 0.116 against 0.131; but 333 tiles (2.5 waves), 3
    splits 0.222 against 0.202, the partial products' traffic costing more than the waves save. Static
    shapes in, so a captured graph keeps one choice."""
    max_splits = SPLIT_K_MAX if max_splits is None else max_splits
    if tiles > 2 * num_sms:
        return 1
    best, best_cost = 1, float(triton.cdiv(tiles, num_sms))
    for splits in range(2, max_splits + 1):
        if k % (splits * block_k) or k // splits < SPLIT_K_MIN_K:
            continue
        cost = triton.cdiv(tiles * splits, num_sms) / splits
        if cost < 0.9 * best_cost:
            best, best_cost = splits, cost
    return best


def fp32_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False,
                       precision: str = "tf32x3", tiles: tuple[int, int, int, int, int] | None = None,
                       weight_lo: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                       split_k: int | None = None) -> torch.Tensor:
    """x [..., K] fp32, weight [N, K] fp32 (K-contiguous, any row stride), bias [N] or None -> [..., N] fp32;
    `residual` [..., N] (or None) is added last, in the epilogue.
    `precision` is tl.dot's input precision ("tf32x3"; "ieee" for comparisons), or "tf32x3w": the same
    products with the weight split beforehand (split_tf32, one pass over the weight) and only x split in
    the kernel; with `weight_lo` given (tf32x3w only), `weight` is taken as already split (split_tf32(w) =
    (weight, weight_lo)) and no split runs here. `tiles` overrides GPU_TILES; `split_k` the split count
    (`pick_split_k`)."""
    assert x.dtype == weight.dtype == torch.float32
    assert weight_lo is None or precision == "tf32x3w", "weight_lo is the pre-split weight's tail: tf32x3w only"
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=torch.float32)
    r2 = y  # unread without a residual
    if residual is not None:
        assert residual.dtype == torch.float32 and residual.shape == (*lead, n)
        r2 = residual.reshape(m, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    if m == 0:
        return y.view(*lead, n)
    if tiles is None:  # the interpreter pays per program: large tiles on the CPU
        tiles = ((1024, 128, 64, 4, 1) if interpreting()
                 else PRESPLIT_TILES if precision == "tf32x3w" else GPU_TILES)
    block_m, block_n, block_k, num_warps, num_stages = tiles
    output_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_k is None:
        split_k = pick_split_k(output_tiles, k, block_k, sm_count(x.device))
    assert split_k == 1 or k % (split_k * block_k) == 0, f"split_k={split_k} must cut K={k} into whole blocks"
    assert split_k * m * n < 2 ** 31 or split_k == 1, "split-K scratch offsets are 32-bit"
    part = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32) if split_k > 1 else y  # y: unread
    presplit = precision == "tf32x3w"
    if presplit:
        # both contiguous: the kernel reads w_lo with w's row stride
        w, w_lo = (weight.contiguous(), weight_lo.contiguous()) if weight_lo is not None else split_tf32(weight)
        assert w_lo.shape == w.shape, (w_lo.shape, w.shape)
    else:
        w, w_lo = weight, weight  # w_lo unread
    b = bias if bias is not None else y  # unread without a bias
    _fp32_linear_kernel[(output_tiles, split_k)](
        x2, w, w_lo, b, r2, y, part, m, n,
        x2.stride(0), w.stride(0), r2.stride(0), y.stride(0),
        K=k, HAS_BIAS=bias is not None, GELU=gelu, HAS_RESIDUAL=residual is not None,
        PRECISION="tf32" if presplit else precision, PRESPLIT=presplit, SPLIT_K=split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split_k > 1:
        sum_block_m, sum_block_n = 32, 128
        _split_k_sum_kernel[(triton.cdiv(m, sum_block_m), triton.cdiv(n, sum_block_n))](
            part, b, r2, y, m, n, r2.stride(0), y.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, GELU=gelu, HAS_RESIDUAL=residual is not None,
            BLOCK_M=sum_block_m, BLOCK_N=sum_block_n,
        )
    return y.view(*lead, n)


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::fp32_linear", mutates_args=())
def fp32_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gelu: bool,
                   presplit: bool = False, residual: Optional[torch.Tensor] = None,
                   weight_lo: Optional[torch.Tensor] = None) -> torch.Tensor:
    return fp32_linear_triton(x, weight, bias, gelu, precision="tf32x3w" if presplit else "tf32x3",
                              residual=residual, weight_lo=weight_lo)


@fp32_linear_op.register_fake
def _(x, weight, bias, gelu, presplit=False, residual=None, weight_lo=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool = False,
                presplit: bool = False, residual: torch.Tensor | None = None,
                weight_lo: torch.Tensor | None = None) -> torch.Tensor:
    """fp32-accurate x @ weight^T + bias (then exact GELU if `gelu`, then + `residual`): the 3xTF32 kernel
    on CUDA or under TRITON_INTERPRET=1 (`presplit`: the variant with the weight split beforehand), else the
    torch reference. `weight_lo` (with `presplit`): `weight` is w_hi and this w_lo, split_tf32 of the real
    weight done once by the caller, so no split runs per call; Triton only, since the torch reference
    needs the unsplit weight (the caller keeps it for that path: codec.linear's `split`)."""
    if use_triton(x):
        return fp32_linear_op(x, weight, bias, gelu, presplit, residual, weight_lo)
    if weight_lo is not None:
        raise ValueError("a pre-split weight (weight_lo) runs only in the Triton kernel (CUDA or TRITON_INTERPRET=1); "
                         "off Triton pass the unsplit weight")
    return fp32_linear_reference(x, weight, bias, gelu, residual)
