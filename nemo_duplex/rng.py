"""Counter-based random numbers, one stream per call.

Why not `torch.Generator`: a call's draws must not depend on which calls share its batch, and they must
be produced inside a captured CUDA graph with no host work. A counter-based generator does both: every
number is a pure function of (call seed, counter, stream, index), computed with integer tensor ops.
The counter is the call's frame (talker step) index, so a call replays bit-identically alone, in any
batch, live or uploaded, eager or captured.

The mixer is a 32-bit integer hash (xor-shift-multiply rounds) evaluated in int64 with every product
kept below 2**63, so the arithmetic is exact and identical on CPU and GPU.
"""
from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
# Streams: disjoint uses of one call's generator.
TALKER_UNIFORM = 1  # Gumbel draws for the MoG component choice (spec 4.6)
TALKER_NORMAL = 2   # Gaussian noise on the MoG mean (spec 4.6)
TEXT_SAMPLE = 3     # multinomial draw of the agent text token (spec 1.4)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit avalanche hash of int64 values in [0, 2**32). Multipliers are < 2**31 so no product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x46CA68B5) & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & MASK32
    x = x ^ (x >> 12)
    return x


def random_bits(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """[B] seeds, [B] counters -> [B, n] uniform 32-bit integers (as int64)."""
    idx = torch.arange(n, device=seed.device, dtype=torch.int64)
    key = _mix32((idx + (stream << 24)) & MASK32)                          # [n]
    c = _mix32((counter.to(torch.int64) & MASK32) ^ 0x5BD1E995)            # [B]
    s = _mix32(seed.to(torch.int64) & MASK32) ^ _mix32((seed.to(torch.int64) >> 32) & MASK32 ^ 0x1B873593)
    x = _mix32(key[None, :] ^ c[:, None])
    return _mix32(x ^ s[:, None])


def uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniform [0, 1) float32 of shape [B, *shape] (24-bit resolution, exact in fp32)."""
    n = math.prod(shape)
    bits = random_bits(seed, counter, stream, n) >> 8
    return (bits.to(torch.float32) * (1.0 / (1 << 24))).view(seed.shape[0], *shape)


def normal(seed: torch.Tensor, counter: torch.Tensor, stream: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal float32 [B, *shape] by Box-Muller over two halves of one stream."""
    n = math.prod(shape)
    bits = random_bits(seed, counter, stream, 2 * n) >> 8
    u = (bits.to(torch.float32) + 1.0) * (1.0 / (1 << 24))                # (0, 1]: log is finite
    u1, u2 = u[:, :n], u[:, n:]
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
    return z.view(seed.shape[0], *shape)


def talker_draws(seed: torch.Tensor, step: torch.Tensor, n_passes: int, num_predictions: int,
                 latent_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The talker's per-step draws (spec 12.8: per pass a uniform for the Gumbel choice, then a normal).
    Returns uniform [B, n_passes, num_predictions] and normal [B, n_passes, latent_size]."""
    u = uniform(seed, step, TALKER_UNIFORM, (n_passes, num_predictions))
    z = normal(seed, step, TALKER_NORMAL, (n_passes, latent_size))
    return u, z
