"""fp32-accurate linear from three fp16 products (ops/fp16x3_linear.py) vs float64 (TRITON_INTERPRET=1 on
CPU), the splits' exactness, and full-shape GPU tests.

Errors are relative to sum_k |x_k w_k| (+ |b|, + |residual|), the natural scale of a dot product's fp32
rounding error, as in test_fp32_linear.py. Inputs have rows and output channels whose sizes differ by
many orders of magnitude, zero rows, and K and N that are not multiples of the 64-column scale block, so
the scaling and every edge mask are exercised."""
import pytest
import torch
import torch.nn.functional as F

from ops.fp16x3_linear import (
    SCALE_BLOCK,
    Fp16Split,
    fp16x3_linear,
    fp16x3_linear_op,
    fp16x3_linear_reference,
    fp16x3_linear_split_op,
    fp16x3_linear_triton,
    merge_fp16_split,
    split_fp16_rows,
    split_fp16_rows_op,
    split_fp16_rows_reference,
    split_fp16_weight,
    unpack_weight_split,
    weight_split_numel,
)
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _inputs(m: int, k: int, n: int, seed: int, spread: float = 7.0):
    """x [m, k] with row sizes e^U(-spread, spread) (one zero row), w [n, k] with channel sizes e^U(-3, 3),
    b [n], residual [m, n]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.empty(m, 1).uniform_(-spread, spread, generator=gen))
    x[min(1, m - 1)] = 0.0
    w = torch.randn(n, k, generator=gen) * k ** -0.5 * torch.exp(torch.empty(n, 1).uniform_(-3, 3, generator=gen))
    b = torch.randn(n, generator=gen)
    r = 10 * torch.randn(m, n, generator=gen)
    return (t.to(DEVICE) for t in (x, w, b, r))


def _relative_error(out, x, w, b=None, gelu=False, residual=None) -> float:
    ref = fp16x3_linear_reference(x.double(), w.double(), None if b is None else b.double(), gelu,
                                  None if residual is None else residual.double())
    scale = x.double().abs() @ w.double().abs().T
    scale = scale + (0 if b is None else b.double().abs()) + (0 if residual is None else residual.double().abs())
    return ((out.double() - ref).abs() / scale.clamp_min(1e-300)).max().item()


def test_row_split_kernel_equals_the_reference_bit_for_bit():
    """The split kernel and the torch statement give the same halves and scales, bit for bit, at sizes from
    1e-30 to 1e30 and for zeros; the halves carry x to 2^-22 of each 64-column block's max; every scaled
    block's max is in [2^14, 2^15]."""
    x, _, _, _ = _inputs(70, 150, 8, seed=1, spread=60.0)  # 150 = 2 x 64 + 22: a partial last block
    got, ref = split_fp16_rows(x), split_fp16_rows_reference(x.cpu())
    for a, e in zip(got, ref):
        assert torch.equal(a.cpu(), e)
    assert got.hi.dtype == got.lo.dtype == torch.float16 and got.inv.shape == (70, 3)
    blocks = torch.nn.functional.pad(x.cpu().abs(), (0, 3 * SCALE_BLOCK - 150)).view(70, 3, SCALE_BLOCK).amax(2)
    live = blocks > 1e-30
    scaled_max = (got.hi.float().cpu().abs().view(70, -1)[:, :150])
    scaled_max = torch.nn.functional.pad(scaled_max, (0, 3 * SCALE_BLOCK - 150)).view(70, 3, SCALE_BLOCK).amax(2)
    assert ((scaled_max[live] >= 2 ** 14) & (scaled_max[live] <= 2 ** 15)).all()
    err = (merge_fp16_split(got).cpu().double() - x.cpu().double()).abs()
    bound = blocks.repeat_interleave(SCALE_BLOCK, 1)[:, :150].double() * 2 ** -22
    assert (err <= bound).all()
    assert torch.equal(merge_fp16_split(got)[1], torch.zeros(150, device=DEVICE))


def test_weight_split_packs_and_reconstructs():
    """split_fp16_weight: one power-of-two scale per output channel, the halves within 2^-22 of each
    channel's max, written into the caller's packed buffer in place (the codec keeps them there)."""
    _, w, _, _ = _inputs(2, 100, 37, seed=2)
    split = split_fp16_weight(w)
    mantissa, _ = torch.frexp(split.inv)
    assert (mantissa == 0.5).all()  # powers of two
    err = (merge_fp16_split(split).double() - w.double()).abs()
    assert (err <= w.double().abs().amax(1, keepdim=True) * 2 ** -22).all()
    packed = torch.full((weight_split_numel(37, 100),), float("nan"), dtype=torch.float16, device=DEVICE)
    pointer = packed.data_ptr()
    into = split_fp16_weight(w, out=packed)
    assert into.hi.data_ptr() == pointer
    views = unpack_weight_split(packed, 37, 100)
    assert all(torch.equal(a, e) for a, e in zip(views, split)) and not torch.isnan(packed).any()


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_float64(gelu, with_bias, with_residual):
    """Within 1e-6 of float64 relative to sum |x w| (+ |b| + |r|), as the fp32 reference is: ~100-term fp32
    sums and erf in fp32 are a few 2^-24, and the splits' ~2^-22."""
    x, w, b, r = _inputs(70, 150, 90, seed=3 + 2 * gelu + with_bias + 4 * with_residual)
    b = b if with_bias else None
    r = r if with_residual else None
    out = fp16x3_linear_triton(split_fp16_rows(x), split_fp16_weight(w), b, gelu, r, tiles=(32, 64, 4, 1))
    assert out.shape == (70, 90) and out.dtype == torch.float32
    assert _relative_error(out, x, w, b, gelu, r) <= 1e-6
    assert _relative_error(fp16x3_linear_reference(x, w, b, gelu, r), x, w, b, gelu, r) <= 1e-6
    if not gelu and not with_bias and not with_residual:
        assert (out[1] == 0).all()  # the zero row


def test_split_output_is_the_split_of_the_fp32_output():
    """split_out: the epilogue writes y already split, bit for bit what splitting the fp32 y gives (so the
    next GEMM reads the same operands either way)."""
    x, w, b, _ = _inputs(70, 150, 130, seed=4)  # 130 = 2 x 64 + 2: a partial scale block in the output
    xs, ws = split_fp16_rows(x), split_fp16_weight(w)
    for tiles in ((32, 64, 4, 1), (64, 128, 4, 1)):
        y = fp16x3_linear_triton(xs, ws, b, True, tiles=tiles)
        ys = fp16x3_linear_triton(xs, ws, b, True, split_out=True, tiles=tiles)
        assert isinstance(ys, Fp16Split) and ys.inv.shape == (70, 3)
        assert all(torch.equal(a, e) for a, e in zip(ys, split_fp16_rows(y))), tiles


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_matches_float64(split_k):
    """K cut into split_k shares of whole scale blocks (partial sums to scratch, summed in order with the
    epilogue, or the split output): as accurate as one pass, deterministic, and not the one-pass result bit
    for bit (the split path ran)."""
    x, w, b, r = _inputs(37, 6 * SCALE_BLOCK, 27, seed=10 + split_k)
    xs, ws = split_fp16_rows(x), split_fp16_weight(w)
    tiles = (32, 64, 4, 1)
    for gelu, res in ((True, None), (False, r)):
        out = fp16x3_linear_triton(xs, ws, b, gelu, res, tiles=tiles, split_k=split_k)
        assert _relative_error(out, x, w, b, gelu, res) <= 1e-6
        assert torch.equal(out, fp16x3_linear_triton(xs, ws, b, gelu, res, tiles=tiles, split_k=split_k))
    assert not torch.equal(out, fp16x3_linear_triton(xs, ws, b, False, r, tiles=tiles, split_k=1))
    split_out = fp16x3_linear_triton(xs, ws, b, True, tiles=tiles, split_k=split_k, split_out=True)
    assert all(torch.equal(a, e) for a, e in
               zip(split_out, split_fp16_rows(fp16x3_linear_triton(xs, ws, b, True, tiles=tiles, split_k=split_k))))
    with pytest.raises(AssertionError, match="whole blocks"):
        fp16x3_linear_triton(xs, ws, b, tiles=tiles, split_k=4)  # 6 blocks in 4 shares


def test_no_rows():
    _, w, b, _ = _inputs(2, 40, 20, seed=5)
    x = torch.empty(0, 40, device=DEVICE)
    assert fp16x3_linear(split_fp16_rows(x), split_fp16_weight(w), b).shape == (0, 20)


def test_torch_path_multiplies_what_the_splits_stand_for(monkeypatch):
    """Off Triton (the CPU without the interpreter) the launcher multiplies the values the splits stand for
    in fp32, and splits rows by the reference, so a caller's code runs the same everywhere."""
    if DEVICE == "cuda":
        pytest.skip("the kernel always runs on CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, b, r = _inputs(30, 100, 20, seed=6)
    xs, ws = split_fp16_rows(x), split_fp16_weight(w)
    out = fp16x3_linear(xs, ws, b, True)
    assert _relative_error(out, x, w, b, True) <= 1e-6
    assert torch.equal(out, fp16x3_linear_reference(merge_fp16_split(xs), merge_fp16_split(ws), b, True))
    assert all(torch.equal(a, e) for a, e in zip(fp16x3_linear(xs, ws, b, True, split_out=True),
                                                  split_fp16_rows_reference(out)))
    merged = F.linear(merge_fp16_split(xs), merge_fp16_split(ws), b)
    assert torch.equal(fp16x3_linear(xs, ws, b, residual=r), r + merged)


def test_opcheck():
    """The custom ops (opaque to torch.compile): schema, fake shapes and dtypes, AOT dispatch."""
    x, w, b, r = _inputs(40, 100, 70, seed=7)
    xs, ws = split_fp16_rows(x), split_fp16_weight(w)
    for op, args in ((split_fp16_rows_op, (x,)), (fp16x3_linear_op, (*xs, *ws, b, True, r)),
                     (fp16x3_linear_op, (*xs, *ws, None, False, None)), (fp16x3_linear_split_op, (*xs, *ws, b, True))):
        torch.library.opcheck(op, tuple(a.clone() if torch.is_tensor(a) else a for a in args), test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(128 * 9, 1536, 6144), (128 * 441, 1536, 384), (128 * 441, 384, 1536),
                                   (128 * 63, 768, 2688), (9 * 64, 6144, 1536),
                                   (32 * 9, 6144, 1536)])  # the last two: split-K (pick_split_k)
def test_gpu_codec_shapes_are_fp32_accurate(m, k, n):
    """At the codec decoder's shapes: within 2e-6 of float64 (relative to sum |x w|), as the 3xTF32
    kernel's GPU test, with rows 1e-3..1e3 apart; the split output is the split of the fp32 output, bit
    for bit; and over 10x closer than one fp16 product of the scaled heads would be."""
    x, w, b, r = _inputs(m, k, n, seed=m + n)
    xs, ws = split_fp16_rows(x), split_fp16_weight(w)
    for gelu in (False, True):
        out = fp16x3_linear(xs, ws, b, gelu)
        assert _relative_error(out, x, w, b, gelu) <= 2e-6, gelu
    assert all(torch.equal(a, e) for a, e in zip(fp16x3_linear(xs, ws, b, True, split_out=True),
                                                  split_fp16_rows(fp16x3_linear(xs, ws, b, True))))
    assert _relative_error(fp16x3_linear(xs, ws, b, residual=r), x, w, b, residual=r) <= 2e-6
    heads_only = fp16x3_linear(Fp16Split(xs.hi, torch.zeros_like(xs.lo), xs.inv),
                               Fp16Split(ws.hi, torch.zeros_like(ws.lo), ws.inv), b)
    assert _relative_error(heads_only, x, w, b) >= 10 * _relative_error(fp16x3_linear(xs, ws, b), x, w, b)
