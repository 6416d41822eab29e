"""ops/activation.py: gelu_tanh_mul and relu_square against their torch statements (interpreter on the CPU,
small shapes; full shapes on the GPU)."""
import pytest
import torch

from ops.activation import (
    gelu_tanh_mul,
    gelu_tanh_mul_op,
    gelu_tanh_mul_reference,
    gelu_tanh_mul_triton,
    relu_square,
    relu_square_op,
    relu_square_reference,
    relu_square_triton,
)
from tests.ops.support import OPCHECK_TESTS

DEVICE = "cpu"


def _gate_up(gen, rows, width, dtype, device):
    """gate and up as the two column halves of one [rows, 2 x width] GEMM output (strided views), values
    spread over the gelu's whole range (deep negative tail included)."""
    stacked = (4 * torch.randn(rows, 2 * width, generator=gen)).to(device, dtype)
    return stacked.chunk(2, dim=-1)


def assert_gelu_mul_close(out, gate, up):
    """Against torch's gelu(gate, tanh) * up and the float64 computation. Both tanh formulas round to -1
    in the deep negative tail (0 out) and differ by an fp32 ulp of tanh now and then elsewhere, which
    matters only where 1 + tanh cancels: |gelu| <= 2^-10. fp32: within 1e-5 relative + 1e-6 max|up|
    absolute of torch and of float64. bf16: within one bf16 step + 2^-10 max|up| of torch, and where
    |gelu| > 2^-10 bit-identical to it in >= 99.9% of elements (a flip of the gelu's rounding is possible
    where the fp32 values straddle a bf16 midpoint; on the GPU tl.exp is the approximate ex2)."""
    ref = gelu_tanh_mul_reference(gate, up)
    assert out.shape == ref.shape and out.dtype == gate.dtype
    scale = up.abs().max().item()
    if gate.dtype == torch.float32:
        exact = torch.nn.functional.gelu(gate.double(), approximate="tanh") * up.double()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6 * scale)
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-6 * scale)
        return 1.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -10 * scale)
    outside_tail = torch.nn.functional.gelu(gate.float(), approximate="tanh").abs() > 2 ** -10
    same = (out == ref)[outside_tail].float().mean().item()
    assert same >= 0.999, same
    return same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up = _gate_up(gen, 5, 300, dtype, DEVICE)  # 300: not a multiple of the block
    assert not gate.is_contiguous()
    assert_gelu_mul_close(gelu_tanh_mul_triton(gate, up), gate, up)
    torch.library.opcheck(gelu_tanh_mul_op, (gate.float(), up.float()), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_square_is_the_torch_statement(dtype):
    """Bit for bit (one rounding of an exact product in both)."""
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(7, 333, generator=gen)).to(DEVICE, dtype)
    out = relu_square_triton(x)
    assert out.dtype == dtype and torch.equal(out, relu_square_reference(x))
    assert (out[x <= 0] == 0).all() and (out[x > 0] > 0).all()
    torch.library.opcheck(relu_square_op, (x.float(),), test_utils=OPCHECK_TESTS)


def test_launchers_take_the_kernel_under_the_interpreter(monkeypatch):
    """Under TRITON_INTERPRET=1 (this directory's tests) the launchers run the kernels; without it, on the
    CPU, the torch statements."""
    gen = torch.Generator().manual_seed(2)
    gate, up = _gate_up(gen, 3, 64, torch.float32, DEVICE)
    calls = []
    monkeypatch.setattr("ops.activation.gelu_tanh_mul_triton", lambda g, u: calls.append("gelu") or g * 0)
    monkeypatch.setattr("ops.activation.relu_square_triton", lambda x: calls.append("relu") or x * 0)
    assert torch.equal(gelu_tanh_mul(gate, up), gate * 0) and torch.equal(relu_square(up), up * 0)
    assert calls == ["gelu", "relu"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert torch.equal(gelu_tanh_mul(gate, up), gelu_tanh_mul_reference(gate, up))
    assert torch.equal(relu_square(up), relu_square_reference(up))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 64, 256])
def test_gpu_full_shapes(rows):
    """The talker's gated MLP (rows x 4608 halves of a stacked GEMM, bf16) and the LLM's relu^2 MLP (rows x
    15680, bf16): as on the CPU."""
    gen = torch.Generator().manual_seed(rows)
    gate, up = _gate_up(gen, rows, 4608, torch.bfloat16, "cuda")
    same = assert_gelu_mul_close(gelu_tanh_mul(gate, up), gate, up)
    print(f"gelu_tanh_mul rows {rows}: {same:.5f} bit-identical to torch outside the tail")
    x = (3 * torch.randn(rows, 15680, generator=gen)).to("cuda", torch.bfloat16)
    assert torch.equal(relu_square(x), relu_square_reference(x))
