"""Residual-quantisation kernel (TRITON_INTERPRET=1 on CPU; the talker's shape on the GPU) against its torch
statements (GEMM distances, argmin, gather, subtract) and against float64.

The kernel sums each distance's dot product in another order than the reference GEMM, so a code may differ
only where the reference's two best distances are within fp32 rounding of each other: every differing code
is checked to be such a near-tie (margin below 1e-5 relative to the distances' scale), and on these seeded
inputs none differ at all."""
import pytest
import torch

from ops.rvq_quantise import rvq_quantise, rvq_quantise_op, rvq_quantise_reference, rvq_quantise_triton
from tests.ops.support import OPCHECK_TESTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEAR_TIE = 1e-5


def _inputs(gen, batch, books, codewords, width, device=DEVICE):
    z = torch.randn(batch, width, generator=gen) * 0.5
    book = torch.randn(books, codewords, width, generator=gen) / width ** 0.5
    return z.to(device), book.to(device), book.pow(2).sum(-1).to(device)


def _float64_path(z, books, codes):
    """The distances of every decision along `codes`' own path, in float64 -> (margin of the chosen code over
    the best other one, relative to the distances' scale) [B, k], and whether the chosen code is a minimum
    within that margin's tolerance."""
    r = z.double()
    margins, chosen_ok = [], []
    for i, book in enumerate(books.double()):
        distances = book.pow(2).sum(-1)[None, :] - 2 * r @ book.T
        scale = distances.abs().amax(-1)
        picked = distances.gather(1, codes[:, i:i + 1])[:, 0]
        best = distances.min(-1).values
        chosen_ok.append(picked - best <= NEAR_TIE * scale)
        top2 = distances.topk(2, largest=False).values
        margins.append((top2[:, 1] - top2[:, 0]) / scale)
        r = r - book[codes[:, i]]
    return torch.stack(margins, -1), torch.stack(chosen_ok, -1)


def _assert_same_codes_but_near_ties(got, ref, z, books):
    margins, ok = _float64_path(z.cpu(), books.cpu(), ref.cpu())
    differ = (got != ref).cpu()
    if differ.any():  # only the first difference per row matters: the paths part there
        first = differ.float().argmax(-1)
        rows = differ.any(-1).nonzero()[:, 0]
        assert (margins[rows, first[rows]] < NEAR_TIE).all(), margins[rows, first[rows]]
    _, got_ok = _float64_path(z.cpu(), books.cpu(), got.cpu())
    assert ok.all() and got_ok.all()   # every decision of both paths is a minimum in float64 (within rounding)
    return int(differ.sum())


@pytest.mark.parametrize("batch,books,codewords,width", [(5, 3, 64, 32), (3, 31, 64, 32), (40, 4, 100, 24),
                                                         (2, 3, 1024, 512), (17, 1, 48, 32)])
def test_kernel_equals_the_torch_statements(batch, books, codewords, width):
    gen = torch.Generator().manual_seed(batch + books + codewords + width)
    z, book, norms = _inputs(gen, batch, books, codewords, width)
    got = rvq_quantise_triton(z, book, norms)
    ref = rvq_quantise_reference(z, book, norms)
    assert got.dtype == torch.int64 and got.shape == (batch, books)
    assert _assert_same_codes_but_near_ties(got, ref, z, book) == 0


def test_each_step_removes_the_chosen_codeword():
    """z built as a sum of codewords from successive books (large first): greedy RVQ finds them back."""
    gen = torch.Generator().manual_seed(5)
    _, book, norms = _inputs(gen, 1, 4, 64, 32)
    book = book * torch.tensor([8.0, 4.0, 2.0, 1.0], device=DEVICE)[:, None, None]
    norms = book.pow(2).sum(-1)
    want = torch.tensor([[3, 17, 40, 63], [0, 1, 2, 3], [63, 62, 61, 60]], device=DEVICE)
    z = sum(book[i][want[:, i]] for i in range(4))
    assert torch.equal(rvq_quantise(z, book, norms), want)


def test_ties_take_the_first_index_across_slices():
    """Two identical codewords in different 16-codeword slices of the kernel: the first index, as
    torch.argmin; the residual then continues from either (they are equal)."""
    gen = torch.Generator().manual_seed(7)
    z, book, _ = _inputs(gen, 4, 2, 64, 32)
    book[0, 5] = book[0, 50] = z[0]   # codewords 5 and 50 equal, and equal to row 0's z
    book[0, 20] = book[0, 44] = z[2]
    norms = book.pow(2).sum(-1)
    got = rvq_quantise(z, book, norms)
    assert got[0, 0] == 5 and got[2, 0] == 20
    assert torch.equal(got, rvq_quantise_reference(z, book, norms))
    torch.library.opcheck(rvq_quantise_op, (z, book, norms), test_utils=OPCHECK_TESTS)


def test_rows_are_independent():
    """A row's codes do not depend on the other rows in its launch (row blocks of 32, then of 16)."""
    gen = torch.Generator().manual_seed(9)
    z, book, norms = _inputs(gen, 40, 5, 64, 32)
    together = rvq_quantise(z, book, norms)
    alone = torch.cat([rvq_quantise(z[i:i + 1], book, norms) for i in (0, 17, 39)])
    assert torch.equal(together[[0, 17, 39]], alone)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [32, 128])
def test_gpu_talker_shape(batch):
    """The step's largest pass (22 books x 1024 x 512) at 32 and 128 calls against the torch statements."""
    gen = torch.Generator().manual_seed(batch)
    z, book, norms = _inputs(gen, batch, 22, 1024, 512, device="cuda")
    got = rvq_quantise(z, book, norms)
    ref = rvq_quantise_reference(z, book, norms)
    differing = _assert_same_codes_but_near_ties(got, ref, z, book)
    print(f"B={batch}: {differing} of {got.numel()} codes differ from the torch statements (near-ties only)")
