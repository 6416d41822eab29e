"""Mamba-2 single-token update for a batch of rows, reading and writing pool slots in place (spec 3.3).

Per row b (slot s = slots[b]), per Mamba layer:
  1. conv: window = [conv_state[s] (K-1 raw xBC columns) | xBC_b]; out = SiLU(sum_k w[:, k] window[:, k] + bias);
     conv_state[s] <- window[:, 1:]
  2. split out -> x [heads, head_dim] | B [groups, d_state] | C [groups, d_state]; head h uses group
     h // (heads / groups) (repeat_interleave, the mamba_ssm kernel semantics; never h % groups)
  3. dt = softplus(dt_raw + dt_bias) (fp32, no clamp: time_step_limit is (0, inf), spec 3.1 / 12.6)
     S <- exp(dt A) S + dt x (outer) B;  y = S C + D x,  A = -exp(A_log); state in its pool dtype
     (fp32 by default), all arithmetic in fp32.
The gated RMSNorm and out_proj stay in torch (llm.py). Two kernels: the depthwise conv over channel
blocks, then the SSM update over (row, block of heads x head_dim channels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import use_triton

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def mamba_step_reference(xBC: torch.Tensor, dt_raw: torch.Tensor, conv_state: torch.Tensor,
                         ssm_state: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                         conv_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                         n_groups: int) -> torch.Tensor:
    """Gather the rows' states, update them in fp32, scatter back. Returns y [B, heads * head_dim] fp32."""
    batch, conv_dim = xBC.shape
    num_heads, head_dim, d_state = ssm_state.shape[1:]
    d_inner = num_heads * head_dim

    window = torch.cat([conv_state[slots].float(), xBC.float()[:, :, None]], dim=-1)  # [B, C, K]
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    weight = conv_weight.float().reshape(conv_dim, -1)
    xBC_act = F.silu((window * weight[None]).sum(-1) + conv_bias.float())
    # Activations are stored in the compute dtype between the conv and the scan (as the unfused model does).
    xBC_act = xBC_act.to(xBC.dtype).float()

    x = xBC_act[:, :d_inner].reshape(batch, num_heads, head_dim)
    B = xBC_act[:, d_inner:d_inner + n_groups * d_state].reshape(batch, n_groups, d_state)
    C = xBC_act[:, d_inner + n_groups * d_state:].reshape(batch, n_groups, d_state)
    B = B.repeat_interleave(num_heads // n_groups, dim=1)  # [B, heads, N]: head h -> group h // (heads/groups)
    C = C.repeat_interleave(num_heads // n_groups, dim=1)

    dt = F.softplus(dt_raw.float() + dt_bias.float())  # [B, heads]
    A = -torch.exp(A_log.float())
    decay = torch.exp(dt * A)[:, :, None, None]
    state = ssm_state[slots].float() * decay + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
    ssm_state[slots] = state.to(ssm_state.dtype)
    y = (state * C[:, :, None, :]).sum(-1) + D.float()[None, :, None] * x
    return y.reshape(batch, d_inner)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _row_block(slots_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block) over a row's WIDTH channels: the row, its slot, the block's BLOCK channel
    offsets and their mask."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return row, slot, offs, offs < WIDTH


@triton.jit
def _conv_step_kernel(
    xbc_ptr, state_ptr, weight_ptr, bias_ptr, slots_ptr, out_ptr,
    stride_xb, stride_ss, stride_sc, stride_ob,
    CONV_DIM: tl.constexpr, KERNEL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row, slot, offs_c, c_mask = _row_block(slots_ptr, CONV_DIM, BLOCK_C)
    offs_k = tl.arange(0, BLOCK_K)
    hist = offs_k < KERNEL - 1  # window columns 0..K-2 come from the state, column K-1 is the new input

    state_row = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    old = tl.load(state_row + offs_k[None, :], mask=c_mask[:, None] & hist[None, :], other=0.0).to(tl.float32)
    x_new = tl.load(xbc_ptr + row * stride_xb + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    window = tl.where(offs_k[None, :] == KERNEL - 1, x_new[:, None], old)

    w = tl.load(weight_ptr + offs_c[:, None] * KERNEL + offs_k[None, :],
                mask=c_mask[:, None] & (offs_k[None, :] < KERNEL), other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    acc = tl.sum(window * w, axis=1) + bias
    act = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(out_ptr + row * stride_ob + offs_c, act.to(out_ptr.dtype.element_ty), mask=c_mask)

    # new state column k = old window column k + 1 (shift left by one, the new input enters last)
    shifted = tl.load(state_row + offs_k[None, :] + 1, mask=c_mask[:, None] & (offs_k[None, :] < KERNEL - 2),
                      other=0.0).to(tl.float32)
    new_state = tl.where(offs_k[None, :] == KERNEL - 2, x_new[:, None], shifted)
    tl.store(state_row + offs_k[None, :], new_state.to(state_ptr.dtype.element_ty),
             mask=c_mask[:, None] & hist[None, :])


@triton.jit
def _ssm_step_kernel(
    xbc_ptr, dt_ptr, state_ptr, slots_ptr, A_log_ptr, D_ptr, dt_bias_ptr, y_ptr,
    stride_xb, stride_db, stride_ss, stride_sh, stride_sp, stride_yb,
    HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr, D_INNER: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    B_OFFSET: tl.constexpr, C_OFFSET: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Program (row, block): BLOCK_R consecutive channels r = head * HEAD_DIM + p of one row, each with its
    # d_state-long state line. At full size (head_dim 80, BLOCK_R 16) a block sits inside one head.
    row, slot, offs_r, r_mask = _row_block(slots_ptr, D_INNER, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < D_STATE
    rn_mask = r_mask[:, None] & n_mask[None, :]
    head = offs_r // HEAD_DIM
    p = offs_r % HEAD_DIM
    group = head // HEADS_PER_GROUP  # repeat_interleave semantics (spec 3.3, pitfall 11)

    xbc_row = xbc_ptr + row * stride_xb
    x = tl.load(xbc_row + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    B = tl.load(xbc_row + B_OFFSET + group[:, None] * D_STATE + offs_n[None, :], mask=rn_mask, other=0.0)
    C = tl.load(xbc_row + C_OFFSET + group[:, None] * D_STATE + offs_n[None, :], mask=rn_mask, other=0.0)

    dt = tl.load(dt_ptr + row * stride_db + head, mask=r_mask, other=0.0).to(tl.float32)
    dt += tl.load(dt_bias_ptr + head, mask=r_mask, other=0.0).to(tl.float32)
    # softplus with torch's threshold 20, log1p(u) written as log(w) * u / (w - 1) (exact for small u)
    u = tl.exp(tl.minimum(dt, 20.0))
    w = 1.0 + u
    dt = tl.where(dt > 20.0, dt, tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0)))  # no clamp
    A = -tl.exp(tl.load(A_log_ptr + head, mask=r_mask, other=0.0).to(tl.float32))
    decay = tl.exp(dt * A)
    D = tl.load(D_ptr + head, mask=r_mask, other=0.0).to(tl.float32)

    s_ptrs = (state_ptr + slot * stride_ss + head[:, None].to(tl.int64) * stride_sh
              + p[:, None] * stride_sp + offs_n[None, :])
    state = tl.load(s_ptrs, mask=rn_mask, other=0.0).to(tl.float32)
    state = state * decay[:, None] + (dt * x)[:, None] * B.to(tl.float32)
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=rn_mask)
    y = tl.sum(state * C.to(tl.float32), axis=1) + D * x
    tl.store(y_ptr + row * stride_yb + offs_r, y, mask=r_mask)


def mamba_step_triton(xBC: torch.Tensor, dt_raw: torch.Tensor, conv_state: torch.Tensor,
                      ssm_state: torch.Tensor, slots: torch.Tensor, conv_weight: torch.Tensor,
                      conv_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                      n_groups: int, block_r: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    batch, conv_dim = xBC.shape
    num_slots, num_heads, head_dim, d_state = ssm_state.shape
    kernel = conv_weight.shape[-1]
    d_inner = num_heads * head_dim
    assert conv_state.shape == (num_slots, conv_dim, kernel - 1) and conv_state.stride(-1) == 1
    assert ssm_state.stride(-1) == 1 and xBC.stride(-1) == 1 and dt_raw.stride(-1) == 1
    assert conv_dim == d_inner + 2 * n_groups * d_state and num_heads % n_groups == 0
    conv_weight = conv_weight.reshape(conv_dim, kernel).contiguous()

    xBC_act = torch.empty(batch, conv_dim, device=xBC.device, dtype=xBC.dtype)
    block_c = 256
    _conv_step_kernel[(batch, triton.cdiv(conv_dim, block_c))](
        xBC, conv_state, conv_weight, conv_bias, slots, xBC_act,
        xBC.stride(0), conv_state.stride(0), conv_state.stride(1), xBC_act.stride(0),
        CONV_DIM=conv_dim, KERNEL=kernel, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(kernel),
    )

    y = torch.empty(batch, d_inner, device=xBC.device, dtype=torch.float32)
    # 8 channels x d_state 128 per program and 2 warps on the GPU (H200, 128 calls: 3.83 TB/s against 3.59
    # for 16 x 4 warps; docs/performance.md); the interpreter pays per program: bigger blocks there
    if block_r is None:
        block_r = 8 if xBC.is_cuda else min(128, triton.next_power_of_2(d_inner))
    if num_warps is None and xBC.is_cuda:
        num_warps = 2
    _ssm_step_kernel[(batch, triton.cdiv(d_inner, block_r))](
        xBC_act, dt_raw, ssm_state, slots, A_log, D, dt_bias, y,
        xBC_act.stride(0), dt_raw.stride(0), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        y.stride(0),
        HEAD_DIM=head_dim, D_STATE=d_state, D_INNER=d_inner, HEADS_PER_GROUP=num_heads // n_groups,
        B_OFFSET=d_inner, C_OFFSET=d_inner + n_groups * d_state,
        BLOCK_R=block_r, BLOCK_N=triton.next_power_of_2(d_state),
        **({} if num_warps is None else {"num_warps": num_warps}),
    )
    return y


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py); it writes the two state pools in place, which
# the schema declares so that a compiled step orders it correctly (whether Inductor then updates the pools
# in place or through a copy is not checked yet; tests/ops/test_custom_ops.py checks the values).
@torch.library.custom_op("nemo_duplex::mamba_step", mutates_args=("conv_state", "ssm_state"))
def mamba_step_op(xBC: torch.Tensor, dt_raw: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                  slots: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, A_log: torch.Tensor,
                  D: torch.Tensor, dt_bias: torch.Tensor, n_groups: int) -> torch.Tensor:
    return mamba_step_triton(xBC, dt_raw, conv_state, ssm_state, slots, conv_weight, conv_bias, A_log, D,
                             dt_bias, n_groups)


@mamba_step_op.register_fake
def _(xBC, dt_raw, conv_state, ssm_state, slots, conv_weight, conv_bias, A_log, D, dt_bias, n_groups):
    num_heads, head_dim = ssm_state.shape[1], ssm_state.shape[2]
    return xBC.new_empty(xBC.shape[0], num_heads * head_dim, dtype=torch.float32)


def mamba_step(xBC: torch.Tensor, dt_raw: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
               slots: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor, A_log: torch.Tensor,
               D: torch.Tensor, dt_bias: torch.Tensor, n_groups: int) -> torch.Tensor:
    """One token for each of B rows.

    xBC [B, conv_dim] raw (pre-conv) in_proj slice, dt_raw [B, heads] in_proj slice (row-strided views are
    fine), conv_state [S, conv_dim, K-1] and ssm_state [S, heads, head_dim, d_state] pools (updated in
    place at rows `slots`), conv_weight [conv_dim, 1, K] or [conv_dim, K], conv_bias [conv_dim],
    A_log / D / dt_bias [heads]. Returns y = S C + D x as [B, heads * head_dim] fp32 (before the gated norm).
    Rows sharing a slot (padding rows on the sink) race; only the sink may be shared.
    """
    if use_triton(xBC):
        return mamba_step_op(xBC, dt_raw, conv_state, ssm_state, slots, conv_weight, conv_bias,
                                 A_log, D, dt_bias, n_groups)
    return mamba_step_reference(xBC, dt_raw, conv_state, ssm_state, slots, conv_weight, conv_bias,
                                A_log, D, dt_bias, n_groups)
