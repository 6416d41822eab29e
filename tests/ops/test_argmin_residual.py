"""argmin + codeword gather + subtraction kernel (TRITON_INTERPRET=1 on CPU; the talker's shape on the GPU)
against its torch statements: bit for bit (an exact minimum, its first index, one fp32 subtraction)."""
import pytest
import torch

from ops.argmin_residual import argmin_residual, argmin_residual_op, argmin_residual_reference, argmin_residual_triton
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _inputs(gen, batch, codewords, width, device=DEVICE):
    residual = torch.randn(batch, width, generator=gen).to(device)
    book = (torch.randn(codewords, width, generator=gen) / width ** 0.5).to(device)
    distances = book.pow(2).sum(-1)[None, :] - 2 * residual @ book.T
    return distances, residual, book


@pytest.mark.parametrize("batch,codewords,width", [(5, 16, 8), (3, 100, 24), (2, 1024, 512)])
def test_kernel_equals_the_torch_statements(batch, codewords, width):
    gen = torch.Generator().manual_seed(batch + codewords + width)
    args = _inputs(gen, batch, codewords, width)
    idx, out = argmin_residual_triton(*args)
    ref_idx, ref_out = argmin_residual_reference(*args)
    assert idx.dtype == torch.int64 and torch.equal(idx, ref_idx) and torch.equal(out, ref_out)


def test_ties_take_the_first_index_and_strided_rows():
    """Equal minima: the first index, as torch.argmin. Distances as a row-strided slice."""
    gen = torch.Generator().manual_seed(2)
    distances, residual, book = _inputs(gen, 4, 16, 8)
    distances[:, 3] = distances[:, 11] = distances.min() - 1.0  # a tie for the minimum in every row
    wide = torch.zeros(4, 20, device=DEVICE)
    wide[:, 2:18] = distances
    idx, out = argmin_residual(wide[:, 2:18], residual, book)
    assert (idx == 3).all()
    assert torch.equal(out, residual - book[3][None, :])
    torch.library.opcheck(argmin_residual_op, (distances, residual, book), test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
def test_gpu_talker_shape():
    """256 rows (N=128, both CFG streams' worth) x 1024 codewords x 512, against the torch statements."""
    gen = torch.Generator().manual_seed(3)
    args = _inputs(gen, 256, 1024, 512, device="cuda")
    idx, out = argmin_residual(*args)
    ref_idx, ref_out = argmin_residual_reference(*args)
    assert torch.equal(idx, ref_idx) and torch.equal(out, ref_out)
