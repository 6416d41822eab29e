"""Residual add + LayerNorm kernel (TRITON_INTERPRET=1 on CPU) vs its torch reference (x + delta * alpha,
then F.layer_norm) and vs the same written out in float64; full shapes on the GPU.
Tolerances: fp32, s bit-identical (the same single fp32 rounding) and y within 1e-5 (rtol and atol) of the
reference (the reduction order differs). bf16, s bit-identical and y >= 99% bit-identical with the rest
within one bf16 step of the reference value (rtol 2^-7), or within 1e-5 absolute where the normed value
cancels to near zero (there an fp32 ulp of the O(1) terms is more than a bf16 step of the result)."""
import pytest
import torch

from ops.layernorm import (
    add_layer_norm,
    add_layer_norm_op,
    add_layer_norm_reference,
    add_layer_norm_then,
    add_layer_norm_then_op,
    add_layer_norm_then_reference,
    add_layer_norm_triton,
    layer_norm_op,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS, assert_norm_output

EPS = 1e-5


def _float64(x, delta, alpha, w, b, eps):
    """The sum (rounded to x's dtype, as the op defines it) and the norm written out in float64."""
    s = x if delta is None else (x.double() + alpha * delta.double()).to(x.dtype)
    h = s.double()
    centred = h - h.mean(-1, keepdim=True)
    y = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps) * w.double() + b.double()
    return s, y


def _inputs(gen, rows, width, dtype, with_delta=True):
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    x = (3 * r(rows, width) + 1).to(dtype)  # an offset mean, so the centring matters
    delta = r(rows, width).to(dtype) if with_delta else None
    w = (1 + 0.1 * r(width)).to(dtype)
    b = (0.1 * r(width)).to(dtype)
    return x, delta, w, b


def _check(s, y, ref_s, ref_y, exact_y, dtype):
    assert torch.equal(s, ref_s)
    assert_norm_output(y, ref_y, exact_y, dtype)


@pytest.mark.parametrize("rows,width", [(7, 64), (5, 100), (3, 1024)])  # 100: not a power of two (masked)
@pytest.mark.parametrize("alpha", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_and_float64(rows, width, alpha, dtype):
    gen = torch.Generator().manual_seed(rows * width + int(alpha * 10))
    x, delta, w, b = _inputs(gen, rows, width, dtype)
    s, y = add_layer_norm_triton(x, delta, alpha, w, b, EPS)
    ref_s, ref_y = add_layer_norm_reference(x, delta, alpha, w, b, EPS)
    _check(s, y, ref_s, ref_y, _float64(x, delta, alpha, w, b, EPS)[1], dtype)


@pytest.mark.parametrize("rows,width", [(7, 64), (5, 100), (3, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_then_norm_matches_reference_and_float64(rows, width, dtype):
    """A layer's output norm and the next layer's first norm in one kernel (the sum is not kept): y as the
    plain kernel's y, bit for bit; the second norm against the reference and against float64 computed from
    the kernel's own y."""
    gen = torch.Generator().manual_seed(rows + width)
    x, delta, w, b = _inputs(gen, rows, width, dtype)
    w2, b2 = (2 + 0.1 * torch.randn(width, generator=gen)).to(DEVICE, dtype), (torch.randn(width, generator=gen)).to(DEVICE, dtype)
    y, z = add_layer_norm_then(x, delta, 0.5, w, b, EPS, w2, b2, 1e-6)
    ref_y, ref_z = add_layer_norm_then_reference(x, delta, 0.5, w, b, EPS, w2, b2, 1e-6)
    assert torch.equal(y, add_layer_norm_triton(x, delta, 0.5, w, b, EPS)[1])
    assert_norm_output(y, ref_y, _float64(x, delta, 0.5, w, b, EPS)[1], dtype)
    assert_norm_output(z, ref_z, _float64(y, None, 1.0, w2, b2, 1e-6)[1], dtype)
    torch.library.opcheck(add_layer_norm_then_op, (x, delta, 0.5, w, b, EPS, w2, b2, 1e-6), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_torch_add_with_alpha_bit_for_bit(dtype):
    """The reference writes the sum as x + delta * alpha (see its docstring): the same bits as
    torch.add(x, delta, alpha=alpha) for the encoder's alphas."""
    gen = torch.Generator().manual_seed(5)
    x, delta, w, b = _inputs(gen, 9, 100, dtype)
    for alpha in (1.0, 0.5):
        assert torch.equal(add_layer_norm_reference(x, delta, alpha, w, b, EPS)[0], torch.add(x, delta, alpha=alpha))


def test_reference_compiled_by_inductor_after_a_matmul_keeps_its_alpha():
    """The encoder's joint as the whole-step compile sees it on the CPU: delta from a matmul, then the
    reference. With torch.add(..., alpha=0.5) Inductor fused the add into an addmm and dropped the alpha
    (pytorch/pytorch#167313): 0.24 relative off eager here, so the compiled step was wrong.
    fp32; tolerance 1e-5 relative (Inductor's own GEMM and norm)."""
    gen = torch.Generator().manual_seed(6)
    x, _, w, b = _inputs(gen, 4, 64, torch.float32)
    weight = torch.randn(64, 64, generator=gen).to(DEVICE) / 8

    def joint(x):
        return add_layer_norm_reference(x, torch.nn.functional.linear(x, weight), 0.5, w, b, EPS)

    torch._dynamo.reset()
    got = torch.compile(joint, backend="inductor", fullgraph=True)(x)
    want = joint(x)
    for g, e in zip(got, want):
        assert ((g - e).norm() / e.norm()).item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_delta_is_layer_norm(dtype):
    gen = torch.Generator().manual_seed(11)
    x, _, w, b = _inputs(gen, 6, 96, dtype, with_delta=False)
    s, y = add_layer_norm(x, None, 1.0, w, b, EPS)  # the launcher: the kernel here (interpreter or GPU)
    assert s is x
    ref_s, ref_y = add_layer_norm_reference(x, None, 1.0, w, b, EPS)
    _check(s, y, ref_s, ref_y, _float64(x, None, 1.0, w, b, EPS)[1], dtype)


def test_launcher_row_strided_and_batched_inputs():
    """[B, T, D] inputs and a row-strided delta (a slice of a wider GEMM output) through the launcher."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 48, generator=gen).to(DEVICE)
    wide = torch.randn(2, 3, 80, generator=gen).to(DEVICE)
    delta = wide[..., 16:64]
    w, b = torch.randn(48, generator=gen).to(DEVICE), torch.randn(48, generator=gen).to(DEVICE)
    s, y = add_layer_norm(x, delta, 0.5, w, b, EPS)
    ref_s, ref_y = add_layer_norm_reference(x, delta, 0.5, w, b, EPS)
    assert s.shape == y.shape == x.shape
    _check(s, y, ref_s, ref_y, _float64(x, delta, 0.5, w, b, EPS)[1], torch.float32)


def test_opcheck():
    gen = torch.Generator().manual_seed(13)
    x, delta, w, b = _inputs(gen, 4, 40, torch.float32)
    torch.library.opcheck(add_layer_norm_op, (x, delta, 0.5, w, b, EPS), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(layer_norm_op, (x, w, b, EPS), test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_full_shapes(alpha, dtype):
    """The encoder's joints at full size: B = 128 rows of d_model 1024, against the torch ops on the GPU
    and against fp32 (float64 for fp32 inputs) computed from the same inputs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    x, delta = (3 * r(128, 1024) + 1).to(dtype), r(128, 1024).to(dtype)
    w, b = (1 + 0.1 * r(1024)).to(dtype), (0.1 * r(1024)).to(dtype)
    s, y = add_layer_norm(x, delta, alpha, w, b, EPS)
    ref_s, ref_y = add_layer_norm_reference(x, delta, alpha, w, b, EPS)
    _check(s, y, ref_s, ref_y, _float64(x, delta, alpha, w, b, EPS)[1], dtype)
    # against the whole computation in fp32 (no rounding of the sum): the bf16 kernel is off by its roundings only
    wide_s, wide_y = add_layer_norm_reference(x.float(), delta.float(), alpha, w.float(), b.float(), EPS)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(s.float(), wide_s, rtol=2 ** -8, atol=0)
        torch.testing.assert_close(y.float(), wide_y, rtol=0, atol=4 * 2 ** -8 * wide_y.abs().max().item())
