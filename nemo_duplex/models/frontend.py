"""Mel front end of the speech encoder (spec 2.1, 12.3): offline over whole clips, and the bounded
streaming window that yields the mel columns one 80 ms encoder frame needs.

Geometry (spec 2.7): mel column c is the STFT frame centred at sample hop*c; with center=True its
n_fft window covers samples [hop*c - n_fft/2, hop*c + n_fft/2). One streaming step k receives audio
samples [1280k, 1280(k+1)) and computes the 8 new columns 8k-7 .. 8k; the last of them ends at
1280k + 255, inside the chunk, so a frame needs no look-ahead.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from nemo_duplex.models.config import FrontendConfig
from ops.dft import rdft  # float64-built DFT basis as one matmul (graph friendly)

# ---------------------------------------------------------------------------------------------
# Slaney mel filterbank (librosa.filters.mel with htk=False, norm="slaney"), built in float64.

def hz_to_mel_slaney(hz: np.ndarray) -> np.ndarray:
    """Slaney's Auditory Toolbox mel scale: linear below 1 kHz (200/3 Hz per mel), log above."""
    hz = np.asarray(hz, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    mel = hz / f_sp
    log_region = hz >= min_log_hz
    return np.where(log_region, min_log_mel + np.log(np.maximum(hz, 1e-10) / min_log_hz) / logstep, mel)


def mel_to_hz_slaney(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, math.log(6.4) / 27.0
    hz = mel * f_sp
    return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), hz)


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                          fmax: float | None = None) -> np.ndarray:
    """[n_mels, n_fft//2+1] float32 triangles on the slaney mel scale, each scaled to unit area
    (norm="slaney": 2 / bandwidth in Hz), like librosa.filters.mel defaults (spec 2.1). The maths is
    float64; as in librosa the triangles are stored in float32 before the area scaling, so the result
    is bitwise the checkpoint's `fb`."""
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0.0, sample_rate / 2, 1 + n_fft // 2)
    mel_points = np.linspace(hz_to_mel_slaney(fmin), hz_to_mel_slaney(fmax), n_mels + 2)
    hz_points = mel_to_hz_slaney(mel_points)
    widths = np.diff(hz_points)
    ramps = hz_points[:, None] - fft_freqs[None, :]
    weights = np.zeros((n_mels, len(fft_freqs)), dtype=np.float32)
    for i in range(n_mels):
        rising = -ramps[i] / widths[i]
        falling = ramps[i + 2] / widths[i + 1]
        weights[i] = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (hz_points[2:n_mels + 2] - hz_points[:n_mels]))[:, None]
    return weights


# ---------------------------------------------------------------------------------------------

class Featurizer(nn.Module):
    """Holds the two checkpoint buffers under their official names (`featurizer.fb`, `.window`)."""

    def __init__(self, cfg: FrontendConfig):
        super().__init__()
        self.register_buffer("fb", torch.empty(1, cfg.n_mels, cfg.n_fft // 2 + 1))
        self.register_buffer("window", torch.empty(cfg.win_length))


class MelFrontend(nn.Module):
    def __init__(self, cfg: FrontendConfig):
        super().__init__()
        if cfg.variant not in ("release", "nemo3"):
            raise ValueError(f"unknown front-end variant {cfg.variant!r}; expected 'release' or 'nemo3'")
        self.cfg = cfg
        self.featurizer = Featurizer(cfg)
        self.fill_standard_buffers()

    @torch.no_grad()
    def fill_standard_buffers(self):
        """The values NeMo computes at construction: librosa slaney mel bank, Hann(periodic=False)."""
        cfg = self.cfg
        fb = slaney_mel_filterbank(cfg.sample_rate, cfg.n_fft, cfg.n_mels)
        self.featurizer.fb.copy_(torch.from_numpy(fb)[None])
        self.featurizer.window.copy_(torch.hann_window(cfg.win_length, periodic=False))  # fp32, as NeMo

    def init_weights(self, generator: torch.Generator):
        # No learned values here: the "random" front end is the real one (its buffers are fixed maths).
        self.fill_standard_buffers()

    # --- shared pieces --------------------------------------------------------------------------

    def valid_columns(self, lengths: torch.Tensor) -> torch.Tensor:
        """Mel columns that count (spec 12.3): N//hop + 1 in the release variant, N//hop in nemo3."""
        extra = 1 if self.cfg.variant == "release" else 0
        return torch.div(lengths, self.cfg.hop_length, rounding_mode="floor") + extra

    def preemphasis(self, audio: torch.Tensor) -> torch.Tensor:
        return torch.cat([audio[:, :1], audio[:, 1:] - self.cfg.preemph * audio[:, :-1]], dim=1)

    def padded_window(self) -> torch.Tensor:
        """The win_length window centred in n_fft zeros, as torch.stft applies it."""
        cfg = self.cfg
        left = (cfg.n_fft - cfg.win_length) // 2
        return F.pad(self.featurizer.window.float(), (left, cfg.n_fft - cfg.win_length - left))

    def log_mel(self, power: torch.Tensor) -> torch.Tensor:
        """power [B, n_fft//2+1, T] -> ln(fb @ power + guard) [B, n_mels, T]."""
        mel = torch.matmul(self.featurizer.fb.float(), power)
        return torch.log(mel + self.cfg.log_zero_guard)

    # --- offline ---------------------------------------------------------------------------------

    def forward(self, audio: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio [B, N] (any float dtype), lengths [B] -> mel [B, n_mels, N//hop+1] fp32, mel_lengths [B].

        Columns at or beyond a row's valid length are 0. Rows shorter than the batch see zeros, not
        their own reflection, past their end (as NeMo), so only their last two valid columns can differ
        from running the row alone."""
        cfg = self.cfg
        audio = audio.float()
        time = torch.arange(audio.shape[1], device=audio.device)
        y = self.preemphasis(audio).masked_fill(time[None, :] >= lengths[:, None], 0.0)
        spec = torch.stft(y, n_fft=cfg.n_fft, hop_length=cfg.hop_length, win_length=cfg.win_length,
                          window=self.featurizer.window.float(), center=True,
                          pad_mode="reflect" if cfg.variant == "release" else "constant",
                          return_complex=True)
        spec = torch.view_as_real(spec)
        power = torch.sqrt(spec.pow(2).sum(-1)).pow(2.0)  # magnitude, then mag_power 2 (spec 2.1)
        mel = self.log_mel(power)
        mel_lengths = self.valid_columns(lengths)
        column = torch.arange(mel.shape[-1], device=mel.device)
        mel = mel.masked_fill(column[None, None, :] >= mel_lengths[:, None, None], 0.0)
        return mel, mel_lengths

    # --- streaming -------------------------------------------------------------------------------

    def stream_tail_samples(self, columns_per_step: int) -> int:
        """Raw samples before a chunk that the chunk's new columns need: the first new column starts
        (columns_per_step-1)*hop + n_fft/2 samples before the chunk, plus one for preemphasis."""
        return (columns_per_step - 1) * self.cfg.hop_length + self.cfg.n_fft // 2 + 1

    def stream_columns(self, audio_tail: torch.Tensor, chunk: torch.Tensor, frame_index: torch.Tensor,
                       columns_per_step: int) -> torch.Tensor:
        """The columns_per_step new mel columns of one chunk, per row.

        audio_tail [B, tail] raw samples just before the chunk (zeros before the call's start),
        chunk [B, columns_per_step*hop], frame_index [B] int64 (= k) -> [B, n_mels, columns_per_step] fp32,
        the columns c*k-(c-1) .. c*k (c = columns_per_step); columns with negative index are garbage
        (callers zero them). Equal to the offline columns of the same index, including the
        release-variant reflection at the start of the call (columns 0 and 1)."""
        cfg = self.cfg
        x = torch.cat([audio_tail.float(), chunk.float()], dim=1)
        y = x[:, 1:] - cfg.preemph * x[:, :-1]  # at the call's first sample x[-1] = 0, so y[0] = x[0]
        # Global sample index of y[:, 0]; the first new column's window starts right there.
        first_sample = frame_index * (columns_per_step * cfg.hop_length) - (y.shape[1] - chunk.shape[1])
        starts = torch.arange(columns_per_step, device=x.device) * cfg.hop_length
        offsets = starts[:, None] + torch.arange(cfg.n_fft, device=x.device)[None, :]  # [C, n_fft]
        sample = first_sample[:, None, None] + offsets[None]  # global index per frame position
        # center=True pads the signal's start: reflect maps sample -m to m; constant makes it 0.
        source = sample.abs() if cfg.variant == "release" else sample
        position = (source - first_sample[:, None, None]).clamp(0, y.shape[1] - 1)
        frames = torch.gather(y, 1, position.flatten(1)).view(position.shape)
        if cfg.variant != "release":
            frames = frames.masked_fill(sample < 0, 0.0)
        real, imag = rdft(frames * self.padded_window())  # [B, C, n_fft//2+1] each
        power = torch.sqrt(real.pow(2) + imag.pow(2)).pow(2.0)
        return self.log_mel(power.transpose(1, 2))
