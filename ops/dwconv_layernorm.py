"""Causal depthwise convolution + LayerNorm in one kernel, channels-last, for the codec decoder's streaming
ConvNeXt blocks (spec 5.2, 5.4):

    padded = [history[slots[b]] | x[b]]                       (the block's last k-1 input frames, then new ones)
    h[b, l, c] = bias[c] + sum_j w[c, j] padded[b, l + j, c]  (Conv1d(C, C, k, groups=C) on the left-padded input)
    y[b, l, :] = layer_norm(h[b, l, :]) * norm_w + norm_b    (over channels, eps 1e-6, biased variance)

Why a kernel: in torch the step ran the cat of the history, cuDNN/ATen's depthwise convolution over a
[B, C, L] tensor, a transpose to [B, L, C], a contiguous copy for LayerNorm and the LayerNorm: ~5 kernels
and four round trips through memory per block, ~2.5 ms of a 52 ms step at N=128 (the conv alone 1.07 ms,
docs/performance.md, session 5 profile). Here each program reads its BLOCK_L output frames' k input frames
straight from x or the history (no cat), and writes y channels-last, ready for the pointwise GEMMs.

With `split` (the codec's fp16x3w GEMMs, ops/fp16x3_linear.py) y is written as the next GEMM reads it:
fp16 halves and a power-of-two scale per 64 channels, the same bits as split_fp16_rows of this y, without
the pass over y that splitting it would take. (On the GPU this variant's layouts differ, so its reductions
run in another order and its y may differ from the fp32 variant's in the last bit: measured, session 11.)

Layout: x [B, L, C], history [S, k-1, C], y [B, L, C], all channels-contiguous fp32. The history is only
read; the caller moves it on afterwards (so no program reads a row another one has already overwritten).
Sums in fp32 in the order j = 0..k-1 (cuDNN's order is its own: the test states the tolerance).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import interpreting, use_triton
from ops.fp16x3_linear import SCALE_BLOCK, Fp16Split, split_fp16_rows_reference, split_tile


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def dwconv_layer_norm_reference(x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor,
                                conv_weight: torch.Tensor, conv_bias: torch.Tensor, norm_weight: torch.Tensor,
                                norm_bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, L, C], history [S, k-1, C], conv_weight [C, 1, k] (nn.Conv1d's depthwise layout) -> [B, L, C]."""
    channels = x.shape[-1]
    padded = torch.cat([history.index_select(0, slots), x], dim=1)  # [B, k-1+L, C]
    h = F.conv1d(padded.transpose(1, 2), conv_weight, conv_bias, groups=channels).transpose(1, 2)
    return F.layer_norm(h, (channels,), norm_weight, norm_bias, eps)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _dwconv_layer_norm_kernel(
    x_ptr, hist_ptr, slots_ptr, w_ptr, b_ptr, nw_ptr, nb_ptr, y_ptr, yh_ptr, yl_ptr, yinv_ptr, L, eps,
    stride_xb, stride_xl, stride_hs, stride_hl, stride_yb, stride_yl,
    C: tl.constexpr, KSIZE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT: tl.constexpr,
    SCALE: tl.constexpr,
):
    """Program (row b, block of BLOCK_L output frames): all C channels of each frame, so the LayerNorm's
    reductions stay in the program. SPLIT: y to yh / yl [B L, C] fp16 and yinv [B L, ceil(C / SCALE)]
    (BLOCK_C a multiple of SCALE; padding channels are 0, so they change no scale)."""
    b = tl.program_id(0).to(tl.int64)
    ls = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    cs = tl.arange(0, BLOCK_C)
    l_mask = ls < L
    c_mask = cs < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    x_row = x_ptr + b * stride_xb
    h_row = hist_ptr + slot * stride_hs
    HIST: tl.constexpr = KSIZE - 1
    acc = tl.zeros([BLOCK_L, BLOCK_C], dtype=tl.float32)
    acc += tl.load(b_ptr + cs, mask=c_mask, other=0.0)[None, :]
    for j in tl.static_range(KSIZE):
        p = ls + (j - HIST)  # input frame of tap j, relative to x; p < 0 is history frame p + HIST
        w_j = tl.load(w_ptr + cs * KSIZE + j, mask=c_mask, other=0.0)
        from_x = (l_mask & (p >= 0))[:, None] & c_mask[None, :]
        from_h = (l_mask & (p < 0))[:, None] & c_mask[None, :]
        v = tl.load(x_row + p[:, None] * stride_xl + cs[None, :], mask=from_x, other=0.0)
        v += tl.load(h_row + (p + HIST)[:, None] * stride_hl + cs[None, :], mask=from_h, other=0.0)
        acc += v * w_j[None, :]
    mean = tl.sum(acc, axis=1) / C  # padding channels hold 0
    centred = tl.where(c_mask[None, :], acc - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(centred * centred, axis=1) / C + eps)
    nw = tl.load(nw_ptr + cs, mask=c_mask, other=0.0)
    nb = tl.load(nb_ptr + cs, mask=c_mask, other=0.0)
    y = centred * rstd[:, None] * nw[None, :] + nb[None, :]
    mask = l_mask[:, None] & c_mask[None, :]
    if SPLIT:
        hi, lo, inv = split_tile(y, BLOCK_L, BLOCK_C, SCALE)
        rows = b * L + ls  # row of the [B L, C] split
        tl.store(yh_ptr + rows[:, None] * C + cs[None, :], hi, mask=mask)
        tl.store(yl_ptr + rows[:, None] * C + cs[None, :], lo, mask=mask)
        n_blocks: tl.constexpr = (C + SCALE - 1) // SCALE
        block_ids = tl.arange(0, BLOCK_C // SCALE)
        tl.store(yinv_ptr + rows[:, None] * n_blocks + block_ids[None, :], inv,
                 mask=l_mask[:, None] & (block_ids < n_blocks)[None, :])
    else:
        tl.store(y_ptr + b * stride_yb + ls[:, None] * stride_yl + cs[None, :], y, mask=mask)


def dwconv_layer_norm_triton(x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor,
                             conv_weight: torch.Tensor, conv_bias: torch.Tensor, norm_weight: torch.Tensor,
                             norm_bias: torch.Tensor, eps: float, split: bool = False) -> torch.Tensor | Fp16Split:
    batch, length, channels = x.shape
    ksize = conv_weight.shape[-1]
    assert x.dtype == history.dtype == conv_weight.dtype == torch.float32
    assert history.shape[1:] == (ksize - 1, channels) and conv_weight.shape == (channels, 1, ksize)
    x = x if x.stride(-1) == 1 else x.contiguous()
    history = history if history.stride(-1) == 1 else history.contiguous()
    if split:
        rows = batch * length
        y = torch.empty(0, device=x.device)  # unwritten
        out = Fp16Split(torch.empty(rows, channels, device=x.device, dtype=torch.float16),
                        torch.empty(rows, channels, device=x.device, dtype=torch.float16),
                        torch.empty(rows, triton.cdiv(channels, SCALE_BLOCK), device=x.device, dtype=torch.float32))
    else:
        y = torch.empty(batch, length, channels, device=x.device, dtype=torch.float32)
        out = Fp16Split(y, y, y)  # unwritten
    if batch == 0 or length == 0:
        return out if split else y
    block_c = triton.next_power_of_2(channels)
    if split:
        block_c = max(block_c, SCALE_BLOCK)
    # ~4096 fp32 values per tile: 32 per thread at 4 warps, for the accumulator and each loaded tap; the
    # interpreter (CPU tests) pays per program, so there one program takes a row's every frame
    block_l = max(1, min(triton.next_power_of_2(length), 4096 // block_c))
    if interpreting():
        block_l = triton.next_power_of_2(length)
    grid = (batch, triton.cdiv(length, block_l))
    _dwconv_layer_norm_kernel[grid](
        x, history, slots, conv_weight.reshape(channels, ksize).contiguous(), conv_bias.contiguous(),
        norm_weight.contiguous(), norm_bias.contiguous(), y, out.hi, out.lo, out.inv, length, eps,
        x.stride(0), x.stride(1), history.stride(0), history.stride(1), y.stride(0) if not split else 0,
        y.stride(1) if not split else 0,
        C=channels, KSIZE=ksize, BLOCK_L=block_l, BLOCK_C=block_c, SPLIT=split, SCALE=SCALE_BLOCK, num_warps=4,
    )
    return out if split else y


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::dwconv_layer_norm", mutates_args=())
def dwconv_layer_norm_op(x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                         conv_bias: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
                         eps: float) -> torch.Tensor:
    return dwconv_layer_norm_triton(x, history, slots, conv_weight, conv_bias, norm_weight, norm_bias, eps)


@dwconv_layer_norm_op.register_fake
def _(x, history, slots, conv_weight, conv_bias, norm_weight, norm_bias, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("nemo_duplex::dwconv_layer_norm_split", mutates_args=())
def dwconv_layer_norm_split_op(x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                               conv_bias: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(dwconv_layer_norm_triton(x, history, slots, conv_weight, conv_bias, norm_weight, norm_bias, eps,
                                          split=True))


@dwconv_layer_norm_split_op.register_fake
def _(x, history, slots, conv_weight, conv_bias, norm_weight, norm_bias, eps):
    rows, channels = x.shape[0] * x.shape[1], x.shape[2]
    return (x.new_empty(rows, channels, dtype=torch.float16), x.new_empty(rows, channels, dtype=torch.float16),
            x.new_empty(rows, triton.cdiv(channels, SCALE_BLOCK)))


def dwconv_layer_norm(x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                      conv_bias: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
                      eps: float, split: bool = False) -> torch.Tensor | Fp16Split:
    """x [B, L, C] new frames, history [S, k-1, C] (row slots[b] precedes x[b]), conv_weight [C, 1, k],
    conv_bias / norm_weight / norm_bias [C] -> LayerNorm(causal depthwise conv) [B, L, C], fp32; with
    `split`, its fp16x3 split with rows flattened (ops/fp16x3_linear.py: [B L, C] halves, [B L, C / 64]
    scales), as split_fp16_rows gives it (of this kernel's y, which on the GPU may differ from the fp32
    variant's in the last bit)."""
    if use_triton(x):
        if split:
            return Fp16Split(*dwconv_layer_norm_split_op(x, history, slots, conv_weight, conv_bias, norm_weight,
                                                         norm_bias, float(eps)))
        return dwconv_layer_norm_op(x, history, slots, conv_weight, conv_bias, norm_weight, norm_bias, float(eps))
    y = dwconv_layer_norm_reference(x, history, slots, conv_weight, conv_bias, norm_weight, norm_bias, eps)
    return split_fp16_rows_reference(y.reshape(-1, y.shape[-1])) if split else y
