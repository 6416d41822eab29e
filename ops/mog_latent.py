"""The MoG head's latent draw after the component choice (spec 4.6), one kernel per pass:

    mu_low = W_mus[k] x            (W_mus = proj_mus.weight viewed [P, R, H]: the component's R x H block)
    mu     = low_mat[k] mu_low     ([L, R] x [R])
    std    = exp(max(proj_logs(x), min_log_std))
    z      = (mu std + mu_else) + (std normal) noise_scale      (mu_else = proj_else(x), given)

for one row per call (x is the CFG-guided trunk output, k the drawn component). Why a kernel: in torch this is
two gathers of the component's blocks, two batched GEMMs, a GEMV, the clamp, exp, and five elementwise ops
with their roundings: 11 launches per pass, 55 per frame step (scripts/dev/census_step.py), each a few
microseconds on a dependent chain. Here a program reads the component's W_mus block ([R, H]: 147 KB in bf16
at full size) and a BLOCK_L-row slice of its low_mat block, and writes BLOCK_L entries of z.

Roundings: every intermediate the torch statement rounds to x's dtype is rounded here too (mu_low, mu,
proj_logs, std, each elementwise product and sum), in the same order, so in bf16 the kernel differs from the
statement only by the dot products' summation order (and the exp's last bit). z is returned in fp32 (its
values are x's dtype's): the residual quantisation that follows works in fp32, which saves that cast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import use_triton
from ops.rmsnorm import round_to

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def mog_latent_reference(x: torch.Tensor, component: torch.Tensor, w_mus: torch.Tensor, low_mat: torch.Tensor,
                         w_logs: torch.Tensor, mu_else: torch.Tensor, normal: torch.Tensor, min_log_std: float,
                         noise_scale: float) -> torch.Tensor:
    """x [B, H], component [B] int64, w_mus [P * R, H], low_mat [P, L, R], w_logs [1, H], mu_else [B, L],
    normal [B, L] (all but component in x's dtype) -> z [B, L] fp32 (x's dtype's values)."""
    num_predictions, latent, rank = low_mat.shape
    w = w_mus.view(num_predictions, rank, -1)[component]  # [B, R, H]
    mu_low = torch.einsum("brh,bh->br", w, x)
    mu = torch.einsum("blr,br->bl", low_mat[component], mu_low)
    std = torch.exp(F.linear(x, w_logs).clamp_min(min_log_std))
    mean = mu * std + mu_else
    return (mean + std * normal * noise_scale).float()


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _mog_latent_kernel(x_ptr, comp_ptr, wmus_ptr, low_ptr, wlogs_ptr, else_ptr, normal_ptr, z_ptr,
                       H, R, L, stride_x, stride_else, stride_normal, stride_z, min_log_std, noise_scale,
                       BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
                       DTYPE: tl.constexpr, BF16: tl.constexpr):
    """Program (row, latent block): mu_low and std for the row (every latent block of the row recomputes
    them: R x H multiply-adds, from L2 after the first), then BLOCK_L entries of z."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(comp_ptr + row).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < R
    hs = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    logs_acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    w_rows = wmus_ptr + (k * R + rs)[:, None] * H
    for h0 in range(0, H, BLOCK_H):
        h_mask = (h0 + hs) < H
        x = tl.load(x_ptr + row * stride_x + h0 + hs, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + h0 + hs[None, :], mask=r_mask[:, None] & h_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        logs_acc += tl.load(wlogs_ptr + h0 + hs, mask=h_mask, other=0.0).to(tl.float32) * x
    mu_low = round_to(acc, DTYPE, BF16)
    logs = tl.maximum(round_to(tl.sum(logs_acc, axis=0), DTYPE, BF16), min_log_std)
    std = round_to(tl.exp(logs), DTYPE, BF16)
    ls = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_mask = ls < L
    low = tl.load(low_ptr + (k * L + ls)[:, None] * R + rs[None, :], mask=l_mask[:, None] & r_mask[None, :],
                  other=0.0).to(tl.float32)
    mu = round_to(tl.sum(low * mu_low[None, :], axis=1), DTYPE, BF16)
    mu_else = tl.load(else_ptr + row * stride_else + ls, mask=l_mask, other=0.0).to(tl.float32)
    normal = tl.load(normal_ptr + row * stride_normal + ls, mask=l_mask, other=0.0).to(tl.float32)
    mean = round_to(round_to(mu * std, DTYPE, BF16) + mu_else, DTYPE, BF16)
    spread = round_to(round_to(std * normal, DTYPE, BF16) * noise_scale, DTYPE, BF16)
    tl.store(z_ptr + row * stride_z + ls, round_to(mean + spread, DTYPE, BF16), mask=l_mask)


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float64: tl.float64}


def mog_latent_triton(x: torch.Tensor, component: torch.Tensor, w_mus: torch.Tensor, low_mat: torch.Tensor,
                      w_logs: torch.Tensor, mu_else: torch.Tensor, normal: torch.Tensor, min_log_std: float,
                      noise_scale: float) -> torch.Tensor:
    batch, hidden = x.shape
    num_predictions, latent, rank = low_mat.shape
    assert w_mus.shape == (num_predictions * rank, hidden) and w_logs.shape == (1, hidden)
    assert mu_else.shape == normal.shape == (batch, latent) and component.shape == (batch,)
    assert x.dtype == w_mus.dtype == low_mat.dtype == w_logs.dtype == mu_else.dtype == normal.dtype
    for t in (x, w_mus, low_mat, w_logs, mu_else, normal):
        assert t.stride(-1) == 1, "rows may be strided, entries contiguous"
    assert w_mus.is_contiguous() and low_mat.is_contiguous()
    z = torch.empty(batch, latent, device=x.device, dtype=torch.float32)
    if batch:
        block_l = min(128, triton.next_power_of_2(latent))
        _mog_latent_kernel[(batch, triton.cdiv(latent, block_l))](
            x, component, w_mus, low_mat, w_logs, mu_else, normal, z, hidden, rank, latent, x.stride(0),
            mu_else.stride(0), normal.stride(0), z.stride(0), float(min_log_std), float(noise_scale),
            BLOCK_H=128, BLOCK_R=triton.next_power_of_2(rank), BLOCK_L=block_l, DTYPE=TL_DTYPES[x.dtype],
            BF16=x.dtype == torch.bfloat16, num_warps=4,
        )
    return z


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::mog_latent", mutates_args=())
def mog_latent_op(x: torch.Tensor, component: torch.Tensor, w_mus: torch.Tensor, low_mat: torch.Tensor,
                  w_logs: torch.Tensor, mu_else: torch.Tensor, normal: torch.Tensor, min_log_std: float,
                  noise_scale: float) -> torch.Tensor:
    return mog_latent_triton(x, component, w_mus, low_mat, w_logs, mu_else, normal, min_log_std, noise_scale)


@mog_latent_op.register_fake
def _(x, component, w_mus, low_mat, w_logs, mu_else, normal, min_log_std, noise_scale):
    return x.new_empty(x.shape[0], low_mat.shape[1], dtype=torch.float32)


def mog_latent(x: torch.Tensor, component: torch.Tensor, w_mus: torch.Tensor, low_mat: torch.Tensor,
               w_logs: torch.Tensor, mu_else: torch.Tensor, normal: torch.Tensor, min_log_std: float,
               noise_scale: float) -> torch.Tensor:
    """z [B, L] fp32 (the values of x's dtype) of the drawn components: one kernel on CUDA or under
    TRITON_INTERPRET=1, else the torch statement."""
    if use_triton(x):
        return mog_latent_op(x, component, w_mus, low_mat, w_logs, mu_else, normal, float(min_log_std),
                             float(noise_scale))
    return mog_latent_reference(x, component, w_mus, low_mat, w_logs, mu_else, normal, min_log_std, noise_scale)
