"""FP8 linear (ops/fp8_linear.py): the row quantiser kernel against its torch reference bit for bit (TRITON_INTERPRET=1
on the CPU), the product against the fp32 statement and against the unquantised bf16 product, the custom op's
opcheck, and full shapes on the GPU."""
import pytest
import torch
import torch.nn.functional as F

from ops.fp8_linear import (
    FP8,
    fp8_linear,
    fp8_linear_op,
    fp8_linear_reference,
    quantize_rows_reference,
    quantize_rows_triton,
    quantize_weight,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _mixed_rows(gen, m, k, dtype=torch.bfloat16):
    """Rows of very different magnitudes (1e-3 .. 1e3), one of them all zeros, one with a single spike."""
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
    x[1] = 0.0
    x[2, 5] = 5000.0
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("k", [64, 1500])   # one block, and blocks of 1024 with a ragged tail
def test_quantiser_is_the_reference_bit_for_bit(k):
    x = _mixed_rows(torch.Generator().manual_seed(k), 6, k)
    q, scale = quantize_rows_triton(x)
    q_ref, scale_ref = quantize_rows_reference(x)
    assert q.dtype == FP8 and scale.shape == (6, 1)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert scale[1].item() == 1.0 and not q.float().isnan().any()
    assert q.float().abs().amax(dim=1)[[0, 2, 3, 4, 5]].eq(448.0).all()   # each row's largest lands on 448
    # what the row stands for: within e4m3's half step (1/16 relative) of x, or below its smallest normal
    back = q.float() * scale
    assert ((back - x.float()).abs() <= x.float().abs() / 16 + scale * 2 ** -7).all()


def test_product_against_the_statement_and_bf16():
    """fp8_linear as served (the quantiser and torch._scaled_mm) gives the fp32 statement within the bf16
    output's rounding, and stays within e4m3's error of the unquantised bf16 product: relative (Frobenius)
    error under 5% on random rows (two 1/16-bounded roundings per term, mostly cancelling over K)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 256, generator=gen)).to(DEVICE, torch.bfloat16)
    w = (0.05 * torch.randn(96, 256, generator=gen)).to(DEVICE, torch.bfloat16)
    w8, w_scale = quantize_weight(w)
    assert w8.dtype == FP8 and w_scale.shape == (96,)
    y = fp8_linear(x[None], w8, w_scale)[0]          # leading dims kept
    ref = fp8_linear_reference(x, w8, w_scale)
    assert y.shape == (5, 96) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
    exact = F.linear(x.float(), w.float())
    assert (y.float() - exact).norm() / exact.norm() < 0.05


@pytest.mark.triton_interpret
def test_opcheck():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=gen).to(DEVICE, torch.bfloat16)
    w8, w_scale = quantize_weight(torch.randn(32, 64, generator=gen).to(DEVICE))
    # Not test_schema: its own bookkeeping multiplies the e4m3 input, which torch cannot ("mul_cpu_reduced_float"
    # and "mul_cuda" are not implemented for Float8_e4m3fn, torch 2.11 and 2.13); the op mutates nothing.
    tests = tuple(t for t in OPCHECK_TESTS if t != "test_schema")
    torch.library.opcheck(fp8_linear_op, (x, w8, w_scale), test_utils=tests)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 128, 256])
@pytest.mark.parametrize("n,k", [(22656, 4480), (4480, 15680)])   # the Mamba in_proj, the MLP down_proj
def test_gpu_full_shapes(m, n, k):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    w8, w_scale = quantize_weight((0.02 * torch.randn(n, k, generator=gen)).to("cuda", torch.bfloat16))
    y = fp8_linear(x, w8, w_scale)
    # the same e4m3 products; the GEMM's fp32 sums in another order, then the bf16 rounding
    torch.testing.assert_close(y.float(), fp8_linear_reference(x, w8, w_scale).float(), rtol=2 ** -7, atol=2e-3)
