"""The codec's streaming iSTFT tail (spec 5.3, RVQCodec.decode_step) in one kernel: for each row b of a
frame step, with the row's state at slot = slots[b],

    mag    = 100 exp(-softplus(-log_mag + ln 100))           head [B, S, n+2]: channels 0..n/2 log_mag, rest phase
    X      = [mag cos(phase) | mag sin(phase) inner_bins]    (imaginary DC and Nyquist zeroed)
    frames = clamp(X @ irdft_basis, -w, w) w                 [S, n] (w the periodic Hann window)
    signal = overlap_add(frames, hop) + [ola_tail[slot] | 0]                       [S hop + n - hop]
    env    = step_envelope + [envelope_tail[slot] | 0]
    wav    = where(step_head & frames_done[slot] == 0, 0, signal / env)[:S hop]   [B, S hop]
    ola_tail[slot], envelope_tail[slot] <- signal[S hop:], env[S hop:];  frames_done[slot] += 1

(n = 16, hop = 4, S = 441 at full size: 1764 samples out per row and step).

Why a kernel: in torch the tail after the decoder's last GEMM is ~30 small launches per frame step (the
magnitude's softplus / exp, cos, sin, the inner-bin multiply, the inverse DFT's cat and matmul, clamp and
window, four overlap-add adds, the gathers of the three state rows, two cats with adds, the division, the
before-start mask and three index_copy_), each ~2 us in a captured CUDA graph for microseconds of work.

The inverse DFT stays a dot product with ops/dft.py's float64-built basis (no FFT): output hop-block t,
sample r is sum_j frames[t - j, j hop + r] (j = 0..n/hop-1, in that order, as `overlap_add` adds them), so a
program computes, for each j, only the hop columns j hop..j hop+hop-1 of the frames t - j it needs: every
frame's n columns once in all, with the spectrum's exp / cos / sin recomputed n/hop times. Not cheap, it turned
out: 0.046 ms per step at 32 calls on the H200, with register spills (docs/performance.md).

Programs: (row, block of BLOCK_T output hop-blocks). Only the first block of a row touches the row's state:
its samples 0..n-hop-1 take the previous tails, its samples below stream_delay the before-start mask (so
step_head must be False from sample n - hop on: it marks the first (n - hop) / 2), and it also computes the
row's n/hop - 1 trailing hop-blocks (the new tails, from the last frames: recomputed rather than read from
another program), then, after a barrier (every read of the row's state done), writes the state row. Rows
sharing a slot (padding rows on the sink) race, as index_copy_ does; only the sink may be shared.

Numerics: fp32 throughout, the torch statement's operations in its order (the overlap-add's sum order, the
tail add, the division), but the DFT's multiply-adds are summed in a different order than the matmul's, and
exp / cos / sin are the hardware's (or numpy's, interpreted), a few ulps apart: tests/ops/test_istft_step.py
states the tolerance.

The reference section also holds the iSTFT's torch functions (the Hann window, the synthesis frames, the
overlap-add, the window envelope), which nemo_duplex/models/codec_model.py's one-shot `istft` uses as well.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ops import interpreting, use_triton
from ops.dft import irdft, irdft_basis

# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def hann_window(n: int, device: torch.device) -> torch.Tensor:
    return torch.hann_window(n, periodic=True, dtype=torch.float32, device=device)


def synthesis_frames(head: torch.Tensor, n_fft: int, by_matmul: bool, window: torch.Tensor | None = None,
                     inner_bins: torch.Tensor | None = None) -> torch.Tensor:
    """head [B, S, n_fft + 2] (decoder output, channels-last) -> windowed time frames [B, S, n_fft].

    Channels 0..n/2 are the log-magnitude m, the rest the phase phi. |X| = 100 exp(-softplus(-m + ln 100))
    (= 100 sigmoid(m - ln 100), NeMo's form kept for its rounding). DC and Nyquist are real (|X| cos phi):
    their imaginary parts are zeroed here and ignored by the inverse DFT anyway. Each frame is clamped to
    [-w, w] and multiplied by w (periodic Hann; `constrain_value_range`). `window` (the Hann window) and
    `inner_bins` (1 for bins 1..n/2-1, 0 for DC and Nyquist), if the caller keeps them: a streaming step
    then builds neither (RVQCodec's step constants); the values are the same."""
    bins = n_fft // 2 + 1
    log_mag, phase = head[..., :bins], head[..., bins:]
    mag = 100.0 * torch.exp(-F.softplus(-log_mag + math.log(100.0)))
    re = mag * torch.cos(phase)
    im = mag * torch.sin(phase)
    if inner_bins is None:
        im = torch.cat([torch.zeros_like(im[..., :1]), im[..., 1:-1], torch.zeros_like(im[..., -1:])], dim=-1)
    else:  # one multiply: the inner bins times 1 are exact, the real ones become (signed) zeros
        im = im * inner_bins
    if by_matmul:
        frames = irdft(re, im, n_fft)  # ops/dft.py: no cuFFT (graph capture)
    else:
        frames = torch.fft.irfft(torch.complex(re, im), n=n_fft, dim=-1)
    window = hann_window(n_fft, head.device) if window is None else window
    return torch.clamp(frames, -window, window) * window


def overlap_add(frames: torch.Tensor, hop: int) -> torch.Tensor:
    """frames [B, S, n] (n a multiple of hop), frame s starting at sample s*hop -> [B, (S-1)*hop + n]."""
    batch, num_frames, n = frames.shape
    shifts = n // hop
    out = frames.new_zeros(batch, num_frames + shifts - 1, hop)
    for j in range(shifts):  # part j of frame s lands on hop-block s + j
        out[:, j:j + num_frames] += frames[:, :, j * hop:(j + 1) * hop]
    return out.flatten(1)


def window_envelope(num_frames: int, n_fft: int, hop: int, device: torch.device) -> torch.Tensor:
    """Sum of w^2 over the frames overlapping each sample, [1, (S-1)*hop + n] (the same overlap-add)."""
    square = hann_window(n_fft, device).square()
    return overlap_add(square.expand(1, num_frames, n_fft), hop)


def istft_step_reference(head: torch.Tensor, window: torch.Tensor, inner_bins: torch.Tensor,
                         envelope: torch.Tensor, step_head: torch.Tensor, ola_tail: torch.Tensor,
                         envelope_tail: torch.Tensor, frames_done: torch.Tensor, slots: torch.Tensor,
                         hop: int) -> torch.Tensor:
    """The torch statements decode_step ran before the kernel, unchanged: `synthesis_frames` (the by_matmul
    path with the step's window and inner-bin mask) and `overlap_add`, then the state bookkeeping. Argument
    layout as `istft_step`; returns wav [B, S hop] and updates the state rows `slots` in place."""
    n_fft = window.shape[0]
    frames = synthesis_frames(head, n_fft, by_matmul=True, window=window, inner_bins=inner_bins)  # [B, S, n]
    signal = overlap_add(frames, hop)  # [B, S hop + n - hop]
    envelope = envelope.expand_as(signal)
    # The previous frame's last n - hop overlap-add samples belong to the start of this one.
    tail = n_fft - hop
    signal = torch.cat([signal[:, :tail] + ola_tail.index_select(0, slots), signal[:, tail:]], dim=1)
    envelope = torch.cat([envelope[:, :tail] + envelope_tail.index_select(0, slots), envelope[:, tail:]], dim=1)
    done = frames_done.index_select(0, slots)
    out_len = hop * frames.shape[1]
    # Sample i of this buffer is one-shot sample S hop t + i - delay; at a stream's start the first
    # `delay` samples precede the signal (one-shot trims them): emit zeros.
    before_start = (done[:, None] == 0) & step_head
    wav = torch.where(before_start, 0.0, signal[:, :out_len] / envelope[:, :out_len])
    ola_tail.index_copy_(0, slots, signal[:, out_len:])
    envelope_tail.index_copy_(0, slots, envelope[:, out_len:])
    frames_done.index_copy_(0, slots, done + 1)
    return wav


# ----------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _overlap_add_blocks(head_row, stride_hs, basis_ptr, window_ptr, inner_ptr, ts, S,
                        N_FFT: tl.constexpr, HOP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_HOP: tl.constexpr):
    """Overlap-added windowed frames at output hop-blocks `ts` [BLOCK] -> [BLOCK, BLOCK_HOP] (columns >= HOP
    are 0)."""
    BINS: tl.constexpr = N_FFT // 2 + 1
    SHIFTS: tl.constexpr = N_FFT // HOP
    fs = tl.arange(0, BLOCK_F)          # DFT input channel f: Re of bin f (f < BINS), else Im of bin f - BINS
    f_mask = fs < 2 * BINS
    is_re = fs < BINS
    k = tl.where(is_re, fs, fs - BINS)  # its bin: head channel k is log_mag, BINS + k the phase
    inner = tl.load(inner_ptr + k, mask=f_mask, other=0.0)
    rs = tl.arange(0, BLOCK_HOP)
    r_mask = rs < HOP
    acc = tl.zeros([BLOCK, BLOCK_HOP], dtype=tl.float32)
    for j in tl.static_range(SHIFTS):  # part j of frame t - j, added in overlap_add's order
        s = ts - j
        valid = (s >= 0) & (s < S)
        tile_mask = valid[:, None] & f_mask[None, :]
        rows = head_row + s[:, None].to(tl.int64) * stride_hs
        log_mag = tl.load(rows + k[None, :], mask=tile_mask, other=0.0)
        phase = tl.load(rows + BINS + k[None, :], mask=tile_mask, other=0.0)
        # softplus with torch's threshold 20, log1p(u) written as log(v) * u / (v - 1) (exact for small u); a
        # NaN stays NaN (the plain minimum would replace it by 20)
        x = -log_mag + 4.605170185988092  # ln 100
        u = tl.exp(tl.minimum(x, 20.0, propagate_nan=tl.PropagateNan.ALL))
        v = 1.0 + u
        log1p = tl.log(v) * u / tl.where(v == 1.0, 1.0, v - 1.0)
        softplus = tl.where(x > 20.0, x, tl.where(v == 1.0, u, log1p))
        mag = 100.0 * tl.exp(-softplus)
        spectrum = tl.where(is_re[None, :], mag * tl.cos(phase), (mag * tl.sin(phase)) * inner[None, :])
        basis = tl.load(basis_ptr + fs[:, None] * N_FFT + (j * HOP + rs)[None, :],
                        mask=f_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_F, BLOCK_HOP]
        frame = tl.dot(spectrum, basis, input_precision="ieee")  # the inverse DFT's hop columns; never TF32
        w = tl.load(window_ptr + j * HOP + rs, mask=r_mask, other=0.0)[None, :]
        frame = tl.clamp(frame, -w, w, propagate_nan=tl.PropagateNan.ALL) * w  # NaN in, NaN out (torch.clamp)
        acc += tl.where(valid[:, None], frame, 0.0)
    return acc


@triton.jit
def _istft_step_kernel(
    head_ptr, basis_ptr, window_ptr, inner_ptr, env_ptr, step_head_ptr, ola_ptr, env_tail_ptr, done_ptr,
    slots_ptr, wav_ptr, S, stride_hb, stride_hs, stride_ola, stride_env_tail, stride_wav,
    N_FFT: tl.constexpr, HOP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_HOP: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    """Program (row b, block of BLOCK_T output hop-blocks). The first block of a row also reads and writes
    the row's state (module docstring)."""
    TAIL: tl.constexpr = N_FFT - HOP
    SHIFTS: tl.constexpr = N_FFT // HOP
    b = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    first = block == 0
    slot = tl.load(slots_ptr + b).to(tl.int64)
    head_row = head_ptr + b * stride_hb
    ola_row = ola_ptr + slot * stride_ola
    env_tail_row = env_tail_ptr + slot * stride_env_tail
    out_len = S * HOP
    rs = tl.arange(0, BLOCK_HOP)
    r_mask = rs < HOP

    ts = block * BLOCK_T + tl.arange(0, BLOCK_T)
    i = ts[:, None] * HOP + rs[None, :]  # sample index in the step's signal
    out_mask = (ts < S)[:, None] & r_mask[None, :]
    in_tail = out_mask & (i < TAIL)  # only in the first block (the launcher makes BLOCK_T hop >= TAIL)
    signal = _overlap_add_blocks(head_row, stride_hs, basis_ptr, window_ptr, inner_ptr, ts, S,
                                 N_FFT, HOP, BLOCK_T, BLOCK_F, BLOCK_HOP)
    signal += tl.load(ola_row + i, mask=in_tail, other=0.0)
    env = tl.load(env_ptr + i, mask=out_mask, other=1.0) + tl.load(env_tail_row + i, mask=in_tail, other=0.0)
    done = tl.load(done_ptr + slot, mask=first, other=1)  # other blocks: no read (the first writes it)
    before_start = (tl.load(step_head_ptr + i, mask=in_tail, other=0) != 0) & (done == 0)
    # IEEE division, as torch's (`/` is approximate); a reset slot's first envelope sample is 0, under the mask
    wav = tl.where(before_start, 0.0, tl.div_rn(signal, tl.where(before_start, 1.0, env)))
    tl.store(wav_ptr + b * stride_wav + i, wav, mask=out_mask)

    if first:
        # the row's last n/hop - 1 hop-blocks: the next step's tails
        tt = S + tl.arange(0, BLOCK_TAIL)
        j_t = tt[:, None] * HOP + rs[None, :]
        t_mask = (tt < S + SHIFTS - 1)[:, None] & r_mask[None, :]
        t_old = t_mask & (j_t < TAIL)  # where a step is shorter than the tail (never at the codec's sizes)
        new_ola = _overlap_add_blocks(head_row, stride_hs, basis_ptr, window_ptr, inner_ptr, tt, S,
                                      N_FFT, HOP, BLOCK_TAIL, BLOCK_F, BLOCK_HOP)
        new_ola += tl.load(ola_row + j_t, mask=t_old, other=0.0)
        new_env = (tl.load(env_ptr + j_t, mask=t_mask, other=0.0)
                   + tl.load(env_tail_row + j_t, mask=t_old, other=0.0))
        # Every thread has read the slot's state row (above) before any thread overwrites it.
        tl.debug_barrier()
        tl.store(ola_row + (j_t - out_len), new_ola, mask=t_mask)
        tl.store(env_tail_row + (j_t - out_len), new_env, mask=t_mask)
        tl.store(done_ptr + slot, done + 1)


GPU_BLOCK_T = 32  # output hop-blocks per program on the GPU: 14 programs per row at S = 441


def istft_step_triton(head: torch.Tensor, basis: torch.Tensor, window: torch.Tensor, inner_bins: torch.Tensor,
                      envelope: torch.Tensor, step_head: torch.Tensor, ola_tail: torch.Tensor,
                      envelope_tail: torch.Tensor, frames_done: torch.Tensor, slots: torch.Tensor, hop: int,
                      block_t: int | None = None) -> torch.Tensor:
    """`block_t` overrides the hop-blocks per program (tests: the GPU's split of a row on the interpreter)."""
    batch, num_frames, channels = head.shape
    n_fft = window.shape[0]
    tail = n_fft - hop
    assert channels == n_fft + 2 and n_fft % hop == 0 and basis.shape == (n_fft + 2, n_fft)
    assert head.dtype == basis.dtype == window.dtype == inner_bins.dtype == envelope.dtype == torch.float32
    assert ola_tail.dtype == envelope_tail.dtype == torch.float32 and frames_done.dtype == torch.int64
    assert envelope.numel() == num_frames * hop + tail and step_head.numel() == num_frames * hop
    assert ola_tail.shape[1:] == envelope_tail.shape[1:] == (tail,)
    assert ola_tail.stride(-1) == envelope_tail.stride(-1) == 1 and frames_done.is_contiguous()
    head = head if head.stride(-1) == 1 else head.contiguous()
    wav = torch.empty(batch, num_frames * hop, device=head.device, dtype=torch.float32)
    if batch == 0:
        return wav
    dot_min = 16  # tl.dot needs every dim >= 16: the hop columns and the tail's hop-blocks are padded
    if block_t is None:  # the interpreter pays per program: there one program takes a row's every hop-block
        block_t = max(dot_min, triton.next_power_of_2(num_frames)) if interpreting() else GPU_BLOCK_T
    # the first block holds every sample the old tails and the before-start mask touch
    assert block_t >= dot_min and block_t == triton.next_power_of_2(block_t), block_t
    assert block_t * hop >= tail, f"block_t={block_t} hop-blocks do not cover the {tail}-sample tail"
    grid = (batch, triton.cdiv(num_frames, block_t))
    _istft_step_kernel[grid](
        head, basis.contiguous(), window.contiguous(), inner_bins.contiguous(), envelope.reshape(-1).contiguous(),
        step_head.reshape(-1).contiguous(), ola_tail, envelope_tail, frames_done, slots, wav, num_frames,
        head.stride(0), head.stride(1), ola_tail.stride(0), envelope_tail.stride(0), wav.stride(0),
        N_FFT=n_fft, HOP=hop, BLOCK_T=block_t, BLOCK_F=max(dot_min, triton.next_power_of_2(n_fft + 2)),
        BLOCK_HOP=max(dot_min, triton.next_power_of_2(hop)),
        BLOCK_TAIL=max(dot_min, triton.next_power_of_2(n_fft // hop - 1)), num_warps=4,
    )
    return wav


# ----------------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------------

# Opaque to torch.compile (see ops/decode_attention.py); the schema declares the in-place state updates.
@torch.library.custom_op("nemo_duplex::istft_step", mutates_args=("ola_tail", "envelope_tail", "frames_done"))
def istft_step_op(head: torch.Tensor, basis: torch.Tensor, window: torch.Tensor, inner_bins: torch.Tensor,
                  envelope: torch.Tensor, step_head: torch.Tensor, ola_tail: torch.Tensor,
                  envelope_tail: torch.Tensor, frames_done: torch.Tensor, slots: torch.Tensor,
                  hop: int) -> torch.Tensor:
    return istft_step_triton(head, basis, window, inner_bins, envelope, step_head, ola_tail, envelope_tail,
                             frames_done, slots, hop)


@istft_step_op.register_fake
def _(head, basis, window, inner_bins, envelope, step_head, ola_tail, envelope_tail, frames_done, slots, hop):
    return head.new_empty(head.shape[0], head.shape[1] * hop, dtype=torch.float32)


def istft_step(head: torch.Tensor, window: torch.Tensor, inner_bins: torch.Tensor, envelope: torch.Tensor,
               step_head: torch.Tensor, ola_tail: torch.Tensor, envelope_tail: torch.Tensor,
               frames_done: torch.Tensor, slots: torch.Tensor, hop: int) -> torch.Tensor:
    """One streaming iSTFT step. head [B, S, n + 2] fp32 (the decoder's output, channels-last), window [n]
    (periodic Hann), inner_bins [n/2 + 1] (1 but for DC and Nyquist), envelope [1, S hop + n - hop] (the
    window envelope of S frames), step_head [S hop] bool (the first (n - hop) / 2 samples), state pools
    ola_tail / envelope_tail [slots, n - hop] fp32 and frames_done [slots] int64 (rows `slots` [B] read,
    then updated in place; distinct but for padding rows on the sink) -> wav [B, S hop] fp32.
    The kernel on CUDA or under TRITON_INTERPRET=1, else the torch reference."""
    if use_triton(head):
        basis = irdft_basis(window.shape[0], head.device)
        return istft_step_op(head, basis, window, inner_bins, envelope, step_head, ola_tail, envelope_tail,
                             frames_done, slots, int(hop))
    return istft_step_reference(head, window, inner_bins, envelope, step_head, ola_tail, envelope_tail,
                                frames_done, slots, hop)
