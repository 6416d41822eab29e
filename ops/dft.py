"""Fixed-size real DFT and inverse real DFT, as a matmul against a float64-built basis.

Why not torch.fft: the codec's per-frame iSTFT (n = 16, spec 5.3) and the streaming mel front end
(n_fft = 512, spec 2.1) run inside captured CUDA graphs, and a DFT of a fixed small size is just a
matmul with a constant basis (no cuFFT plan, no plan cache, same kernel for every batch bucket).

With H = n // 2 + 1 bins:
* forward basis `[n, 2H]`: column k is cos(2 pi k j / n), column H + k is -sin(2 pi k j / n), so
  `frames @ basis = [Re X | Im X]` (torch.fft.rfft, norm "backward").
* inverse basis `[2H, n]`: row k is c_k cos(2 pi k j / n) / n and row H + k is -c_k sin(2 pi k j / n) / n,
  with c_k = 1 for DC and (n even) Nyquist and 2 otherwise (the Hermitian mirror). The sine rows of
  DC and Nyquist are exactly zero, so their imaginary parts are ignored, as torch.fft.irfft does.
The angle index k * j is reduced mod n in integers before the float64 cos/sin, so every entry is the
float64-rounded exact value before the final cast.

The Triton kernel is a tiled GEMM `out = x @ basis` with `tl.dot(..., input_precision="ieee")`: IEEE
fp32 products whatever the global TF32 flags say (the codec must not run in TF32, spec 1.6 / 9.9).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ops import interpreting, use_triton

# ----------------------------------------------------------------------------------------------------
# Bases
# ----------------------------------------------------------------------------------------------------

def _angles(n: int) -> torch.Tensor:
    """[n//2+1, n] float64 angles 2 pi ((k j) mod n) / n."""
    k = torch.arange(n // 2 + 1, dtype=torch.int64)
    j = torch.arange(n, dtype=torch.int64)
    return (torch.outer(k, j) % n).to(torch.float64) * (2.0 * math.pi / n)


def _cos_sin(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 cos and sin of `_angles(n)`, with the values that are exactly 0 mathematically (sin of
    0 and pi, cos of pi/2 and 3pi/2) snapped from ~1e-16 to 0."""
    angles = _angles(n)
    cos, sin = torch.cos(angles), torch.sin(angles)
    cos[cos.abs() < 1e-12] = 0.0
    sin[sin.abs() < 1e-12] = 0.0
    return cos, sin


@functools.lru_cache(maxsize=None)
def _rdft_basis(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    cos, sin = _cos_sin(n)
    basis = torch.cat([cos, -sin], dim=0).T  # [n, 2H]
    return basis.contiguous().to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _irdft_basis(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    cos, sin = _cos_sin(n)
    weight = torch.full((n // 2 + 1, 1), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    if n % 2 == 0:
        weight[-1] = 1.0  # Nyquist has no mirror image
    # The sine rows of DC and Nyquist are exactly 0 (sin 0, sin pi j after snapping): their Im parts are ignored.
    return torch.cat([weight * cos / n, -weight * sin / n], dim=0).contiguous().to(device=device, dtype=dtype)  # [2H, n]


# assume_constant_result: torch.compile traces through lru_cache, so without it every compiled step would
# rebuild the basis (~20 ops, float64 on the CPU, then a copy to the device); with it the cached tensor
# enters the graph as a constant (tests/ops/test_dft.py).
@torch.compiler.assume_constant_result
def rdft_basis(n: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Forward real-DFT basis `[n, 2*(n//2+1)]`, built in float64, cached per (n, device, dtype).
    Build it once before CUDA-graph capture (the first call allocates)."""
    return _rdft_basis(n, torch.device(device), dtype)


@torch.compiler.assume_constant_result
def irdft_basis(n: int, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse real-DFT basis `[2*(n//2+1), n]`, built in float64, cached per (n, device, dtype)."""
    return _irdft_basis(n, torch.device(device), dtype)


# ----------------------------------------------------------------------------------------------------
# Reference: a plain torch matmul against the basis
# ----------------------------------------------------------------------------------------------------

def basis_matmul_reference(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """x [R, K] @ basis [K, N] -> [R, N]."""
    return x @ basis


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _basis_matmul_kernel(
    x_ptr, basis_ptr, out_ptr, R,
    stride_xr, stride_bk, stride_or,
    K: tl.constexpr, N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: BLOCK_R rows x BLOCK_N output columns, looping over K. Rows are contiguous in
    their last dim (the launcher makes them so). K and N are the basis shape, fixed per transform
    size, so they are compile-time constants (a static loop; Triton 3.6's interpreter cannot run a
    `range` with a runtime bound)."""
    pid_r = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xr + ks[None, :],
                    mask=(rows[:, None] < R) & (ks[None, :] < K), other=0.0)
        b = tl.load(basis_ptr + ks[:, None] * stride_bk + cols[None, :],
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(x, b, acc, input_precision="ieee")  # never TF32
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], acc,
             mask=(rows[:, None] < R) & (cols[None, :] < N))


def _block(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))  # tl.dot needs every dim >= 16


GPU_TILES = (64, 64, 32)  # (rows, max output columns, max reduction step) per program on the GPU


def basis_matmul_triton(x: torch.Tensor, basis: torch.Tensor,
                        tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [R, K] @ basis [K, N] -> [R, N], fp32 in, fp32 out. `tiles` overrides the tile choice (tests)."""
    x = x.contiguous()
    R, K = x.shape
    N = basis.shape[1]
    out = torch.empty(R, N, device=x.device, dtype=torch.float32)
    if R == 0:
        return out
    if tiles is None:  # the interpreter pays per program and per loop step: big tiles on the CPU
        tiles = (1024, 1024, 512) if interpreting() else GPU_TILES
    block_r, block_n, block_k = tiles[0], _block(N, tiles[1]), _block(K, tiles[2])
    grid = (triton.cdiv(R, block_r), triton.cdiv(N, block_n))
    _basis_matmul_kernel[grid](x, basis, out, R, x.stride(0), basis.stride(0), out.stride(0), K=K, N=N,
                               BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


# ----------------------------------------------------------------------------------------------------
# Launcher and the public transforms
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py): Inductor would otherwise see a plain matmul it may
# lower to TF32 or fuse differently; the op keeps the IEEE fp32 kernel bit for bit.
@torch.library.custom_op("nemo_duplex::basis_matmul", mutates_args=())
def basis_matmul_op(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    return basis_matmul_triton(x, basis)


@basis_matmul_op.register_fake
def _(x, basis):
    return x.new_empty(x.shape[0], basis.shape[1], dtype=torch.float32)


def _use_triton(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and use_triton(x)


def basis_matmul(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ basis [K, N]: the Triton kernel for fp32 on CUDA (or under TRITON_INTERPRET=1),
    else the torch reference."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    out = basis_matmul_op(flat, basis) if _use_triton(flat) else basis_matmul_reference(flat, basis)
    return out.reshape(*lead, basis.shape[1])


def rdft(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """frames [..., n] real -> (re, im), each [..., n//2+1]: torch.fft.rfft(frames) split in two."""
    n = frames.shape[-1]
    spectrum = basis_matmul(frames, rdft_basis(n, frames.device, frames.dtype))
    return spectrum[..., : n // 2 + 1], spectrum[..., n // 2 + 1:]


def irdft(re: torch.Tensor, im: torch.Tensor, n: int) -> torch.Tensor:
    """(re, im) [..., n//2+1] -> frames [..., n]: torch.fft.irfft(complex(re, im), n) (imaginary parts
    of DC and, for even n, Nyquist are ignored)."""
    bins = n // 2 + 1
    if re.shape[-1] != bins or im.shape != re.shape:
        raise ValueError(f"irdft(n={n}) needs re and im of shape [..., {bins}]; got {tuple(re.shape)}, "
                         f"{tuple(im.shape)}")
    return basis_matmul(torch.cat([re, im], dim=-1), irdft_basis(n, re.device, re.dtype))
