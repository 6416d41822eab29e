"""Weight-only FP8 linear (ops/fp8_weight_linear.py) against its fp32 statement (TRITON_INTERPRET=1 on the CPU),
its error against the unquantised product next to the FP8 GEMM's, the same bits every run and whatever the
other rows, the custom op's opcheck, and full shapes on the GPU."""
import pytest
import torch
import torch.nn.functional as F

from ops.fp8_linear import FP8, fp8_linear_reference, quantize_weight
from ops.fp8_weight_linear import (
    fp8_weight_linear,
    fp8_weight_linear_op,
    fp8_weight_linear_reference,
    fp8_weight_linear_triton,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _operands(gen, m, k, n, dtype=torch.bfloat16):
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    w[3] *= 100.0   # rows of different magnitudes: each keeps its own scale
    w8, scale = quantize_weight(w.to(DEVICE, dtype))
    return x, w8, scale


def _check(y, x, w8, scale, min_exact=0.97):
    """y is the fp32 statement rounded once to x's dtype: >= min_exact of the elements equal to it, and every
    element within half a bf16 step of the fp32 value plus the fp32 sums' order error (2^-20 of
    sum_k |x_k w_k| scale, which matters where the sum cancels to near zero)."""
    exact = (x.float() @ w8.float().t()) * scale[None, :]
    magnitude = (x.float().abs() @ w8.float().abs().t()) * scale[None, :]
    assert y.dtype == x.dtype and y.shape == exact.shape
    assert (y.float() == exact.to(y.dtype).float()).float().mean().item() >= min_exact
    assert ((y.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + magnitude * 2.0 ** -20).all()


@pytest.mark.parametrize("m,k,n,split_k", [(1, 256, 96, None), (5, 384, 200, 3), (33, 512, 64, 1),
                                           (64, 256, 130, 2), (100, 640, 257, None), (17, 1000, 48, 4)])
def test_kernel_matches_the_fp32_statement(m, k, n, split_k):
    """Fresh random bf16 rows, e4m3 weights with per-row scales; ragged tiles in M, N and K; split-K (the
    partial sums added by the second kernel) or not; one row tile (<= 64 rows) or several (100 rows)."""
    x, w8, scale = _operands(torch.Generator().manual_seed(m * 1000 + n), m, k, n)
    _check(fp8_weight_linear_triton(x, w8, scale, split_k=split_k), x, w8, scale)


def test_fp16_rows():
    x, w8, scale = _operands(torch.Generator().manual_seed(9), 7, 256, 80, torch.float16)
    _check(fp8_weight_linear_triton(x, w8, scale), x, w8, scale)


def test_the_same_bits_every_run_and_whatever_the_other_rows():
    """Twice the same inputs: identical outputs, with and without split-K (no atomics). A row's output with
    other rows beside it equals its output alone (same tiles): the determinism a served call needs."""
    x, w8, scale = _operands(torch.Generator().manual_seed(3), 9, 512, 96)
    tiles = (16, 64, 128, 4, 1)
    for split_k in (1, 4):
        y = fp8_weight_linear_triton(x, w8, scale, tiles=tiles, split_k=split_k)
        assert torch.equal(y, fp8_weight_linear_triton(x, w8, scale, tiles=tiles, split_k=split_k))
        alone = fp8_weight_linear_triton(x[4:5].contiguous(), w8, scale, tiles=tiles, split_k=split_k)
        assert torch.equal(alone[0], y[4])


def test_rounds_only_the_weight():
    """Against the unquantised product: within e4m3's error (relative Frobenius error under 4%: a 1/16-bounded
    rounding per weight, mostly cancelling over K), and smaller than the FP8 GEMM's, which also rounds x to
    e4m3 (ops/fp8_linear.py; measured here 2.6% against 3.7%)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(16, 1024, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(256, 1024, generator=gen) * 1024 ** -0.5).to(DEVICE, torch.bfloat16)
    w8, scale = quantize_weight(w)
    exact = F.linear(x.float(), w.float())
    weight_only = (fp8_weight_linear(x, w8, scale).float() - exact).norm() / exact.norm()
    both = (fp8_linear_reference(x, w8, scale).float() - exact).norm() / exact.norm()
    assert weight_only < 0.04 and weight_only < 0.8 * both, (weight_only, both)


def test_launcher_keeps_leading_dims_and_takes_the_statement_off_triton():
    """fp8_weight_linear: [..., K] in, [..., N] out; strided rows are made contiguous; fp32 rows (which the
    kernel does not take) get the fp32 statement."""
    x, w8, scale = _operands(torch.Generator().manual_seed(6), 6, 128, 40)
    y = fp8_weight_linear(x.view(2, 3, 128), w8, scale)
    assert y.shape == (2, 3, 40)
    _check(y.view(6, 40), x, w8, scale)
    wide = torch.cat([x, x], dim=1)[:, :128]   # rows with a stride of 256
    assert torch.equal(fp8_weight_linear(wide, w8, scale), y.view(6, 40))
    xf = x.float()
    assert torch.equal(fp8_weight_linear(xf, w8, scale), fp8_weight_linear_reference(xf, w8, scale))
    assert w8.dtype == FP8


@pytest.mark.triton_interpret
def test_opcheck():
    x, w8, scale = _operands(torch.Generator().manual_seed(4), 3, 64, 32)
    # Not test_schema (as ops/fp8_linear.py's: it multiplies the e4m3 input, which torch cannot)
    tests = tuple(t for t in OPCHECK_TESTS if t != "test_schema")
    torch.library.opcheck(fp8_weight_linear_op, (x, w8, scale), test_utils=tests)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 64, 128, 500])
@pytest.mark.parametrize("k,n", [(4480, 22656), (10240, 4480), (15680, 4480), (1152, 3456), (4608, 1152)])
def test_gpu_full_shapes(m, k, n):
    """The LLM's in_proj / out_proj / down_proj and the talker's stacked q/k/v and down_proj, at the buckets'
    row counts and a prompt's (500)."""
    x, w8, scale = _operands(torch.Generator().manual_seed(m + n), m, k, n)
    _check(fp8_weight_linear(x, w8, scale), x, w8, scale)
