"""The two MLP activations of a frame step, each as one kernel over the GEMM's output:

    gelu_tanh_mul(gate, up) = gelu_tanh(gate) * up     (the talker's gated MLPs, spec 4.1; gate and up may be
                                                        the two column halves of one stacked GEMM's output)
    relu_square(x)          = relu(x) ** 2             (the LLM's MLP, spec 3.5)

Why kernels: in torch each is two launches (gelu, mul; clamp_min, pow), 44 + 25 of them per frame step
at full size (scripts/dev/census_step.py), each a few microseconds on the step's critical path
(docs/performance.md). relu_square is torch's arithmetic exactly (a bf16 square of a bf16 value is exact in
fp32, so it rounds once either way). gelu_tanh_mul is ATen's formula in fp32, with the gelu rounded to the
input dtype before the multiply as torch rounds between its two ops, but its tanh is written with exp, not
libdevice's tanhf: a few fp32 ulps apart, so a bf16 rounding differs now and then where 1 + tanh cancels
(tests/ops/test_activation.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import use_triton
from ops.rmsnorm import as_rows, round_to

# torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
GELU_BETA = 0.7978845608028654   # sqrt(2) * (2 / sqrt(pi)) * 0.5, as ATen builds it
GELU_KAPPA = 0.044715


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def gelu_tanh_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def relu_square_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _gelu_tanh_mul_kernel(gate_ptr, up_ptr, out_ptr, width, stride_gate, stride_up, stride_out,
                          BETA: tl.constexpr, KAPPA: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """Program = (row, BLOCK columns): rows may be strided (column views of a stacked GEMM's output)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    u = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    x = g.to(tl.float32)
    inner = BETA * (x + KAPPA * (x * x * x))
    # ATen's formula, 0.5 x (1 + tanh(inner)), with tanh = 1 - 2 / (exp(2 inner) + 1) (libdevice's tanhf,
    # which ATen calls, does not run under the interpreter): where tanh(inner) rounds to -1 both give 0,
    # as torch does, and elsewhere they differ by an fp32 ulp of tanh now and then. Roundings by round_to:
    # a bf16 cast between fp32 ops may be folded away on the GPU, and the interpreter truncates casts.
    dtype = out_ptr.dtype.element_ty
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    gelu = round_to(0.5 * x * (1.0 + tanh), dtype, BF16)  # torch rounds the gelu before the multiply
    out = round_to(gelu * u.to(tl.float32), dtype, BF16)
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=mask)


@triton.jit
def _relu_square_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, BF16: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.maximum(x, 0.0)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, round_to(x * x, dtype, BF16).to(dtype), mask=mask)


def gelu_tanh_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    assert gate.shape == up.shape and gate.dtype == up.dtype
    g2, u2 = as_rows(gate, gate.shape[-1]), as_rows(up, up.shape[-1])
    rows, width = g2.shape
    out = torch.empty(rows, width, device=gate.device, dtype=gate.dtype)
    if rows and width:
        block = min(1024, triton.next_power_of_2(width))
        _gelu_tanh_mul_kernel[(rows, triton.cdiv(width, block))](
            g2, u2, out, width, g2.stride(0), u2.stride(0), out.stride(0),
            BETA=GELU_BETA, KAPPA=GELU_KAPPA, BLOCK=block, BF16=gate.dtype == torch.bfloat16, num_warps=4,
        )
    return out.view(gate.shape)


def relu_square_triton(x: torch.Tensor) -> torch.Tensor:
    x2 = x.contiguous()
    out = torch.empty_like(x2)
    n = x2.numel()
    if n:
        _relu_square_kernel[(triton.cdiv(n, 1024),)](x2, out, n, BLOCK=1024, BF16=x.dtype == torch.bfloat16,
                                                      num_warps=4)
    return out.view(x.shape)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::gelu_tanh_mul", mutates_args=())
def gelu_tanh_mul_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gelu_tanh_mul_triton(gate, up)


@gelu_tanh_mul_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("nemo_duplex::relu_square", mutates_args=())
def relu_square_op(x: torch.Tensor) -> torch.Tensor:
    return relu_square_triton(x)


@relu_square_op.register_fake
def _(x):
    return x.new_empty(x.shape)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, same shapes (rows may be strided): one kernel on CUDA or under
    TRITON_INTERPRET=1, else the torch statement."""
    if use_triton(gate):
        return gelu_tanh_mul_op(gate, up)
    return gelu_tanh_mul_reference(gate, up)


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2: one kernel on CUDA or under TRITON_INTERPRET=1, else the torch statement."""
    if use_triton(x):
        return relu_square_op(x)
    return relu_square_reference(x)
