"""fp32-accurate linear (3xTF32) kernel vs float64 (TRITON_INTERPRET=1 on CPU), plus full-shape GPU tests.

Errors are measured against the float64 product, relative to sum_k |x_k w_k| (the natural scale of a
dot product's rounding error): fp32 accumulation over K terms gives ~K * 2^-24 in the worst case."""
import pytest
import torch
import torch.nn.functional as F

from ops.fp32_linear import fp32_linear, fp32_linear_reference, fp32_linear_triton, pick_split_k
from tests.ops.support import DEVICE


def _relative_error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                    gelu: bool = False) -> float:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    if gelu:
        ref = F.gelu(ref)
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return ((out.double() - ref).abs() / scale).max().item()


@pytest.mark.parametrize("precision", ["tf32x3", "tf32x3w"])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64(gelu, with_bias, precision):
    gen = torch.Generator().manual_seed(int(gelu) * 2 + int(with_bias))
    # M, N, K not multiples of the tiles: every edge mask is exercised
    x = torch.randn(2, 37, 40, generator=gen).to(DEVICE)
    w = (torch.randn(27, 40, generator=gen) / 6).to(DEVICE)
    b = torch.randn(27, generator=gen).to(DEVICE) if with_bias else None
    out = fp32_linear_triton(x, w, b, gelu, precision=precision, tiles=(32, 16, 16, 4, 1))
    assert out.shape == (2, 37, 27) and out.dtype == torch.float32
    # 40-term fp32 sums (and erf in fp32 for the GELU): a few 2^-24 relative
    assert _relative_error(out, x, w, b, gelu) <= 1e-6
    torch.testing.assert_close(out, fp32_linear_reference(x, w, b, gelu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["tf32x3", "tf32x3w"])
def test_residual_epilogue(precision):
    """residual + (x w^T + b), the ConvNeXt skip added in the epilogue: the float64 sum within the GEMM's
    bound plus one fp32 rounding of the add, and a row-strided residual (a slice) read as given."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(37, 40, generator=gen).to(DEVICE)
    w = (torch.randn(27, 40, generator=gen) / 6).to(DEVICE)
    b = torch.randn(27, generator=gen).to(DEVICE)
    wide = (10 * torch.randn(37, 35, generator=gen)).to(DEVICE)
    residual = wide[:, 4:31]
    out = fp32_linear_triton(x, w, b, precision=precision, tiles=(32, 16, 16, 4, 1), residual=residual)
    ref = F.linear(x.double(), w.double(), b.double()) + residual.double()
    scale = x.double().abs() @ w.double().abs().T + b.double().abs() + residual.double().abs()
    assert ((out.double() - ref).abs() / scale).max().item() <= 1e-6
    torch.testing.assert_close(out, fp32_linear_reference(x, w, b, residual=residual), rtol=1e-5, atol=1e-5)
    assert (out - fp32_linear_triton(x, w, b, precision=precision, tiles=(32, 16, 16, 4, 1))).abs().min() > 0


@pytest.mark.parametrize("precision", ["tf32x3", "tf32x3w"])
@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_matches_float64(split_k, precision):
    """The reduction cut into split_k shares (partial products to scratch, summed in order by a second
    kernel with the bias, GELU and residual epilogue): as accurate as one pass, deterministic, and not the
    one-pass result bit for bit (so the split path really ran)."""
    gen = torch.Generator().manual_seed(30 + split_k)
    x = torch.randn(37, 96, generator=gen).to(DEVICE)  # K = 96 = 2 x 3 x 16: whole 16-wide blocks per split
    w = (torch.randn(27, 96, generator=gen) / 10).to(DEVICE)
    b = torch.randn(27, generator=gen).to(DEVICE)
    residual = (10 * torch.randn(37, 27, generator=gen)).to(DEVICE)
    tiles = (32, 16, 16, 4, 1)
    for gelu, res in ((True, None), (False, residual)):
        out = fp32_linear_triton(x, w, b, gelu, precision=precision, tiles=tiles, residual=res, split_k=split_k)
        ref = fp32_linear_reference(x.double(), w.double(), b.double(), gelu,
                                    None if res is None else res.double())
        scale = x.double().abs() @ w.double().abs().T + b.double().abs() + (0 if res is None else res.double().abs())
        assert ((out.double() - ref).abs() / scale).max().item() <= 1e-6  # 96-term fp32 sums: a few 2^-24
        again = fp32_linear_triton(x, w, b, gelu, precision=precision, tiles=tiles, residual=res, split_k=split_k)
        assert torch.equal(out, again)
    one_pass = fp32_linear_triton(x, w, b, precision=precision, tiles=tiles, residual=residual, split_k=1)
    assert not torch.equal(out, one_pass)
    with pytest.raises(AssertionError, match="whole blocks"):
        fp32_linear_triton(x, w, b, precision=precision, tiles=tiles, split_k=4)  # 96 / 4 = 24: not whole blocks


def test_pick_split_k_by_waves():
    # 132 SMs, 32-wide K blocks, shares of at least 512
    assert pick_split_k(tiles=36, k=6144, block_k=32, num_sms=132) == 3    # 108 programs: one wave, 1/3 each
    assert pick_split_k(tiles=108, k=6144, block_k=32, num_sms=132) == 6   # 5 waves of 1/6: 0.83 of one
    assert pick_split_k(tiles=132, k=6144, block_k=32, num_sms=132) == 1   # exactly one wave already
    assert pick_split_k(tiles=144, k=1536, block_k=32, num_sms=132) == 3   # 2 waves -> 4 waves of 1/3
    assert pick_split_k(tiles=333, k=1536, block_k=32, num_sms=132) == 1   # above two waves: never split
    assert pick_split_k(tiles=36, k=768, block_k=32, num_sms=132) == 1     # a share would be < 512
    assert pick_split_k(tiles=36, k=6144, block_k=32, num_sms=132, max_splits=1) == 1


def test_split_tf32_rounds_to_nearest():
    """w_hi and w_lo are TF32 values (low 13 of 23 mantissa bits clear), w_hi the NEAREST one: |w_lo| <=
    2^-11 |w| and the tails of positive weights take both signs (truncated heads leave tails with the
    weight's sign, whose dropped products then add up over K: the presplit kernel failed its GPU test that
    way); w_hi + w_lo is w within TF32's rounding of the tail (2^-22 |w|)."""
    from ops.fp32_linear import split_tf32

    w = torch.randn(33, 17, generator=torch.Generator().manual_seed(9)).to(DEVICE) * 3
    hi, lo = split_tf32(w.t())  # a transposed view: split_tf32 works on a contiguous copy
    wt = w.t().contiguous()
    assert int((hi.view(torch.int32) & 8191).abs().max()) == 0
    assert int((lo.view(torch.int32) & 8191).abs().max()) == 0
    assert (lo.abs() <= wt.abs() * 2 ** -11).all()
    assert ((hi + lo - wt).abs() <= wt.abs() * 2 ** -22).all()
    _, lo_positive = split_tf32(wt.abs() + 0.5)
    assert (lo_positive > 0).any() and (lo_positive < 0).any()


def test_split_kernel_equals_the_torch_split():
    """The one-pass split kernel gives the torch statement's hi and lo bit for bit, also from a transposed
    (non-contiguous) weight, the codec's upsampling layout."""
    from ops.fp32_linear import split_tf32, split_tf32_reference

    w = torch.randn(37, 70, generator=torch.Generator().manual_seed(4)).to(DEVICE) * 5
    for weight in (w, w.t()):
        hi, lo = split_tf32(weight)
        ref_hi, ref_lo = split_tf32_reference(weight.contiguous())
        assert hi.is_contiguous() and torch.equal(hi, ref_hi) and torch.equal(lo, ref_lo)


def test_split_into_out_and_the_pre_split_weight_through_the_op():
    """split_tf32(w, out=) writes the same halves into the caller's [2, N, K] memory (the codec keeps its
    decoder's weights split there, re-split in place), and fp32_linear with weight_lo (the custom op's
    pre-split argument) gives the per-call split's result bit for bit: same products, no split kernel run.
    A wrong w_lo changes the result, so the argument is read."""
    from ops import fp32_linear as module
    from ops.fp32_linear import split_tf32

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 11, 40, generator=gen).to(DEVICE)
    w = (torch.randn(27, 40, generator=gen) / 6).to(DEVICE)
    b = torch.randn(27, generator=gen).to(DEVICE)
    r = torch.randn(3, 11, 27, generator=gen).to(DEVICE)
    table = torch.full((2, 27, 40), float("nan"), device=DEVICE)
    pointer = table.data_ptr()
    hi, lo = split_tf32(w, out=table)
    assert table.data_ptr() == pointer and hi.data_ptr() == pointer
    assert all(torch.equal(a, e) for a, e in zip(split_tf32(w), table))
    per_call = fp32_linear(x, w, b, True, presplit=True, residual=r)
    calls = []
    real_split = module.split_tf32
    module.split_tf32 = lambda *a, **k: calls.append(1) or real_split(*a, **k)
    try:
        pre_split = fp32_linear(x, table[0], b, True, presplit=True, residual=r, weight_lo=table[1])
    finally:
        module.split_tf32 = real_split
    assert calls == [] and torch.equal(pre_split, per_call)
    assert not torch.equal(fp32_linear(x, table[0], b, True, presplit=True, residual=r, weight_lo=2 * table[1]),
                           per_call)


def test_pre_split_weight_needs_the_kernel(monkeypatch):
    """Off Triton the torch reference needs the unsplit weight: a pre-split one is refused, not multiplied."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cuda":
        pytest.skip("the kernel always runs on CUDA")
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="unsplit"):
        fp32_linear(torch.randn(2, 8), w, None, presplit=True, weight_lo=w)


def test_strided_weight_and_launcher():
    """A transposed weight view (the codec's upsampling matmul) and a non-contiguous x are accepted."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(24, 30, generator=gen).to(DEVICE).t()  # [30, 24], K-stride 30
    x = torch.randn(24, 50, generator=gen).to(DEVICE).t()  # [50, 24] non-contiguous
    out = fp32_linear(x, w, None)
    assert _relative_error(out, x, w, None) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(128 * 9, 1536, 6144), (128 * 441, 1536, 384), (441, 384, 1536), (9, 6144, 1536),
                                   (32 * 9, 6144, 1536), (128 * 9, 6144, 1536)])  # the last two: split-K (pick_split_k)
def test_gpu_codec_shapes_are_fp32_accurate(m, k, n):
    """At the codec decoder's shapes: 3xTF32 within 2e-6 of float64 (relative to sum |x w|), like an IEEE
    fp32 GEMM, and over 10x closer than a single TF32 product -- so this is not TF32 in disguise."""
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).cuda()
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).cuda()
    b = (torch.randn(n, generator=gen) * 0.1).cuda()
    for gelu in (False, True):
        assert _relative_error(fp32_linear_triton(x, w, b, gelu), x, w, b, gelu) <= 2e-6
        presplit = fp32_linear_triton(x, w, b, gelu, precision="tf32x3w")
        assert _relative_error(presplit, x, w, b, gelu) <= 2e-6
    x3 = _relative_error(fp32_linear_triton(x, w, b), x, w, b)
    assert _relative_error(fp32_linear_triton(x, w, b, precision="tf32"), x, w, b) >= 10 * x3
