"""Counter-based RNG kernel (TRITON_INTERPRET=1 on CPU, the GPU where there is one) vs its torch
reference: uniforms bit-identical (integer hash, exact), normals within 2e-6 (log/sqrt/cos rounding);
and the reference's own properties (batch invariance, streams and counters decorrelated, moments)."""
import pytest
import torch

from ops.counter_rng import counter_rng_triton, normal_reference, random_bits_reference, uniform_reference
from tests.ops.support import DEVICE, OPCHECK_TESTS


def _seeds():
    # negative and > 2**32 seeds exercise both halves of the seed; counters up to 2**40
    seed = torch.tensor([0, 1, -7, 2**40 + 3, 123456789, -(2**62)], dtype=torch.int64, device=DEVICE)
    counter = torch.tensor([0, 5, 5, 2**33 + 1, 999, 17], dtype=torch.int64, device=DEVICE)
    return seed, counter


@pytest.mark.parametrize("n", [1, 37, 1024, 3000])
@pytest.mark.parametrize("stream", [1, 3])
def test_uniform_bit_identical(n, stream):
    seed, counter = _seeds()
    out = counter_rng_triton(seed, counter, stream, n, normal=False)
    assert torch.equal(out, uniform_reference(seed, counter, stream, n))
    assert 0.0 <= out.min() and out.max() < 1.0


@pytest.mark.parametrize("n", [5, 512])
def test_normal_matches_reference(n):
    seed, counter = _seeds()
    out = counter_rng_triton(seed, counter, 2, n, normal=True)
    torch.testing.assert_close(out, normal_reference(seed, counter, 2, n), rtol=2e-6, atol=2e-6)


def test_rows_are_independent_of_batch():
    seed, counter = _seeds()
    whole = counter_rng_triton(seed, counter, 1, 300, normal=False)
    for i in range(seed.shape[0]):
        alone = counter_rng_triton(seed[i:i + 1], counter[i:i + 1], 1, 300, normal=False)
        assert torch.equal(alone[0], whole[i])


def test_reference_statistics():
    """Streams, counters and seeds give different draws; moments of 10^6 draws are right."""
    seed = torch.arange(1000, dtype=torch.int64)
    counter = torch.zeros(1000, dtype=torch.int64)
    u = uniform_reference(seed, counter, 1, 1000)
    assert abs(u.mean().item() - 0.5) < 2e-3 and abs(u.var().item() - 1 / 12) < 2e-3
    z = normal_reference(seed, counter, 2, 500)
    assert abs(z.mean().item()) < 5e-3 and abs(z.std().item() - 1) < 5e-3
    bits = random_bits_reference(seed[:2], counter[:2], 1, 64)
    assert not torch.equal(bits, random_bits_reference(seed[:2], counter[:2], 2, 64))
    assert not torch.equal(bits, random_bits_reference(seed[:2], counter[:2] + 1, 1, 64))
    assert not torch.equal(bits[0], bits[1])


@pytest.mark.parametrize("normal", [False, True])
def test_opcheck(normal):
    from ops.counter_rng import counter_rng_op

    seed = torch.tensor([3, 5, 7], device=DEVICE)
    counter = torch.tensor([0, 11, 2], device=DEVICE)
    torch.library.opcheck(counter_rng_op, (seed, counter, 1, 24, normal), test_utils=OPCHECK_TESTS)
