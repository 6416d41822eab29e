"""Codebook sum kernel (TRITON_INTERPRET=1 on CPU; the codec's shape on the GPU) against its torch statement:
bit for bit (the same fp32 additions in the same order)."""
import pytest
import torch

from ops.codebook_sum import codebook_sum, codebook_sum_op, codebook_sum_reference, codebook_sum_triton
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _inputs(gen, lead, books, codewords, width, device=DEVICE):
    tables = (torch.randn(books, codewords, width, generator=gen) * 0.7 ** torch.arange(books)[:, None, None]).to(device)
    codes = torch.randint(0, codewords, (*lead, books), generator=gen).to(device)
    return codes, tables


@pytest.mark.parametrize("lead,books,codewords,width", [((5,), 31, 16, 8), ((2, 3), 4, 10, 24), ((2,), 31, 1024, 512)])
def test_kernel_equals_the_torch_statement(lead, books, codewords, width):
    gen = torch.Generator().manual_seed(books + width)
    codes, tables = _inputs(gen, lead, books, codewords, width)
    out = codebook_sum_triton(codes, tables)
    ref = codebook_sum_reference(codes, tables)
    assert out.shape == (*lead, width) and torch.equal(out, ref)
    # the order matters for the last bits: summing the other way round is not what the kernel does
    backwards = sum(tables[i][codes[..., i]] for i in reversed(range(books)))
    assert books < 8 or not torch.equal(out, backwards)


def test_bf16_tables_sum_in_fp32_and_repeat_rows():
    """The talker's use: bf16 tables (the padded code table viewed [Q, K + 1, D]), summed in fp32 in codebook
    order and rounded once, bit for bit the reference; a bf16 running sum (rounded at every add) is not what
    the kernel does. `repeat=2` writes the rows twice over (both CFG streams), and opcheck covers it."""
    gen = torch.Generator().manual_seed(9)
    codes, tables = _inputs(gen, (6,), 31, 17, 40)
    tables = tables.bfloat16()
    out = codebook_sum_triton(codes, tables)
    ref = codebook_sum_reference(codes, tables)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    torch.testing.assert_close(out.double(), sum(tables[i][codes[:, i]].double() for i in range(31)),
                               rtol=2 ** -8, atol=0)
    bf16_running = tables[0][codes[:, 0]]
    for i in range(1, 31):
        bf16_running = bf16_running + tables[i][codes[:, i]]
    assert not torch.equal(out, bf16_running)
    twice = codebook_sum(codes, tables, repeat=2)
    assert twice.shape == (12, 40) and torch.equal(twice[:6], out) and torch.equal(twice[6:], out)
    assert torch.equal(codebook_sum_reference(codes, tables, repeat=2), twice)
    torch.library.opcheck(codebook_sum_op, (codes, tables, 2), test_utils=OPCHECK_TESTS)


def test_codec_dequantize_and_opcheck():
    """The codec's dequantize (through the stacked codebooks) equals the plain per-codebook sum."""
    from nemo_duplex.models.codec import RVQCodec
    from nemo_duplex.models.config import tiny_config

    codec = RVQCodec(tiny_config().codec).to(DEVICE)
    codec.init_weights(torch.Generator().manual_seed(0))
    codes = torch.randint(0, codec.cfg.codebook_size, (3, 2, codec.cfg.num_quantizers),
                          generator=torch.Generator().manual_seed(1)).to(DEVICE)
    plain = codec.prvq.mus_list[0][codes[..., 0]]
    for i in range(1, codec.cfg.num_quantizers):
        plain = plain + codec.prvq.mus_list[i][codes[..., i]]
    assert torch.equal(codec.dequantize(codes), plain)
    torch.library.opcheck(codebook_sum_op, (codes, codec.prvq.stacked()), test_utils=OPCHECK_TESTS)


def test_stacked_copy_follows_the_weights():
    """The stacked codebooks are rebuilt after the weights are drawn again or a state_dict is loaded."""
    from nemo_duplex.models.codec import RVQCodec
    from nemo_duplex.models.config import tiny_config

    codec = RVQCodec(tiny_config().codec)
    codec.init_weights(torch.Generator().manual_seed(0))
    first = codec.prvq.stacked().clone()
    codec.init_weights(torch.Generator().manual_seed(1))
    assert not torch.equal(codec.prvq.stacked(), first)
    assert torch.equal(codec.prvq.stacked(), torch.stack(list(codec.prvq.mus_list)))
    other = RVQCodec(tiny_config().codec)
    other.init_weights(torch.Generator().manual_seed(2))
    codec.load_state_dict(other.state_dict())
    assert torch.equal(codec.prvq.stacked(), torch.stack(list(other.prvq.mus_list)))


@pytest.mark.gpu
def test_gpu_codec_shape():
    """128 calls x 31 codebooks of 1024 x 512: bit for bit."""
    codes, tables = _inputs(torch.Generator().manual_seed(3), (128, 1), 31, 1024, 512, device="cuda")
    assert torch.equal(codebook_sum(codes, tables), codebook_sum_reference(codes, tables))
