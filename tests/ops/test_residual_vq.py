"""The talker's RVQ kernel (ops/residual_vq.py: one kernel per codebook, a 64-bit atomic min merging the
codeword blocks) against its torch reference (a distance GEMM, argmin and subtraction per book).

On the CPU (TRITON_INTERPRET=1) and fp32: the codes equal the reference's. The distances are summed in
another order than the reference's GEMM, so on the GPU a code may differ where two codewords' distances
are within rounding: there every differing code must be such a near-tie (float64 distance gap <= 1e-5 of
the distances' scale), and >= 99.9% of codes equal."""
import pytest
import torch

from ops.residual_vq import residual_vq, residual_vq_op, residual_vq_reference, residual_vq_triton
from tests.ops.support import OPCHECK_TESTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(gen, batch, k, codewords, width, scale=1.0, device=DEVICE):
    z = (torch.randn(batch, width, generator=gen) * scale).to(device)
    books = (torch.randn(k, codewords, width, generator=gen) * width ** -0.5).to(device)
    return z, books, books.pow(2).sum(-1)


def _assert_differences_are_near_ties(z, books, codes, ref, rel=1e-5):
    """Walk each row along the reference's codes; at a row's first differing code, the two codewords' float64
    distances from the reference's residual must be within `rel` of the distances' scale (later codes of
    that row follow another residual and are not compared)."""
    r = z.double()
    b64 = books.double()
    alive = torch.ones(z.shape[0], dtype=torch.bool, device=z.device)
    for i in range(books.shape[0]):
        d = b64[i].pow(2).sum(-1)[None, :] - 2 * r @ b64[i].T
        differ = alive & (codes[:, i] != ref[:, i])
        if differ.any():
            rows = differ.nonzero()[:, 0]
            gap = (d[rows, codes[rows, i]] - d[rows, ref[rows, i]]).abs()
            assert (gap <= rel * d[rows].abs().max(-1).values).all(), gap
        alive &= ~differ
        r = r - b64[i][ref[:, i]]


@pytest.mark.parametrize("batch,k,codewords,width,blocks", [
    (5, 3, 64, 32, (16, 16, 16)),     # fewer rows than a block; 4 codeword blocks merged per row
    (20, 4, 128, 64, (16, 32, 32)),   # two row blocks, the last partial
    (1, 2, 64, 48, (16, 64, 16)),     # one codeword block (no merge across programs)
    (3, 5, 256, 128, None),           # the launcher's choice
])
def test_kernel_equals_the_reference(batch, k, codewords, width, blocks):
    gen = torch.Generator().manual_seed(batch * 100 + k)
    for scale in (1.0, 8.0):  # 8: most distances negative (|r| >> |e|), the key's negative branch
        z, books, norms = _inputs(gen, batch, k, codewords, width, scale)
        codes = residual_vq_triton(z, books, norms, blocks)
        ref = residual_vq_reference(z, books, norms)
        assert codes.dtype == torch.int64 and codes.shape == (batch, k)
        assert torch.equal(codes, ref), (codes, ref)
        if scale == 8.0:
            assert (norms[0][ref[:, 0]] - 2 * (z * books[0][ref[:, 0]]).sum(-1) < 0).all()


def test_ties_take_the_first_index_across_blocks():
    """Two equal codewords in different codeword blocks (so in different programs, merged by the atomic min):
    the lower index, as torch.argmin; also when the later copy's block is the first to finish (any order)."""
    gen = torch.Generator().manual_seed(0)
    z, books, _ = _inputs(gen, 6, 2, 64, 16)
    z0 = z[:, :]
    books[0, 40] = books[0, 5] = z0[0] * 0.5   # row 0's nearest, twice: blocks 0 and 2 of 16
    books[1, 63] = books[1, 17] = 0.0          # row r of book 1 may pick 17, never 63
    norms = books.pow(2).sum(-1)
    codes = residual_vq_triton(z, books, norms, (16, 16, 16))
    ref = residual_vq_reference(z, books, norms)
    assert codes[0, 0] == 5 and torch.equal(codes, ref)
    assert not (codes[:, 1] == 63).any()


def test_dispatch_and_custom_op():
    gen = torch.Generator().manual_seed(1)
    z, books, norms = _inputs(gen, 4, 3, 64, 32)
    assert torch.equal(residual_vq(z, books), residual_vq_reference(z, books, norms))  # norms computed
    torch.library.opcheck(residual_vq_op, (z, books, norms), test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("calls", [1, 32, 128, 129])
def test_full_shape_on_the_gpu(calls):
    """The talker's shape (31 books of 1024 x 512) on the H200 against the cuBLAS reference."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    gen = torch.Generator().manual_seed(calls)
    z, books, norms = _inputs(gen, calls, 31, 1024, 512, device="cuda")
    codes = residual_vq_triton(z, books, norms)
    ref = residual_vq_reference(z, books, norms)
    assert (codes == ref).float().mean().item() >= 0.999
    _assert_differences_are_near_ties(z, books, codes, ref)
    assert torch.equal(codes, residual_vq_triton(z, books, norms))  # deterministic (atomic min is order-free)
