"""The Triton launchers reach the kernels through torch custom ops so that torch.compile(fullgraph=True)
sees one opaque node per kernel. Checked here (kernels under TRITON_INTERPRET=1 on the CPU, on the GPU
where there is one): torch.library.opcheck (schema, declared mutation, fake shapes agree with the real
op), and a fullgraph-compiled function calling every op gives the eager results (exactly: same kernels)."""
import math

import pytest
import torch

from ops.bounded_attention import bounded_attention, bounded_attention_op
from ops.decode_attention import decode_attention, decode_attention_op
from ops.dft import basis_matmul, basis_matmul_op, irdft_basis
from ops.fp32_linear import fp32_linear, fp32_linear_op, split_tf32
from ops.mamba_step import mamba_step, mamba_step_op
from tests.ops.support import DEVICE, OPCHECK_TESTS

# opcheck's faketensor/aot tests; the autograd-registration test is for training ops (these are inference only)


def _inputs(gen):
    r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=gen).to(DEVICE, dtype)  # noqa: E731
    B, S, heads, hd, dstate, groups, K = 3, 5, 4, 8, 16, 2, 4
    conv_dim = heads * hd + 2 * groups * dstate
    mamba = dict(xBC=r(B, conv_dim), dt_raw=0.5 * r(B, heads), conv_state=r(S, conv_dim, K - 1),
                 ssm_state=r(S, heads, hd, dstate), slots=torch.tensor([4, 0, 2], device=DEVICE),
                 conv_weight=r(conv_dim, 1, K) / 2, conv_bias=0.1 * r(conv_dim),
                 A_log=torch.log(torch.rand(heads, generator=gen) * 15 + 1).to(DEVICE), D=1 + 0.1 * r(heads),
                 dt_bias=-2 + 0.1 * r(heads), n_groups=groups)
    L = 24
    decode = dict(q=r(B, 8, 16), k_cache=r(S, 2, L, 16), v_cache=r(S, 2, L, 16),
                  slots=torch.tensor([1, 3, 4], device=DEVICE), seq_lens=torch.tensor([5, 24, 1], device=DEVICE),
                  scale=0.25, window=None, num_splits=None, pages=None)
    W, H, D = 6, 2, 16
    bounded = dict(q=r(B, H, D), k_new=r(B, H, D), v_new=r(B, H, D), keys=r(S, W, H, D), values=r(S, W, H, D),
                   pos=r(W + 1, H, D), pos_bias_u=r(H, D), pos_bias_v=r(H, D),
                   slots=torch.tensor([0, 2, 4], device=DEVICE), t=torch.tensor([0, 3, 11], device=DEVICE))
    linear = dict(x=r(2, 5, 24), weight=r(16, 24) / math.sqrt(24), bias=r(16), gelu=True)
    dft = dict(x=r(7, 18), basis=irdft_basis(16, DEVICE))
    return mamba, decode, bounded, linear, dft


@pytest.mark.triton_interpret
def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    mamba, decode, bounded, linear, dft = _inputs(gen)
    split = split_tf32(linear["weight"])
    # the decode pools paged: 2 pages of 16 positions per row (the last 8 never read), in shuffled order
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 8))  # noqa: E731
    paged = dict(decode, k_cache=pad(decode["k_cache"]).unflatten(2, (2, 16)).transpose(1, 2).flatten(0, 1),
                 v_cache=pad(decode["v_cache"]).unflatten(2, (2, 16)).transpose(1, 2).flatten(0, 1),
                 pages=torch.randperm(decode["k_cache"].shape[0] * 2, generator=gen).view(-1, 2).to(DEVICE,
                                                                                                  torch.int32))
    for op, kwargs in ((mamba_step_op, mamba), (decode_attention_op, decode), (decode_attention_op, paged),
                       (bounded_attention_op, bounded),
                       (fp32_linear_op, linear), (fp32_linear_op, dict(linear, presplit=True)),
                       (fp32_linear_op, dict(linear, gelu=False, presplit=True,
                                             residual=torch.randn(2, 5, 16, generator=gen).to(DEVICE))),
                       (fp32_linear_op, dict(linear, weight=split[0], presplit=True, residual=None,
                                             weight_lo=split[1])),   # the weight split beforehand
                       (basis_matmul_op, dft)):
        args = tuple(v.clone() if torch.is_tensor(v) else v for v in kwargs.values())
        torch.library.opcheck(op, args, test_utils=OPCHECK_TESTS)


@pytest.mark.triton_interpret
def test_fullgraph_compile_matches_eager():
    gen = torch.Generator().manual_seed(1)
    mamba, decode, bounded, linear, dft = _inputs(gen)

    def step(m, d, b, lin, f):
        y = mamba_step(**m)
        a = decode_attention(**d)
        o = bounded_attention(**b)
        g = fp32_linear(**lin)
        return y, a, o, g, basis_matmul(**f)

    def fresh():  # the Mamba pools are written in place: each run starts from its own copy
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in mamba.items()}

    m_eager, m_comp = fresh(), fresh()
    eager = step(m_eager, decode, bounded, linear, dft)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(m_comp, decode, bounded, linear, dft)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    # the in-place state update happened inside the compiled function, exactly once
    for name in ("conv_state", "ssm_state"):
        torch.testing.assert_close(m_comp[name], m_eager[name], rtol=0, atol=0)
        assert not torch.equal(m_eager[name], mamba[name])
