"""Counter-based RNG and text sampling."""
import math

import pytest
import torch

from nemo_duplex.models import rng
from nemo_duplex.models.config import SamplingParams
from nemo_duplex.models.sampling import sample_text


def test_rng_is_per_call_and_batch_invariant():
    seeds = torch.tensor([3, 7, 3, 11], dtype=torch.int64)
    counters = torch.tensor([0, 5, 1, 9], dtype=torch.int64)
    u = rng.uniform(seeds, counters, rng.TALKER_UNIFORM, (4, 16))
    alone = torch.cat([rng.uniform(seeds[i:i + 1], counters[i:i + 1], rng.TALKER_UNIFORM, (4, 16)) for i in range(4)])
    assert torch.equal(u, alone)                      # a row never depends on its batch mates
    assert not torch.equal(u[0], u[2])                # same seed, another counter: other numbers
    assert not torch.equal(rng.uniform(seeds, counters, rng.TALKER_NORMAL, (4, 16)), u)  # streams differ


def test_rng_distributions():
    seeds = torch.arange(64, dtype=torch.int64)
    counters = torch.zeros(64, dtype=torch.int64)
    u = rng.uniform(seeds, counters, rng.TALKER_UNIFORM, (4096,)).flatten()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # uniformity: chi-square over 16 bins, below the 0.1% critical value for 15 degrees of freedom
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum().item() < 37.7
    z = rng.normal(seeds, counters, rng.TALKER_NORMAL, (4096,)).flatten()
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01
    assert abs(((z > 1.96).float().mean().item()) - 0.025) < 0.002
    assert torch.isfinite(z).all()


def test_rng_large_seed_and_counter():
    s = torch.tensor([2**40 + 5, 2**40 + 6], dtype=torch.int64)
    c = torch.tensor([2**33, 2**33], dtype=torch.int64)
    u = rng.uniform(s, c, rng.TEXT_SAMPLE, (8,))
    assert torch.isfinite(u).all() and not torch.equal(u[0], u[1])


def _sample(logits, params: SamplingParams, seen=None, seed=0, counter=0):
    B, V = logits.shape
    return sample_text(logits, torch.tensor([12, 1, 2]), seen if seen is not None else torch.zeros(B, V, dtype=torch.bool),
                       torch.full((B,), params.temperature), torch.full((B,), params.top_p),
                       torch.full((B,), params.repetition_penalty), torch.full((B,), params.greedy),
                       torch.full((B,), seed, dtype=torch.int64), torch.full((B,), counter, dtype=torch.int64))


def test_greedy_and_special_argmax_kept():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 40, generator=g)
    assert torch.equal(_sample(logits, SamplingParams()), logits.argmax(-1))
    logits[:, 12] = 50.0  # argmax PAD: kept even when sampling hot
    assert (_sample(logits, SamplingParams(temperature=5.0, top_p=1.0)) == 12).all()


def test_top_p_keeps_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * 12]))
    p = SamplingParams(temperature=1.0, top_p=0.7)
    picks = torch.stack([_sample(logits, p, seed=s) for s in range(400)])
    assert set(picks.unique().tolist()) <= {0, 1}     # 0.5 + 0.3 reaches 0.7: the rest is cut
    frac0 = (picks == 0).float().mean().item()
    assert abs(frac0 - 0.5 / 0.8) < 0.08


def test_repetition_penalty_applies_to_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0] + [-30.0] * 13])
    seen = torch.zeros(1, 16, dtype=torch.bool)
    seen[0, 0] = True
    p = SamplingParams(temperature=0.05, top_p=1.0, repetition_penalty=2.0)
    picks = torch.stack([_sample(logits, p, seen=seen, seed=s) for s in range(50)])
    assert (picks == 1).all()                         # 2.0 / 2 = 1.0 < 1.9: the seen token loses
    assert math.isclose(SamplingParams(temperature=1.0).greedy, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_argmax_and_margins_on_the_logits_dtype(dtype):
    """frame_step's greedy path takes argmax and top-2 on the logits' own dtype (no fp32 copy of
    [B, vocab]): the same index and values as on the fp32 upcast, with ties at the maximum (the first one
    wins in both) and NaN rows; on the GPU as well where there is one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        logits = (torch.randn(16, 4099, generator=gen) * 3).to(dtype)
        logits[:, 7 + trial] = logits.max()
        if trial % 4 == 0:
            logits[3, 100] = float("nan")
        logits = logits.to(device)
        assert torch.equal(logits.argmax(-1), logits.float().argmax(-1))
        torch.testing.assert_close(logits.topk(2, dim=-1).values.float(), logits.float().topk(2, dim=-1).values,
                                   rtol=0, atol=0, equal_nan=True)
