"""Top-p + Gumbel-max kernel (TRITON_INTERPRET=1 on CPU; full shape on the GPU) vs its torch reference (HF's
top-p warper, log_softmax, + noise, argmax). The draw is an integer: on inputs without near-ties it must be
equal; the kernel's drop rule is also checked entry by entry (a huge noise on one entry picks it iff kept)."""
import pytest
import torch

from ops.top_p_sample import (
    gumbel,
    top_p_filter,
    top_p_gumbel_argmax,
    top_p_gumbel_argmax_op,
    top_p_gumbel_argmax_reference,
    top_p_gumbel_argmax_triton,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _draws(gen, rows, n, scale, device=DEVICE):
    logits = (scale * torch.randn(rows, n, generator=gen)).to(device)
    noise = gumbel(torch.rand(rows, n, generator=gen)).to(device)
    return logits, noise


@pytest.mark.parametrize("n,rows", [(16, 24), (100, 12), (1024, 2)])  # 100: padded to 128 (masked lanes)
@pytest.mark.parametrize("scale", [0.5, 3.0])
@pytest.mark.parametrize("top_p", [0.95, 0.5])
def test_kernel_equals_reference(n, rows, scale, top_p):
    gen = torch.Generator().manual_seed(n + rows + int(10 * scale) + int(100 * top_p))
    logits, noise = _draws(gen, rows, n, scale)
    out = top_p_gumbel_argmax_triton(logits, noise, top_p)
    assert out.dtype == torch.int64 and out.shape == (rows,)
    assert torch.equal(out, top_p_gumbel_argmax_reference(logits, noise, top_p))


def test_bf16_logits_with_strided_rows():
    """The talker passes its stacked heads GEMM's output as it is: bf16 logits, a column slice (rows strided).
    The kernel reads them in fp32: the same draws as the reference on the fp32 values. Three rows of the
    talker's 1024 components (a row takes seconds through the interpreter's sort): two of them start a
    row stride of 1536 after the one before, so a kernel stepping by the row's width would draw otherwise."""
    gen = torch.Generator().manual_seed(12)
    heads, noise = _draws(gen, 16, 1024 + 512, 3.0)
    heads, noise = heads[:3].bfloat16(), noise[:3, :1024].contiguous()
    logits = heads[:, :1024]
    out = top_p_gumbel_argmax(logits, noise, 0.95)
    assert torch.equal(out, top_p_gumbel_argmax_reference(logits.float(), noise, 0.95))
    assert torch.equal(out, top_p_gumbel_argmax_reference(logits, noise, 0.95))


@pytest.mark.parametrize("top_p", [0.95, 0.6, 1.0])
def test_drop_rule_entry_by_entry(top_p):
    """For each entry i, a noise of 1e4 on i alone: the draw is i exactly when HF's warper keeps i."""
    gen = torch.Generator().manual_seed(7)
    n = 32
    logits = (2 * torch.randn(1, n, generator=gen)).to(DEVICE)
    kept = torch.isfinite(top_p_filter(logits, top_p))[0]
    assert 1 < int(kept.sum()) < n or top_p == 1.0
    rows = logits.expand(n, n).contiguous()
    noise = 1e4 * torch.eye(n, device=DEVICE)
    out = top_p_gumbel_argmax(rows, noise, top_p)
    picked = out == torch.arange(n, device=DEVICE)
    assert torch.equal(picked, kept)


def test_tie_group_at_the_threshold_is_kept_whole():
    """Equal logits straddling the threshold: HF drops the members its sort puts first, the kernel keeps the
    group (module docstring); below the group everything goes, above it everything stays."""
    # probabilities 0.026 (x4 tied) above 0.0005: the cumulative mass crosses 1 - 0.95 at the second tied one
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 2.0, 2.5, 3.0, 3.2, -3.0, 3.4]], device=DEVICE)
    probs = logits.softmax(-1)[0]
    tied = probs[0].item()
    below = probs[8].item()
    assert below < 0.05 < below + 4 * tied  # the threshold falls inside the tie group
    kept_hf = torch.isfinite(top_p_filter(logits, 0.95))[0]
    assert not kept_hf[8] and 0 < int(kept_hf[:4].sum()) < 4
    for i in range(10):
        noise = torch.zeros(1, 10, device=DEVICE)
        noise[0, i] = 1e4
        picked = int(top_p_gumbel_argmax(logits, noise, 0.95)[0]) == i
        assert picked == (i != 8)


def test_row_strided_noise():
    """One pass's slice of every pass's noise [B, passes, n][:, p] (row stride passes x n), as the talker
    passes it, read in place."""
    gen = torch.Generator().manual_seed(4)
    logits, _ = _draws(gen, 6, 16, 2.0)
    noise_all = gumbel(torch.rand(6, 5, 16, generator=gen)).to(DEVICE)
    for p in range(5):
        out = top_p_gumbel_argmax(logits, noise_all[:, p], 0.95)
        assert torch.equal(out, top_p_gumbel_argmax_reference(logits, noise_all[:, p].contiguous(), 0.95))


def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    logits, noise = _draws(gen, 5, 64, 2.0)
    torch.library.opcheck(top_p_gumbel_argmax_op, (logits, noise, 0.95), test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_gpu_full_shape(scale):
    """The talker's draw at N=128: 128 rows x 1024 components, logits rounded through bf16 as the MoG head
    makes them (many exact ties). A row may differ from the reference only where HF's cumulative
    probability comes within 1e-5 of 1 - p (a rounding of the sums decides) or a tie group straddles the
    threshold; the test prints how many did."""
    gen = torch.Generator().manual_seed(int(scale))
    logits, noise = _draws(gen, 128, 1024, scale, device="cuda")
    logits = logits.bfloat16().float()
    out = top_p_gumbel_argmax(logits, noise, 0.95)
    ref = top_p_gumbel_argmax_reference(logits, noise, 0.95)
    differ = out != ref
    s, _ = logits.sort(-1)
    cumulative = s.softmax(-1).cumsum(-1)
    near = ((cumulative - 0.05).abs() < 1e-5).any(-1)
    below = cumulative <= 0.05
    last_dropped = torch.where(below, s, torch.full_like(s, float("-inf"))).max(-1).values
    first_kept = torch.where(below, torch.full_like(s, float("inf")), s).min(-1).values
    straddles = last_dropped == first_kept
    print(f"rows differing from the reference: {int(differ.sum())} of 128 "
          f"(near the threshold {int(near.sum())}, tie at the threshold {int(straddles.sum())})")
    assert not (differ & ~near & ~straddles).any()
    assert int(differ.sum()) <= 2
