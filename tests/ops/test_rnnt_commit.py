"""RNN-T symbol-step commit kernel (TRITON_INTERPRET=1 on CPU; the full shape on the GPU) against its torch
statements: bit for bit (an exact maximum, its first index, selections)."""
import pytest
import torch

from ops.rnnt_commit import rnnt_commit, rnnt_commit_op, rnnt_commit_reference, rnnt_commit_triton
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _inputs(gen, batch, vocab, layers, hidden, dtype=torch.float32, device=DEVICE):
    blank = vocab - 1
    logits = torch.randn(batch, vocab, generator=gen)
    logits[: batch // 3, blank] = 100.0  # a third of the rows pick blank
    active = torch.rand(batch, generator=gen) < 0.7
    h_next, h, c_next, c = (torch.randn(layers, batch, hidden, generator=gen) for _ in range(4))
    last = torch.randint(0, vocab, (batch,), generator=gen)
    tokens = torch.full((batch, 5), -7, dtype=torch.int64)
    return [t.to(device, dtype) if t.is_floating_point() else t.to(device)
            for t in (logits, active, h_next, h, c_next, c, last, tokens)], blank


@pytest.mark.parametrize("batch,vocab,layers,hidden", [(9, 17, 2, 12), (6, 1025, 2, 640)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_torch_statements(batch, vocab, layers, hidden, dtype):
    gen = torch.Generator().manual_seed(batch + vocab)
    (logits, active, h_next, h, c_next, c, last, tokens), blank = _inputs(gen, batch, vocab, layers, hidden, dtype)
    want = [t.clone() for t in (active, h, c, last, tokens)]
    rnnt_commit_reference(logits, blank, want[0], h_next, want[1], c_next, want[2], want[3], want[4], 3)
    rnnt_commit_triton(logits, blank, active, h_next, h, c_next, c, last, tokens, 3)
    for got, ref in zip((active, h, c, last, tokens), want):
        assert torch.equal(got, ref)
    assert 0 < int(active.sum()) < batch  # some rows emitted, some did not


def test_ties_take_the_first_index_and_opcheck():
    gen = torch.Generator().manual_seed(3)
    (logits, active, h_next, h, c_next, c, last, tokens), blank = _inputs(gen, 4, 9, 2, 8)
    logits[:] = 0.0
    logits[:, 2] = logits[:, 5] = 1.0  # a tie for the maximum: the first index, 2
    active[:] = True
    rnnt_commit(logits, blank, active, h_next, h, c_next, c, last, tokens, 0)
    assert (tokens[:, 0] == 2).all() and (last == 2).all() and active.all() and torch.equal(h, h_next)
    args = [t.clone() for t in _inputs(torch.Generator().manual_seed(4), 3, 9, 2, 8)[0]]
    torch.library.opcheck(rnnt_commit_op, (args[0], 8, *args[1:], 1), test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
def test_gpu_full_shape():
    """128 rows, the RNN-T's 1025 logits, 2 layers x 640 (bf16): bit for bit as above."""
    gen = torch.Generator().manual_seed(5)
    (logits, active, h_next, h, c_next, c, last, tokens), blank = _inputs(gen, 128, 1025, 2, 640, torch.bfloat16,
                                                                          "cuda")
    want = [t.clone() for t in (active, h, c, last, tokens)]
    rnnt_commit_reference(logits, blank, want[0], h_next, want[1], c_next, want[2], want[3], want[4], 4)
    rnnt_commit(logits, blank, active, h_next, h, c_next, c, last, tokens, 4)
    for got, ref in zip((active, h, c, last, tokens), want):
        assert torch.equal(got, ref)
