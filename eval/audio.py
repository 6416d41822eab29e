"""Audio helpers for the eval tools: 16-bit PCM WAV read/write and band-limited resampling.

Reading is the server's WAV decoding (nemo_duplex/audio.py) at the file's own rate. Writing and resampling
are eval's own: `to_pcm16` scales by 32768, the exact inverse of reading (the server's scales by 32767), so
a clip read and written again keeps its samples; and the eval numbers were measured with this resampler,
not the server's soxr. The agent speaks at 22.05 kHz (spec 5: the codec's target rate) while the ASR models
and the clips are 16 kHz, so eval needs a resampler. torchaudio and scipy are not dependencies; `resample`
is a small windowed-sinc (Kaiser) interpolator. Measured, 22.05 kHz -> 16 kHz (checked in
tests/test_wer.py): sines up to 6 kHz come out within 1e-5 of the exact sine (amplitude 0.5), the band
edge rolls off from ~7 kHz (7.4 kHz is off by 0.15), and tones above the 8 kHz output Nyquist are
attenuated by more than 90 dB.
"""
from __future__ import annotations

import math
import wave
from pathlib import Path

import numpy as np

from nemo_duplex.audio import wav_samples


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read a PCM WAV (8/16/32-bit integer). Returns (float32 mono samples in [-1, 1], sample rate);
    several channels are averaged."""
    return wav_samples(Path(path).read_bytes())


def to_pcm16(wav: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1] -> int16 (x 32768, rounded, clipped: the inverse of read_wav)."""
    return np.clip(np.round(np.asarray(wav, np.float64) * 32768.0), -32768, 32767).astype(np.int16)


def write_wav(path: str | Path, wav: np.ndarray, sample_rate: int) -> None:
    """Write mono float samples in [-1, 1] as 16-bit PCM."""
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(to_pcm16(wav).astype("<i2").tobytes())


def _kaiser(x: np.ndarray, beta: float) -> np.ndarray:
    """Kaiser window at positions x in [-1, 1] (zero outside)."""
    inside = np.abs(x) <= 1.0
    arg = beta * np.sqrt(np.clip(1.0 - x * x, 0.0, None))
    return np.where(inside, np.i0(arg) / np.i0(beta), 0.0)


def resample(wav: np.ndarray, sr_in: int, sr_out: int, zero_crossings: int = 32,
             rolloff: float = 0.94, kaiser_beta: float = 9.0) -> np.ndarray:
    """Band-limited resampling of a 1-D signal by windowed-sinc interpolation.

    Output sample n sits at input time t = n * sr_in / sr_out; it is the sum of the input samples within
    `zero_crossings` lobes of a sinc whose cutoff is `rolloff` times the lower of the two Nyquist rates,
    tapered by a Kaiser window. t is split into an integer base and a rational phase with integer
    arithmetic, so long signals do not drift, and the filter is tabulated once per distinct phase
    (320 phases for 22.05 -> 16 kHz). The input is zero outside its ends.

    Returns float32 of length ceil(len(wav) * sr_out / sr_in).
    """
    x = np.asarray(wav, np.float64)
    if x.ndim != 1:
        raise ValueError(f"resample expects a 1-D signal, got shape {x.shape}")
    if sr_in == sr_out:
        return x.astype(np.float32)
    g = math.gcd(sr_in, sr_out)
    up, down = sr_out // g, sr_in // g  # t = n * down / up
    n_out = -(-len(x) * up // down)
    cutoff = rolloff * min(1.0, sr_out / sr_in)  # in cycles per input sample, x2 (1.0 = input Nyquist)
    half = int(math.ceil(zero_crossings / cutoff))  # taps on each side of t, in input samples
    taps = np.arange(-half + 1, half + 1)  # tap k reads input sample base + k

    n = np.arange(n_out, dtype=np.int64)
    base = (n * down) // up
    phase = (n * down) % up  # t - base = phase / up
    phases, phase_index = np.unique(phase, return_inverse=True)
    dist = taps[None, :] - phases[:, None] / up  # [P, taps]: distance from t to each tap
    table = cutoff * np.sinc(cutoff * dist) * _kaiser(dist / half, kaiser_beta)

    padded = np.concatenate([np.zeros(half), x, np.zeros(half + 1)])
    out = np.empty(n_out, np.float64)
    chunk = 1 << 15  # bounds the [chunk, taps] gather to a few MB
    for start in range(0, n_out, chunk):
        sl = slice(start, start + chunk)
        idx = base[sl, None] + taps[None, :] + half
        out[sl] = np.einsum("nt,nt->n", padded[idx], table[phase_index[sl]])
    return out.astype(np.float32)
