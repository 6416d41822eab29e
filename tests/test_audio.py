"""The wire formats (nemo_duplex/audio.py): streaming resampling equals soxr's one-shot resampling of the whole
signal over any chunking, G.711 equals the standard library's reference codec bit for bit, WAVs of any
common rate, channel count and integer width decode."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import soxr

from nemo_duplex.audio import (
    RATES,
    AudioFormat,
    AudioFormatError,
    InputStream,
    OutputStream,
    decode_wav,
    g711_decode,
    g711_encode,
)


def sweep(seconds: float, rate: int, f0: float = 50.0, f1: float = 7000.0) -> np.ndarray:
    """A logarithmic sine sweep (0.5 amplitude) from f0 to f1 Hz."""
    t = np.arange(int(seconds * rate)) / rate
    k = np.log(f1 / f0) / seconds
    return (0.5 * np.sin(2 * np.pi * f0 * (np.exp(k * t) - 1) / k)).astype(np.float32)


@pytest.mark.parametrize("rate", [8000, 24000, 44100, 48000])
def test_streaming_input_equals_one_shot_resampling(rate):
    """A sweep sent as PCM16 in uneven chunks, resampled to 16 kHz as it arrives, equals soxr's one-shot
    resampling of the same samples: tolerance 1e-6 (soxr's streaming state carries the filter exactly; the
    two differ only in float rounding)."""
    x = sweep(2.0, rate)
    pcm = (np.clip(np.round(x * 32767), -32768, 32767).astype("<i2"))
    stream = InputStream(AudioFormat("pcm16", rate), 16000)
    sizes = np.random.default_rng(0).integers(1, 3000, size=10_000)
    out, pos = [], 0
    for n in sizes:
        if pos >= pcm.size:
            break
        out.append(stream(pcm[pos: pos + n].tobytes()))
        pos += n
    out.append(stream.flush())
    got = np.concatenate(out)
    want = soxr.resample(pcm.astype(np.float32) / 32768.0, rate, 16000, quality="HQ")
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_streaming_output_equals_one_shot_and_has_no_clicks_at_frame_boundaries():
    """The model's 22.05 kHz frames (1764 samples each) to a 24 kHz client: the concatenated packets equal
    the one-shot resampling of the whole signal up to the last frame's held-back tail (within one PCM16
    step), so frame boundaries add nothing."""
    x = sweep(1.6, 22050)[: 20 * 1764]
    stream = OutputStream(AudioFormat("pcm16", 24000), 22050)
    got = np.concatenate([np.frombuffer(stream(x[i: i + 1764]), "<i2") for i in range(0, x.size, 1764)])
    want = np.round(np.clip(soxr.resample(x, 22050, 24000, quality="HQ"), -1, 1) * 32767)
    # what the resampler holds back until more input comes (soxr HQ: ~38 ms at 22.05 -> 24 kHz), then
    # given by flush() at the end of the call
    assert 0 < want.size - got.size <= 1000
    assert np.abs(got - want[: got.size]).max() <= 1
    whole = np.concatenate([got, np.frombuffer(stream.flush(), "<i2")])
    assert whole.shape == want.shape and np.abs(whole - want).max() <= 1


# (from, to, bound in ms): docs/protocol.md quotes these as the delay the resampler adds
DELAY_BOUNDS = [(24000, 16000, 40), (8000, 16000, 120), (22050, 24000, 45), (22050, 8000, 85)]


@pytest.mark.parametrize("from_rate,to_rate,bound_ms", DELAY_BOUNDS)
def test_the_delay_the_streaming_resampler_adds_is_bounded(from_rate, to_rate, bound_ms):
    """Fed 20 ms at a time (a telephony packet; the worst case of the chunkings we see), what soxr holds
    back is, after the first 200 ms, never more than the bound: the latency a caller at that rate pays on top
    of the model's. Measured means: 22 ms (24 -> 16 kHz), 63 ms (8 -> 16), 23 ms (22.05 -> 24), 46 ms
    (22.05 -> 8)."""
    rs = InputStream(AudioFormat("pcm16", from_rate), to_rate) if from_rate != 22050 else None
    out_stream = OutputStream(AudioFormat("pcm16", to_rate), 22050) if rs is None else None
    chunk = from_rate // 50
    x = sweep(1.2, from_rate)
    given, held = 0, []
    for k in range(0, x.size - chunk + 1, chunk):
        piece = x[k: k + chunk]
        if rs is not None:
            given += rs(to_pcm16_bytes(piece)).size
        else:
            given += len(out_stream(piece)) // 2
        held.append(((k + chunk) * to_rate / from_rate - given) / to_rate * 1000)
    assert max(held[10:]) <= bound_ms and min(held[10:]) >= 0


def to_pcm16_bytes(x: np.ndarray) -> bytes:
    return np.clip(np.round(x * 32767), -32768, 32767).astype("<i2").tobytes()


def test_g711_equals_the_reference_codec_bit_for_bit():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop  # the standard library's G.711 (Python <= 3.12), the reference here

    every = bytes(range(256))
    for enc, to_lin, from_lin in (("pcmu", audioop.ulaw2lin, audioop.lin2ulaw),
                                  ("pcma", audioop.alaw2lin, audioop.lin2alaw)):
        decoded = np.frombuffer(to_lin(every, 2), "<i2") / 32768.0
        np.testing.assert_array_equal(g711_decode(every, enc), decoded.astype(np.float32))
        pcm16 = np.arange(-32768, 32768, dtype="<i2")
        want = from_lin(pcm16.tobytes(), 2)
        # g711_encode takes floats: x * 32767 rounds back to the same int16 for every value but -32768
        x = pcm16.astype(np.float32) / 32767.0
        assert g711_encode(x, enc) == want, enc


def test_g711_call_format_round_trip():
    """8 kHz mu-law in: decoded and resampled to 16 kHz; the model's output to mu-law at 8 kHz."""
    x = sweep(1.0, 8000, f1=3500.0)
    fmt = AudioFormat("pcmu", 8000)
    stream = InputStream(fmt, 16000)
    got = np.concatenate([stream(g711_encode(x, "pcmu")), stream.flush()])
    assert got.size == 16000
    out = OutputStream(fmt, 22050)
    data = out(soxr.resample(x, 8000, 22050, quality="HQ"))
    assert 7000 < len(data) <= 8000   # one byte a sample at 8 kHz, less what the resampler holds back


def _wav(x: np.ndarray, rate: int, channels: int, width: int) -> bytes:
    import io
    import wave

    frames = np.repeat(x[:, None], channels, axis=1).reshape(-1)
    if width == 1:
        raw = (np.round(frames * 127) + 128).astype(np.uint8).tobytes()
    elif width == 2:
        raw = np.round(frames * 32767).astype("<i2").tobytes()
    else:
        raw = np.round(frames * 2147483647).astype("<i4").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


@pytest.mark.parametrize("rate,channels,width", [(48000, 2, 2), (44100, 1, 4), (8000, 1, 1), (24000, 6, 2)])
def test_uploads_of_any_common_wav_decode_to_16_khz_mono(rate, channels, width):
    x = sweep(0.5, rate, f1=3000.0)
    got = decode_wav(_wav(x, rate, channels, width), 16000)
    want = soxr.resample(x, rate, 16000, quality="HQ")
    tol = {1: 2e-2, 2: 1e-4, 4: 1e-6}[width]   # the file's quantisation step
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)


def test_formats_refused_name_the_limit():
    with pytest.raises(AudioFormatError, match="12345 Hz"):
        AudioFormat("pcm16", 12345)
    with pytest.raises(AudioFormatError, match="8000 Hz"):
        AudioFormat("pcmu", 16000)
    with pytest.raises(AudioFormatError, match="whole samples"):
        InputStream(AudioFormat("pcm16", 24000, channels=2), 16000)(b"\x00" * 6)
    assert 24000 in RATES and 16000 in RATES and 22050 in RATES


@pytest.mark.parametrize("declared", [0, 100, 2 ** 32 - 1, None])
def test_a_wav_header_that_lies_about_its_length_is_not_trusted(declared):
    """The data chunk's size field says 0, too few (100 bytes: then a trailing chunk would follow; here none
    does, so the rest is samples), or more than the file has: the samples are the bytes the file holds. A
    truthful header (None) still bounds the data before a trailing chunk."""
    import io
    import wave

    x = sweep(0.5, 16000)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(to_pcm16_bytes(x))
    data = bytearray(buf.getvalue())
    at = data.index(b"data") + 4
    if declared is None:
        data += b"LIST" + (4).to_bytes(4, "little") + b"INFO"   # a trailing chunk after the samples
    else:
        data[at: at + 4] = declared.to_bytes(4, "little")
    want = np.frombuffer(to_pcm16_bytes(x), "<i2") / 32768.0
    if declared == 100:
        got = decode_wav(bytes(data))
        assert got.size == 50       # a size within the file is the chunk's: the next chunk may follow
        return
    got = decode_wav(bytes(data))
    assert got.shape == want.shape and np.array_equal(got, want.astype(np.float32))
    from nemo_duplex.audio import wav_info

    assert wav_info(bytes(data)).frames == x.size
