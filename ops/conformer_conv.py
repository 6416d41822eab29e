"""The streaming FastConformer's convolution module between its two pointwise GEMMs, one frame per row
(spec 2.5), in one kernel:

    glu    = h[:, :d] * sigmoid(h[:, d:])                 h = pointwise_conv1(x) [B, 2d]
    window = [cache[slot] (k-1 past GLU outputs, oldest first) | glu]        [B, d, k]
    cache[slot] <- window[:, :, 1:]                        (in place)
    out    = silu(layer_norm(depthwise_k(window)))         [B, d]   (then pointwise_conv2, a GEMM, in torch)

with the roundings of the torch ops it replaces (ConformerConvolution.step before): the GLU output, the
conv output, the LayerNorm output and the SiLU output are each rounded once to the compute dtype (bf16 by
rmsnorm's `round_to`), everything between in fp32.
Why a kernel: in torch this is 7 launches per layer (glu, gather, cat, index_copy_, depthwise conv,
layer_norm, silu), 168 of the encoder's 828 per frame step at 24 layers (scripts/dev/census_step.py).
Races: one program per row, and it touches only its own slot's cache row. Real rows have distinct slots;
padding rows may all share the sink slot, whose contents are garbage anyway (their outputs are discarded).
Within a program every thread reads its window (both the taps and the shifted copy it writes back) before
a barrier, and only then writes the slot's cache, so the write never overtakes a read of the same row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import use_triton
from ops.layernorm import layer_norm_row
from ops.rmsnorm import round_to

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def conformer_conv_step_reference(h: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                                  conv_weight: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
                                  eps: float) -> torch.Tensor:
    """The torch statement (the encoder's CPU path and the kernel's reference): the ops of the streaming
    step before the kernel, unchanged. Rows sharing a slot (the sink) race in index_copy_ too."""
    glu = F.glu(h, dim=-1)  # [B, d]
    window = torch.cat([cache[slots], glu[:, :, None]], dim=2)
    cache.index_copy_(0, slots, window[:, :, 1:])
    conv = F.conv1d(window, conv_weight, groups=window.shape[1])[:, :, 0]
    return F.silu(F.layer_norm(conv, (conv.shape[-1],), norm_weight, norm_bias, eps))


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _conformer_conv_kernel(
    h_ptr, cache_ptr, slots_ptr, dw_ptr, w_ptr, b_ptr, out_ptr,
    stride_h, stride_cs, stride_cc, stride_o, eps,
    D: tl.constexpr, KERNEL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BF16: tl.constexpr,
):
    """Program = one row: all D channels (BLOCK_D, masked) x the K-1 cached taps (BLOCK_H, masked)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    taps = tl.arange(0, BLOCK_H)
    c_mask = offs < D
    hist_mask = c_mask[:, None] & (taps < KERNEL - 1)[None, :]
    dtype = out_ptr.dtype.element_ty

    # GLU of the new frame (F.glu: a * sigmoid(b) in fp32, rounded once)
    a = tl.load(h_ptr + row * stride_h + offs, mask=c_mask, other=0.0).to(tl.float32)
    gate = tl.load(h_ptr + row * stride_h + D + offs, mask=c_mask, other=0.0).to(tl.float32)
    glu = round_to(a * tl.sigmoid(gate), dtype, BF16)

    # Window = [cache taps 0..K-2 | glu]; the slot's cache row is [D, K-1] with unit tap stride.
    cache_row = cache_ptr + slot * stride_cs + offs[:, None] * stride_cc + taps[None, :]
    hist = tl.load(cache_row, mask=hist_mask, other=0.0).to(tl.float32)
    # the new cache, read now as well: tap j <- window tap j + 1 (the oldest drops out, glu enters last)
    shifted = tl.load(cache_row + 1, mask=c_mask[:, None] & (taps < KERNEL - 2)[None, :], other=0.0)
    new_cache = tl.where((taps == KERNEL - 2)[None, :], glu[:, None].to(shifted.dtype), shifted)

    w_hist = tl.load(dw_ptr + offs[:, None] * KERNEL + taps[None, :], mask=hist_mask, other=0.0).to(tl.float32)
    w_new = tl.load(dw_ptr + offs * KERNEL + (KERNEL - 1), mask=c_mask, other=0.0).to(tl.float32)
    conv = round_to(tl.sum(hist * w_hist, axis=1) + glu * w_new, dtype, BF16)  # conv1d's output

    # Every thread has read the slot's cache row (hist and shifted) before any thread overwrites it.
    tl.debug_barrier()
    tl.store(cache_row, new_cache.to(cache_ptr.dtype.element_ty), mask=hist_mask)

    y = layer_norm_row(tl.where(c_mask, conv, 0.0), c_mask, w_ptr, b_ptr, offs, eps, D, dtype, BF16)
    out = round_to(y * tl.sigmoid(y), dtype, BF16)  # SiLU
    tl.store(out_ptr + row * stride_o + offs, out.to(dtype), mask=c_mask)


def conformer_conv_step_triton(h: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                               conv_weight: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
                               eps: float) -> torch.Tensor:
    batch, two_d = h.shape
    d = two_d // 2
    kernel = conv_weight.shape[-1]
    assert two_d == 2 * d and kernel >= 2 and conv_weight.numel() == d * kernel
    assert cache.shape[1:] == (d, kernel - 1) and cache.stride(-1) == 1 and cache.dtype == h.dtype
    assert h.stride(-1) == 1 and norm_weight.shape == norm_bias.shape == (d,)
    conv_weight = conv_weight.reshape(d, kernel).contiguous()
    out = torch.empty(batch, d, device=h.device, dtype=h.dtype)
    if batch:
        block_d = triton.next_power_of_2(d)
        block_h = triton.next_power_of_2(kernel - 1)
        _conformer_conv_kernel[(batch,)](
            h, cache, slots, conv_weight, norm_weight, norm_bias, out,
            h.stride(0), cache.stride(0), cache.stride(1), out.stride(0), float(eps),
            D=d, KERNEL=kernel, BLOCK_D=block_d, BLOCK_H=block_h, BF16=h.dtype == torch.bfloat16,
            num_warps=max(1, min(8, block_d * block_h // 1024)),
        )
    return out


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py); the schema declares the in-place cache update.
@torch.library.custom_op("nemo_duplex::conformer_conv_step", mutates_args=("cache",))
def conformer_conv_step_op(h: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                           norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float) -> torch.Tensor:
    return conformer_conv_step_triton(h, cache, slots, conv_weight, norm_weight, norm_bias, eps)


@conformer_conv_step_op.register_fake
def _(h, cache, slots, conv_weight, norm_weight, norm_bias, eps):
    return h.new_empty(h.shape[0], h.shape[1] // 2)


def conformer_conv_step(h: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                        norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float) -> torch.Tensor:
    """h [B, 2d] pointwise_conv1 output, cache [S, d, k-1] (rows `slots` updated in place), slots [B] int64
    (distinct but for padding rows on the sink), conv_weight [d, 1, k] depthwise (no bias), norm_weight /
    norm_bias [d] -> silu(layer_norm(depthwise(window))) [B, d] in h's dtype. The kernel on CUDA or under
    TRITON_INTERPRET=1, else the torch reference."""
    if use_triton(h):
        return conformer_conv_step_op(h, cache, slots, conv_weight, norm_weight, norm_bias, float(eps))
    return conformer_conv_step_reference(h, cache, slots, conv_weight, norm_weight, norm_bias, eps)
