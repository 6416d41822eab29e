"""Audio in and out: WAV files, the wire formats callers speak (PCM16 at any common rate, G.711 mu-law and
A-law at 8 kHz), and the conversion to and from the model's own rates (16 kHz in, 22.05 kHz out).

Resampling is soxr's (python-soxr, the SoX resampler; "HQ" quality): maintained, a few tens of microseconds
per 80 ms frame, and with `ResampleStream` a streaming resampler whose output over any chunking equals the
one-shot resampling of the whole signal (tests/test_audio.py), so frame and message boundaries add no clicks.
torchaudio would do as well but pins a torch build of its own. Each call has its own streams: an
`InputStream` per call turns whatever the client sends into 16 kHz float samples, an `OutputStream` turns
the model's 22.05 kHz frames into the client's format.
"""
from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

RATES = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)   # the PCM rates accepted on the wire
G711_RATE = 8000   # G.711 is 8 kHz, one byte a sample


class Encoding(NamedTuple):
    """The names an encoding goes by on the wire."""
    label: str                      # in messages
    media_type: str                 # the OpenAI Realtime GA format's `type`
    realtime_beta: str              # the Realtime beta format name
    native_names: tuple[str, ...]   # what the native protocol's `format` field takes


# The encodings this server speaks, by their name here; the protocols' format names all come from this table
ENCODINGS = {
    "pcm16": Encoding("PCM16", "audio/pcm", "pcm16", ("pcm16", "pcm_s16le")),
    "pcmu": Encoding("G.711 mu-law", "audio/pcmu", "g711_ulaw", ("pcmu", "g711_ulaw")),
    "pcma": Encoding("G.711 A-law", "audio/pcma", "g711_alaw", ("pcma", "g711_alaw")),
}


class AudioFormatError(ValueError):
    """Audio in a format this server does not take; the message names the limit."""


# ---- G.711 (ITU-T G.711: mu-law and A-law, 8-bit log-PCM) -----------------------------------------------
def _ulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    magnitude = (((u & 0x0F) << 3) + 0x84) << ((u >> 4) & 7)
    return np.where(u & 0x80, 0x84 - magnitude, magnitude - 0x84).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    exponent, mantissa = (a >> 4) & 7, a & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(a & 0x80, magnitude, -magnitude).astype(np.int16)


def _ulaw_encode(x: np.ndarray) -> np.ndarray:
    """int16 -> mu-law bytes, as G.711's reference code does it: on the 14-bit value (an arithmetic shift,
    so a negative value's magnitude rounds up), bias 33, clip at 8159."""
    v = x.astype(np.int32) >> 2
    mask = np.where(v < 0, 0x7F, 0xFF)
    v = np.minimum(np.abs(v), 8159) + 0x21
    segment = np.floor(np.log2(v)).astype(np.int32) - 5
    code = np.where(segment >= 8, 0x7F, (segment << 4) | ((v >> (segment + 1)) & 0x0F))   # past the last segment
    return (code ^ mask).astype(np.uint8)


def _alaw_encode(x: np.ndarray) -> np.ndarray:
    """int16 -> A-law bytes."""
    x = x.astype(np.int32)
    sign = np.where(x >= 0, 0x80, 0)
    magnitude = np.minimum(np.where(x >= 0, x, -x - 1), 32767) >> 3   # 13-bit magnitude
    exponent = np.where(magnitude < 32, 0, np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32) - 4)
    mantissa = np.where(exponent == 0, magnitude >> 1, magnitude >> exponent) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)


_DECODE = {"pcmu": _ulaw_decode_table(), "pcma": _alaw_decode_table()}
_ENCODE = {"pcmu": _ulaw_encode(np.arange(-32768, 32768)), "pcma": _alaw_encode(np.arange(-32768, 32768))}


def g711_decode(data: bytes, encoding: str) -> np.ndarray:
    """mu-law ("pcmu") or A-law ("pcma") bytes -> float32 samples in [-1, 1)."""
    return _DECODE[encoding][np.frombuffer(data, np.uint8)] * np.float32(1.0 / 32768.0)


def g711_encode(x: np.ndarray, encoding: str) -> bytes:
    """float32 samples in [-1, 1] -> mu-law or A-law bytes."""
    return _ENCODE[encoding][to_pcm16(x).astype(np.int32) + 32768].tobytes()


# ---- PCM16 and WAV ----------------------------------------------------------------------------------------
def from_pcm16(data: bytes) -> np.ndarray:
    """Little-endian PCM16 bytes -> float32 samples in [-1, 1): x / 32768 in one pass (1/32768 is a power
    of two, so the product is the quotient exactly)."""
    return np.frombuffer(data, dtype="<i2") * np.float32(1.0 / 32768.0)


def to_pcm16(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round(np.asarray(x, dtype=np.float32) * 32767.0), -32768, 32767).astype("<i2")


def resample(x: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """One-shot resampling of a whole 1-D float signal (soxr, HQ); the identity at equal rates."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if from_rate == to_rate:
        return x
    import soxr

    return soxr.resample(x, from_rate, to_rate, quality="HQ").astype(np.float32, copy=False)


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
            rate, channels, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
        # the frames the file holds, not the header's count (wav_data)
        return WavInfo(rate, channels, width, len(wav_data(data)) // max(1, channels * width))
    except (wave.Error, EOFError) as e:
        raise AudioFormatError(f"not a PCM WAV file: {e}") from None


def wav_data(data: bytes) -> bytes:
    """The sample bytes of a RIFF WAV's `data` chunk as the file holds them: its declared size when the file
    has that many bytes after it, else every byte to the end of the file (a streamed WAV declares 0 or
    2^32 - 1, a lying header anything; what is there is what the caller sent)."""
    pos = 12
    while pos + 8 <= len(data):
        name, size = data[pos: pos + 4], int.from_bytes(data[pos + 4: pos + 8], "little")
        if name == b"data":
            start = pos + 8
            end = start + size
            return data[start: end] if 0 < size and end <= len(data) else data[start:]
        pos += 8 + size + (size & 1)   # chunks are padded to an even length
    raise AudioFormatError("a WAV without a data chunk")


def decode_wav(data: bytes, sample_rate: int = 16000, max_seconds: float | None = None) -> np.ndarray:
    """PCM WAV bytes (8, 16 or 32-bit integer, any channel count, a rate of RATES) -> float32 mono samples in
    [-1, 1] at `sample_rate`: channels averaged, then resampled."""
    info = wav_info(data)
    if info.sample_rate not in RATES:
        raise AudioFormatError(f"sample rate {info.sample_rate} Hz; this server takes {', '.join(map(str, RATES))} Hz")
    _check_samples(info)
    if max_seconds is not None and info.seconds > max_seconds:
        raise AudioFormatError(f"{info.seconds:.1f} s of audio; the limit is {max_seconds:g} s")
    return resample(_mono_samples(data, info), info.sample_rate, sample_rate)


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    """PCM WAV bytes (8, 16 or 32-bit integer, any channel count, any rate) -> (float32 mono samples in
    [-1, 1], channels averaged, at the file's own rate; that rate)."""
    info = wav_info(data)
    _check_samples(info)
    return _mono_samples(data, info), info.sample_rate


def _check_samples(info: WavInfo) -> None:
    if info.sample_width not in (1, 2, 4):
        raise AudioFormatError(f"{8 * info.sample_width}-bit samples; this server takes 8, 16 or 32-bit integer PCM")
    if info.channels < 1:
        raise AudioFormatError("a WAV without channels")


def _mono_samples(data: bytes, info: WavInfo) -> np.ndarray:
    raw = wav_data(data)
    # whole sample frames only: a file cut short (a broken transfer) can end inside one
    step = info.channels * info.sample_width
    raw = raw[:len(raw) - len(raw) % step]
    if info.sample_width == 1:   # 8-bit WAV is unsigned
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif info.sample_width == 2:
        x = from_pcm16(raw)
    else:
        x = np.frombuffer(raw, "<i4").astype(np.float32) * np.float32(1.0 / 2147483648.0)
    if info.channels > 1:
        x = x.reshape(-1, info.channels).mean(axis=1, dtype=np.float32)
    return x


def read_wav(path: str | Path, sample_rate: int = 16000) -> np.ndarray:
    return decode_wav(Path(path).read_bytes(), sample_rate)


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


# ---- a caller's wire format, streaming both ways ----------------------------------------------------------
@dataclass(frozen=True)
class AudioFormat:
    """What a caller sends or receives: PCM16 little-endian at `rate`, or G.711 ("pcmu" / "pcma") at 8 kHz;
    `channels` interleaved (input only: averaged to mono)."""
    encoding: str = "pcm16"
    rate: int = 16000
    channels: int = 1

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise AudioFormatError(f"encoding {self.encoding!r}: this server speaks {', '.join(ENCODINGS)}")
        if self.encoding != "pcm16" and self.rate != G711_RATE:
            raise AudioFormatError(f"{self.encoding} is G.711 at {G711_RATE} Hz, not {self.rate} Hz")
        if self.rate not in RATES:
            raise AudioFormatError(f"sample rate {self.rate} Hz; this server takes {', '.join(map(str, RATES))} Hz")
        if not 1 <= self.channels <= 8:
            raise AudioFormatError(f"{self.channels} channels; this server takes 1 to 8 (averaged to mono)")

    @property
    def bytes_per_frame(self) -> int:   # one sample of every channel
        return self.channels * (2 if self.encoding == "pcm16" else 1)

    def check(self, data: bytes) -> None:
        """Whole sample frames only: audio that ends inside one would shift all that follows."""
        if len(data) % self.bytes_per_frame:
            raise AudioFormatError(f"{len(data)} bytes of {self.describe()}; a message holds whole samples "
                                   f"({self.bytes_per_frame} bytes each)")

    def decode(self, data: bytes) -> np.ndarray:
        x = from_pcm16(data) if self.encoding == "pcm16" else g711_decode(data, self.encoding)
        return x.reshape(-1, self.channels).mean(axis=1, dtype=np.float32) if self.channels > 1 else x

    def encode(self, x: np.ndarray) -> bytes:
        return to_pcm16(x).tobytes() if self.encoding == "pcm16" else g711_encode(x, self.encoding)

    def describe(self) -> str:
        return f"{ENCODINGS[self.encoding].label} {self.rate} Hz" + (f" x {self.channels} channels" if self.channels > 1 else "")


class _Stream:
    """soxr's streaming resampler, or nothing at equal rates."""

    def __init__(self, from_rate: int, to_rate: int):
        self.identity = from_rate == to_rate
        if not self.identity:
            import soxr

            self.rs = soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        if self.identity:
            return x
        return self.rs.resample_chunk(np.ascontiguousarray(x, dtype=np.float32), last=last)


class InputStream:
    """A caller's bytes, in any chunking, -> float32 samples at the model's rate. Bytes that end inside a
    sample frame (a multi-channel frame, a PCM16 sample) are refused: the caller's audio would be shifted."""

    def __init__(self, fmt: AudioFormat, model_rate: int):
        self.fmt, self._resample = fmt, _Stream(fmt.rate, model_rate)

    def __call__(self, data: bytes) -> np.ndarray:
        self.fmt.check(data)
        return self._resample(self.fmt.decode(data))

    def flush(self) -> np.ndarray:
        """At the end of the input: what the resampler still holds."""
        return self._resample(np.zeros(0, np.float32), last=True)


class OutputStream:
    """The model's frames (float32 at its rate), in order, -> the caller's bytes."""

    def __init__(self, fmt: AudioFormat, model_rate: int):
        if fmt.channels != 1:
            raise AudioFormatError("output audio is mono")
        self.fmt, self._resample = fmt, _Stream(model_rate, fmt.rate)

    @property
    def native(self) -> bool:   # the model's own PCM16 as it is (FrameEvent.pcm16)
        return self._resample.identity and self.fmt.encoding == "pcm16"

    def __call__(self, pcm: np.ndarray) -> bytes:
        return self.fmt.encode(self._resample(pcm))

    def flush(self) -> bytes:
        """After the last frame: what the resampler still holds (its filter's delay; nothing at the model's
        own rate)."""
        return self.fmt.encode(self._resample(np.zeros(0, np.float32), last=True))
