"""Agent text sampling (spec 1.4), batched with per-row settings and no host syncs.

The rule, ported from NeMo's `ModelInterface._sample_text_token`: if the argmax is PAD, BOS or EOS keep
it; otherwise apply the repetition penalty over the call's previously generated non-special tokens
(positive logits / rp, negative * rp), divide by the temperature, keep the top-p nucleus (sorted
descending, tokens whose preceding cumulative probability already exceeds top_p are removed, the first
always kept), and draw from the softmax. Temperature 0, or everything disabled (top_p >= 1, rp == 1,
temperature in {0, 1}), is greedy. The draw is an inverse-CDF lookup of the call's own counter-based
uniform (rng.py), so a call's tokens do not depend on its batch mates.
"""
from __future__ import annotations

import torch

from nemo_duplex.models import rng


def sample_text(logits: torch.Tensor, special_ids: torch.Tensor, seen: torch.Tensor, temperature: torch.Tensor,
                top_p: torch.Tensor, rep_penalty: torch.Tensor, greedy: torch.Tensor, seed: torch.Tensor,
                counter: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype), special_ids [k] (PAD, BOS, EOS), seen [B, V] bool (tokens this call
    generated before, non-special), temperature/top_p/rep_penalty [B] float, greedy [B] bool,
    seed/counter [B] int64 -> tokens [B] int64."""
    logits = logits.float()
    argmax = logits.argmax(dim=-1)
    keep_argmax = greedy | torch.isin(argmax, special_ids)
    penalised = torch.where(logits > 0, logits / rep_penalty[:, None], logits * rep_penalty[:, None])
    x = torch.where(seen, penalised, logits) / temperature.clamp_min(1e-6)[:, None]
    sampled = nucleus_draw(x, top_p, rng.uniform(seed, counter, rng.TEXT_SAMPLE, (1,)))
    return torch.where(keep_argmax, argmax, sampled)


# Opaque to torch.compile: at full size Inductor's code generation failed on the cumulative sum over the
# 131,072-token vocabulary (a split scan; docs/performance.md, "Compiled back ends on the GPU"), so the
# compiled back ends run this piece as written, with eager kernels, inside their graphs.
@torch.library.custom_op("nemo_duplex::nucleus_draw", mutates_args=())
def nucleus_draw(x: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """x [B, V] fp32 (penalised, tempered logits), top_p [B], u [B, 1] uniform in [0, 1) -> tokens [B] int64:
    the top-p nucleus of softmax(x) (the first token always kept), drawn by inverse CDF at u."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = sorted_x.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    probs = torch.where(before > top_p[:, None], torch.zeros_like(probs), probs)
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_max(cdf.shape[-1] - 1)
    return order.gather(-1, pick).squeeze(-1)


@nucleus_draw.register_fake
def _(x, top_p, u):
    return x.new_empty(x.shape[0], dtype=torch.int64)
