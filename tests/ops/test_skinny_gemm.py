"""ops/skinny_gemm.py against F.linear in fp32 (TRITON_INTERPRET=1 on the CPU; full shapes on the GPU)."""
import pytest
import torch
import torch.nn.functional as F

from ops.skinny_gemm import MAX_ROWS, skinny_gemm_triton, skinny_linear, use_skinny
from tests.ops.support import DEVICE


def _check_bf16(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, min_exact: float):
    """y is the fp32 product rounded once to bf16: >= min_exact of the elements equal to the rounded fp32
    reference, and every element within half a bf16 step of the fp32 reference plus the fp32 summation's
    own order error (2^-20 of sum_k |x_k w_k|, which matters where the sum cancels to near zero)."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    rounded = ref.to(y.dtype).float()
    exact = (y.float() == rounded).float().mean().item()
    magnitude = F.linear(x.float().abs(), w.float().abs())
    assert exact >= min_exact, exact
    assert ((y.float() - ref).abs() <= ref.abs() * 2.0 ** -8 + magnitude * 2.0 ** -20).all()


@pytest.mark.parametrize("m,k,n,split_k", [(1, 256, 96, None), (5, 384, 200, 3), (33, 512, 64, 1),
                                           (64, 256, 130, 2), (17, 640, 257, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_fp32_reference(m, k, n, split_k, with_bias):
    """Fresh random bf16 inputs; split-K (partials summed by the second kernel) or not; ragged N and K
    tiles. >= 97% of outputs equal the fp32 product rounded to bf16, the rest one step away."""
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).bfloat16().to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16().to(DEVICE)
    b = torch.randn(n, generator=gen).bfloat16().to(DEVICE) if with_bias else None
    _check_bf16(skinny_gemm_triton(x, w, b, split_k=split_k), x, w, b, min_exact=0.97)


def test_splits_do_not_change_the_result_order_dependence_is_fixed():
    """The same inputs twice give bit-identical outputs (no atomics), with and without split-K."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 512, generator=gen).bfloat16().to(DEVICE)
    w = (torch.randn(96, 512, generator=gen) * 512 ** -0.5).bfloat16().to(DEVICE)
    for split_k in (1, 4):
        assert torch.equal(skinny_gemm_triton(x, w, split_k=split_k), skinny_gemm_triton(x, w, split_k=split_k))


def test_dispatch_takes_the_kernel_only_for_few_half_precision_rows():
    """skinny_linear takes the kernel for bf16/fp16 with at most max_rows rows (on CUDA or under the
    interpreter), else F.linear."""
    w = torch.randn(48, 64, device=DEVICE).bfloat16()
    x = torch.randn(3, 64, device=DEVICE).bfloat16()
    interpret_or_cuda = DEVICE == "cuda" or __import__("os").environ.get("TRITON_INTERPRET") == "1"
    assert use_skinny(x, w) == interpret_or_cuda
    assert not use_skinny(x.float(), w.float())
    assert not use_skinny(torch.randn(MAX_ROWS + 1, 64, device=DEVICE).bfloat16(), w)
    assert not use_skinny(x, w, max_rows=0)
    assert torch.equal(skinny_linear(x, w, max_rows=0), F.linear(x, w))
    _check_bf16(skinny_linear(x, w), x, w, None, min_exact=0.95)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 64])
@pytest.mark.parametrize("k,n", [(4480, 22656), (10240, 4480), (1024, 1024), (1152, 4608), (4480, 131072)])
def test_gpu_step_shapes(m, k, n):
    """The frame step's GEMM shapes at full size (LLM in/out projections, encoder, talker, text head)."""
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).bfloat16().cuda()
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16().cuda()
    _check_bf16(skinny_gemm_triton(x, w), x, w, None, min_exact=0.97)
