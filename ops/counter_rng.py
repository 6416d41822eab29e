"""Counter-based random numbers for a batch of calls: uniform or normal draws as a pure function of
(call seed, counter, stream, index), one kernel per draw (nemo_duplex/models/rng.py says why counter-based).

The mixer is a 32-bit integer hash (xor-shift-multiply rounds) evaluated in int64 with every product
below 2**63, so the integer arithmetic is exact and identical in torch (CPU or GPU) and in the kernel:
the bits, and so the uniforms, are bit-identical across the three. Normals (Box-Muller) go through
log/sqrt/cos, whose last-ulp rounding may differ between implementations.
Why a kernel: in torch one draw is ~40 integer ops over [B, n] (four rounds of the hash, each seven ops),
~200 kernels per frame step for the talker's and the text sampler's draws.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ops import use_triton

MASK32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

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


def random_bits_reference(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """[B] seeds, [B] counters -> [B, n] uniform 32-bit integers (as int64)."""
    idx = torch.arange(n, device=seed.device, dtype=torch.int64)
    key = _mix32((idx + (stream << 24)) & MASK32)                          # [n]
    c = _mix32((counter.to(torch.int64) & MASK32) ^ 0x5BD1E995)            # [B]
    s = _mix32(seed.to(torch.int64) & MASK32) ^ _mix32((seed.to(torch.int64) >> 32) & MASK32 ^ 0x1B873593)
    x = _mix32(key[None, :] ^ c[:, None])
    return _mix32(x ^ s[:, None])


def uniform_reference(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """[B, n] uniform [0, 1) float32 (24-bit resolution, exact in fp32)."""
    bits = random_bits_reference(seed, counter, stream, n) >> 8
    return bits.to(torch.float32) * (1.0 / (1 << 24))


def normal_reference(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """[B, n] standard normal float32 by Box-Muller over the two halves of 2n draws of one stream."""
    bits = random_bits_reference(seed, counter, stream, 2 * n) >> 8
    u = (bits.to(torch.float32) + 1.0) * (1.0 / (1 << 24))                # (0, 1]: log is finite
    u1, u2 = u[:, :n], u[:, n:]
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _mix32_t(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x46CA68B5) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 12)
    return x


@triton.jit
def _bits_t(idx, stream, c, s):
    key = _mix32_t((idx + (stream << 24)) & 0xFFFFFFFF)
    return _mix32_t(_mix32_t(key ^ c) ^ s)


@triton.jit
def _counter_rng_kernel(seed_ptr, counter_ptr, out_ptr, n, stride_o, stream, NORMAL: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program = (row, block of indices). All integer work in int64, as the reference. `stream` is a
    small int (Triton may pass it as a constant): stream << 24 fits in 32 bits, and idx is int64."""
    row = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = idx < n
    seed = tl.load(seed_ptr + row).to(tl.int64)
    counter = tl.load(counter_ptr + row).to(tl.int64)
    c = _mix32_t((counter & 0xFFFFFFFF) ^ 0x5BD1E995)
    s = _mix32_t(seed & 0xFFFFFFFF) ^ _mix32_t(((seed >> 32) & 0xFFFFFFFF) ^ 0x1B873593)
    if NORMAL:
        u1 = ((_bits_t(idx, stream, c, s) >> 8).to(tl.float32) + 1.0) * (1.0 / 16777216.0)
        u2 = ((_bits_t(idx + n, stream, c, s) >> 8).to(tl.float32) + 1.0) * (1.0 / 16777216.0)
        out = tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(6.283185307179586 * u2)
    else:
        out = (_bits_t(idx, stream, c, s) >> 8).to(tl.float32) * (1.0 / 16777216.0)
    tl.store(out_ptr + row * stride_o + idx, out, mask=mask)


def counter_rng_triton(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int, normal: bool) -> torch.Tensor:
    batch = seed.shape[0]
    out = torch.empty(batch, n, device=seed.device, dtype=torch.float32)
    if batch and n:
        block = min(1024, triton.next_power_of_2(n))
        _counter_rng_kernel[(batch, triton.cdiv(n, block))](seed, counter, out, n, out.stride(0), stream,
                                                             NORMAL=normal, BLOCK=block)
    return out


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py).
@torch.library.custom_op("nemo_duplex::counter_rng", mutates_args=())
def counter_rng_op(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int, normal: bool) -> torch.Tensor:
    return counter_rng_triton(seed, counter, stream, n, normal)


@counter_rng_op.register_fake
def _(seed, counter, stream, n, normal):
    return seed.new_empty(seed.shape[0], n, dtype=torch.float32)


def uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """seed, counter [B] int64 -> [B, n] float32 uniform [0, 1): the kernel on CUDA or under
    TRITON_INTERPRET=1 (bit-identical to the reference), else the reference."""
    if use_triton(seed):
        return counter_rng_op(seed, counter, stream, n, False)
    return uniform_reference(seed, counter, stream, n)


def normal(seed: torch.Tensor, counter: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """seed, counter [B] int64 -> [B, n] float32 standard normal."""
    if use_triton(seed):
        return counter_rng_op(seed, counter, stream, n, True)
    return normal_reference(seed, counter, stream, n)
