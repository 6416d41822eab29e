"""Counter-based random numbers, one stream per call.

Why not `torch.Generator`: a call's draws must not depend on which calls share its batch, and they must
be produced inside a captured CUDA graph with no host work. A counter-based generator does both: every
number is a pure function of (call seed, counter, stream, index), computed with integer tensor ops.
The counter is the call's frame (talker step) index, so a call replays bit-identically alone, in any
batch, live or uploaded, eager or captured.

The hash, its kernel and its torch reference are in ops/counter_rng.py.
"""
from __future__ import annotations

import math

import torch

from ops import counter_rng

# Streams: disjoint uses of one call's generator.
TALKER_UNIFORM = 1  # Gumbel draws for the MoG component choice (spec 4.6)
TALKER_NORMAL = 2   # Gaussian noise on the MoG mean (spec 4.6)
TEXT_SAMPLE = 3     # multinomial draw of the agent text token (spec 1.4)


def uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniform [0, 1) float32 of shape [B, *shape] (24-bit resolution, exact in fp32)."""
    return counter_rng.uniform(seed, counter, stream, math.prod(shape)).view(seed.shape[0], *shape)


def normal(seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal float32 [B, *shape] by Box-Muller over two halves of one stream."""
    return counter_rng.normal(seed, counter, stream, math.prod(shape)).view(seed.shape[0], *shape)


def talker_draws(seed: torch.Tensor, step: torch.Tensor, n_passes: int, num_predictions: int,
                 latent_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The talker's per-step draws (spec 12.8: per pass a uniform for the Gumbel choice, then a normal).
    Returns uniform [B, n_passes, num_predictions] and normal [B, n_passes, latent_size]."""
    u = uniform(seed, step, TALKER_UNIFORM, (n_passes, num_predictions))
    z = normal(seed, step, TALKER_NORMAL, (n_passes, latent_size))
    return u, z
