"""Mamba-2 single-token update: Triton kernels (TRITON_INTERPRET=1 on CPU) vs the torch reference,
the reference vs a literal per-head loop, and full-shape GPU tests."""
import math

import pytest
import torch
import torch.nn.functional as F

from ops.mamba_step import mamba_step, mamba_step_reference, mamba_step_triton
from tests.ops.support import DEVICE

# the kernels run on the GPU where there is one, else under TRITON_INTERPRET=1 (tests/conftest.py)


def _make(batch, num_slots, heads, head_dim, d_state, groups, kernel, dtype, state_dtype, device, gen):
    conv_dim = heads * head_dim + 2 * groups * d_state
    proj = torch.randn(batch, conv_dim + heads + 7, generator=gen)  # a wider in_proj output: row-strided views
    xBC = proj[:, 3:3 + conv_dim].to(device, dtype)
    dt_raw = (0.5 * proj[:, 3 + conv_dim:3 + conv_dim + heads]).to(device, dtype)
    params = dict(
        conv_weight=(torch.randn(conv_dim, 1, kernel, generator=gen) / math.sqrt(kernel)).to(device, dtype),
        conv_bias=(0.1 * torch.randn(conv_dim, generator=gen)).to(device, dtype),
        A_log=torch.log(torch.empty(heads).uniform_(1, 16, generator=gen)).to(device, dtype),
        D=(1 + 0.1 * torch.randn(heads, generator=gen)).to(device, dtype),
        # softplus(dt_bias) in [1e-3, 1e-1]: some heads near the clamp value transformers would use
        dt_bias=torch.log(torch.expm1(torch.empty(heads).uniform_(1e-3, 1e-1, generator=gen))).to(device, dtype),
    )
    conv_state = torch.randn(num_slots, conv_dim, kernel - 1, generator=gen).to(device, dtype)
    ssm_state = torch.randn(num_slots, heads, head_dim, d_state, generator=gen).to(device, state_dtype)
    if not xBC.is_contiguous():
        assert xBC.stride(-1) == 1
    return xBC, dt_raw, conv_state, ssm_state, params


def _naive(xBC, dt_raw, conv_state, ssm_state, slots, conv_weight, conv_bias, A_log, D, dt_bias, n_groups):
    """Literal per-row, per-head loop in float64 (no shared code with the reference)."""
    heads, head_dim, d_state = ssm_state.shape[1:]
    d_inner = heads * head_dim
    ys, convs, ssms = [], [], []
    for b in range(xBC.shape[0]):
        s = int(slots[b])
        window = torch.cat([conv_state[s].double(), xBC[b].double()[:, None]], dim=1)
        act = F.silu((window * conv_weight[:, 0].double()).sum(1) + conv_bias.double())
        act = act.to(xBC.dtype).double()
        y = torch.zeros(d_inner, dtype=torch.float64)
        new_state = torch.zeros(heads, head_dim, d_state, dtype=torch.float64)
        for h in range(heads):
            g = h // (heads // n_groups)
            x = act[h * head_dim:(h + 1) * head_dim]
            B = act[d_inner + g * d_state:d_inner + (g + 1) * d_state]
            C = act[d_inner + n_groups * d_state + g * d_state:d_inner + n_groups * d_state + (g + 1) * d_state]
            dt = F.softplus(dt_raw[b, h].double() + dt_bias[h].double())
            A = -torch.exp(A_log[h].double())
            st = torch.exp(dt * A) * ssm_state[s, h].double() + dt * torch.outer(x, B)
            new_state[h] = st
            y[h * head_dim:(h + 1) * head_dim] = st @ C + D[h].double() * x
        ys.append(y)
        convs.append(window[:, 1:])
        ssms.append(new_state)
    return torch.stack(ys), torch.stack(convs), torch.stack(ssms)


TINY = dict(heads=8, head_dim=12, d_state=16, groups=2, kernel=4)


def test_reference_matches_naive_loop():
    gen = torch.Generator().manual_seed(0)
    xBC, dt_raw, conv_state, ssm_state, p = _make(3, 4, **TINY, dtype=torch.float32, state_dtype=torch.float32,
                                                  device="cpu", gen=gen)
    slots = torch.tensor([2, 0, 1])
    y_naive, conv_naive, ssm_naive = _naive(xBC, dt_raw, conv_state, ssm_state, slots, n_groups=2, **p)
    y = mamba_step_reference(xBC, dt_raw, conv_state, ssm_state, slots, n_groups=2, **p)
    # fp32 vs float64: tolerance 1e-5
    torch.testing.assert_close(y.double(), y_naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_state[slots].double(), conv_naive, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ssm_state[slots].double(), ssm_naive, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_r", [None, 16, 8])  # 16, 8: blocks straddle heads of 12 / 20 channels
@pytest.mark.parametrize("shape", [TINY, dict(heads=6, head_dim=20, d_state=8, groups=3, kernel=3),
                                   dict(heads=4, head_dim=16, d_state=32, groups=1, kernel=4)])
def test_kernel_matches_reference_with_sink_rows(shape, block_r):
    gen = torch.Generator().manual_seed(shape["heads"] * 7 + shape["kernel"])
    num_slots = 5
    sink = num_slots - 1
    xBC, dt_raw, conv_state, ssm_state, p = _make(5, num_slots, **shape, dtype=torch.float32,
                                                  state_dtype=torch.float32, device=DEVICE, gen=gen)
    # three real rows in shuffled slots (slot 1 stays untouched), two padding rows on the sink
    slots = torch.tensor([3, sink, 0, 2, sink], device=DEVICE)
    untouched = (conv_state[1].clone(), ssm_state[1].clone())
    initial_ssm = ssm_state.clone()
    ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
    for step in range(3):  # a few consecutive tokens: the state must carry over
        xs, dts = xBC * (1 + step), dt_raw - 0.3 * step
        y_ref = mamba_step_reference(xs, dts, ref_conv, ref_ssm, slots, n_groups=shape["groups"], **p)
        y = mamba_step_triton(xs, dts, conv_state, ssm_state, slots, n_groups=shape["groups"], block_r=block_r, **p)
        real = slots != sink
        # fp32 both sides; summation order differs only
        torch.testing.assert_close(y[real], y_ref[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv_state[:sink], ref_conv[:sink], rtol=0, atol=0)
        torch.testing.assert_close(ssm_state[:sink], ref_ssm[:sink], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(y).all()
    assert torch.equal(conv_state[1], untouched[0]) and torch.equal(ssm_state[1], untouched[1])
    assert (ssm_state[3] - initial_ssm[3]).abs().max() > 1e-3  # the real slots did change


def test_bf16_activations_fp32_state():
    gen = torch.Generator().manual_seed(11)
    xBC, dt_raw, conv_state, ssm_state, p = _make(3, 4, **TINY, dtype=torch.bfloat16, state_dtype=torch.float32,
                                                  device=DEVICE, gen=gen)
    slots = torch.tensor([1, 3, 0], device=DEVICE)
    ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
    y_ref = mamba_step_reference(xBC, dt_raw, ref_conv, ref_ssm, slots, n_groups=2, **p)
    y = mamba_step(xBC, dt_raw, conv_state, ssm_state, slots, n_groups=2, **p)  # launcher -> kernel
    assert y.dtype == torch.float32 and ssm_state.dtype == torch.float32
    # the bf16 rounding of the conv output may flip in the last bit: 1e-2
    torch.testing.assert_close(y, y_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ssm_state, ref_ssm, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(conv_state, ref_conv, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- GPU (full shapes)

FULL = dict(heads=128, head_dim=80, d_state=128, groups=8, kernel=4)  # conv_dim 12288 (spec 3.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 33, 128])
def test_gpu_full_shapes(batch, dtype):
    gen = torch.Generator().manual_seed(batch)
    num_slots = batch + 1
    sink = num_slots - 1
    xBC, dt_raw, conv_state, ssm_state, p = _make(batch, num_slots, **FULL, dtype=dtype,
                                                  state_dtype=torch.float32, device="cuda", gen=gen)
    slots = torch.randperm(sink, generator=gen)[:batch].cuda()
    if batch > 2:
        slots[-2:] = sink  # padding rows
    ref_conv, ref_ssm = conv_state.clone(), ssm_state.clone()
    y_ref = mamba_step_reference(xBC, dt_raw, ref_conv, ref_ssm, slots, n_groups=8, **p)
    y = mamba_step(xBC, dt_raw, conv_state, ssm_state, slots, n_groups=8, **p)
    real = slots != sink
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y[real], y_ref[real], rtol=tol, atol=tol)
    torch.testing.assert_close(ssm_state[:sink], ref_ssm[:sink], rtol=tol, atol=tol)
    torch.testing.assert_close(conv_state[:sink], ref_conv[:sink], rtol=0, atol=0)
