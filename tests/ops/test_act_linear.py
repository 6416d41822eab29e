"""Activation-prologue down projection (TRITON_INTERPRET=1 on CPU; the encoder's and talker's shapes on the GPU)
against the two torch steps (activation, then F.linear) and float64.

fp32: within 1e-5 of the reference (the sums' order differs). bf16: the activation rounds as the separate kernel
does but its exp is not ATen's (a few fp32 ulps), and the GEMM sums in another order than cuBLAS, so outputs
may differ from the reference by a bf16 step: within 2^-7 relative of the largest output, and within the same
bound of float64 as the reference itself is (one rounding of the activation and one of the output)."""
import pytest
import torch

from ops.act_linear import MAX_ROWS, act_linear, act_linear_op, act_linear_reference, tickets_for
from tests.ops.support import OPCHECK_TESTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _float64(x, weight, activation):
    x = x.double()
    if activation == "silu":
        a = torch.nn.functional.silu(x)
    else:
        gate, up = x.chunk(2, dim=-1)
        a = torch.nn.functional.gelu(gate, approximate="tanh") * up
    return a @ weight.double().T


def _check(x, weight, activation, dtype):
    tickets = tickets_for(weight.shape[0], x.device)
    out = act_linear(x, weight, tickets, activation)
    ref = act_linear_reference(x, weight, activation)
    exact = _float64(x, weight, activation)
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.count_nonzero(tickets) == 0    # every launch leaves its tickets at zero
    scale = exact.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * scale)
    else:
        assert (out.float() - ref.float()).abs().max().item() <= 2 ** -7 * scale
        ref_err = (ref.double() - exact).abs().max().item()
        assert (out.double() - exact).abs().max().item() <= max(ref_err, 2 ** -8 * scale) * 1.5
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh_mul"])
@pytest.mark.parametrize("rows,k,n", [(3, 256, 64), (17, 192, 100), (64, 128, 48)])
def test_equals_the_two_torch_steps(dtype, activation, rows, k, n):
    gen = torch.Generator().manual_seed(rows + k + n)
    width = 2 * k if activation == "gelu_tanh_mul" else k
    x = (torch.randn(rows, width, generator=gen) * 2).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(DEVICE)
    out = _check(x, weight, activation, dtype)
    again = act_linear(x, weight, tickets_for(n, x.device), activation)
    assert torch.equal(out, again)   # the split-K sum is in split order: the same bits every launch


def test_rows_past_the_limit_take_the_torch_steps():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(MAX_ROWS + 1, 64, generator=gen).to(DEVICE)
    weight = torch.randn(32, 64, generator=gen).to(DEVICE)
    assert torch.equal(act_linear(x, weight, tickets_for(32, x.device), "silu"),
                       act_linear_reference(x, weight, "silu"))
    assert torch.equal(act_linear(x[:4], weight, None, "silu"), act_linear_reference(x[:4], weight, "silu"))
    torch.library.opcheck(act_linear_op, (x[:4], weight, tickets_for(32, x.device), "silu"),
                          test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("activation,rows,k,n", [("silu", 32, 4096, 1024), ("gelu_tanh_mul", 64, 4608, 1152),
                                                 ("silu", 1, 4096, 1024), ("gelu_tanh_mul", 2, 4608, 1152)])
def test_gpu_step_shapes(activation, rows, k, n):
    """The encoder's feed-forward (32 calls, one) and the talker's gated MLP (both CFG streams) in bf16."""
    gen = torch.Generator().manual_seed(rows)
    width = 2 * k if activation == "gelu_tanh_mul" else k
    x = (torch.randn(rows, width, generator=gen)).to(torch.bfloat16).cuda()
    weight = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).cuda()
    _check(x, weight, activation, torch.bfloat16)
