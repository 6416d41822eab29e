"""WAV in and out (PCM16 through the standard library) and the sample-format checks every entry point
shares. Nothing is resampled silently: a wrong rate, channel count or sample width is refused with the
reason."""
from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class AudioFormatError(ValueError):
    """The audio is not in the format the model takes; the message names the limit."""


@dataclass
class WavInfo:
    sample_rate: int
    channels: int
    sample_width: int
    frames: int

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


def wav_info(data: bytes) -> WavInfo:
    try:
        with wave.open(io.BytesIO(data)) as w:
            return WavInfo(w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes())
    except (wave.Error, EOFError) as e:
        raise AudioFormatError(f"not a PCM WAV file: {e}") from None


def decode_wav(data: bytes, sample_rate: int = 16000, max_seconds: float | None = None) -> np.ndarray:
    """PCM16 mono WAV bytes at `sample_rate` -> float32 samples in [-1, 1]."""
    info = wav_info(data)
    if info.sample_rate != sample_rate:
        raise AudioFormatError(f"sample rate {info.sample_rate} Hz; this model takes {sample_rate} Hz (not resampled)")
    if info.channels != 1:
        raise AudioFormatError(f"{info.channels} channels; this model takes mono (1 channel)")
    if info.sample_width != 2:
        raise AudioFormatError(f"{8 * info.sample_width}-bit samples; this model takes 16-bit PCM")
    if max_seconds is not None and info.seconds > max_seconds:
        raise AudioFormatError(f"{info.seconds:.1f} s of audio; the limit is {max_seconds:g} s")
    with wave.open(io.BytesIO(data)) as w:
        raw = w.readframes(info.frames)
    # whole samples only: a file cut short (a broken transfer) can end inside one, and a header's frame
    # count is not checked against the data (streamed WAVs declare 0 or 2^32 - 1 bytes)
    return from_pcm16(raw[:len(raw) - len(raw) % 2])


def from_pcm16(data: bytes) -> np.ndarray:
    """Little-endian PCM16 bytes -> float32 samples in [-1, 1): x / 32768 in one pass (1/32768 is a power
    of two, so the product is the quotient exactly)."""
    return np.frombuffer(data, dtype="<i2") * np.float32(1.0 / 32768.0)


def read_wav(path: str | Path, sample_rate: int = 16000) -> np.ndarray:
    return decode_wav(Path(path).read_bytes(), sample_rate)


def to_pcm16(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round(np.asarray(x, dtype=np.float32) * 32767.0), -32768, 32767).astype("<i2")


def encode_wav(x: np.ndarray, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(to_pcm16(x).tobytes())
    return buf.getvalue()


def write_wav(path: str | Path, x: np.ndarray, sample_rate: int) -> None:
    Path(path).write_bytes(encode_wav(x, sample_rate))
