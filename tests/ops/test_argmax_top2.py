"""argmax + top-2 kernel (TRITON_INTERPRET=1 on CPU; the text head's shape on the GPU) against torch's argmax and
topk: equal exactly (every output is an input value or its index), ties and repeated maxima included."""
import pytest
import torch

from ops.argmax_top2 import argmax_top2, argmax_top2_op, argmax_top2_reference, argmax_top2_triton
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _check(x, block=None):
    index, top2 = argmax_top2_triton(x, block) if block else argmax_top2(x)
    ref_index, ref_top2 = argmax_top2_reference(x)
    assert index.dtype == torch.int64 and top2.dtype == torch.float32
    assert torch.equal(index, ref_index), (index, ref_index)
    assert torch.equal(top2, ref_top2), (top2, ref_top2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,vocab,block", [(3, 1000, 128), (5, 64, 16), (2, 4097, 1024), (4, 300, None)])
def test_equals_torch(dtype, batch, vocab, block):
    gen = torch.Generator().manual_seed(batch * vocab)
    x = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype).to(DEVICE)
    _check(x, block)


def test_ties_and_repeated_maxima():
    """bf16 logits tie often. Row 0: the maximum twice in one chunk; row 1: in two chunks (the first index, and
    top-2 the maximum twice); row 2: the runner-up in another chunk than the maximum; row 3: all equal;
    row 4: -inf everywhere but one entry. Strided rows (a view of wider logits)."""
    x = torch.zeros(5, 96)
    x[:, :] = torch.linspace(-2, 1, 96)
    x[0, 5] = x[0, 9] = 7.0
    x[1, 3] = x[1, 70] = 7.0
    x[2, 80] = 9.0
    x[2, 10] = 8.5
    x[3] = 0.25
    x[4] = float("-inf")
    x[4, 40] = -3.0
    wide = torch.zeros(5, 100, dtype=torch.bfloat16)
    wide[:, 2:98] = x.to(torch.bfloat16)
    view = wide[:, 2:98].to(DEVICE)
    for block in (16, 32, 128):
        _check(view, block)
    index, top2 = argmax_top2_triton(view, 16)
    assert index.tolist() == [5, 3, 80, 0, 40]
    assert top2[1].tolist() == [7.0, 7.0] and top2[2].tolist() == [9.0, 8.5]
    torch.library.opcheck(argmax_top2_op, (view,), test_utils=OPCHECK_TESTS)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 128])
def test_gpu_text_head_shape(batch):
    """The LLM's 131072-token text logits in bf16, rounded to few values so ties happen."""
    gen = torch.Generator().manual_seed(batch)
    x = (torch.randn(batch, 131072, generator=gen) * 4).round().to(torch.bfloat16).cuda()
    _check(x)
