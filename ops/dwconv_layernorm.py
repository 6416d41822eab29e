"""Causal depthwise convolution + LayerNorm in one kernel, channels-last, for the codec decoder's streaming
ConvNeXt blocks (spec 5.2, 5.4):

    padded = [history[slots[b]] | x[b]]                       (the block's last k-1 input frames, then new ones)
    h[b, l, c] = bias[c] + sum_j w[c, j] padded[b, l + j, c]  (Conv1d(C, C, k, groups=C) on the left-padded input)
    y[b, l, :] = layer_norm(h[b, l, :]) * norm_w + norm_b    (over channels, eps 1e-6, biased variance)

Why a kernel: in torch the step ran the cat of the history, cuDNN/ATen's depthwise convolution over a
[B, C, L] tensor, a transpose to [B, L, C], a contiguous copy for LayerNorm and the LayerNorm: ~5 kernels
and four round trips through memory per block, ~2.5 ms of a 52 ms step at N=128 (the conv alone 1.07 ms,
docs/performance.md profile). Here each program reads its BLOCK_L output frames' k input frames
straight from x or the history (no cat), and writes y channels-last, ready for the pointwise GEMMs.

The codec's fp16x3w GEMMs take y split (ops/fp16x3_linear.py); a variant of this kernel that wrote it split
ran slower on the H200 than this kernel and a separate split pass together (9 blocks:
202 vs 178 us at 32 calls, 722 vs 661 us at 128; docs/performance.md), so it is gone.

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
    x_ptr, hist_ptr, slots_ptr, w_ptr, b_ptr, nw_ptr, nb_ptr, y_ptr, L, eps,
    stride_xb, stride_xl, stride_hs, stride_hl, stride_yb, stride_yl,
    C: tl.constexpr, KSIZE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Program (row b, block of BLOCK_L output frames): all C channels of each frame, so the LayerNorm's
    reductions stay in the program."""
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
    tl.store(y_ptr + b * stride_yb + ls[:, None] * stride_yl + cs[None, :], y, mask=l_mask[:, None] & c_mask[None, :])


def dwconv_layer_norm_triton(x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor,
                             conv_weight: torch.Tensor, conv_bias: torch.Tensor, norm_weight: torch.Tensor,
                             norm_bias: torch.Tensor, eps: float) -> torch.Tensor:
    batch, length, channels = x.shape
    ksize = conv_weight.shape[-1]
    assert x.dtype == history.dtype == conv_weight.dtype == torch.float32
    assert history.shape[1:] == (ksize - 1, channels) and conv_weight.shape == (channels, 1, ksize)
    x = x if x.stride(-1) == 1 else x.contiguous()
    history = history if history.stride(-1) == 1 else history.contiguous()
    y = torch.empty(batch, length, channels, device=x.device, dtype=torch.float32)
    if batch == 0 or length == 0:
        return y
    block_c = triton.next_power_of_2(channels)
    # ~4096 fp32 values per tile: 32 per thread at 4 warps, for the accumulator and each loaded tap; the
    # interpreter (CPU tests) pays per program, so there one program takes a row's every frame
    block_l = max(1, min(triton.next_power_of_2(length), 4096 // block_c))
    if interpreting():
        block_l = triton.next_power_of_2(length)
    grid = (batch, triton.cdiv(length, block_l))
    _dwconv_layer_norm_kernel[grid](
        x, history, slots, conv_weight.reshape(channels, ksize).contiguous(), conv_bias.contiguous(),
        norm_weight.contiguous(), norm_bias.contiguous(), y, length, eps,
        x.stride(0), x.stride(1), history.stride(0), history.stride(1), y.stride(0), y.stride(1),
        C=channels, KSIZE=ksize, BLOCK_L=block_l, BLOCK_C=block_c, num_warps=4,
    )
    return y


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


def dwconv_layer_norm(x: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                      conv_bias: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """x [B, L, C] new frames, history [S, k-1, C] (row slots[b] precedes x[b]), conv_weight [C, 1, k],
    conv_bias / norm_weight / norm_bias [C] -> LayerNorm(causal depthwise conv) [B, L, C], fp32."""
    if use_triton(x):
        return dwconv_layer_norm_op(x, history, slots, conv_weight, conv_bias, norm_weight, norm_bias, float(eps))
    return dwconv_layer_norm_reference(x, history, slots, conv_weight, conv_bias, norm_weight, norm_bias, eps)
